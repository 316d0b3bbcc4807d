"""transformers' common image-processing suite on our `Inkling2ImageProcessor` (Pillow + NumPy), which
AutoImageProcessor gives for both backend names ("pil" and "torchvision"): the suite runs it under both.

No reference runs: transformers' built-in `Inkling2ImageProcessor` is torchvision-based, and torchvision is not
installed here (nor needed by this package). Failures are marked as in the model modules
(`inkling2_expected_failures.py`); skips name what does not apply to Inkling2's output format, which the built-in
shares (one 40 x 40 pixel block per image token).
"""

import math
import unittest

import numpy as np
import torch
import transformers_suites

transformers_suites.require_suites()

from inkling2_common_testers import _SeededTest, expect, image_processing_testers  # noqa: E402
from inkling2_expected_failures import IMAGE_PROCESSOR_SKIPS, OURS_IMAGE_PROCESSOR  # noqa: E402

from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING  # noqa: E402

from transformers_inkling2 import Inkling2Config  # noqa: E402

ImageProcessingTester, ImageProcessingTestMixin = image_processing_testers()


class Inkling2ImageProcessingTester(ImageProcessingTester):
    def __init__(self, parent, **kwargs):
        # images of 30 to 120 pixels a side: 1 to 9 image tokens each
        kwargs.setdefault("min_resolution", 30)
        kwargs.setdefault("max_resolution", 120)
        kwargs.setdefault("size", {"height": 40, "width": 40})
        kwargs.setdefault("do_normalize", True)
        kwargs.setdefault("image_mean", [0.5, 0.5, 0.5])
        kwargs.setdefault("image_std", [0.5, 0.5, 0.5])
        kwargs.setdefault("do_convert_rgb", True)
        super().__init__(parent, **kwargs)

    def _get_image_processing_classes(self):
        # the suite looks the classes up by the test folder's name, a model type; here: what AutoImageProcessor gives
        # for each backend. Ours for both (Pillow + NumPy, no torchvision), as `backend="torchvision"` loads it too
        return dict(IMAGE_PROCESSOR_MAPPING[Inkling2Config])

    def expected_output_image_shape(self, images):
        # one [40, 40, 3] block per image token (the tokens of all the images, one after another)
        return self.size["height"], self.size["width"], self.num_channels


def image_tokens(image, cell=40) -> int:
    """Image tokens of one test image, counted as tml-renderers counts them: `ceil(H / 40)` rows, `W // 40 + 1`
    columns (docs/images.md)."""
    if isinstance(image, np.ndarray):
        height, width = image.shape[:2]  # the suite's NumPy images are channels-last
    elif isinstance(image, torch.Tensor):
        height, width = image.shape[1:]  # and its tensors channels-first
    else:
        width, height = image.size
    return math.ceil(height / cell) * (width // cell + 1)


class Inkling2ImageProcessingTest(_SeededTest, ImageProcessingTestMixin, unittest.TestCase):
    image_processor_tester_class = Inkling2ImageProcessingTester

    # The suite's `test_call_*` expect `pixel_values` of [images, *shape]; Inkling2's (the built-in's too) are
    # [image tokens, 40, 40, 3]: one block per image token, all images' tokens in a row, with `image_grid_thw`
    # [images, 3] = [1, rows, cols]. As transformers' own tests of such processors (Qwen2-VL) do, these overrides
    # check that layout on the suite's inputs.
    def _check_call(self, image_inputs, num_channels=3, **call_kwargs):
        for image_processing_class in self.image_processing_classes.values():
            image_processor = image_processing_class(**self.image_processor_dict)
            for images in ([image_inputs[0]], image_inputs):
                encoding = image_processor(images if len(images) > 1 else images[0], return_tensors="pt", **call_kwargs)
                tokens = [image_tokens(image) for image in images]
                self.assertEqual(tuple(encoding.pixel_values.shape), (sum(tokens), 40, 40, num_channels))
                self.assertEqual(tuple(encoding.image_grid_thw.shape), (len(images), 3))
                self.assertEqual(encoding.image_grid_thw.prod(-1).tolist(), tokens)

    def test_call_pil(self):
        self._check_call(self.image_processor_tester.prepare_image_inputs(equal_resolution=False))

    def test_call_numpy(self):
        self._check_call(self.image_processor_tester.prepare_image_inputs(equal_resolution=False, numpify=True))

    def test_call_pytorch(self):
        self._check_call(self.image_processor_tester.prepare_image_inputs(equal_resolution=False, torchify=True))

    def test_call_numpy_4_channels(self):
        self.image_processor_tester.num_channels = 4
        image_inputs = self.image_processor_tester.prepare_image_inputs(equal_resolution=False, numpify=True)
        self._check_call(
            image_inputs,
            num_channels=4,
            do_convert_rgb=False,
            input_data_format="channels_last",
            image_mean=[0.0, 0.0, 0.0, 0.0],
            image_std=[1.0, 1.0, 1.0, 1.0],
        )


expect(Inkling2ImageProcessingTest, xfail=OURS_IMAGE_PROCESSOR, skip=IMAGE_PROCESSOR_SKIPS)
