"""Names of the original Inkling2 checkpoint layout and how they map onto our modules.

The official checkpoints (and transformers' built-in `inkling2` when it saves) use the original names
(`model.llm.layers.N.attn.wq_du`, interleaved `w13` expert rows, `attn_res.attn_queries.{i}` belonging to layer
`i + 1`, ...). Our modules use transformers' names. The renamings below are registered with transformers'
conversion-mapping machinery, which applies them when loading and reverses them when saving, so that our
`save_pretrained` writes the original layout again and checkpoints move freely between the two packages.
"""

from __future__ import annotations

from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Interleave, WeightConverter, WeightRenaming


class ShiftedIndexRenaming(WeightRenaming):
    """A renaming whose captured number is shifted: `attn_res.attn_queries.{i}` feeds layer `i + 1`'s attention
    (layer 0 reads the embedding directly and has no query)."""

    __slots__ = ("shift",)

    def __init__(self, source_patterns, target_patterns, shift: int):
        self.shift = shift
        super().__init__(source_patterns=source_patterns, target_patterns=target_patterns)

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        matched = self._scoped_match(source_key)
        if matched is None:
            return source_key, None
        prefix, key, match = matched
        self._was_used = True
        index = int(match.group(self.compiled_sources.groupindex["g0"] + 1)) + self.shift
        renamed = key.replace(match.group(0), self.target_patterns[0].replace(r"\1", str(index)), 1)
        return (prefix or "") + renamed, self.source_patterns[0]

    def reverse_transform(self) -> ShiftedIndexRenaming:
        return self.copy(self._original_target_patterns, self._original_source_patterns, shift=-self.shift)


def text_model_renamings() -> list[WeightRenaming]:
    """Original text-decoder names -> ours (applied in order, each to the result of the previous ones)."""
    renames = [
        (r"model\.llm\.unembed\.weight", "lm_head.weight"),
        (r"model\.llm\.", "model."),
        (r"embed\.weight", "embed_tokens.weight"),
        (r"(?<!embed_tokens\.)embed_norm\.", "embed_tokens.embed_norm."),
        (r"mlp\.experts\.w2_weight", "mlp.experts.down_proj"),
        # quantized experts (see quantization/checkpoints.py): block scales and NVFP4 outer-scale tensors
        (r"mlp\.experts\.w2_weight_scale", "mlp.experts.down_proj_scale"),
        (r"mlp\.experts\.w13_weight_(scale_2|global_scale|amax|outer_scale_denominator)", r"mlp.experts.gate_up_proj_\1"),
        (r"mlp\.experts\.w2_weight_(scale_2|global_scale|amax|outer_scale_denominator)", r"mlp.experts.down_proj_\1"),
        (r"mlp\.gate\.bias", "mlp.gate.e_score_correction_bias"),
        (r"attn\.wq_du", "self_attn.q_proj"),
        (r"attn\.wk_dv", "self_attn.k_proj"),
        (r"attn\.wv_dv", "self_attn.v_proj"),
        (r"attn\.wr_du", "self_attn.r_proj"),
        (r"attn\.wo_ud", "self_attn.o_proj"),
        (r"attn\.gate_attn", "self_attn.gate_proj"),
        (r"attn\.attn_sink_proj", "self_attn.sink_proj"),
        (r"\.attn\.(q_l2_clip|rel_l2_clip|k_sconv|v_sconv|rel_logits_proj)\.", r".self_attn.\1."),
        (r"attn_sconv\.", "post_attention_convolution."),
        (r"mlp_sconv\.", "post_mlp_convolution."),
        (r"(convolution|sconv)\.weight", r"\1.conv1d.weight"),
        (r"sconv\.static_w", "sconv.static_weight"),
        # not `...weight_proj.lora_A...` of an adapter (PEFT's loading applies these renamings to adapter keys too)
        (r"sconv\.weight_proj(?!\.)", "sconv.weight_proj.weight"),
        (r"mlp_norm", "post_attention_layernorm"),
        (r"attn_norm", "input_layernorm"),
        (r"(q|k|v)_input_norm", r"\1_input_layernorm"),
        (r"attn_res\.mlp_queries\.(\d+)", r"layers.\1.mlp_input.query"),
        (r"attn_res\.output_query", "final_input.query"),
    ]
    return [
        # rows g0, u0, g1, u1, ... -> all gate rows, then all up rows (packed weights and block scales alike)
        *(
            WeightConverter(source_patterns=rf"mlp\.experts\.w13_weight{suffix}", target_patterns=f"mlp.experts.gate_up_proj{suffix}", operations=[Interleave(dim=1)])
            for suffix in ("", "_scale")
        ),
        *(WeightRenaming(source, target) for source, target in renames),
        ShiftedIndexRenaming(r"attn_res\.attn_queries\.(\d+)", r"layers.\1.attention_input.query", shift=1),
    ]


def multimodal_model_renamings() -> list[WeightRenaming]:
    """Original names -> ours around the text decoder (whose own renamings transformers applies within
    `model.language_model`): the head, the decoder's place, and the ViT."""
    from .modeling_inkling2_vision import vision_checkpoint_renames

    renames = [
        (r"model\.llm\.unembed\.weight", "lm_head.weight"),
        (r"model\.llm\.", "model.language_model."),
        *vision_checkpoint_renames(),
    ]
    return [WeightRenaming(source, target) for source, target in renames]


def register_conversion_mappings() -> None:
    """Makes transformers rename original-layout checkpoints for our model types (and back when saving)."""
    register_checkpoint_conversion_mapping("inkling2_text", text_model_renamings(), overwrite=True)
    register_checkpoint_conversion_mapping("inkling2", multimodal_model_renamings(), overwrite=True)
