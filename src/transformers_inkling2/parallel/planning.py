"""`inkling2 plan`: GPU memory of a checkpoint variant at a tensor/expert-parallel size, context length and batch.

Counted from the config, the way the model stores things (see `memory_plan`):
- weights: every tensor of the model itself (built on the meta device) at its stored dtype: BF16, fp32 for the
  modules the original runs in fp32, routed experts packed (MXFP8 1 + 1/32 bytes a weight, NVFP4 1/2 + 1/16 + fp32
  outer scales). Attention projections and per-head tensors are split over `tp` ranks by heads (key/value ones by
  kv heads, at most one kv head per rank), routed experts over `ep` ranks, `lm_head` by vocabulary; the embedding,
  router, norms, attention-residual queries and the ViT are replicated.
- cache: full-attention layers hold `context` keys and values per sequence, sliding layers `window - 1 + 8`; both
  split over `tp` by kv heads (a rank keeps its kv heads; with more ranks than kv heads each rank keeps one); four
  short-convolution states per layer of `kernel - 1 + 8` fp32 inputs.
- activations: the largest transient of one prefill chunk, dominated by the relative logits of one layer
  (`chunk * heads / tp * extent`) and the MoE's sorted activations (`chunk * top_k * 2 * intermediate`), in fp32,
  plus the fp32 attention-residual block states of the chunk; with the default chunk (16,384 tokens) a few GB.
The result is an estimate for planning, not a promise: the CUDA allocator, NCCL buffers and CUDA graphs add
hundreds of MB to a few GB per GPU.

`serving_pages` sizes the serving engine's cache (`Inkling2Engine` over `Inkling2PagedCache`) instead: what a GPU
has left after the weights, one step's activations and every row's fixed state, in pages of full-attention keys and
values.
"""

import copy
import math
import re
from dataclasses import dataclass

import torch

from ..cache.common import MAX_STEP_TOKENS
from ..cache.paged import (
    check_page_size,
    convolution_state_bytes,
    full_layer_bytes_per_token,
    local_kv_width,
    pages_that_fit,
    row_state_bytes,
)
from ..configuration_inkling2 import FULL_LAYER, Inkling2Config, Inkling2DSparkConfig, Inkling2TextConfig
from ..modeling.activation_memory import prefill_activation_bytes

GIB = 2**30
VARIANTS = {
    "nvfp4-mxfp8": lambda layer: "nvfp4" if layer < 40 else "mxfp8",  # thinkingmachines/Inkling-2-Small
    "mxfp8": lambda layer: "mxfp8",  # thinkingmachines/Inkling-2-Small-MXFP8
    "bf16": lambda layer: "bf16",
}


@dataclass
class MemoryPlan:
    weights: float
    kv_cache: float
    conv_states: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.conv_states + self.activations

    def gib(self) -> dict[str, float]:
        return {name: value / GIB for name, value in {**self.__dict__, "total": self.total}.items()}


# The tensors the parallel plans (`parallel/tensor_parallel.py`) split, along which dim, over which ranks: the text
# decoder's attention by heads (its key/value tensors by kv heads), routed experts in blocks, `lm_head` by vocabulary.
# Everything else is replicated, the ViT's attention and the DSpark drafter included.
DECODER_LAYERS = r"^model\.(language_model\.)?layers\.\d+\."
SPLITS = (
    (re.compile(DECODER_LAYERS + r"self_attn\.(q_proj|r_proj|gate_proj|sink_proj)\.weight$"), 0, "tp"),
    (re.compile(DECODER_LAYERS + r"self_attn\.o_proj\.weight$"), 1, "tp"),
    (re.compile(DECODER_LAYERS + r"self_attn\.(q_l2_clip|rel_l2_clip)\.scale$"), 0, "tp"),
    (re.compile(DECODER_LAYERS + r"self_attn\.(k_proj|v_proj)\.weight$"), 0, "kv"),
    (re.compile(DECODER_LAYERS + r"self_attn\.[kv]_sconv\.(conv1d|weight_proj)\.weight$"), 0, "kv"),
    (re.compile(DECODER_LAYERS + r"self_attn\.[kv]_sconv\.static_weight$"), 1, "kv"),
    (re.compile(DECODER_LAYERS + r"mlp\.experts\."), 0, "ep"),
    (re.compile(r"^lm_head\.weight$"), 0, "tp"),
)


def expert_quantization(text: Inkling2TextConfig, variant: str) -> dict | None:
    formats = [VARIANTS[variant](layer) for layer in range(text.num_hidden_layers)]
    if set(formats) == {"bf16"}:
        return None
    return {"formats": formats, "nvfp4_outer_scales": ["scale_2"], "nvfp4_outer_per_half": True}


