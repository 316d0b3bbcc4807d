"""Text and images in: the tokenizer, the image processor, the processor, the chat template and response parsing."""
