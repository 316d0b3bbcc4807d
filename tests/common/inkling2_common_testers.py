"""Model testers for transformers' common suites, the way transformers' own model folders write them, for either
implementation of Inkling2: ours (`transformers_inkling2`) or transformers' built-in `transformers.models.inkling2`
(the reference). `model_classes("ours" | "builtin")` names the classes; the test modules subclass the bases below.

Import only after `transformers_suites.require_suites()`: the bases inherit the fetched suites' mixins. Nothing here
imports `transformers_inkling2` unless asked for "ours" (the reference runs in a process without it).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import re
import unittest
from types import SimpleNamespace

import pytest
import torch
import transformers_suites
from transformers.testing_utils import torch_device

_modeling = transformers_suites.load("test_modeling_common")
_configuration = transformers_suites.load("test_configuration_common")
_pipeline = transformers_suites.load("test_pipeline_mixin")
_training = transformers_suites.load("test_training_mixin")
_tensor_parallel = transformers_suites.load("test_tensor_parallel_mixin")

ModelTesterMixin = _modeling.ModelTesterMixin
GenerationTesterMixin = _modeling.GenerationTesterMixin  # the stand-in: no generate() tests
ConfigTester = _configuration.ConfigTester
PipelineTesterMixin = _pipeline.PipelineTesterMixin
TrainingTesterMixin = _training.TrainingTesterMixin
TensorParallelTesterMixin = _tensor_parallel.TensorParallelTesterMixin
ids_tensor = _modeling.ids_tensor
floats_tensor = _modeling.floats_tensor

SEED = 0


def model_classes(which: str) -> SimpleNamespace:
    """The config and model classes of "ours" or of transformers' "builtin" port."""
    if which == "ours":
        module = importlib.import_module("transformers_inkling2")
        get = functools.partial(getattr, module)
    elif which == "builtin":
        get = functools.partial(getattr, importlib.import_module("transformers.models.inkling2"))
    else:
        raise ValueError(which)
    return SimpleNamespace(
        which=which,
        text_config=get("Inkling2TextConfig"),
        vision_config=get("Inkling2VisionConfig"),
        config=get("Inkling2Config"),
        text_model=get("Inkling2TextModel"),
        causal_lm=get("Inkling2ForCausalLM"),
        model=get("Inkling2Model"),
        conditional_generation=get("Inkling2ForConditionalGeneration"),
    )


# Tiny text decoder, fields shared by both configs: two layers (sliding, then full: the suites want at most two), an
# attention-residual block boundary after the first, GQA in both attention kinds, 4 experts of which 2 per token, a
# window, relative-bias extent and log-scaling floor that a 7-token prompt crosses; a vocabulary of 99 like
# transformers' own testers.
TEXT_CONFIG = dict(
    vocab_size=99,
    unpadded_vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    layer_types=["hybrid_sliding", "hybrid"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=8,
    sliding_window_size=4,
    rel_extent=4,
    d_rel=4,
    log_scaling_n_floor=5,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_layers_per_attn_res_block=1,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Tiny ViT: 4-pixel patches merged 2 x 2, so an image token is an 8 x 8 pixel block
VISION_CONFIG = dict(
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    posemb_grid_size=4,
    projection_hidden_dim=32,
    text_hidden_size=32,
)
# low, as in transformers' VLM testers: the resize tests clamp ids from above
IMAGE_TOKEN_ID = 3


class Inkling2TextModelTester:
    def __init__(self, parent, classes, batch_size=3, seq_length=7, is_training=True):
        self.parent = parent
        self.classes = classes
        self.config_class = classes.text_config
        self.base_model_class = classes.text_model
        self.causal_lm_class = classes.causal_lm
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        for name, value in TEXT_CONFIG.items():
            setattr(self, name, value)

    def get_config(self):
        return self.config_class(**copy.deepcopy(TEXT_CONFIG))

    def prepare_config_and_inputs(self):
        # ids above the special ones (pad 0, bos 1, eos 2, and 3: the multimodal tester's image token)
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 4) + 4
        attention_mask = torch.tril(torch.ones_like(input_ids)).flip(0)  # last row: one token; first: all
        attention_mask[0] = 1
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}

    def create_and_check_model(self, config, input_ids, attention_mask):
        model = self.base_model_class(config).to(torch_device).eval()
        with torch.no_grad():
            model(input_ids, attention_mask=attention_mask)
            result = model(input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))

    def create_and_check_causal_lm(self, config, input_ids, attention_mask):
        model = self.causal_lm_class(config).to(torch_device).eval()
        with torch.no_grad():
            result = model(input_ids, attention_mask=attention_mask, labels=input_ids)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        self.parent.assertTrue(torch.isfinite(result.loss))