def official_config() -> Inkling2Config:
    """Inkling-2-Small as its repo ships it: the multimodal model and the DSpark drafter (`mtp.safetensors`, which
    `from_pretrained` loads with it)."""
    return Inkling2Config(dspark_config=Inkling2DSparkConfig().to_dict())


def meta_model(config: Inkling2Config | Inkling2TextConfig, variant: str = "nvfp4-mxfp8") -> torch.nn.Module:
    """The model of `config` (multimodal for an `Inkling2Config`, else the text decoder) on the meta device, which
    holds no memory: every tensor at the dtype `from_pretrained(..., dtype=torch.bfloat16)` gives it (BF16, fp32 for
    the modules the original runs in fp32) and the routed experts packed as the `variant` checkpoint stores them."""
    from ..modeling.modeling_inkling2 import Inkling2ForConditionalGeneration
    from ..modeling.modeling_inkling2_text import Inkling2ForCausalLM

    config = copy.deepcopy(config)
    text = config.get_text_config()
    text.expert_quantization = expert_quantization(text, variant)
    model_class = Inkling2ForConditionalGeneration if isinstance(config, Inkling2Config) else Inkling2ForCausalLM
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=torch.bfloat16)
    keep_fp32 = model._keep_in_fp32_modules_strict
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if any(pattern in name for pattern in keep_fp32):
            tensor.data = tensor.data.float()
    return model


def planned_split(name: str, text: Inkling2TextConfig, tp: int, ep: int) -> tuple[int, int] | None:
    """(dim, ranks): how the parallel plans split the model's tensor `name` over `tp` / `ep` ranks, key/value tensors
    over at most as many ranks as there are kv heads; None for a tensor every rank holds whole."""
    ranks = {"tp": tp, "ep": ep, "kv": min(tp, text.num_key_value_heads, text.swa_num_key_value_heads)}
    return next(((dim, ranks[size]) for pattern, dim, size in SPLITS if pattern.search(name)), None)


def weight_bytes(config: Inkling2Config | Inkling2TextConfig, variant: str, tp: int, ep: int) -> float:
    """Bytes of one rank's weights, counted on the model itself (`meta_model`): every tensor at its stored dtype,
    divided over the ranks that split it (`planned_split`)."""
    text, model = config.get_text_config(), meta_model(config, variant)
    total = 0.0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        split = planned_split(name, text, tp, ep)
        total += tensor.numel() * tensor.element_size() / (1 if split is None else split[1])
    return total


def checked_sizes(text: Inkling2TextConfig, variant: str, tp: int, ep: int | None, **sizes) -> int:
    """The expert-parallel size (`tp` unless given), once the variant is known and every size a positive whole
    number (named when not: a plan of them would divide by zero or print negative memory) and TP / EP divide the
    heads / experts. An `ep` left out is not named: the message would blame a size nobody gave."""
    if variant not in VARIANTS:
        raise ValueError(f"Unknown checkpoint variant {variant!r}: one of {sorted(VARIANTS)}.")
    sizes = {"tp": tp, **({} if ep is None else {"ep": ep}), **sizes}
    not_positive = {name: value for name, value in sizes.items() if not isinstance(value, int) or value < 1}
    if not_positive:
        listing = ", ".join(f"`{name}` = {value}" for name, value in not_positive.items())
        raise ValueError(f"A memory plan needs positive whole numbers: {listing}.")
    ep = tp if ep is None else ep
    if text.num_attention_heads % tp or text.swa_num_attention_heads % tp or text.n_routed_experts % ep:
        raise ValueError(
            f"TP {tp} must divide the attention heads ({text.num_attention_heads}) and EP {ep} the experts "
            f"({text.n_routed_experts})."
        )
    return ep


def memory_plan(
    config: Inkling2Config | Inkling2TextConfig,
    variant: str = "nvfp4-mxfp8",
    tp: int = 1,
    ep: int | None = None,
    context: int = 262_144,
    batch: int = 1,
    prefill_chunk: int = 16_384,
) -> MemoryPlan:
    """Bytes per GPU; see the module docstring for what is counted and how."""
    text = config.get_text_config()
    ep = checked_sizes(text, variant, tp, ep, context=context, batch=batch, prefill_chunk=prefill_chunk)
    weights = weight_bytes(config, variant, tp, ep)

    kv_cache = 0.0
    for layer_type in text.layer_types:
        sliding = layer_type != FULL_LAYER
        keys = min(context, text.sliding_window_size - 1 + MAX_STEP_TOKENS) if sliding else context
        kv_cache += batch * 2 * keys * local_kv_width(text, layer_type, tp) * 2.0
    conv_states = float(batch * convolution_state_bytes(text, tp))

    activations = batch * prefill_activation_bytes(text, min(prefill_chunk, context), tp)
    return MemoryPlan(weights, kv_cache, conv_states, activations)


