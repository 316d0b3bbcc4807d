"""Configurations of Inkling-2-Small: the text decoder, the ViT, and the multimodal model around them.

Field names and defaults are those of the official `config.json` (and of transformers' built-in `inkling2`),
so a checkpoint's config loads unchanged into either package. Defaults describe Inkling-2-Small.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

SLIDING_LAYER = "hybrid_sliding"
FULL_LAYER = "hybrid"
LAYER_TYPES = (SLIDING_LAYER, FULL_LAYER)
EXPERT_FORMATS = ("bf16", "nvfp4", "mxfp8")


def default_layer_types(num_hidden_layers: int, full_attention_every: int = 6) -> list[str]:
    """Every `full_attention_every`-th layer attends globally (by default the sixth: 5, 11, ..., 47); the others use
    the sliding window."""
    return [FULL_LAYER if (i + 1) % full_attention_every == 0 else SLIDING_LAYER for i in range(num_hidden_layers)]


# `from_pretrained(..., tp_plan="auto")` under torchrun: what each rank holds (`parallel/tensor_parallel.py` has the
# `inkling2_*` styles and says why). Keys are relative to the text decoder; models holding one prefix them.
ATTENTION = "layers.*.self_attn"
TEXT_MODEL_TP_PLAN = {
    "embed_tokens": "replicate",  # named, so that transformers does not split it by vocabulary on its own
    ATTENTION: "inkling2_attention",
    **{f"{ATTENTION}.{name}": "inkling2_colwise" for name in ("q_proj", "k_proj", "v_proj", "r_proj", "gate_proj",
                                                              "sink_proj")},  # fmt: skip
    f"{ATTENTION}.o_proj": "inkling2_rowwise",
    f"{ATTENTION}.q_l2_clip": "inkling2_head_rows",  # scale [heads, head_dim]
    f"{ATTENTION}.rel_l2_clip": "inkling2_head_rows",  # scale [heads, d_rel]
    f"{ATTENTION}.k_sconv.conv1d": "inkling2_head_rows",  # sliding layers: weight [kv_heads * head_dim, 1, k]
    f"{ATTENTION}.v_sconv.conv1d": "inkling2_head_rows",
    f"{ATTENTION}.k_sconv": "inkling2_head_columns",  # full layers: static_weight [k, kv_heads * head_dim]
    f"{ATTENTION}.v_sconv": "inkling2_head_columns",
    f"{ATTENTION}.k_sconv.weight_proj": "inkling2_colwise",  # full layers: rows kv_head * k + lag
    f"{ATTENTION}.v_sconv.weight_proj": "inkling2_colwise",
    "layers.*.mlp.experts": "inkling2_experts",
}
TEXT_MODEL_EP_PLAN = {
    # a plan names parameters only, and the packed experts are buffers: the MoE block's rule splits all of them
    "layers.*.mlp": "inkling2_expert_blocks",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}

# What a numeric field can hold, as (what the error says, test); NaN fails every test.
POSITIVE = ("positive and finite", lambda value: 0 < value < math.inf)
NON_NEGATIVE = ("non-negative and finite", lambda value: 0 <= value < math.inf)
PROBABILITY = ("a probability in [0, 1]", lambda value: 0 <= value <= 1)
FINITE = ("finite", math.isfinite)
NumberRule = tuple[str, Callable[[float], bool]]


def require_valid_numbers(config: PreTrainedConfig, rules: dict[str, NumberRule]) -> None:
    """Sizes, counts, scales and rates that cannot be: a clear error naming each such field, before any check that
    would divide by one (a negative width otherwise fails later, far from its cause, or blames another field)."""
    wrong = [
        f"`{name}` = {getattr(config, name)!r} (must be {kind})"
        for name, (kind, test) in rules.items()
        if not test(getattr(config, name))
    ]
    if wrong:
        raise ValueError(f"{type(config).__name__}: {', '.join(wrong)}.")


DSPARK_HEAD_TYPES = ("rnn", "vanilla")
POSITIVE_DSPARK_FIELDS = (
    "block_size", "markov_rank", "num_draft_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "context_window", "distance_buckets", "rms_norm_eps",
)  # fmt: skip
DSPARK_NUMBER_RULES = {
    **dict.fromkeys(POSITIVE_DSPARK_FIELDS, POSITIVE),
    "mask_token_id": NON_NEGATIVE,
    "initializer_range": NON_NEGATIVE,
}
POSITIVE_TEXT_FIELDS = (
    "vocab_size", "unpadded_vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
    "sliding_window_size", "d_rel",
    "rel_extent", "log_scaling_n_floor", "max_position_embeddings", "rms_norm_eps", "conv_kernel_size",
    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "route_scale", "qk_l2_clip_threshold",
    "rel_l2_clip_threshold", "n_layers_per_attn_res_block", "mlp_gate_softcap", "mlp_up_softcap",
    "final_logit_softcapping",
)  # fmt: skip
TEXT_NUMBER_RULES = {
    **dict.fromkeys(POSITIVE_TEXT_FIELDS, POSITIVE),
    "log_scaling_alpha": NON_NEGATIVE,  # a negative one would shrink, then flip, the queries of long contexts
    "attention_dropout": PROBABILITY,
    "initializer_range": NON_NEGATIVE,
}
POSITIVE_VISION_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels", "patch_size",
    "layer_norm_eps", "spatial_merge_size", "posemb_grid_size", "projection_hidden_dim", "text_hidden_size",
)  # fmt: skip
VISION_NUMBER_RULES = {
    **dict.fromkeys(POSITIVE_VISION_FIELDS, POSITIVE),
    "attention_dropout": PROBABILITY,
    "layer_scale_init_value": FINITE,
    "initializer_range": NON_NEGATIVE,
}


@strict
class Inkling2DSparkConfig(PreTrainedConfig):
    r"""
    The DSpark drafter bundled with the checkpoint: it proposes `block_size` tokens per decoding step from the target's
    own hidden states, and the target verifies them in one pass (see `docs/dspark.md`).

    Args:
        block_size (`int`, defaults to 7): tokens drafted per step (the block is the last committed token followed by
            `block_size - 1` mask tokens; block position k predicts the token k + 1 after it).
        target_layer_ids (`list[int]`, defaults to `[1, 12, 23, 34, 45]`): decoder layers whose outputs, concatenated,
            are the drafter's context features (never the last layer).
        mask_token_id (`int`, defaults to 200064): the token that fills the block after its first position.
        head_type (`str`, defaults to `"rnn"`): `"rnn"` adds the recurrent Markov head's bias to the base logits, token
            by token; `"vanilla"` drafts from the base logits alone (all positions in parallel).
        markov_rank (`int`, defaults to 256): width of the Markov head's token embedding and state.
        num_draft_layers (`int`, defaults to 2): decoder layers of the drafter.
        hidden_size / num_attention_heads / num_key_value_heads / head_dim / intermediate_size: their shape (the
            width must equal the target's: the drafter shares its embedding and lm_head).
        context_window (`int`, defaults to 1024): committed positions before the block that the drafter attends to.
        distance_buckets (`int`, defaults to 64): learned attention-bias buckets by distance to a context position
            (distances beyond share the last bucket).
        use_confidence_head (`bool`, defaults to `True`): a per-position acceptance predictor; generate() can stop a
            draft early where it falls below `dspark_confidence_threshold`.
        rms_norm_eps (`float`, defaults to 1e-6), initializer_range (`float`, defaults to 0.02).
    """

    model_type = "inkling2_dspark"
    base_config_key = "dspark_config"

    block_size: int = 7
    target_layer_ids: list[int] | None = None
    mask_token_id: int = 200064
    head_type: str = "rnn"
    markov_rank: int = 256
    num_draft_layers: int = 2
    hidden_size: int = 4608
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 12288
    context_window: int = 1024
    distance_buckets: int = 64
    use_confidence_head: bool = True
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        if self.target_layer_ids is None:
            self.target_layer_ids = [1, 12, 23, 34, 45]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        require_valid_numbers(self, DSPARK_NUMBER_RULES)
        super().validate_architecture()
        if self.head_type not in DSPARK_HEAD_TYPES:
            raise ValueError(f"`head_type` must be one of {DSPARK_HEAD_TYPES}, got {self.head_type!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DSpark `num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                f"`num_key_value_heads` ({self.num_key_value_heads})."
            )
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(
                f"DSpark needs `target_layer_ids`: the target layers whose outputs it reads, numbered from 0; got "
                f"{self.target_layer_ids!r}."
            )

    def check_fits_target(self, text_config: "Inkling2TextConfig") -> None:
        """The drafter reads the target's layers and shares its embedding: their sizes must agree."""
        last = text_config.num_hidden_layers - 1
        if any(not 0 <= i < last for i in self.target_layer_ids):
            raise ValueError(
                f"DSpark `target_layer_ids` {self.target_layer_ids} must name target layers in [0, {last}) "
                f"(the target has {text_config.num_hidden_layers} layers; the last one is never tapped)."
            )
        if self.hidden_size != text_config.hidden_size:
            raise ValueError(
                f"DSpark `hidden_size` ({self.hidden_size}) must equal the target's ({text_config.hidden_size}): the "
                "drafter shares the target's embedding and lm_head."
            )
        if not 0 <= self.mask_token_id < text_config.vocab_size:
            raise ValueError(f"DSpark `mask_token_id` {self.mask_token_id} is outside the vocabulary.")


@strict
class Inkling2TextConfig(PreTrainedConfig):
    r"""
    The MoE text decoder.

    Args:
        vocab_size (`int`, defaults to 201024): rows of the embedding and unembedding matrices (padded).
        unpadded_vocab_size (`int`, defaults to 200058): rows that hold real tokens; logits are sliced to it. At or
            above `vocab_size` every row is a real token (as after `from_pretrained(path, text_config={"vocab_size":
            n})` with a smaller vocabulary: transformers keeps the other saved fields as they are).
        hidden_size (`int`, defaults to 4608): width of the residual stream.
        num_hidden_layers (`int`, defaults to 48): decoder layers.
        num_attention_heads / num_key_value_heads / head_dim: attention shape of the full-attention layers.
        swa_num_attention_heads / swa_num_key_value_heads / swa_head_dim: the same for the sliding-window layers.
        sliding_window_size (`int`, defaults to 1024): keys a sliding-window query sees, itself included.
        d_rel (`int`, defaults to 16): per-head width of the relative states that mix the relative-bias bank.
        rel_extent (`int`, defaults to 1024): backward distance over which full layers add the relative bias
            (sliding layers use `sliding_window_size`).
        log_scaling_n_floor / log_scaling_alpha: full layers multiply queries and relative states by
            `1 + alpha * log(max(1, (position + 1) / n_floor))`.
        layer_types (`list[str]`): `"hybrid_sliding"` or `"hybrid"` (full attention) per layer.
        conv_kernel_size (`int`, defaults to 4): taps of the four short causal convolutions of every layer.
        moe_intermediate_size / n_routed_experts / num_experts_per_tok / route_scale / scoring_func: the MoE.
        qk_l2_clip_threshold / rel_l2_clip_threshold: maximum L2 norm of query/key and relative-state heads.
        n_layers_per_attn_res_block (`int`, defaults to 6): layers summed into one attention-residual block.
        mlp_gate_softcap / mlp_up_softcap: softcaps of the experts' SwiGLU.
        final_logit_softcapping (`float`, defaults to 30.0): softcap of the output logits.
        dspark_config (`Inkling2DSparkConfig` or `dict`, *optional*): the bundled DSpark drafter, if any.
        expert_quantization (`dict`, *optional*): how the routed experts are stored when not in BF16; filled in by
            `from_pretrained` from the checkpoint (see `docs/quantization.md`): `{"formats": [per layer "bf16" |
            "nvfp4" | "mxfp8"], "nvfp4_outer_scales": [NVFP4 outer-scale tensor suffixes, e.g. "scale_2"],
            "nvfp4_outer_per_half": bool}`.
    """

    model_type = "inkling2_text"
    base_config_key = "text_config"
    base_model_tp_plan = TEXT_MODEL_TP_PLAN
    base_model_ep_plan = TEXT_MODEL_EP_PLAN
    sub_configs_defaults = {"dspark_config": SubConfigSpec(Inkling2DSparkConfig, optional=True)}
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "sliding_window": "sliding_window_size",
        "num_local_experts": "n_routed_experts",
        "sconv_kernel_size": "conv_kernel_size",
        "model_max_length": "max_position_embeddings",
        "intermediate_size": "moe_intermediate_size",
        "routed_scaling_factor": "route_scale",
    }

    vocab_size: int = 201024
    unpadded_vocab_size: int = 200058
    hidden_size: int = 4608
    num_hidden_layers: int = 48
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    swa_num_attention_heads: int = 48
    swa_num_key_value_heads: int = 8
    swa_head_dim: int = 128
    sliding_window_size: int = 1024
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_n_floor: int = 128000
    log_scaling_alpha: float = 0.1
    layer_types: list[str] | None = None
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    hidden_act: str = "silu"
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    route_scale: float = 8.0
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 200006
    qk_l2_clip_threshold: float = 22.627416997969522
    rel_l2_clip_threshold: float = 8.0
    n_layers_per_attn_res_block: int = 6
    mlp_gate_softcap: float = 4.0
    mlp_up_softcap: float = 25.0
    final_logit_softcapping: float = 30.0
    scoring_func: str = "sigmoid"
    use_cache: bool = True
    expert_quantization: dict | None = None
    dspark_config: Inkling2DSparkConfig | dict | None = None

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        super().__post_init__(**kwargs)

    def validate_layer_type(self):
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if unknown:
            raise ValueError(
                f"Unknown layer type(s) {unknown} in `layer_types`: Inkling2 layers are {LAYER_TYPES[0]!r} "
                f"(sliding window) or {LAYER_TYPES[1]!r} (full attention)."
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"`layer_types` has {len(self.layer_types)} entries but `num_hidden_layers` is "
                f"{self.num_hidden_layers}: give one entry per layer."
            )

    def validate_architecture(self):
        require_valid_numbers(self, TEXT_NUMBER_RULES)
        super().validate_architecture()
        for prefix, heads, kv_heads in (
            ("", self.num_attention_heads, self.num_key_value_heads),
            ("swa_", self.swa_num_attention_heads, self.swa_num_key_value_heads),
        ):
            if heads % kv_heads:
                raise ValueError(
                    f"`{prefix}num_attention_heads` ({heads}) must be a multiple of `{prefix}num_key_value_heads` "
                    f"({kv_heads}): every key/value head serves the same number of query heads."
                )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"`num_experts_per_tok` ({self.num_experts_per_tok}) cannot exceed `n_routed_experts` "
                f"({self.n_routed_experts})."
            )
        if self.scoring_func != "sigmoid":
            raise ValueError(f"Inkling2 routers score experts with a sigmoid, got `scoring_func={self.scoring_func!r}`.")
        if self.expert_quantization is not None:
            formats = self.expert_quantization.get("formats", [])
            if len(formats) != self.num_hidden_layers or not set(formats) <= set(EXPERT_FORMATS):
                raise ValueError(
                    f"`expert_quantization['formats']` must give one of {EXPERT_FORMATS} per layer "
                    f"({self.num_hidden_layers} layers), got {formats}."
                )
        if self.dspark_config is not None:
            self.dspark_config.check_fits_target(self)

    def expert_format(self, layer_idx: int) -> str:
        """How layer `layer_idx` stores its routed experts: "bf16", "nvfp4" or "mxfp8"."""
        return "bf16" if self.expert_quantization is None else self.expert_quantization["formats"][layer_idx]

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_LAYER]


