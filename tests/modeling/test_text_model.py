"""The text decoder against transformers' built-in `inkling2` (the oracle) on the same random weights."""

import dataclasses

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from inkling2_helpers import ORACLE_TEXT_CONFIG, build_pair, left_padded_batch, positions_from_mask, within
from torch.utils._python_dispatch import TorchDispatchMode

from transformers_inkling2 import Inkling2Config, Inkling2StaticCache, Inkling2TextConfig


def oracle_and_our_logits(dtype=torch.float32, seed=0, **overrides):
    ours, oracle = build_pair(seed=seed, dtype=dtype, **overrides)
    input_ids, attention_mask = left_padded_batch(seed=seed)
    inputs = dict(attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask), use_cache=False)
    with torch.no_grad():
        return ours(input_ids, **inputs).logits, oracle(input_ids, **inputs).logits, attention_mask.bool()


@pytest.mark.parametrize("seed", [0, 1])
def test_fp32_logits_equal_builtin_with_left_padding_beyond_the_window(seed):
    ours, oracle, real = oracle_and_our_logits(seed=seed)
    assert ours.shape == oracle.shape == (2, 21, ORACLE_TEXT_CONFIG["unpadded_vocab_size"])
    assert oracle[real].abs().max() > 1.0  # a live model, not a near-zero one
    assert (ours - oracle)[real].abs().max() <= 1e-4


def test_fp32_logits_equal_builtin_without_log_scaling_and_with_equal_extents():
    ours, oracle, real = oracle_and_our_logits(log_scaling_n_floor=128000, rel_extent=8)
    assert (ours - oracle)[real].abs().max() <= 1e-4


def test_bf16_logits_are_as_close_to_fp32_as_the_builtins():
    """bf16 bound: our bf16 logits are within 1.25x the built-in bf16's own relative L2 error to the fp32 logits
    (both about 0.2 on this random 12-layer model, where bf16 noise flips expert choices)."""
    _, truth, real = oracle_and_our_logits()
    ours16, oracle16, _ = oracle_and_our_logits(dtype=torch.bfloat16)

    def relative_error(logits):
        return ((logits - truth)[real].norm() / truth[real].norm()).item()

    assert relative_error(ours16) <= 1.25 * relative_error(oracle16) + 1e-3


def test_parameter_names_and_shapes_equal_builtin():
    ours, oracle = build_pair()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in oracle.state_dict().items()}


def test_config_fields_and_defaults_equal_builtin():
    from transformers.models.inkling2 import configuration_inkling2 as builtin

    for ours, theirs in [
        (Inkling2TextConfig(), builtin.Inkling2TextConfig()),
        (Inkling2Config().vision_config, builtin.Inkling2VisionConfig()),
    ]:
        ours_fields = {f.name: getattr(ours, f.name) for f in dataclasses.fields(ours)}
        theirs_fields = {f.name: getattr(theirs, f.name) for f in dataclasses.fields(theirs)}
        assert {name: ours_fields[name] for name in theirs_fields} == theirs_fields
        # ours: the quantized expert layout and the DSpark drafter
        assert set(ours_fields) - set(theirs_fields) <= {"expert_quantization", "dspark_config"}
    assert Inkling2Config().image_token_id == builtin.Inkling2Config().image_token_id == 200054
    assert Inkling2TextConfig().full_attention_layers == list(range(5, 48, 6))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "multiple of `num_key_value_heads`"),
        (dict(swa_num_attention_heads=6, swa_num_key_value_heads=4), "swa_num_key_value_heads"),
        (dict(num_hidden_layers=2, layer_types=["hybrid", "global"]), "Unknown layer type"),
        (dict(num_hidden_layers=3, layer_types=["hybrid", "hybrid_sliding"]), "one entry per layer"),
        (dict(num_experts_per_tok=9, n_routed_experts=8), "cannot exceed"),
        (dict(unpadded_vocab_size=0, vocab_size=200), "unpadded_vocab_size"),
    ],
)
def test_bad_text_config_is_a_clear_error(fields, message):
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        Inkling2TextConfig(**fields)


def test_mismatched_vision_and_text_width_is_a_clear_error():
    with pytest.raises(StrictDataclassClassValidationError, match="text_hidden_size"):
        Inkling2Config(text_config=dict(hidden_size=64), vision_config=dict(text_hidden_size=32))


def test_a_prompt_too_long_for_one_forward_points_to_chunked_prefill():
    from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2RelativeLogits

    with pytest.raises(ValueError, match="prefill_chunk_size"):
        Inkling2RelativeLogits(16, 1024)(torch.empty(1, 50_000, 48, 16, device="meta"))