class Inkling2VisionTextModelTester:
    """One image of 2 x 2 image tokens per row, its four placeholders after the first text token."""

    def __init__(self, parent, classes, batch_size=3, seq_length=9, is_training=True, grid=(2, 2)):
        self.parent = parent
        self.classes = classes
        self.config_class = classes.config
        self.base_model_class = classes.model
        self.conditional_generation_class = classes.conditional_generation
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.grid = grid
        self.num_image_tokens = grid[0] * grid[1]
        self.image_token_id = IMAGE_TOKEN_ID
        self.cell = VISION_CONFIG["patch_size"] * VISION_CONFIG["spatial_merge_size"]
        self.num_channels = 3
        self.text_config = dict(TEXT_CONFIG)
        self.vision_config = dict(VISION_CONFIG)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "pad_token_id"):
            setattr(self, name, TEXT_CONFIG[name])

    def get_config(self):
        return self.config_class(
            text_config=copy.deepcopy(TEXT_CONFIG),
            vision_config=copy.deepcopy(VISION_CONFIG),
            image_token_id=IMAGE_TOKEN_ID,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 4) + 4  # never the image token
        input_ids[:, 1 : 1 + self.num_image_tokens] = IMAGE_TOKEN_ID
        attention_mask = torch.ones_like(input_ids)
        pixel_values = floats_tensor([self.batch_size * self.num_image_tokens, self.cell, self.cell, 3]) * 2 - 1
        image_grid_thw = torch.tensor([[1, *self.grid]] * self.batch_size, device=torch_device)
        return self.get_config(), input_ids, attention_mask, pixel_values, image_grid_thw

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask, pixel_values, image_grid_thw = self.prepare_config_and_inputs()
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "pixel_values": pixel_values,
            "image_grid_thw": image_grid_thw,
        }
        return config, inputs


class _SeededTest:
    """Fixed seeds for every test (the testers draw their inputs from torch's and Python's generators), and subtests
    folded into their test, so that a test has one outcome that an `xfail` mark can hold: the first failing subtest
    fails the test; a skipped subtest skips only itself, and a test all of whose subtests skipped is skipped. A test
    that `expect(..., xfail=...)` lists must pass: its skip is a failure."""

    _must_pass = frozenset()

    def setUp(self):
        super().setUp()
        from transformers import set_seed

        set_seed(SEED)

    @contextlib.contextmanager
    def subTest(self, msg=None, **params):
        self._subtests_entered += 1
        try:
            yield
        except unittest.SkipTest as skipped:
            self._subtests_skipped.append(str(skipped))

    def _callTestMethod(self, method):
        self._subtests_entered, self._subtests_skipped = 0, []
        try:
            method()
            if self._subtests_entered and len(self._subtests_skipped) == self._subtests_entered:
                raise unittest.SkipTest(self._subtests_skipped[0])
        except unittest.SkipTest as skipped:
            if self._testMethodName in self._must_pass:
                raise AssertionError(f"skipped, where it must pass: {skipped}") from None
            raise


