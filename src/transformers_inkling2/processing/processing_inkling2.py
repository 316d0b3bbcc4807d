"""The multimodal processor: tokenizer + image processor + chat template.

The chat template writes one `<|unused_200054|>` placeholder per image (after `<|content_image|>`); the processor
expands it into one placeholder per image feature, `tokens rows x token cols` of the image's grid, and returns
`pixel_values` and `image_grid_thw` beside `input_ids`. transformers' `ProcessorMixin` does the bookkeeping
(matching placeholders to images, with clear errors when their counts differ); this class says how many
placeholders an image takes.

Checkpoints name it `Inkling2Processor` in `processor_config.json`, as transformers' built-in port does: importing
this package makes that name (and the image processor's) resolve to ours in every Auto class and pipeline
(`transformers_inkling2/__init__.py`), without torchvision.
"""

from transformers import ProcessorMixin

from .image_processing_inkling2 import Inkling2ImageProcessor
from .tokenization_inkling2 import IMAGE_TOKEN, Inkling2Tokenizer


class Inkling2Processor(ProcessorMixin):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = IMAGE_TOKEN
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if chat_template is None:
            chat_template = getattr(tokenizer, "chat_template", None)
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        """Always our tokenizer and our (torchvision-free) image processor, whatever class names a checkpoint's
        files carry, so that official checkpoints load too."""
        kwargs.pop("subfolder", None)
        return [
            Inkling2ImageProcessor.from_pretrained(pretrained_model_name_or_path, **kwargs),
            Inkling2Tokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs),
        ]

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        """One placeholder per image feature: the image's token rows x token cols."""
        return self.image_token * int(image_inputs["image_grid_thw"][image_idx].prod())

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "pixel_values", "image_grid_thw"]


Inkling2MultimodalProcessor = Inkling2Processor  # its name in earlier versions of this package

__all__ = ["Inkling2MultimodalProcessor", "Inkling2Processor"]
