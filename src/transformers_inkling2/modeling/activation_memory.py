"""How long a prompt one forward may take at once, so that any prompt length runs through a plain `forward` or
`generate()`.

A prefill's activations grow with the tokens it runs at once, not with the cache: per token and row, the relative
logits of one layer (`heads * extent` fp32), the MoE's sorted activations (`top_k * 2 * intermediate` fp32) and the
attention-residual block states (fp32). The eager reference attention also materializes `[heads, queries, keys]`
scores. `automatic_prefill_chunk` picks the largest chunk (a multiple of `CHUNK_GRANULE`) whose estimate fits in half
of the memory free on the device, and never more tokens than the attention kernels can index in one call (2^31
elements of relative logits: for many rows, fewer than a granule, in steps of `SMALL_CHUNK_GRANULE`); the cache
carries everything between chunks, so the result equals one forward.
`inkling2 plan` prints the same estimate (`prefill_activation_bytes`).
"""

from __future__ import annotations

import torch

from ..configuration_inkling2 import Inkling2TextConfig

CHUNK_GRANULE = 1024
SMALL_CHUNK_GRANULE = 64  # for many rows, where the index limit leaves fewer than two CHUNK_GRANULEs
MEMORY_SHARE = 0.5  # of the free memory: the allocator's fragmentation and what the estimate leaves out
MAX_INDEXED_ELEMENTS = 2**31  # attention kernels index the relative logits of one call with 32-bit offsets
EXTENT_PITCH_PADDING = 16  # the prefill kernels' layout pads each row of relative logits by up to this much
FP32 = 4


def prefill_activation_bytes(config: Inkling2TextConfig, tokens: int, tp: int = 1) -> float:
    """Estimated peak activation bytes of a prefill of `tokens` tokens in one row (model-parallel over `tp` heads)."""
    relative_logits = config.num_attention_heads / tp * config.rel_extent * FP32
    moe = config.num_experts_per_tok * 2 * max(config.hidden_size, 2 * config.moe_intermediate_size) * FP32
    block_states = (config.num_hidden_layers // config.n_layers_per_attn_res_block + 2) * config.hidden_size * FP32
    return tokens * (relative_logits + moe + block_states)


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes a forward can still allocate on `device`: the driver's free memory plus what PyTorch's allocator holds
    unused (CUDA), the kernel's MemAvailable (CPU on Linux), else None."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def automatic_prefill_chunk(
    config: Inkling2TextConfig,
    batch: int,
    length: int,
    past_length: int,
    device: torch.device,
    materializes_scores: bool,
) -> int | None:
    """The prefill chunk for `length` new tokens in `batch` rows after `past_length` cached ones, or None when one
    forward takes them all. `materializes_scores`: the attention backend keeps `[heads, queries, keys]` fp32 scores
    (the eager reference), which then count too."""
    heads = config.num_attention_heads
    per_token = prefill_activation_bytes(config, 1)
    if materializes_scores:  # scores, bias and probabilities of the layer running, over every key
        per_token += 3 * heads * (past_length + length) * FP32
    indexed = MAX_INDEXED_ELEMENTS // (batch * heads * (config.rel_extent + EXTENT_PITCH_PADDING))
    granule = CHUNK_GRANULE if indexed >= 2 * CHUNK_GRANULE else SMALL_CHUNK_GRANULE
    chunk = max(indexed - granule, granule)  # a granule's margin for the kernels' padded rows
    free = free_memory_bytes(device)
    if free is not None:
        chunk = min(chunk, int(free * MEMORY_SHARE / (batch * per_token)))
    chunk = max(granule, chunk // granule * granule)
    return None if length <= chunk else chunk


__all__ = ["automatic_prefill_chunk", "free_memory_bytes", "prefill_activation_bytes"]
