"""transformers' common tokenization suite on our `Inkling2Tokenizer` (o200k_base + the 60 Inkling tokens).

Reference: `test_common_builtin_tokenizer.py` runs the same suite on transformers' generic `TokenizersBackend` over the
same saved files (the built-in port has no tokenizer class: its checkpoints load as `TokenizersBackend`).
"""

import unittest

import transformers_suites

transformers_suites.require_suites()

from inkling2_common_testers import CachedTokenizerLoads, _SeededTest, expect, tokenization_mixin  # noqa: E402
from inkling2_expected_failures import OURS_TOKENIZER, TOKENIZER_SKIPS, TOKENIZER_SLOW  # noqa: E402

from transformers_inkling2 import Inkling2Tokenizer  # noqa: E402

TokenizerTesterMixin = tokenization_mixin()


class Inkling2TokenizationTest(CachedTokenizerLoads, _SeededTest, TokenizerTesterMixin, unittest.TestCase):
    tokenizer_class = Inkling2Tokenizer
    test_seq2seq = False

    @classmethod
    def setUpClass(cls):
        super().setUpClass()  # (no Hub checkpoint: the tokenizer is built offline, then saved where the suite loads it)
        Inkling2Tokenizer().save_pretrained(cls.tmpdirname)


expect(Inkling2TokenizationTest, xfail=OURS_TOKENIZER, skip=TOKENIZER_SKIPS, slow=TOKENIZER_SLOW)