class Inkling2TextModelTestBase(
    _SeededTest,
    ModelTesterMixin,
    GenerationTesterMixin,
    PipelineTesterMixin,
    TrainingTesterMixin,
    TensorParallelTesterMixin,
):
    """`Inkling2TextModel` and `Inkling2ForCausalLM`. Subclasses set `classes = model_classes(...)` and
    `all_model_classes`, and inherit `unittest.TestCase` last."""

    classes = None
    # MoE routing: top-k experts per token, so an expert that no token picks gets no gradient
    test_all_params_have_gradient = False
    # (the suite runs it only for models whose config file starts with a copyright year >= 2023)
    test_can_init_all_missing_weights_before_2023 = True
    # the overfit test's 90% loss drop in 30 steps instead of 300 (a 2-core CPU)
    training_overfit_steps = 30
    training_overfit_learning_rate = 1e-2

    @property
    def pipeline_model_mapping(self):
        return {"feature-extraction": self.classes.text_model, "text-generation": self.classes.causal_lm}

    def setUp(self):
        super().setUp()
        self.model_tester = Inkling2TextModelTester(self, self.classes)
        self.config_tester = ConfigTester(self, config_class=self.classes.text_config, **copy.deepcopy(TEXT_CONFIG))

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_causal_lm(self):
        self.model_tester.create_and_check_causal_lm(*self.model_tester.prepare_config_and_inputs())


class Inkling2ModelTestBase(_SeededTest, ModelTesterMixin, GenerationTesterMixin, PipelineTesterMixin):
    """`Inkling2Model` and `Inkling2ForConditionalGeneration` (image + text). No TrainingTesterMixin: its overfit
    test trains text models only (it reads `config.vocab_size`, a field of the text config); the text model's module
    runs it."""

    classes = None
    test_all_params_have_gradient = False
    test_can_init_all_missing_weights_before_2023 = True
    _is_composite = True
    # the ViT runs on packed patches: its last_hidden_state is [sum(1 + 4 * image tokens), hidden] (each image's class
    # token, then its patches), not one row per `pixel_values` row (as for transformers' Qwen2-VL-style models)
    skip_test_image_features_output_shape = True

    @property
    def pipeline_model_mapping(self):
        return {"image-text-to-text": self.classes.conditional_generation}

    def setUp(self):
        super().setUp()
        self.model_tester = Inkling2VisionTextModelTester(self, self.classes)
        # like transformers' VLM testers: the sub-configs at their defaults (a config only: nothing is built)
        self.config_tester = ConfigTester(
            self, config_class=self.classes.config, has_text_modality=False, image_token_id=IMAGE_TOKEN_ID
        )

    def test_config(self):
        self.config_tester.run_common_tests()

    @unittest.skip("the text decoder, so the composite model, has no SDPA path (its relative position bias is eager)")
    def test_can_set_attention_dynamically_composite_model(self):
        pass


def expect(cls, xfail: dict[str, str] | None = None, skip: dict[str, str] | None = None, slow: tuple[str, ...] = ()):
    """Marks inherited tests of `cls` in place, each with its reason: `skip` (the test does not apply to the model
    family), or `xfail`, strict: a fixed test then XPASSes, which fails the run (drop its entry). A test in `xfail`
    that the suite skips (e.g. "no sparse experts", where the reference has them) counts as failing: it must pass.
    `slow`: marked as transformers marks its slow tests (run with RUN_SLOW=1). Marks a wrapper, never the mixin's
    own function (which the other modules share)."""
    from transformers.testing_utils import slow as slow_test

    for name in slow:
        setattr(cls, name, slow_test(_wrap(cls, name)))
    for name, reason in (skip or {}).items():
        setattr(cls, name, unittest.skip(reason)(_wrap(cls, name)))
    for name, reason in (xfail or {}).items():
        setattr(cls, name, pytest.mark.xfail(strict=True, reason=reason)(_wrap(cls, name)))
    cls._must_pass = frozenset(cls._must_pass) | set(xfail or {})
    return cls


