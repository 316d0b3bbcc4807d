"""Reference: transformers' common tokenization suite on `TokenizersBackend`, transformers' generic fast tokenizer,
over the files that `Inkling2Tokenizer().save_pretrained` writes (saved by a subprocess: this process stays without
`transformers_inkling2`). The built-in port has no tokenizer class; its checkpoints load as `TokenizersBackend`.

Runs with the other reference modules: `python -m pytest --noconftest tests/common/test_common_builtin_*.py`.
"""

import subprocess
import sys
import unittest

import transformers_suites
from inkling2_reference import require_pristine_transformers

require_pristine_transformers()
transformers_suites.require_suites()

from inkling2_common_testers import CachedTokenizerLoads, _SeededTest, expect, tokenization_mixin  # noqa: E402
from inkling2_expected_failures import BUILTIN_TOKENIZER, TOKENIZER_SKIPS, TOKENIZER_SLOW  # noqa: E402
from transformers import TokenizersBackend  # noqa: E402

TokenizerTesterMixin = tokenization_mixin()


class Inkling2BuiltinTokenizationTest(CachedTokenizerLoads, _SeededTest, TokenizerTesterMixin, unittest.TestCase):
    tokenizer_class = TokenizersBackend
    test_seq2seq = False

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        save = "import sys, transformers_inkling2 as ours; ours.Inkling2Tokenizer().save_pretrained(sys.argv[1])"
        subprocess.run([sys.executable, "-c", save, cls.tmpdirname], check=True)


expect(Inkling2BuiltinTokenizationTest, xfail=BUILTIN_TOKENIZER, skip=TOKENIZER_SKIPS, slow=TOKENIZER_SLOW)
