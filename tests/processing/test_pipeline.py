"""pipeline("image-text-to-text") on a tiny random model saved to disk and reloaded: chat messages with images
from a URL (a loopback server), a path and a PIL image, text-only messages, and a batch."""

import functools
import http.server
import threading

import numpy as np
import PIL.Image
import pytest
from transformers import pipeline

from transformers_inkling2 import Inkling2ForConditionalGeneration, Inkling2MultimodalProcessor
from transformers_inkling2.tiny import build_tiny_model, build_tiny_processor


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build_tiny_model(seed=3).save_pretrained(folder)
    build_tiny_processor().save_pretrained(folder)
    rng = np.random.default_rng(0)
    PIL.Image.fromarray(rng.integers(0, 255, (70, 110, 3), dtype=np.uint8)).save(folder / "picture.png")
    return folder


@pytest.fixture(scope="module")
def image_url(saved):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(saved))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/picture.png"
    server.shutdown()
    thread.join()


@pytest.fixture(scope="module")
def pipe(saved):
    generator = pipeline("image-text-to-text", model=str(saved))
    assert isinstance(generator.model, Inkling2ForConditionalGeneration)
    assert isinstance(generator.processor, Inkling2MultimodalProcessor)
    return generator


def user_turn(text, image=None):
    content = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image", **image})
    return [{"role": "user", "content": content}]


def reply(pipe, messages):
    return pipe(text=messages, max_new_tokens=5, return_full_text=False, generate_kwargs={"do_sample": False})


def test_pipeline_reply_equals_generate_on_the_processed_chat(pipe, saved):
    messages = user_turn("What is in the picture?", {"path": str(saved / "picture.png")})
    text = reply(pipe, messages)[0]["generated_text"]
    inputs = pipe.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    assert int((inputs["input_ids"] == 200054).sum()) == 6  # 70x110 pixels -> a 2x3 token grid
    generated = pipe.model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert text == pipe.processor.decode(generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_the_extra_column_reaches_the_model(pipe):
    """An image whose width is a multiple of 40 gets tml's extra column of padding (docs/images.md): the
    placeholders, the ViT's features and the patch grid its positions are resampled to all include it."""
    image = PIL.Image.fromarray(np.random.default_rng(1).integers(0, 255, (40, 80, 3), dtype=np.uint8))
    inputs = pipe.processor.apply_chat_template(
        user_turn("What is it?", {"image": image}), tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert inputs["image_grid_thw"].tolist() == [[1, 1, 3]]
    features = pipe.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert [len(f) for f in features] == [3] == [int((inputs["input_ids"] == 200054).sum())]
    assert pipe.model(**inputs).logits.isfinite().all()


def test_the_model_refuses_images_that_are_not_rgb(pipe):
    """The processor keeps 4 channels when told not to convert (`do_convert_rgb=False`); the ViT needs RGB."""
    rgba = np.random.default_rng(2).integers(0, 255, (30, 50, 4), dtype=np.uint8)
    inputs = pipe.processor.image_processor(rgba, do_convert_rgb=False, image_mean=[0.5] * 4, image_std=[0.5] * 4)
    with pytest.raises(ValueError, match=r"\[image tokens, 40, 40, 3\]"):
        pipe.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])


@pytest.mark.parametrize("source", ["url", "path", "pil"])
def test_images_from_a_url_a_path_and_pil_give_the_same_reply(pipe, saved, image_url, source):
    image = {
        "url": {"url": image_url},
        "path": {"path": str(saved / "picture.png")},
        "pil": {"image": PIL.Image.open(saved / "picture.png")},
    }[source]
    expected = reply(pipe, user_turn("Describe it.", {"path": str(saved / "picture.png")}))[0]["generated_text"]
    assert reply(pipe, user_turn("Describe it.", image))[0]["generated_text"] == expected


def test_text_only_messages_and_a_batch(pipe, saved):
    text_only = user_turn("Hello there")
    with_image = user_turn("And this?", {"path": str(saved / "picture.png")})
    single = [reply(pipe, text_only)[0]["generated_text"], reply(pipe, with_image)[0]["generated_text"]]
    batch = pipe(text=[text_only, with_image], max_new_tokens=5, return_full_text=False, generate_kwargs={"do_sample": False})
    assert [out[0]["generated_text"] for out in batch] == single


def test_unreadable_image_is_a_clear_error(pipe, saved):
    (saved / "broken.png").write_bytes(b"not an image")
    with pytest.raises(Exception, match="broken.png"):
        reply(pipe, user_turn("?", {"path": str(saved / "broken.png")}))