@pytest.mark.parametrize("queries", [8, 9, 40])
def test_relative_logits_of_prompts_come_aligned_for_the_prefill_kernel(queries):
    """Decode steps (up to 8 queries) get the plain product; prompts get the same values as a view whose rows start
    one element before a 16-byte boundary at a pitch of 15 mod 16 (what makes the kernel's bias rows 16-byte
    aligned), with a guard of buffer around them (what lets its tiles read past the rows without masks)."""
    from transformers_inkling2.backends.attention.relative_logits import ALIGNED_GUARD
    from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2RelativeLogits

    projection = Inkling2RelativeLogits(16, 40)
    torch.nn.init.normal_(projection.proj)
    states = torch.randn(2, queries, 3, 16)
    logits = projection(states)
    torch.testing.assert_close(logits, (states @ projection.proj).transpose(1, 2), rtol=1e-5, atol=1e-5)
    if queries > 8:
        assert (logits.storage_offset() + 1) % 8 == 0 and logits.stride(2) % 16 == 15
        assert logits.stride(1) % 16 == 0 and logits.stride(0) % 16 == 0
        last = logits.storage_offset() + sum((n - 1) * step for n, step in zip(logits.shape, logits.stride()))
        assert (
            logits.storage_offset() >= ALIGNED_GUARD
            and logits.untyped_storage().size() // 4 - 1 - last >= ALIGNED_GUARD
        )
    else:
        assert logits.storage_offset() == 0


def test_hidden_states_equal_builtin():
    """The embeddings, then every layer's output: the stream speculative drafters tap."""
    ours, oracle = build_pair(seed=2)
    input_ids, _ = left_padded_batch(seed=2)
    with torch.no_grad():
        ours_states = ours(input_ids, output_hidden_states=True, use_cache=False).hidden_states
        oracle_states = oracle.model(input_ids, output_hidden_states=True, use_cache=False).hidden_states
    assert len(ours_states) == len(oracle_states) == ORACLE_TEXT_CONFIG["num_hidden_layers"] + 1
    assert max((a - b).abs().max() for a, b in zip(ours_states, oracle_states)) <= 1e-4


class Conversions(TorchDispatchMode):
    """Records every dtype conversion: which tensor (storage, view, version) to which dtype. The converted tensors are
    kept alive, so that no later tensor can reuse their memory and look like them."""

    def __init__(self):
        super().__init__()
        self.seen, self.kept = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket is torch.ops.aten._to_copy and args[0].is_floating_point():
            x = args[0]
            view = (x.untyped_storage().data_ptr(), x.storage_offset(), x.shape, x.stride(), x._version)
            self.seen.append((view, out.dtype))
            self.kept.append(x)
        return out


def test_a_bf16_decode_step_converts_no_tensor_twice():
    """Each reader of the layer input converted it to fp32 on its own (up to three launches for one conversion); a
    decode step now converts every tensor at most once per dtype (on GPUs each conversion is a kernel launch)."""
    model = build_pair(dtype=torch.bfloat16)[0]
    input_ids, attention_mask = left_padded_batch(seed=3, length=9, pad=2)
    cache = Inkling2StaticCache(model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask, past_key_values=cache)
        with Conversions() as conversions:
            model(input_ids[:, :1], attention_mask=torch.ones(2, 10, dtype=torch.long), past_key_values=cache)
    assert len(conversions.seen) > 100 and len(set(conversions.seen)) == len(conversions.seen)


@pytest.mark.parametrize("num_queries", [1, 3])
def test_attention_residual_steps_mix_as_prompts_do(num_queries):
    """A step's few tokens mix by products and sums (what `torch.compile` fuses), a prompt's by einsums: per token
    the same mix, fp32 within 1e-6 relative, on random blocks, partial block and queries."""
    from transformers_inkling2.cache.common import MAX_STEP_TOKENS
    from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2BlockAttentionResidual

    config = Inkling2TextConfig(**ORACLE_TEXT_CONFIG)
    mix = Inkling2BlockAttentionResidual(config, num_queries)
    generator = torch.Generator().manual_seed(num_queries)
    torch.nn.init.normal_(mix.query, std=2.0, generator=generator)
    blocks = torch.randn(2, 20, 3, config.hidden_size, generator=generator)
    partial = torch.randn(2, 20, config.hidden_size, generator=generator) * 3
    prompt = torch.stack(mix(blocks, partial))
    steps = [torch.stack(mix(blocks[:, t : t + MAX_STEP_TOKENS], partial[:, t : t + MAX_STEP_TOKENS]))
             for t in range(0, 20, MAX_STEP_TOKENS)]  # fmt: skip
    assert prompt.shape == (num_queries, 2, 20, config.hidden_size)
    assert within(torch.cat(steps, dim=2), prompt, 1e-6)