def _wrap(cls, name):
    original = getattr(cls, name, None)
    if original is None:
        raise AttributeError(f"{cls.__name__} has no test {name!r} to mark")

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    return wrapper


# ----------------------------------------------------------------------------------------------------------------
# Image processor, tokenizer, processor
# ----------------------------------------------------------------------------------------------------------------


def image_processing_testers():
    """The image-processing suite's tester and mixin (loaded on demand: not every module needs them)."""
    module = transformers_suites.load("test_image_processing_common")
    return module.ImageProcessingTester, module.ImageProcessingTestMixin


def tokenization_mixin():
    return transformers_suites.load("test_tokenization_common").TokenizerTesterMixin


def processing_mixin():
    return transformers_suites.load("test_processing_common").ProcessorTesterMixin


class CachedTokenizerLoads:
    """For tokenizer test classes (before the mixin): `get_tokenizer()` loads each (folder, kwargs) once and hands
    out deep copies, which are twice as fast as loading the 200k-token vocabulary again. A test's own
    `from_pretrained` calls still load from disk."""

    _loaded = {}

    @classmethod
    def get_tokenizer(cls, pretrained_name=None, **kwargs):
        pretrained_name = pretrained_name or cls.tmpdirname
        key = (cls.tokenizer_class, pretrained_name, repr(sorted(kwargs.items())))
        if key not in CachedTokenizerLoads._loaded:
            CachedTokenizerLoads._loaded[key] = super().get_tokenizer(pretrained_name, **kwargs)
        return copy.deepcopy(CachedTokenizerLoads._loaded[key])

    @classmethod
    def tearDownClass(cls):
        CachedTokenizerLoads._loaded.clear()
        super().tearDownClass()

    def get_clean_sequence(self, tokenizer, with_prefix_space=False, max_length=20, min_length=5):
        """The suite's own, on the same ids: the first `max_length` ids (ascending, as the suite's scan of the whole
        vocabulary finds them) whose text is plain letters and spaces and encodes back to that one id. It stops
        there instead of decoding all 200k ids (seconds, in every test that asks for a clean sequence)."""
        ids = []
        for token_id in sorted(set(tokenizer.get_vocab().values())):
            text = tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
            if re.match(r"^[ a-zA-Z]+$", text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                ids.append(token_id)
                if max_length is not None and len(ids) == max_length:
                    break
        if min_length is not None and 0 < len(ids) < min_length:
            while len(ids) < min_length:
                ids = ids + ids
        text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        if " " not in text and len(ids) > 1:
            first = tokenizer.decode([ids[0]], clean_up_tokenization_spaces=False)
            text = first + " " + tokenizer.decode(ids[1:], clean_up_tokenization_spaces=False)
        if with_prefix_space:
            text = " " + text
        return text, tokenizer.encode(text, add_special_tokens=False)


class CachedProcessorLoads:
    """For processor test classes (before the mixin): `get_processor()` and `get_component()` load once per
    arguments and hand out deep copies (see `CachedTokenizerLoads`)."""

    _loaded = {}

    def _cached(self, key, load):
        if key not in CachedProcessorLoads._loaded:
            CachedProcessorLoads._loaded[key] = load()
        return copy.deepcopy(CachedProcessorLoads._loaded[key])

    def get_processor(self, use_tiny_ckpt=True):
        load = super().get_processor
        return self._cached(("processor", use_tiny_ckpt), lambda: load(use_tiny_ckpt))

    def get_component(self, attribute, use_tiny_ckpt=True, **kwargs):
        key = ("component", attribute, use_tiny_ckpt, repr(sorted(kwargs.items())))
        load = super().get_component
        return self._cached(key, lambda: load(attribute, use_tiny_ckpt, **kwargs))

    @classmethod
    def tearDownClass(cls):
        CachedProcessorLoads._loaded.clear()
        super().tearDownClass()
