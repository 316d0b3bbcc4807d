"""The Inkling2 text decoder, read top to bottom: norms and clips, short convolutions, attention, the MoE (whose
routed experts, in `experts.py`, are transformers `@use_experts_implementation` experts), block attention residuals,
the decoder layer, the base model and the causal-LM head.

This is the plain reference implementation: every step in the precision the original runs it in (fp32 for norms,
convolutions, routing, attention-residual mixing and logits). Faster paths plug in through the registries of
`interfaces` (attention backends, expert storages, kernels for a prompt's convolutions, the routed experts and the
relative-logits layout, loading and generation hooks), without changing this file's numerics; this file imports none
of them.
"""


import copy
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils import can_return_tuple, logging
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ..cache.common import (
    K_CONV,
    MAX_STEP_TOKENS,
    POST_ATTENTION_CONV,
    POST_MLP_CONV,
    V_CONV,
    join_convolution_context,
)
from ..cache.dynamic import Inkling2Cache
from ..cache.paged import Inkling2PagedCache
from ..cache.static import Inkling2StaticCache
from ..configuration_inkling2 import SLIDING_LAYER, Inkling2Config, Inkling2TextConfig
from .activation_memory import SMALL_CHUNK_GRANULE, automatic_prefill_chunk
from .attention import PAGED_KEYS_BACKEND, default_attention_backend, eager_attention, get_attention_backend
from .experts import Inkling2Experts, RouteTerms, softcap
from .interfaces import (
    ATTENTION_BACKENDS,
    EXPERT_STORAGES,
    GENERATION_HOOKS,
    KERNELS,
    LOADING_HOOKS,
    has_forward_hooks,
)
from .loading_checks import raise_on_non_finite_weights, raise_on_non_float_tensors, raise_on_unconverted_load
from .modeling_inkling2_dspark import Inkling2DSparkAttention, Inkling2DSparkDrafter
from .norms import Inkling2RMSNorm, rms_normalize
from .tensors import fp32_operand, local_tensor, shared_fp32

logger = logging.get_logger(__name__)
INKLING2_CACHES = (Inkling2Cache, Inkling2StaticCache, Inkling2PagedCache)


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Scales each vector (last dim) down to L2 norm `threshold` when longer; in fp32."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (threshold / (norm + 1e-6)).clamp(max=1.0)


class Inkling2ScaledL2Clip(nn.Module):
    """A learned per-head, per-channel scale followed by an L2 clip (queries and relative states)."""

    def __init__(self, num_heads: int, head_dim: int, threshold: float):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(num_heads, head_dim))
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_clip(x.float() * fp32_operand(local_tensor(self.scale)), self.threshold)


class Inkling2NormedEmbedding(nn.Embedding):
    """Token embedding followed by an RMSNorm (`embed_norm`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, eps: float):
        super().__init__(num_embeddings, embedding_dim)
        self.embed_norm = Inkling2RMSNorm(embedding_dim, eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(input_ids))


class Inkling2RelativeLogits(nn.Module):
    """A bank of `d_rel` bias-versus-distance profiles; each query head mixes them with its relative state."""

    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.proj = nn.Parameter(torch.empty(d_rel, extent))

    def forward(self, relative_states: torch.Tensor) -> torch.Tensor:
        """[batch, queries, heads, d_rel] -> [batch, heads, queries, extent] bias per backward distance (for prompts,
        the same product in the layout the prefill kernel reads, where one is registered)."""
        weight = self.proj.to(relative_states.dtype)
        layout = KERNELS.optional("relative_logits_layout")
        if layout is None or relative_states.shape[1] <= MAX_STEP_TOKENS:
            return (relative_states @ weight).transpose(1, 2)
        return layout(relative_states.transpose(1, 2), weight)


# --- short convolutions -------------------------------------------------------------------------------------------


def convolution_context(
    inputs: torch.Tensor, kernel_size: int, cache, layer_idx: int, conv_idx: int, query_positions: torch.Tensor
) -> torch.Tensor:
    """[batch, C, T] inputs preceded by the `kernel_size - 1` inputs before them (zeros at the sequence start)."""
    if cache is None:
        return join_convolution_context(inputs.new_zeros(*inputs.shape[:-1], kernel_size - 1), inputs)
    return cache.convolution_context(layer_idx, conv_idx, inputs, kernel_size, query_positions)


def zero_padding(x: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Zeroes padded tokens so that they never leak into a convolution (a bool mask multiplies as 1.0 / 0.0)."""
    return x if token_mask is None else x * token_mask[:, :, None]