def format_plan(plan: MemoryPlan, gpu_gib: float | None = None) -> str:
    rows = [f"| {name} | {value:,.2f} |" for name, value in plan.gib().items()]
    table = "\n".join(["| per GPU | GiB |", "|---|---|", *rows])
    if gpu_gib is not None:
        verdict = "fits" if plan.total / GIB <= gpu_gib else "does NOT fit"
        table += f"\n\n{verdict} in {gpu_gib:g} GiB per GPU"
    return table


class NoRoomForPages(ValueError):
    """`serving_pages` found less than the engine's two pages (page 0 is reserved) of memory left."""


@dataclass
class ServingPages:
    """What one GPU holds when serving: bytes, and `pages` of `page_size` tokens (the pool, what
    `Inkling2Engine(num_pages=...)` takes; its page 0 is reserved, so sequences hold `pages - 1` of them)."""

    weights: float
    activations: float
    row_state: float  # all `max_num_seqs` rows'
    page_bytes: int
    pages: int
    page_size: int
    max_num_seqs: int

    @property
    def tokens(self) -> int:
        return (self.pages - 1) * self.page_size

    @property
    def tokens_per_sequence(self) -> int:
        """With every row full: a sequence holds whole pages."""
        return (self.pages - 1) // self.max_num_seqs * self.page_size


def serving_pages(
    config: Inkling2Config | Inkling2TextConfig,
    gpu_gib: float,
    variant: str = "nvfp4-mxfp8",
    tp: int = 1,
    ep: int | None = None,
    max_num_seqs: int = 64,
    page_size: int = 256,
    max_step_tokens: int = 2048,
    dspark: bool = False,
) -> ServingPages:
    """The pages of BF16 full-attention keys/values that `gpu_gib` per GPU holds once the weights, the activations of
    one `max_step_tokens` prompt chunk and `max_num_seqs` rows' fixed state (with `dspark`, the drafter's context
    too) are counted; `NoRoomForPages` when fewer than two fit."""
    text = config.get_text_config()
    sizes = {"max_num_seqs": max_num_seqs, "page_size": page_size, "max_step_tokens": max_step_tokens}
    ep = checked_sizes(text, variant, tp, ep, **sizes)
    if not isinstance(gpu_gib, (int, float)) or not 0 < gpu_gib < math.inf:
        raise ValueError(f"`gpu_gib` must be a positive, finite number of GiB, got {gpu_gib}.")
    check_page_size(page_size)
    dspark_config = getattr(config, "dspark_config", None)
    if dspark and dspark_config is None:
        raise ValueError("`dspark` needs a config with a DSpark drafter (`dspark_config`); this one has none.")
    weights = weight_bytes(config, variant, tp, ep)
    activations = prefill_activation_bytes(text, max_step_tokens, tp)
    drafter = dspark_config if dspark else None
    row_state = max_num_seqs * row_state_bytes(text, tp=tp, dspark_config=drafter)
    page_bytes = page_size * full_layer_bytes_per_token(text, tp=tp)
    memory = gpu_gib * GIB - weights - activations
    pages = pages_that_fit(memory, text, page_size, max_num_seqs, tp=tp, dspark_config=drafter)
    if pages < 2:
        raise NoRoomForPages(
            f"{gpu_gib:g} GiB per GPU leave no room for the serving engine's pages ({page_bytes / 2**20:,.1f} MiB "
            f"each, two at least): weights {weights / GIB:,.2f} GiB, one {max_step_tokens:,}-token step's "
            f"activations {activations / GIB:,.2f} GiB, {max_num_seqs} rows' fixed state {row_state / GIB:,.2f} "
            "GiB. Split the model over more GPUs (TP / EP), or lower the rows or the step."
        )
    return ServingPages(weights, activations, row_state, page_bytes, pages, page_size, max_num_seqs)


def format_pages(pages: ServingPages) -> str:
    rows = {
        "weights (GiB)": f"{pages.weights / GIB:,.2f}",
        "step activations (GiB)": f"{pages.activations / GIB:,.2f}",
        "rows' fixed state (GiB)": f"{pages.row_state / GIB:,.2f}",
        "pages (GiB)": f"{pages.pages * pages.page_bytes / GIB:,.2f}",
        "pages": f"{pages.pages:,}",
        "tokens": f"{pages.tokens:,}",
        "tokens per sequence": f"{pages.tokens_per_sequence:,}",
    }
    return "\n".join(["| serving engine per GPU | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows.items())])
