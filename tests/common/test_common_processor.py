"""transformers' common processing suite on our `Inkling2Processor` (our tokenizer + our image processor).

No reference runs: the built-in `Inkling2Processor` needs the built-in, torchvision-based image processor, and
torchvision is not installed here (nor needed by this package). Failures are marked as in the model modules
(`inkling2_expected_failures.py`).
"""

import unittest

import transformers_suites

transformers_suites.require_suites()

from inkling2_common_testers import CachedProcessorLoads, _SeededTest, expect, processing_mixin  # noqa: E402
from inkling2_expected_failures import OURS_PROCESSOR, PROCESSOR_SKIPS, PROCESSOR_SLOW  # noqa: E402

from transformers_inkling2 import Inkling2ImageProcessorPil, Inkling2Processor, Inkling2Tokenizer  # noqa: E402

ProcessorTesterMixin = processing_mixin()


class Inkling2ProcessorTest(CachedProcessorLoads, _SeededTest, ProcessorTesterMixin, unittest.TestCase):
    processor_class = Inkling2Processor

    @classmethod
    def _setup_tokenizer(cls):
        return Inkling2Tokenizer()

    @classmethod
    def _setup_image_processor(cls):
        return Inkling2ImageProcessorPil()


expect(Inkling2ProcessorTest, xfail=OURS_PROCESSOR, skip=PROCESSOR_SKIPS, slow=PROCESSOR_SLOW)
