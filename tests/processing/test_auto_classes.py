"""With the package imported, checkpoints that name transformers' own classes (as one made for the built-in port
does) load our processor, image processor and tokenizer through every Auto class and the pipeline, without
torchvision."""

import json

import pytest
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, pipeline

from transformers_inkling2 import (
    Inkling2ForConditionalGeneration,
    Inkling2ImageProcessor,
    Inkling2Processor,
    Inkling2Tokenizer,
    build_tiny_model,
    build_tiny_processor,
)


@pytest.fixture(scope="module")
def builtin_named_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("builtin_named")
    build_tiny_model().save_pretrained(folder)
    build_tiny_processor().save_pretrained(folder)
    config = json.loads((folder / "processor_config.json").read_text())
    config["processor_class"] = "Inkling2Processor"
    config["image_processor"]["image_processor_type"] = "Inkling2ImageProcessor"
    (folder / "processor_config.json").write_text(json.dumps(config))
    # the image processor's settings also as their own file, as older savers write them
    (folder / "preprocessor_config.json").write_text(json.dumps(config["image_processor"]))
    return folder


def test_auto_classes_give_ours(builtin_named_checkpoint):
    assert type(AutoImageProcessor.from_pretrained(builtin_named_checkpoint)) is Inkling2ImageProcessor
    processor = AutoProcessor.from_pretrained(builtin_named_checkpoint)
    assert type(processor) is Inkling2Processor and type(processor.image_processor) is Inkling2ImageProcessor
    assert type(AutoTokenizer.from_pretrained(builtin_named_checkpoint)) is Inkling2Tokenizer


def test_the_pipeline_loads_ours_from_a_path(builtin_named_checkpoint):
    chat = pipeline("image-text-to-text", model=str(builtin_named_checkpoint))
    assert type(chat.processor) is Inkling2Processor and type(chat.model) is Inkling2ForConditionalGeneration


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_either_backend_gives_ours(builtin_named_checkpoint, backend):
    assert type(AutoImageProcessor.from_pretrained(builtin_named_checkpoint, backend=backend)) is Inkling2ImageProcessor