@strict
class Inkling2VisionConfig(PreTrainedConfig):
    r"""
    The ViT that encodes images, and the 2x2 merger that projects them into the text width.

    Args:
        hidden_size (`int`, defaults to 1024), num_hidden_layers (`int`, defaults to 23),
        num_attention_heads (`int`, defaults to 16), patch_size (`int`, defaults to 20): the ViT.
        intermediate_size (`int`, *optional*): MLP width, `hidden_size * mlp_ratio` when unset.
        layer_scale_init_value (`float`, defaults to 0.1): initial layer scales.
        rope_parameters (`dict`, *optional*): axial rotary embedding (`rope_type="axial"`, `rope_theta`).
        spatial_merge_size (`int`, defaults to 2): side of the patch square merged into one text token.
        posemb_grid_size (`int`, defaults to 32): side of the learned position grid, interpolated per image.
        projection_hidden_dim (`int`, defaults to 4096) / projector_bias: the merger MLP.
        text_hidden_size (`int`, defaults to 4608): width of the text model the merger projects into.
    """

    model_type = "inkling2_vision"
    base_config_key = "vision_config"
    default_rope_type = "axial"
    attribute_map = {"native_patch_size": "patch_size", "adapter_merge_size": "spatial_merge_size"}

    hidden_size: int = 1024
    intermediate_size: int | None = None
    num_hidden_layers: int = 23
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 20
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float | int = 0.0
    mlp_ratio: float = 4.0
    layer_scale_init_value: float = 0.1
    rope_parameters: dict | None = None
    spatial_merge_size: int = 2
    posemb_grid_size: int = 32
    projection_hidden_dim: int = 4096
    projector_bias: bool = False
    text_hidden_size: int = 4608
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None:
            require_valid_numbers(self, {"mlp_ratio": POSITIVE})  # before it sizes the MLP (the validators run later)
            self.intermediate_size = int(self.hidden_size * self.mlp_ratio)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "axial", "rope_theta": 10000.0}
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        require_valid_numbers(self, VISION_NUMBER_RULES)
        super().validate_architecture()
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"Vision `hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        if (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError("The axial rotary embedding needs a vision head dimension divisible by 4.")
        if self.rope_parameters.get("rope_type", "axial") != "axial":
            raise ValueError(f"Inkling2's ViT uses axial rotary embeddings, got {self.rope_parameters}.")