def depthwise_convolution(context: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.conv1d(context, weight, groups=C)`: [batch, C, T + k - 1] and [C, 1, k] -> [batch, C, T]. On the CPU a
    step of at most MAX_STEP_TOKENS tokens takes the same sum as an unfolded product: oneDNN's set-up per call (about
    0.24 ms) is ten times the whole 4-tap step (0.02 ms; 28 such calls per Inkling-2-Nano decode step). CUDA keeps
    the one cuDNN launch that decode graphs capture."""
    kernel_size = weight.shape[-1]
    if context.is_cuda or context.shape[-1] - kernel_size + 1 > MAX_STEP_TOKENS:
        return F.conv1d(context, weight, groups=context.shape[1])
    return (context.unfold(-1, kernel_size, 1) * weight).sum(-1)


class Inkling2ShortConvolution(nn.Module):
    """Causal depthwise convolution with a residual, in fp32: `(conv(x) + x) / sqrt(k + 1)`."""

    def __init__(self, channels: int, kernel_size: int, layer_idx: int, conv_idx: int):
        super().__init__()
        self.kernel_size, self.layer_idx, self.conv_idx = kernel_size, layer_idx, conv_idx
        self.conv1d = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x, token_mask=None, cache=None, query_positions=None):
        weight = local_tensor(self.conv1d.weight).float()  # this rank's channels under tensor parallelism
        divisor = math.sqrt(self.kernel_size + 1)
        step = KERNELS.optional("step_convolution") if cache is not None else None
        at = (cache, self.layer_idx, self.conv_idx, query_positions)
        output = None if step is None else step(x, token_mask, *at, weight, divisor)
        if output is not None:
            return output
        x32 = x.float()
        inputs = zero_padding(x32, token_mask).transpose(1, 2)
        context = convolution_context(inputs, self.kernel_size, cache, self.layer_idx, self.conv_idx, query_positions)
        fused = KERNELS.optional("prompt_convolution")
        output = None if fused is None else fused(context, x, weight, divisor)
        if output is not None:
            return output
        convolved = depthwise_convolution(context, weight).transpose(1, 2)
        return ((convolved + x32) / divisor).to(x.dtype)


class Inkling2DynamicShortConvolution(nn.Module):
    """Causal convolution whose taps are static per-channel weights plus per-token taps projected from the layer
    input (one set per key/value head): `(conv(x) + x) / sqrt(2k + 1)`. `static_weight[lag]` weights the token
    `lag` steps back. Used on keys and values of the full-attention layers. Under tensor parallelism it holds the
    channels and taps of this rank's kv heads; the head count is read from the projected taps."""

    def __init__(self, channels: int, input_size: int, num_heads: int, kernel_size: int, layer_idx: int, conv_idx: int):
        super().__init__()
        self.kernel_size, self.layer_idx, self.conv_idx, self.num_heads = kernel_size, layer_idx, conv_idx, num_heads
        self.static_weight = nn.Parameter(torch.zeros(kernel_size, channels))
        self.weight_proj = nn.Linear(input_size, num_heads * kernel_size, bias=False)

    def forward(self, x, tap_input, token_mask=None, cache=None, query_positions=None):
        batch, length, channels = x.shape
        k = self.kernel_size
        x32 = x.float()
        inputs = zero_padding(x32, token_mask).transpose(1, 2)
        context = convolution_context(inputs, k, cache, self.layer_idx, self.conv_idx, query_positions)
        # lagged[b, t, c, lag] = input of token t - lag
        lagged = context.unfold(-1, k, 1).flip(-1).transpose(1, 2)
        per_token_taps = self.weight_proj(tap_input).float().view(batch, length, -1, 1, k)
        heads = per_token_taps.shape[2]
        static_taps = fp32_operand(local_tensor(self.static_weight)).T.reshape(heads, channels // heads, k)
        taps = (static_taps + per_token_taps).reshape(batch, length, channels, k)
        convolved = (lagged * taps).sum(-1)
        return ((convolved + x32) / math.sqrt(2 * k + 1)).to(x.dtype)


# --- attention ----------------------------------------------------------------------------------------------------


def log_scaling(position_ids: torch.Tensor, config: Inkling2TextConfig) -> torch.Tensor:
    """The full layers' scale of their queries and relative states, `tau = 1 + alpha * log(max(1, (pos + 1) /
    n_floor))`, [batch or 1, T, 1, 1], fp32."""
    ratio = (position_ids.float() + 1) / config.log_scaling_n_floor
    return (1 + config.log_scaling_alpha * torch.log(ratio.clamp(min=1.0)))[..., None, None]


class Inkling2Attention(nn.Module):
    """Gated attention with relative bias and a per-token sink.

    Queries are scaled per head and L2-clipped, keys pass a short convolution and an L2 clip, values a short
    convolution and an RMS norm; relative states are scaled and clipped. Full-attention layers convolve keys and
    values dynamically, take separate q/k/v inputs and scale queries and relative states up logarithmically with
    the position. The output is gated by `sigmoid(gate_proj(x))` before `o_proj`.

    Under tensor parallelism (`parallel/tensor_parallel.py`) a rank holds a block of query heads and their kv heads:
    activations are reshaped with `-1` heads, so `num_heads` / `num_key_value_heads` stay the model's totals.
    """

    def __init__(self, config: Inkling2TextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_sliding = config.layer_types[layer_idx] == SLIDING_LAYER
        prefix = "swa_" if self.is_sliding else ""
        self.num_heads = getattr(config, f"{prefix}num_attention_heads")
        self.num_key_value_heads = getattr(config, f"{prefix}num_key_value_heads")
        self.head_dim = getattr(config, f"{prefix}head_dim")
        self.sliding_window = config.sliding_window_size if self.is_sliding else None
        self.scaling = self.head_dim**-0.5
        hidden, kv_width = config.hidden_size, self.num_key_value_heads * self.head_dim

        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.r_proj = nn.Linear(hidden, self.num_heads * config.d_rel, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.sink_proj = nn.Linear(hidden, self.num_heads, bias=False)
        if self.is_sliding:
            self.k_sconv = Inkling2ShortConvolution(kv_width, config.conv_kernel_size, layer_idx, K_CONV)
            self.v_sconv = Inkling2ShortConvolution(kv_width, config.conv_kernel_size, layer_idx, V_CONV)
        else:
            conv_args = (kv_width, hidden, self.num_key_value_heads, config.conv_kernel_size, layer_idx)
            self.k_sconv = Inkling2DynamicShortConvolution(*conv_args, K_CONV)
            self.v_sconv = Inkling2DynamicShortConvolution(*conv_args, V_CONV)
        extent = config.sliding_window_size if self.is_sliding else config.rel_extent
        self.rel_logits_proj = Inkling2RelativeLogits(config.d_rel, extent)
        self.q_l2_clip = Inkling2ScaledL2Clip(self.num_heads, self.head_dim, config.qk_l2_clip_threshold)
        self.rel_l2_clip = Inkling2ScaledL2Clip(self.num_heads, config.d_rel, config.rel_l2_clip_threshold)

    def forward(
        self,
        query_input: torch.Tensor,
        key_input: torch.Tensor,
        value_input: torch.Tensor,
        log_scale: torch.Tensor | None,
        query_positions: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Inkling2Cache | None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, attention probabilities or None). `log_scale`: the full layers' (`log_scaling`), which sliding
        layers ignore. With `output_attentions` this call runs the eager reference, the one backend that materializes
        the probabilities (transformers' `capture_outputs` records them from here)."""
        batch, length, _ = query_input.shape
        dtype = query_input.dtype
        token_mask = None if attention_mask is None else attention_mask[:, -length:]

        query_states, gate, relative_states, sinks, key_states, value_states = self.projections(
            query_input, key_input, value_input
        )
        states = (key_states, value_states, key_input, value_input, token_mask, cache, query_positions, attention_mask)
        # a sliding layer's decode step may convolve, clip / normalize and cache its keys and values in one kernel
        fused = KERNELS.optional("key_value_step")
        attended = None if fused is None else fused(self, *states)
        if attended is None:
            attended = self.attended_keys(*states)
        keys, values, key_positions, key_padding, in_order, block_table = attended
        probabilities = [] if output_attentions else None
        inputs = dict(
            sinks=sinks.transpose(1, 2),
            query_positions=query_positions,
            key_positions=key_positions,
            key_padding=key_padding,
            sliding_window=self.sliding_window,
            scaling=self.scaling,
        )
        if block_table is not None:  # paged keys (the serving engine's decode steps): the decode path reads pages
            if output_attentions:
                raise ValueError("`output_attentions` is not available over paged keys (`Inkling2PagedCache`).")
            backend = get_attention_backend(PAGED_KEYS_BACKEND)
            inputs.update(block_table=block_table, page_size=keys.shape[2])
        elif probabilities is None:
            backend = get_attention_backend(self.config._attn_implementation, keys_in_order=in_order)
        else:
            backend = functools.partial(eager_attention, probabilities_out=probabilities)
        tau = None if self.is_sliding else log_scale
        args = (backend, query_states, relative_states, gate, tau, keys, values)
        # a decode step that the backend hands to the fused decode kernel may take the query side into that kernel
        fused = KERNELS.optional("attention_step")
        output = None if fused is None else fused(self, *args, **inputs)
        if output is None:
            output = self.gated_attention(*args, dtype=dtype, **inputs)
        return self.o_proj(output), probabilities[0] if probabilities else None

    def attended_keys(
        self, key_states, value_states, key_input, value_input, token_mask, cache, query_positions, attention_mask
    ) -> tuple:
        """What the step attends to, from the raw k / v projections [batch, T, kv_heads * head_dim]: keys convolved
        and L2-clipped, values convolved and RMS-normalized, both in the layer inputs' dtype, [batch, kv_heads, T,
        head_dim]; through the cache when there is one (written, then read back with the cached tokens). Returns
        (keys, values, key positions, key padding, whether the key positions ascend contiguously, block table or
        None) as `cache.attention_keys` does."""
        batch, length, _ = key_states.shape
        dtype = key_input.dtype  # the layer's inputs' (the three share it)
        if self.is_sliding:
            keys = self.k_sconv(key_states, token_mask, cache, query_positions)
            values = self.v_sconv(value_states, token_mask, cache, query_positions)
        else:
            keys = self.k_sconv(key_states, key_input, token_mask, cache, query_positions)
            values = self.v_sconv(value_states, value_input, token_mask, cache, query_positions)

        keys = l2_clip(keys.view(batch, length, -1, self.head_dim).float(), self.config.qk_l2_clip_threshold)
        keys = keys.to(dtype).transpose(1, 2)
        values = rms_normalize(values.view(batch, length, -1, self.head_dim), self.config.rms_norm_eps)
        values = values.to(dtype).transpose(1, 2)
        if cache is None:
            return keys, values, query_positions, attention_mask, True, None
        return cache.attention_keys(self.layer_idx, keys, values, query_positions, attention_mask)

    def gated_attention(self, backend, query_states, relative_states, gate, tau, keys, values, dtype, **inputs):
        """The attention output before `o_proj`, [batch, T, heads * head_dim] in `dtype` (the layer input's): queries
        and relative states scaled and clipped (times the log scale `tau` in full layers), the relative logits, the
        backend, the sigmoid gate."""
        batch, length, _ = query_states.shape
        queries = self.q_l2_clip(query_states.view(batch, length, -1, self.head_dim))
        relative_states = self.rel_l2_clip(relative_states.view(batch, length, -1, self.config.d_rel))
        if tau is not None:
            queries, relative_states = queries * tau, relative_states * tau
        queries = queries.to(dtype).transpose(1, 2)
        relative_logits = self.rel_logits_proj(relative_states.to(dtype))
        output = backend(queries, keys, values, relative_logits=relative_logits, **inputs)
        return (fp32_operand(output.reshape(batch, length, -1)) * torch.sigmoid(gate.float())).to(dtype)

    def projections(self, query_input, key_input, value_input) -> list[torch.Tensor]:
        """q, gate, relative states and sink logits of the query input, k and v of theirs: one grouped GEMV where the
        `input_projections` kernel takes them (a CUDA decode step), else the six linears."""
        modules = [self.q_proj, self.gate_proj, self.r_proj, self.sink_proj, self.k_proj, self.v_proj]
        inputs = [query_input] * 4 + [key_input, value_input]
        fused = KERNELS.optional("input_projections")
        outputs = None if fused is None else fused(inputs, modules)
        return outputs if outputs is not None else [module(x) for module, x in zip(modules, inputs, strict=True)]


# --- mixture of experts -------------------------------------------------------------------------------------------


class Inkling2TopKRouter(nn.Module):
    """Sigmoid scores; the top-k of `scores + e_score_correction_bias` are chosen, weighted by their normalized
    scores times `route_scale`. In fp32."""

    def __init__(self, config: Inkling2TextConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.route_scale = config.route_scale
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, weights, chosen experts) of x [rows, hidden]; from the `top_k_routing` kernel where it takes
        them (a CUDA decode step), else computed here."""
        fused = KERNELS.optional("top_k_routing")
        bias = self.e_score_correction_bias
        routed = None if fused is None else fused(x, self.weight, bias, self.top_k, self.route_scale)
        if routed is not None:
            return routed
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        chosen = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, chosen)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.route_scale
        return logits, weights, chosen


class Inkling2SparseMoeBlock(nn.Module):
    def __init__(self, config: Inkling2TextConfig, layer_idx: int):
        super().__init__()
        self.gate = Inkling2TopKRouter(config)
        expert_format = config.expert_format(layer_idx)
        storage = EXPERT_STORAGES.get(expert_format)
        if expert_format == "bf16":
            self.experts = storage(config)
        else:
            quantization = config.expert_quantization
            self.experts = storage(
                config,
                expert_format,
                outer_scales=tuple(quantization.get("nvfp4_outer_scales", ())),
                per_half=quantization.get("nvfp4_outer_per_half", False),
            )

    def forward(self, x: torch.Tensor, summed: bool = True) -> torch.Tensor | RouteTerms:
        """x [..., H] -> the MoE's output [..., H]; with `summed=False`, where the experts' kernel gives them
        (`Inkling2ExpertsBase.route_terms`), the output's terms instead, for a kernel that adds them itself."""
        flat = x.reshape(-1, x.shape[-1])
        _, weights, expert_ids = self.gate(flat)
        terms = None if summed else self.experts.route_terms(flat, expert_ids, weights)
        if terms is not None:
            return terms
        return self.experts(flat, expert_ids, weights).view_as(x)


# --- block attention residuals ------------------------------------------------------------------------------------


def with_block(blocks: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
    """The blocks [batch, T, n, hidden] (fp32, RMS-normalized) followed by `partial`, RMS-normalized in fp32."""
    return torch.cat([blocks, rms_normalize(partial, 1e-6)[..., None, :]], dim=-2)


class Inkling2BlockAttentionResidual(nn.Module):
    """Replaces a residual connection: learned queries attend (softmax over blocks, scale 1/sqrt(hidden)) over the
    RMS-normalized stack [completed blocks..., current partial block]. In fp32; one output per query. The completed
    blocks arrive already normalized (fp32, one tensor [batch, T, blocks, hidden]): they never change, and every
    later mix reads them."""

    def __init__(self, config: Inkling2TextConfig, num_queries: int = 1):
        super().__init__()
        shape = (config.hidden_size,) if num_queries == 1 else (num_queries, config.hidden_size)
        self.query = nn.Parameter(torch.zeros(shape))

    def forward(self, blocks: torch.Tensor, partial: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stack = with_block(blocks, partial)
        queries = self.query.float().view(-1, stack.shape[-1])
        if stack.shape[1] <= MAX_STEP_TOKENS:
            # A step's few tokens: the same sums as products and reductions, which `torch.compile` fuses with the
            # norms around them; as einsums they are batched cuBLAS dot products, three launches of a few us each.
            logits = (stack[:, :, None] * queries[:, None]).sum(-1)
            weights = torch.softmax(logits / math.sqrt(stack.shape[-1]), -1)
            return (weights[..., None] * stack[:, :, None]).sum(-2).unbind(-2)
        weights = torch.softmax(torch.einsum("qh,btnh->btqn", queries, stack) / math.sqrt(stack.shape[-1]), -1)
        return torch.einsum("btqn,btnh->btqh", weights, stack).unbind(-2)


# --- decoder layer ------------------------------------------------------------------------------------------------


class Inkling2DecoderLayer(GradientCheckpointingLayer):
    """Attention, then the MoE, each behind a block attention residual and followed by a short convolution.

    The stream is the completed blocks (the embedding, then one per `n_layers_per_attn_res_block` layers), stacked
    in one tensor, and a partial block, the sum of the sublayer outputs since the last boundary. A layer that opens a
    block appends the partial block to the stack (RMS-normalized once, in fp32, as every mix reads it) and restarts
    it from its attention output. Both travel as positional tensors, so that reentrant checkpointing
    (`use_reentrant=True`) carries their gradients too.
    """

    def __init__(self, config: Inkling2TextConfig, layer_idx: int):
        super().__init__()
        self.is_sliding = config.layer_types[layer_idx] == SLIDING_LAYER
        self.opens_block = layer_idx % config.n_layers_per_attn_res_block == 0
        # Layer 0 reads the embedding directly; full layers mix separate query, key and value inputs.
        num_inputs = 1 if self.is_sliding else 3
        self.attention_input = Inkling2BlockAttentionResidual(config, num_inputs) if layer_idx > 0 else None
        self.mlp_input = Inkling2BlockAttentionResidual(config)
        self.self_attn = Inkling2Attention(config, layer_idx)
        self.mlp = Inkling2SparseMoeBlock(config, layer_idx)
        if self.is_sliding:
            self.input_layernorm = Inkling2RMSNorm(config.hidden_size, config.rms_norm_eps)
        else:
            self.q_input_layernorm = Inkling2RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.k_input_layernorm = Inkling2RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.v_input_layernorm = Inkling2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Inkling2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_convolution = Inkling2ShortConvolution(
            config.hidden_size, config.conv_kernel_size, layer_idx, POST_ATTENTION_CONV
        )
        self.post_mlp_convolution = Inkling2ShortConvolution(
            config.hidden_size, config.conv_kernel_size, layer_idx, POST_MLP_CONV
        )

    def forward(
        self, partial, blocks, log_scale, query_positions, attention_mask=None, cache=None, output_attentions=False
    ):
        dtype = partial.dtype
        (query_input, key_input, value_input), partial, blocks = self.attention_inputs(blocks, partial, dtype)
        attention_output, _ = self.self_attn(
            query_input, key_input, value_input, log_scale, query_positions, attention_mask, cache, output_attentions
        )
        token_mask = None if attention_mask is None else attention_mask[:, -partial.shape[1] :]
        # where the layer opens a block, the partial block has joined the completed ones: it restarts from the
        # attention's output
        continued = None if self.opens_block else partial
        partial, mlp_input = self.mlp_inputs(attention_output, continued, blocks, token_mask, cache, query_positions,
                                             dtype)  # fmt: skip
        return self.layer_output(mlp_input, partial, token_mask, cache, query_positions, dtype), blocks

    def attention_norms(self) -> tuple[Inkling2RMSNorm, ...]:
        """The norms of the attention's inputs: one in a sliding layer, the query's, key's and value's in a full one."""
        return (self.input_layernorm,) if self.is_sliding else (
            self.q_input_layernorm, self.k_input_layernorm, self.v_input_layernorm)  # fmt: skip

    def attention_inputs(self, blocks, partial, dtype) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(the attention's query, key and value inputs in `dtype`, one tensor for all three in a sliding layer: the
        stream's attention-residual mix, layer 0's embedding, RMS-normalized; the partial block as the rest of the
        layer reads it; the completed blocks as the rest of the layer reads them: where the layer opens a block,
        with the partial block normalized after them). One launch where the `residual_mix` kernel takes the call (a
        decode step): it reads the partial block in its own dtype, where the reference converts it to fp32 once for
        all its readers, and writes the new blocks from what it reads for the mix."""
        norms = self.attention_norms()
        if self.attention_input is not None:
            fused = KERNELS.optional("residual_mix")
            mixed = None if fused is None else fused(self.attention_input, norms, blocks, partial, dtype,
                                                     self.opens_block)  # fmt: skip
            if mixed is not None:
                normalized, blocks = mixed
                return normalized * (3 // len(normalized)), partial, blocks
        partial = shared_fp32(partial)  # the mix and the sums after it each read it in fp32
        inputs = (partial,) * len(norms) if self.attention_input is None else self.attention_input(blocks, partial)
        normalized = [norm(x).to(dtype) for norm, x in zip(norms, inputs, strict=True)] * (3 // len(norms))
        return normalized, partial, with_block(blocks, partial) if self.opens_block else blocks

    def mlp_inputs(self, attention_output, partial, blocks, token_mask, cache, query_positions, dtype) -> tuple:
        """(the partial block fp32, the MoE's input in `dtype`): the attention's output through the post-attention
        convolution joins the partial block (or starts it, where `partial` is None), then the MoE's
        attention-residual mix, RMS-normalized. One launch, the convolution included, where the
        `residual_mix_after_sublayer` kernel takes the step."""
        fused = KERNELS.optional("residual_mix_after_sublayer")
        convolution = self.post_attention_convolution
        if fused is not None:
            norms = (self.post_attention_layernorm,)
            at = (attention_output, token_mask, cache, query_positions, partial, self.mlp_input, norms, blocks, dtype)
            result = fused(convolution, *at)
            if result is not None:
                return result[0], result[1][0]
        attention_output = convolution(attention_output, token_mask, cache, query_positions)
        if partial is None:
            partial = attention_output.float()
        else:
            partial = partial.float() + fp32_operand(attention_output)  # an fp32 sum (type promotion)
        mlp_input = self.mlp_input(blocks, partial)[0]
        return partial, self.post_attention_layernorm(mlp_input).to(dtype)

    def layer_output(self, mlp_input, partial, token_mask, cache, query_positions, dtype) -> torch.Tensor:
        """The layer's output in `dtype`: the partial block (fp32) plus the MoE's output (of mlp_input, in its dtype)
        through the post-MLP convolution. Where the `residual_step_convolution` kernel takes the step, one launch
        after the experts' GEMMs: the step convolution adds the partial block in its epilogue, and the experts'
        terms in its prologue where their kernel leaves the sum to it (`summed=False`; not to a hooked MoE, whose
        hooks expect its output)."""
        convolution = self.post_mlp_convolution
        fused = KERNELS.optional("residual_step_convolution")
        at = (token_mask, cache, query_positions)
        end = None if fused is None else fused(convolution, mlp_input, *at, partial, dtype)
        if end is not None:
            return end(self.mlp(mlp_input, summed=has_forward_hooks(self.mlp)))
        return (partial + fp32_operand(convolution(self.mlp(mlp_input), *at))).to(dtype)


# --- models -------------------------------------------------------------------------------------------------------


DTYPE_KWARGS = ("dtype", "torch_dtype")  # `torch_dtype`: the older name, still accepted
# static caches are made in whole multiples of this many tokens, so that calls with slightly longer prompts reuse one
STATIC_CACHE_GRANULE = 4096
OUTPUT_SWITCHES = ("output_hidden_states", "output_attentions", "output_router_logits")


def output_switches(kwargs: dict) -> dict:
    """The `output_*` switches a head was given and passes on to its base model: one left out or None falls back to
    the config there (transformers' `capture_outputs` reads a given None as off)."""
    switches = {name: kwargs.pop(name, None) for name in OUTPUT_SWITCHES}
    return {name: value for name, value in switches.items() if value is not None}


HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")


class Inkling2PreTrainedModel(PreTrainedModel):
    config: Inkling2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Inkling2DecoderLayer", "Inkling2DSparkDrafter"]  # the drafter on one device
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = False
    _supports_sdpa = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False
    # Run in fp32 in the original, whatever the model dtype.
    _keep_in_fp32_modules_strict = [
        "e_score_correction_bias",
        "mlp.gate.weight",
        "post_attention_convolution",
        "post_mlp_convolution",
        "k_sconv.conv1d",
        "v_sconv.conv1d",
        "attention_input",
        "mlp_input",
        "final_input",
    ]

    # what transformers' `capture_outputs` records (`output_hidden_states`, `output_attentions`,
    # `output_router_logits`): each layer's output (its partial block), each attention's probabilities, each router's
    # logits
    _can_record_outputs = {
        "hidden_states": Inkling2DecoderLayer,
        "attentions": Inkling2Attention,
        "router_logits": OutputRecorder(Inkling2TopKRouter, index=0),
    }

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """Our experts read `config._experts_implementation` ("grouped_mm" by default, "batched_mm" or "eager")."""
        return True

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """Our attention reads `config._attn_implementation` at every call (see `interfaces.ATTENTION_BACKENDS`)."""
        return True

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """No `attn_implementation` asked for: the registered default (with the package's backends, the fastest path
        for each call on CUDA and the eager reference elsewhere); `"eager"` asks for the reference everywhere."""
        if requested_attention is None:
            requested_attention = default_attention_backend()
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    def post_init(self):
        super().post_init()
        # the fast paths a forward may ask for, imported now rather than inside a traced or captured step
        ATTENTION_BACKENDS.load()
        KERNELS.load()

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *model_args,
        allow_incomplete_checkpoint: bool = False,
        check_finite_weights: bool = True,
        **kwargs,
    ):
        """Loads like any transformers model (a few missing or unexpected tensors are reported and the missing ones
        initialized), with the steps registered in `interfaces.LOADING_HOOKS` (the experts' storage read from the
        tensor headers before the model is built, the bundled drafter, scale checks) and three checks that fail
        loudly, naming the tensor (`loading_checks`): a checkpoint whose names did not convert (most of the model
        missing, tensors under unknown names instead; `allow_incomplete_checkpoint=True` loads it anyway), a weight
        stored as integers, and NaN or infinite weights (`check_finite_weights=False` skips that one; see
        docs/loading.md for its cost)."""
        checkpoint, revision = pretrained_model_name_or_path, kwargs.get("revision")
        return_info = kwargs.pop("output_loading_info", False)
        config = kwargs.pop("config", None)
        if checkpoint is not None:
            if isinstance(config, PreTrainedConfig):
                config = copy.deepcopy(config)
            else:
                config, kwargs = cls._load_config(config or checkpoint, kwargs)
            for complete_config in LOADING_HOOKS.stage("config"):
                complete_config(config, checkpoint, revision)
        model, info = super().from_pretrained(
            checkpoint, *model_args, config=config, output_loading_info=True, **kwargs
        )
        for finish_loading in LOADING_HOOKS.stage("model"):
            finish_loading(model, checkpoint, revision, info)
        if not allow_incomplete_checkpoint:
            raise_on_unconverted_load(model, info)
        raise_on_non_float_tensors(model, checkpoint, revision, unexpected=info.get("unexpected_keys") or ())
        if check_finite_weights:
            raise_on_non_finite_weights(model)
        return (model, info) if return_info else model

    @classmethod
    def _load_config(cls, path, kwargs: dict) -> tuple[PreTrainedConfig, dict]:
        """The config as `from_pretrained` would load it, so that the config hooks can complete it first: as
        transformers' Auto classes do, the config takes the keyword arguments that are its fields, and the hub
        arguments and a requested dtype also go on to the weights."""
        hub = {name: kwargs[name] for name in HUB_KWARGS if name in kwargs}
        dtypes = {name: kwargs[name] for name in DTYPE_KWARGS if kwargs.get(name) is not None}
        config_kwargs = {k: v for k, v in kwargs.items() if k not in hub and not (k in DTYPE_KWARGS and v == "auto")}
        config, unused = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **hub, **config_kwargs)
        return config, {**unused, **dtypes, **hub}

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs: dict | None = None, every_n_layers: int = 1, offload: bool = False
    ):
        """transformers' activation (gradient) checkpointing, non-reentrant unless `use_reentrant=True` is asked for
        (also when the kwargs name neither, as Trainer's `{}` does). `gradient_checkpointing_enable(...)` and
        `Trainer(gradient_checkpointing=True)` arrive here too."""
        kwargs = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
        super().activation_checkpointing_enable(kwargs, every_n_layers=every_n_layers, offload=offload)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, Inkling2RelativeLogits):
            module.proj.normal_(0.0, std)
        elif isinstance(module, Inkling2Experts):
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
        elif isinstance(module, Inkling2TopKRouter):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, Inkling2ScaledL2Clip):
            module.scale.fill_(1.0)
        elif isinstance(module, Inkling2DynamicShortConvolution):
            module.static_weight.zero_()
        elif isinstance(module, Inkling2BlockAttentionResidual):
            module.query.zero_()
        elif isinstance(module, Inkling2DSparkAttention):
            module.distance_bias.zero_()
            module.block_bias.zero_()
        elif isinstance(module, Inkling2DSparkDrafter):
            module.block_position_embedding.normal_(0.0, std)


class Inkling2TextModel(Inkling2PreTrainedModel):
    config: Inkling2TextConfig

    def __init__(self, config: Inkling2TextConfig):
        super().__init__(config)
        self.embed_tokens = Inkling2NormedEmbedding(config.vocab_size, config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(Inkling2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_input = Inkling2BlockAttentionResidual(config)
        self.norm = Inkling2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Inkling2Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        prefill_chunk_size: int | None = None,
        cache_position: torch.LongTensor | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        """`attention_mask` is the 2-D padding mask over the cached and the new tokens ([batch, past + new]);
        `prefill_chunk_size` runs a long input through the layers in chunks of that many tokens, carrying the
        cache between them, so that activation memory is bounded by the chunk (same result; see `prefill_in_chunks`);
        without it a long input picks its chunk from the free memory (`automatic_prefill_chunk`).
        `position_ids` only drive the full layers' log scaling (physical positions drive everything else).
        `output_hidden_states=True` returns the embeddings and every layer's output (its partial attention-residual
        block, the stream that speculative drafters tap), the last one after the final readout and norm, as
        transformers models do (`capture_outputs` records them, a list of indices selects some);
        `output_attentions=True` each layer's attention probabilities, `output_router_logits=True` each router's
        logits [tokens, experts]. `cache_position` ([new tokens]) gives the new tokens' stream positions on the device
        (default: right after the cached tokens), which a captured decode step reads instead of a host count; with an
        `Inkling2StaticCache`, `attention_mask` may then hold just the new tokens' columns. With the serving engine's
        `Inkling2PagedCache`, `cache_position` is [rows, new tokens] for a decode step (every row at its own length)
        or [new tokens] for one row's prompt chunk."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training and (use_cache or past_key_values is not None):
            # recomputing a layer in backward would write its cache a second time
            logger.warning_once("Gradient checkpointing in training: the cache is not used (`use_cache=False`).")
            use_cache, past_key_values = False, None
        if use_cache and past_key_values is None:
            past_key_values = Inkling2Cache(self.config)
        if past_key_values is not None and not isinstance(past_key_values, INKLING2_CACHES):
            raise TypeError(
                f"Inkling2 needs an `Inkling2Cache`, `Inkling2StaticCache` or `Inkling2PagedCache` (they also hold "
                f"short-convolution states), got {type(past_key_values).__name__}. Pass `past_key_values=None` or an "
                "`Inkling2Cache(config)`."
            )
        if isinstance(past_key_values, Inkling2PagedCache) and cache_position is None:
            raise ValueError("With an `Inkling2PagedCache` (rows of different lengths) pass `cache_position`.")

        batch, length, _ = inputs_embeds.shape
        if prefill_chunk_size is None:
            prefill_chunk_size = self.automatic_prefill_chunk(inputs_embeds, past_key_values, **kwargs)
        if prefill_chunk_size is not None and length > prefill_chunk_size:
            return self.prefill_in_chunks(
                inputs_embeds, attention_mask, position_ids, past_key_values, use_cache, prefill_chunk_size, **kwargs
            )
        static = isinstance(past_key_values, (Inkling2StaticCache, Inkling2PagedCache))
        query_positions, past_length = cache_position, None
        if query_positions is None or not static:  # a captured step reads no host-side length
            past_length = 0 if past_key_values is None else past_key_values.get_seq_length()
        if query_positions is None:
            query_positions = torch.arange(past_length, past_length + length, device=inputs_embeds.device)
        if position_ids is None:  # [1, new] shared by the batch, or [batch, new] when every row has its own
            position_ids = query_positions.view(-1, length)
        if static:  # it keeps the padding of the cached tokens itself
            attention_mask = self._new_tokens_mask(attention_mask, batch, length)
            past_key_values.begin_step(query_positions)  # the step's slots, once for all layers
        else:
            attention_mask = self._padding_mask(attention_mask, batch, past_length + length)

        output_attentions = kwargs.get("output_attentions")
        output_attentions = bool(self.config.output_attentions if output_attentions is None else output_attentions)
        partial = inputs_embeds
        blocks = inputs_embeds.new_zeros((batch, length, 0, inputs_embeds.shape[-1]), dtype=torch.float32)
        # the full layers' scale depends on the positions only: computed once for all of them
        full_layers = any(kind != SLIDING_LAYER for kind in self.config.layer_types)
        log_scale = log_scaling(position_ids, self.config) if full_layers else None
        for layer in self.layers:
            partial, blocks = layer(
                partial,
                blocks,
                log_scale=log_scale,
                query_positions=query_positions,
                attention_mask=attention_mask,
                cache=past_key_values,
                output_attentions=output_attentions,
            )
        hidden_states = self.readout(blocks, partial, inputs_embeds.dtype)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)

    def readout(self, blocks, partial, dtype) -> torch.Tensor:
        """The last hidden states in `dtype`: the readout's attention-residual mix of the stream, RMS-normalized. One
        launch where the `residual_mix` kernel takes the call (a decode step)."""
        fused = KERNELS.optional("residual_mix")
        mixed = None if fused is None else fused(self.final_input, (self.norm,), blocks, partial, dtype)
        if mixed is not None:
            return mixed[0][0]
        return self.norm(self.final_input(blocks, partial)[0]).to(dtype)

    def automatic_prefill_chunk(self, inputs_embeds, cache, **kwargs) -> int | None:
        """The chunk a long input runs in when the caller gives no `prefill_chunk_size`: the largest whose activations
        fit the free memory (`activation_memory`); None for short inputs, in training with gradients, and when every
        layer's hidden states or attentions are asked for (those need the whole input at once)."""
        batch, length, _ = inputs_embeds.shape
        wants_all = any(
            getattr(self.config, name) if kwargs.get(name) is None else kwargs[name]
            for name in ("output_hidden_states", "output_attentions")
        )
        training = self.training and torch.is_grad_enabled()
        if length <= SMALL_CHUNK_GRANULE or wants_all or training or torch.compiler.is_compiling():
            return None
        device = inputs_embeds.device
        past_length = 0 if cache is None else cache.get_seq_length()
        materializes_scores = device.type != "cuda" or self.config._attn_implementation in (None, "eager")
        return automatic_prefill_chunk(self.config, batch, length, past_length, device, materializes_scores)

    def prefill_in_chunks(self, inputs_embeds, attention_mask, position_ids, cache, use_cache, chunk_size, **kwargs):
        """Consecutive slices of the input through the model with one cache: everything in the model is causal, so
        the result equals one forward over the whole input (the cache is made here, and dropped after, when the
        caller has none)."""
        for output in ("output_hidden_states", "output_attentions"):
            if kwargs.get(output):
                raise ValueError(f"`{output}` is not available with `prefill_chunk_size`.")
        cache = Inkling2Cache(self.config) if cache is None else cache
        past_length = cache.get_seq_length()
        hidden_states = []
        for start in range(0, inputs_embeds.shape[1], chunk_size):
            end = min(start + chunk_size, inputs_embeds.shape[1])
            output = self(
                inputs_embeds=inputs_embeds[:, start:end],
                attention_mask=None if attention_mask is None else attention_mask[:, : past_length + end],
                position_ids=None if position_ids is None else position_ids[..., start:end],
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            hidden_states.append(output.last_hidden_state)
        return MoeModelOutputWithPast(
            last_hidden_state=torch.cat(hidden_states, dim=1), past_key_values=cache if use_cache is not False else None
        )

    @staticmethod
    def _padding_mask(attention_mask, batch: int, total_length: int) -> torch.Tensor | None:
        """Checks the 2-D mask; returns None when nothing is padded (the fast, common case)."""
        if attention_mask is None:
            return None
        if attention_mask.dim() != 2 or attention_mask.shape != (batch, total_length):
            raise ValueError(
                f"Inkling2 takes a 2-D padding mask of shape [batch, past + new tokens] = {(batch, total_length)}, "
                f"got {tuple(attention_mask.shape)}. Custom 4-D masks are not supported."
            )
        return None if bool(attention_mask.all()) else attention_mask.bool()

    @staticmethod
    def _new_tokens_mask(attention_mask, batch: int, length: int) -> torch.Tensor | None:
        """The new tokens' columns of a 2-D mask, without looking at the values (no host synchronization)."""
        if attention_mask is None:
            return None
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < length:
            raise ValueError(
                f"Inkling2 takes a 2-D padding mask of shape [batch, past + new tokens] (or [batch, new tokens] with a "
                f"static cache); got {tuple(attention_mask.shape)} for {batch} rows of {length} new tokens."
            )
        return attention_mask[:, -length:].bool()


class Inkling2LanguageModelingMixin:
    """What every Inkling2 model with an `lm_head` shares: the logits, the cache that generate() uses, and the
    bundled DSpark drafter with `generate(dspark=True)`. Listed first in the bases: it specializes `generate` and
    the cache preparation of `GenerationMixin` and the PreTrainedModel's `get_compiled_call`."""

    _tp_plan = {"lm_head": "colwise_gather_output"}  # by vocabulary, the logits gathered on every rank

    def init_dspark(self, config: Inkling2TextConfig) -> None:
        """The drafter when the config describes one (`dspark_config`); it reads this model's hidden states and
        shares its embedding and lm_head."""
        text_config = config.get_text_config()
        dspark_config = text_config.dspark_config
        self.dspark = None if dspark_config is None else Inkling2DSparkDrafter(dspark_config, text_config.vocab_size)

    def set_dspark(self, drafter: Inkling2DSparkDrafter) -> Inkling2DSparkDrafter:
        """Installs a drafter built after the model (loaded from `mtp.safetensors`, or new for training): on the
        embedding's device and dtype, its config recorded in the model's configs so that save_pretrained keeps it."""
        reference = self.get_input_embeddings().weight
        self.dspark = drafter.to(device=reference.device, dtype=reference.dtype)
        text_config = self.config.get_text_config()
        for config in {id(self.config): self.config, id(text_config): text_config}.values():
            config.dspark_config = drafter.config
        return self.dspark

    def dspark_prompt_embeddings(self, input_ids: torch.LongTensor, **model_kwargs) -> torch.Tensor:
        """The prompt's input embeddings as the first forward would build them (images placed, where there are any)."""
        return self.get_input_embeddings()(input_ids)

    def generate(self, *args, **kwargs):
        """`generate()` as usual, through the registered generation hook: with the package's, `dspark=True` (or
        `dspark: true` in the generation config) decodes with the bundled DSpark drafter (same output as without
        it, several tokens per target pass; see `docs/dspark.md` and `generation/hooks.py`)."""
        hook = GENERATION_HOOKS.optional("generate")
        if hook is None:
            return super().generate(*args, **kwargs)
        return hook(self, super().generate, *args, **kwargs)

    def compute_logits(self, hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """lm_head in fp32, softcap, then only the real (unpadded) vocabulary."""
        if isinstance(logits_to_keep, int):
            hidden_states = hidden_states[:, -logits_to_keep:] if logits_to_keep else hidden_states
        else:
            hidden_states = hidden_states[:, logits_to_keep]
        text_config = self.config.get_text_config()
        logits = softcap(self.lm_head(hidden_states).float(), text_config.final_logit_softcapping)
        return logits[..., : text_config.unpadded_vocab_size]

    def logits_and_loss(self, hidden_states, logits_to_keep=0, labels=None, **loss_kwargs):
        logits = self.compute_logits(hidden_states, logits_to_keep)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **loss_kwargs)
        return logits, loss

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size: int, max_cache_length: int
    ):
        """generate() gets an `Inkling2Cache` (keys/values plus convolution states) instead of a DynamicCache, or with
        `cache_implementation="static"` an `Inkling2StaticCache`, whose decode steps replay as CUDA graphs on GPUs."""
        implementation = generation_config.cache_implementation
        if model_kwargs.get("past_key_values") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        if implementation not in (None, "dynamic", "static"):
            raise ValueError(
                f"Inkling2 decodes with its own caches: `cache_implementation` None/'dynamic' (`Inkling2Cache`) or "
                f"'static' (`Inkling2StaticCache`, CUDA graphs on GPUs); got {implementation!r}."
            )
        if implementation != "static":
            model_kwargs["past_key_values"] = Inkling2Cache(self.config.get_text_config())
            return
        rows = max(generation_config.num_beams, generation_config.num_return_sequences) * batch_size
        # room for the last token and for one speculative block past it (DSpark verifies up to 8 at a time)
        length = max(max_cache_length, generation_config.max_cache_len or 0) + 1 + MAX_STEP_TOKENS
        model_kwargs["past_key_values"] = self.static_cache(rows, length)

    def static_cache(self, batch_size: int, max_cache_len: int) -> Inkling2StaticCache:
        """An empty static cache for this batch holding at least `max_cache_len` tokens: the previous one, reset, when
        it is for the same rows and long enough (its buffers and captured graphs are reused: prompts of other
        lengths do not capture again), else a new one, its length rounded up to `STATIC_CACHE_GRANULE` tokens."""
        # buffers made under inference mode (e.g. by `inkling2 serve`) cannot be reset outside it
        rows = (batch_size, self.device, self.dtype, torch.is_inference_mode_enabled())
        previous = getattr(self, "_static_cache", None)
        if getattr(self, "_static_cache_rows", None) != rows or previous.max_cache_len < max_cache_len:
            length = -(-max_cache_len // STATIC_CACHE_GRANULE) * STATIC_CACHE_GRANULE
            self._static_cache = Inkling2StaticCache(self.config.get_text_config(), length, batch_size)
            self._static_cache_rows = rows
        self._static_cache.reset()
        return self._static_cache

    @staticmethod
    def create_masks_for_generate(attention_mask=None, **kwargs):
        """generate() builds 4-D masks for compileable caches; Inkling2 takes the 2-D padding mask as it is (the
        static cache keeps the padding of the cached tokens itself)."""
        return attention_mask

    def get_compiled_call(self, compile_config):
        """generate() asks for a compiled forward for the decode steps when the cache is static and the model is on a
        GPU (`disable_compile=True` in the generation config turns that off): the registered generation hook answers
        (with the package's, decode steps replayed as CUDA graphs, exact against the eager step; see
        `generation/decode_graphs.py`)."""
        hook = GENERATION_HOOKS.optional("compiled_call")
        if hook is None:
            return super().get_compiled_call(compile_config)
        return hook(self, compile_config)


class Inkling2ForCausalLM(Inkling2LanguageModelingMixin, Inkling2PreTrainedModel, GenerationMixin):
    config: Inkling2TextConfig
    _tied_weights_keys = {}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _keys_to_ignore_on_load_unexpected = [r"^model\.visual\.", r"^model\.vision_tower\.", r"^mtp\."]

    def __init__(self, config: Inkling2TextConfig):
        super().__init__(config)
        self.model = Inkling2TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_dspark(config)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Inkling2Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        prefill_chunk_size: int | None = None,
        cache_position: torch.LongTensor | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        """`output_hidden_states`, `output_attentions` and `output_router_logits` (each MoE layer's router logits) go
        to the base model; no auxiliary load-balancing loss is computed (`aux_loss` stays None)."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            prefill_chunk_size=prefill_chunk_size,
            cache_position=cache_position,
            return_dict=True,
            **output_switches(kwargs),
        )
        logits, loss = self.logits_and_loss(outputs.last_hidden_state, logits_to_keep, labels, **kwargs)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


__all__ = ["Inkling2PreTrainedModel", "Inkling2TextModel", "Inkling2ForCausalLM", "Inkling2LanguageModelingMixin"]