@strict
class Inkling2Config(PreTrainedConfig):
    r"""
    The multimodal Inkling-2-Small: a text decoder and a ViT whose features replace image placeholder tokens.

    Args:
        text_config (`Inkling2TextConfig` or `dict`, *optional*): the decoder.
        vision_config (`Inkling2VisionConfig` or `dict`, *optional*): the ViT.
        image_token_id (`int`, defaults to 200054): the placeholder `<|unused_200054|>`, one per image feature.
        dspark_config (`Inkling2DSparkConfig` or `dict`, *optional*): the bundled DSpark drafter, if any; mirrored
            into `text_config.dspark_config` so that the text decoder loaded alone keeps it.
    """

    model_type = "inkling2"
    sub_configs_defaults = {
        "text_config": Inkling2TextConfig,
        "vision_config": Inkling2VisionConfig,
        "dspark_config": SubConfigSpec(Inkling2DSparkConfig, optional=True),
    }

    text_config: Inkling2TextConfig | dict | None = None
    vision_config: Inkling2VisionConfig | dict | None = None
    image_token_id: int = 200054
    dspark_config: Inkling2DSparkConfig | dict | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.dspark_config is None:
            self.dspark_config = self.text_config.dspark_config
        self.text_config.dspark_config = self.dspark_config

    def validate_architecture(self):
        if not 0 <= self.image_token_id < self.text_config.vocab_size:
            raise ValueError(
                f"`image_token_id` = {self.image_token_id!r} is outside the vocabulary (0 to "
                f"{self.text_config.vocab_size - 1}): it must be the token that image placeholders use."
            )
        if self.dspark_config is not None:
            self.dspark_config.check_fits_target(self.text_config)
        if self.vision_config.text_hidden_size != self.text_config.hidden_size:
            raise ValueError(
                f"`vision_config.text_hidden_size` ({self.vision_config.text_hidden_size}) must equal "
                f"`text_config.hidden_size` ({self.text_config.hidden_size}): the merger projects into the text width."
            )


__all__ = ["Inkling2Config", "Inkling2DSparkConfig", "Inkling2TextConfig", "Inkling2VisionConfig"]
