"""Public ops: CUDA tensors go to the Triton kernels (NVFP4 / MXFP8 from compute capability 8.9 on), everything
else to the PyTorch references."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from .reference import (
    FORMATS,
    Routing,
    max_tiles,
    moe_forward_reference,
    route_reference,
)

__all__ = ["KernelConfig", "moe_forward", "pick_config", "route", "slot_output_parts"]

_FMT_CODE = {"bf16": 0, "mxfp8": 1, "nvfp4": 2}
_RANK_ROUTE_SLOTS = 2048  # up to this many slots routing ranks slots pairwise (1-2 launches), beyond: histograms
_ROUTE_CHUNK = 256
_ROUTE_BLOCK = 64


def _kernels():
    from . import triton_kernels  # lazy: triton is imported only when a kernel runs

    return triton_kernels


def _register_kernels():
    from . import register_kernels  # lazy: needs Triton's Gluon

    return register_kernels


def _e4m3_conversions(device: torch.device) -> bool:
    """Whether the GPU converts E4M3 in hardware (`cvt.rn.f16x2.e4m3x2`, Triton's `float8e4nv`): NVIDIA compute
    capability >= 8.9 (Ada, Hopper, Blackwell). Every NVFP4 / MXFP8 kernel decodes through it; below (A100: 8.0)
    Triton refuses `float8e4nv` and ptxas the conversion, so those formats run the reference there."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _gluon_available() -> bool:
    try:
        _register_kernels()
    except ImportError:
        return False
    return True


def _register_gemv_supported(device: torch.device) -> bool:
    """The Gluon register-GEMV kernels need mma.sync (any GPU from compute capability 8.0, Blackwell included) with
    E4M3 conversions, and Triton's Gluon; there is no interpreter for them."""
    return not _interpreting() and _e4m3_conversions(device) and _gluon_available()


# 128 bytes of a weight row per step (register_kernels' STEP_BYTES and `_step_inputs`), known here without Gluon
_REGISTER_STEP_INPUTS = {"nvfp4": 256, "mxfp8": 128}
_REGISTER_SLOTS_PER_EXPERT = {"nvfp4": 2.0, "mxfp8": 1.5}  # up to where they beat the Triton kernels (pick_config)
_REGISTER_GATE_UP_FEATURES = 32  # features of one gate/up program (register_kernels.FEATURES), known here without Gluon
# of their 4-warp programs one SM holds at once: its 65,536 registers over 128 threads of 56-71 registers each
_REGISTER_PROGRAMS_PER_SM = 8


def _register_gemv_usable(x: torch.Tensor, fmt: str, hidden: int, inter: int) -> bool:
    """Formats and shapes the register-GEMV kernels take: NVFP4 or MXFP8 with H and I in whole steps."""
    step = _REGISTER_STEP_INPUTS.get(fmt)
    return step is not None and hidden % step == 0 and inter % step == 0 and _register_gemv_supported(x.device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape of the two expert GEMMs. ``block_m`` is also the tile height of the routing; ``split_k``
    splits the reduction over that many programs (partial sums added in a fixed order afterwards).
    ``register_gemv``: NVFP4 / MXFP8 decode through the Gluon kernels of `register_kernels`, whose shape is
    fixed (`REGISTER_GEMV`: 8 slots x 64 weight rows per program, 128-byte steps); only ``split_k`` is read."""

    block_m: int
    gate_up_n: int
    down_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    register_gemv: bool = False


REGISTER_GEMV = KernelConfig(8, 64, 64, 256, 4, 1, register_gemv=True)


def _register_split(num_slots: int, num_experts: int, inter: int, multiprocessors: int) -> int:
    """How many programs may share each reduction of the register kernels: as many as keep the gate/up grid over the
    experts the slots are expected to reach (uniform routing) within one wave of the GPU. At few active experts (2 of
    96 at T = 1, what one GPU of TP4/EP4 sees) the unsplit grid is one program per SM, each streaming its rows alone;
    split, the same bytes stream in parallel. Where the unsplit grid already fills a wave (8 of 384 experts at T = 1),
    a split only adds a second wave (docs/benchmarks.md, "Decode: a split reduction where the grid is sparse")."""
    experts = max(num_experts, 1)  # (no experts at all still gets a valid split)
    active = experts * (1 - (1 - 1 / experts) ** num_slots)
    programs = max(active, 1.0) * inter / _REGISTER_GATE_UP_FEATURES
    return max(1, int(multiprocessors * _REGISTER_PROGRAMS_PER_SM // programs))


def pick_config(num_slots: int, num_experts: int, fmt: str, register_gemv: bool = False, *, inter: int = 0,
                multiprocessors: int = 0) -> KernelConfig:
    """Shape from sizes only (never from the data), so the choice is graph-safe.

    ``register_gemv`` (the device and shapes allow `register_kernels`): NVFP4 and MXFP8 decode take those
    kernels while an expert's slots mostly fit one 8-slot tile (beyond, each further tile reads the expert's
    weights again): on an H200, NVFP4 up to 2 slots per expert on average (68% / 67% of the copy bandwidth at
    T = 8 / 64 against 51% / 52% for the Triton kernels), MXFP8 up to 1.5 (61% / 75% / 75% at T = 1 / 8 / 64
    against 51% / 68-71% / 69-73%; the Triton kernels are faster from T = 96, 2 per expert); docs/benchmarks.md.
    Given the expert width ``inter`` and the GPU's ``multiprocessors``, their reductions are split where the grid
    would leave SMs idle (`_register_split`).

    Decode (few slots per expert) is weight streaming: 16-row M tiles and 128 inputs per K step; quantized
    formats take 64-wide N tiles (fewest instructions per weight byte in the SASS, and fastest in the H200
    sweep recorded in docs/benchmarks.md, where splitting K did not help at T=1), BF16 32 / 64 (the fastest of
    a sweep at T = 1 and 8 with 16 and 384 experts, docs/benchmarks.md).
    Prefill: large M tiles so that each dequantized weight tile feeds many rows; the shapes for more than 96
    rows per expert are the fastest of the 8192-token sweep in docs/benchmarks.md.
    """
    per_expert = num_slots / max(num_experts, 1)
    if register_gemv and per_expert <= _REGISTER_SLOTS_PER_EXPERT.get(fmt, 0):
        if inter and multiprocessors:
            return replace(REGISTER_GEMV, split_k=_register_split(num_slots, num_experts, inter, multiprocessors))
        return REGISTER_GEMV
    if per_expert <= 8:
        if fmt == "bf16":
            return KernelConfig(16, 32, 64, 128, 4, 4)
        return KernelConfig(16, 64, 64, 128, 4, 3)
    k_prefill = {"bf16": 64, "mxfp8": 64, "nvfp4": 128}[fmt]
    if per_expert <= 96:
        return KernelConfig(64, 64, 128, k_prefill, 4, 3)
    return {
        "bf16": KernelConfig(128, 128, 256, 64, 8, 3),
        "mxfp8": KernelConfig(128, 64, 128, 64, 4, 4),
        "nvfp4": KernelConfig(128, 64, 128, 128, 8, 3),
    }[fmt]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _empty_routing(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """A `Routing` for these ids whose tensors the routing kernels fill (sizes from the slot count only)."""
    slots, device = expert_ids.numel(), expert_ids.device
    n_tiles = max_tiles(slots, num_experts, block_m)
    int32 = dict(dtype=torch.int32, device=device)
    return Routing(torch.empty(slots, **int32), torch.empty(slots, **int32), torch.empty(num_experts + 1, **int32),
                   torch.empty(n_tiles, **int32), torch.empty(n_tiles, **int32), num_experts, expert_ids.shape[1],
                   block_m)  # fmt: skip


def _routing_launch(ids: torch.Tensor, routing: Routing) -> tuple[tuple, dict]:
    """The arguments every routing kernel starts with (ids, the routing's tensors, slots, experts, tiles) and its
    constexprs: NB bins (the experts, and one for the dropped slots: ids outside [0, E)), BM, TB."""
    bins = _next_pow2(routing.num_experts + 1)
    tensors = (routing.sorted_slots, routing.slot_position, routing.expert_offsets, routing.tile_expert,
               routing.tile_start)  # fmt: skip
    args = (ids, *tensors, ids.numel(), routing.num_experts, routing.tile_expert.numel())
    return args, dict(NB=bins, BM=routing.block_m, TB=max(8, min(32, 16384 // bins)))


def _rank_block(slots: int) -> int:
    """Slots of one ranking program: up to `_ROUTE_BLOCK` (one program ranks every slot up to there)."""
    return min(_ROUTE_BLOCK, max(16, _next_pow2(slots)))


def _route_triton(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """`route` on CUDA. Up to `_RANK_ROUTE_SLOTS` slots, each slot's rank among its expert's slots is counted pairwise:
    one launch when one program holds every slot, else a second that lays out the tiles. Beyond, per-chunk
    histograms, one scan and a scatter. Grids depend on the slot count only."""
    kernels = _kernels()
    ids = expert_ids.contiguous()
    slots = ids.numel()
    routing = _empty_routing(ids, num_experts, block_m)
    args, sizes = _routing_launch(ids, routing)
    bins, n_tiles = sizes["NB"], routing.tile_expert.numel()
    if slots <= _RANK_ROUTE_SLOTS:
        rank_block = _rank_block(slots)
        programs = _next_pow2(_cdiv(slots, rank_block))  # each also counts the offsets of bins / programs experts
        kernels._route_rank_kernel[(programs,)](*args, RB=rank_block, NBP=max(1, bins // programs),
                                                TILES=programs == 1, **sizes, num_warps=4)  # fmt: skip
        if programs > 1:
            kernels._route_tiles_kernel[(1,)](routing.expert_offsets, routing.tile_expert, routing.tile_start,
                                              num_experts, n_tiles, **sizes, num_warps=4)  # fmt: skip
    else:
        chunks = _cdiv(slots, _ROUTE_CHUNK)
        histogram = torch.empty(chunks, bins, dtype=torch.int32, device=ids.device)
        chunk_base = torch.empty(chunks, bins, dtype=torch.int32, device=ids.device)
        kernels._route_hist_kernel[(chunks,)](ids, histogram, slots, num_experts, CHUNK=_ROUTE_CHUNK, B=_ROUTE_BLOCK,
                                              NB=bins, num_warps=4)  # fmt: skip
        kernels._route_scan_kernel[(1,)](histogram, chunk_base, routing.expert_offsets, routing.tile_expert,
                                         routing.tile_start, chunks, num_experts, n_tiles, **sizes,
                                         num_warps=4)  # fmt: skip
        kernels._route_scatter_kernel[(chunks,)](ids, chunk_base, routing.expert_offsets, routing.sorted_slots,
                                                 routing.slot_position, slots, num_experts, CHUNK=_ROUTE_CHUNK,
                                                 B=_ROUTE_BLOCK, NB=bins, num_warps=4)  # fmt: skip
    return routing


def route(expert_ids: torch.Tensor, num_experts: int, block_m: int = 16) -> Routing:
    """Group the ``T * top_k`` slots of ``expert_ids [T, top_k]`` by expert (see :class:`Routing`).

    On CUDA this is one launch (<= 64 slots), two (<= 2048) or three, with grids fixed by the slot count: no host
    synchronization, CUDA-graph capturable. Elsewhere it is :func:`route_reference`.
    """
    if block_m not in (8, 16, 32, 64, 128):
        raise ValueError(f"block_m must be 8, 16, 32, 64 or 128, got {block_m}")
    if expert_ids.is_cuda:
        if expert_ids.dim() != 2:
            raise ValueError(f"expert_ids must be [T, top_k], got shape {tuple(expert_ids.shape)}")
        return _route_triton(expert_ids, num_experts, block_m)
    return route_reference(expert_ids, num_experts, block_m)


def _split_k(k_dim: int, wanted: int) -> int:
    """Largest split <= wanted whose K slices are whole multiples of 32."""
    split = wanted
    while split > 1 and k_dim % (split * 32):
        split //= 2
    return split


def _steps_split(steps: int, wanted: int) -> int:
    """Largest split <= wanted that divides the register kernels' 256-input steps evenly."""
    return max(split for split in range(1, wanted + 1) if steps % split == 0)


def _block_k(k_dim: int, wanted: int) -> int:
    bk = wanted
    while bk > 32 and k_dim % bk:
        bk //= 2
    if k_dim % bk:
        raise ValueError(f"reduction size {k_dim} must be a multiple of 32 for the Triton path")
    return bk


def _expert_dims(fmt: str, w13: torch.Tensor, w2: torch.Tensor):
    e, two_i = w13.shape[0], w13.shape[1]
    h = w13.shape[2] * (2 if fmt == "nvfp4" else 1)
    i = w2.shape[2] * (2 if fmt == "nvfp4" else 1)
    if two_i != 2 * i or w2.shape[0] != e or w2.shape[1] != h:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not describe [E, 2I, H] and "
                         f"[E, H, I] in format {fmt}")
    return e, h, i


def _as_bytes(t: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    if t is None:
        return fallback
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


@dataclass(frozen=True)
class _Problem:
    """One `moe_forward` call as the kernels see it: T tokens routed to top_k experts each (T * top_k slots), hidden
    size H, expert width I, E experts of one format (its kernel code), the tile shape and the slots' routing."""

    tokens: int
    top_k: int
    hidden: int
    inter: int
    num_experts: int
    fmt: str
    config: KernelConfig
    routing: Routing

    @property
    def slots(self) -> int:
        return self.tokens * self.top_k

    @property
    def code(self) -> int:
        return _FMT_CODE[self.fmt]

    @property
    def tiles(self) -> tuple[torch.Tensor, ...]:
        """The routing as the GEMMs take it: slots sorted by expert, each M tile's expert and first slot, and the
        experts' offsets into the sorted slots."""
        routing = self.routing
        return routing.sorted_slots, routing.tile_expert, routing.tile_start, routing.expert_offsets


@dataclass(frozen=True)
class _KernelWeights:
    """The experts' tensors as the kernels read them: values (BF16, or the packed bytes of E4M3 / E2M1), block
    scales as bytes, and NVFP4's fp32 outer multipliers ([E, 2]: gate, up; [E]); a placeholder where a format has
    no scale or multiplier (the kernels never read it)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor
    gate_up_outer: torch.Tensor
    down_outer: torch.Tensor


def _kernel_weights(fmt, w13, w2, w13_scale, w2_scale, w13_outer, w2_outer, placeholder) -> _KernelWeights:
    if fmt == "bf16":
        gate_up, down = w13.to(torch.bfloat16).contiguous(), w2.to(torch.bfloat16).contiguous()
    else:
        gate_up, down = _as_bytes(w13, w13).contiguous(), _as_bytes(w2, w2).contiguous()
    gate_up_outer = down_outer = placeholder
    if fmt == "nvfp4":
        num_experts = w13.shape[0]
        gate_up_outer = w13_outer.float().reshape(num_experts, -1).expand(num_experts, 2).contiguous()
        down_outer = w2_outer.float().reshape(num_experts).contiguous()
    return _KernelWeights(gate_up, down, _as_bytes(w13_scale, gate_up).contiguous(),
                          _as_bytes(w2_scale, down).contiguous(), gate_up_outer, down_outer)  # fmt: skip


def _routing_and_inputs(x, expert_ids, routing, num_experts, inter, fmt, config, placeholder, tickets=None):
    """(the routing, unless one is given; what the gate/up GEMM reads; its per-token scale; the [slots, I] buffer its
    SwiGLU output goes to; `tickets` zeroed, or None). NVFP4 and the register kernels multiply in f16: each token
    scaled by a power of two into f16 range (NVFP4: its inputs de-interleaved, see the kernels). Where one program
    ranks every slot (decode steps) that conversion and the routing share one launch, which also zeroes `tickets`
    (int32), the counters with which a split register gate/up GEMM's last program per block applies the SwiGLU (no
    `_swiglu_kernel` launch); elsewhere they are not used (None). The other formats read the bf16 x as it is."""
    tokens, hidden = x.shape
    slots = expert_ids.numel()
    f16_input = fmt == "nvfp4" or config.register_gemv
    fused = routing is None and f16_input and slots <= _ROUTE_BLOCK
    if routing is None and not fused:
        routing = _route_triton(expert_ids, num_experts, config.block_m)
    if not f16_input:
        return routing, x, placeholder, torch.empty(slots, inter, dtype=torch.bfloat16, device=x.device), None
    kernels = _kernels()
    x_in = torch.empty(tokens, hidden, dtype=torch.float16, device=x.device)
    x_scale = torch.empty(tokens, dtype=torch.float32, device=x.device)
    row = _next_pow2(hidden)
    conversion = dict(DEINTERLEAVE=fmt == "nvfp4", BLOCK=row, num_warps=max(4, min(16, row // 1024)))
    if fused:
        ids = expert_ids.contiguous()
        routing = _empty_routing(ids, num_experts, config.block_m)
        args, sizes = _routing_launch(ids, routing)
        kernels._route_and_convert_kernel[(1 + tokens,)](
            *args, x, x.stride(0), x_in, x_scale, hidden, placeholder if tickets is None else tickets,
            0 if tickets is None else tickets.numel(), RB=_rank_block(slots), **sizes, **conversion,
        )  # fmt: skip
    else:
        kernels._x_to_f16_kernel[(tokens,)](x, x.stride(0), x_in, x_scale, hidden, **conversion)
        tickets = None
    # (MXFP8 with split K: `_swiglu_kernel` stores its bf16 values here, exactly: |act| <= 100)
    return routing, x_in, x_scale, torch.empty(slots, inter, dtype=torch.float16, device=x.device), tickets


def _splits(config: KernelConfig, fmt: str, hidden: int, inter: int) -> tuple[int, int]:
    """How many programs share the reduction of the gate/up GEMM (over H) and of the down GEMM (over I)."""
    if config.register_gemv:
        return tuple(_steps_split(k_dim // _REGISTER_STEP_INPUTS[fmt], config.split_k)
                     for k_dim in (hidden, inter))  # fmt: skip
    return _split_k(hidden, config.split_k), _split_k(inter, config.split_k)


def _gate_up(problem, weights, x_in, x_scale, act, gate_cap, up_cap, split, partial_out, tickets) -> None:
    """act = softcapped SwiGLU of each slot's gate/up products (with split K: fp32 partial sums to partial_out, the
    SwiGLU after them in the register kernel's last program per block where `tickets` counts them, else in
    `_swiglu_kernel`)."""
    config, tiles, n_tiles = problem.config, problem.tiles, problem.routing.tile_expert.numel()
    w, scale = weights.gate_up, weights.gate_up_scale
    caps = (float(gate_cap), float(up_cap))
    if config.register_gemv:
        register = _register_kernels()
        register._gate_up_kernel[(n_tiles, problem.inter // register.FEATURES.value, split)](
            x_in, *tiles, w, w.stride(0), w.stride(1), scale, scale.stride(0), scale.stride(1), weights.gate_up_outer,
            x_scale, act, partial_out, partial_out if tickets is None else tickets, problem.slots, problem.hidden,
            problem.inter, *caps, TOPK=problem.top_k, SPLIT_K=split, TICKETS=tickets is not None, FMT=problem.code,
            num_warps=register.WARPS.value,
        )  # fmt: skip
        return
    _kernels()._gate_up_kernel[(n_tiles, _cdiv(problem.inter, config.gate_up_n), split)](
        x_in, x_in.stride(0), *tiles, w, w.stride(0), w.stride(1), scale, scale.stride(0), scale.stride(1),
        weights.gate_up_outer, x_scale, act, act.stride(0), partial_out, problem.slots, problem.hidden, problem.inter,
        *caps, TOPK=problem.top_k, FMT=problem.code, BM=config.block_m, BN=config.gate_up_n,
        BK=_block_k(problem.hidden // split, config.block_k), SPLIT_K=split, DOT_FP32=_interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _down(problem, weights, act, slot_weights, split, y) -> None:
    """y[split part, slot] = the slot's routing weight times down(act[slot]), fp32, per split part of I."""
    config, tiles, n_tiles = problem.config, problem.tiles, problem.routing.tile_expert.numel()
    w, scale = weights.down, weights.down_scale
    if config.register_gemv:
        register = _register_kernels()
        register._down_kernel[(n_tiles, problem.hidden // register.ROWS.value, split)](
            act, *tiles, slot_weights, w, w.stride(0), w.stride(1), scale, scale.stride(0), scale.stride(1),
            weights.down_outer, y, problem.slots, problem.hidden, problem.inter, FMT=problem.code,
            num_warps=register.WARPS.value,
        )  # fmt: skip
        return
    _kernels()._down_kernel[(n_tiles, _cdiv(problem.hidden, config.down_n), split)](
        act, act.stride(0), *tiles, slot_weights, w, w.stride(0), w.stride(1), scale, scale.stride(0),
        scale.stride(1), weights.down_outer, y, problem.slots, problem.hidden, problem.inter, FMT=problem.code,
        BM=config.block_m, BN=config.down_n, BK=_block_k(problem.inter // split, config.block_k), SPLIT_K=split,
        DOT_FP32=_interpreting(), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _moe_forward_triton(x, expert_ids, routing_weights, w13, w2, fmt, w13_scale, w2_scale, w13_outer,
                        w2_outer, gate_cap, up_cap, routing=None, config: KernelConfig | None = None,
                        out: torch.Tensor | None = None, combine: bool = True):
    """`moe_forward` on CUDA tensors (or under Triton's interpreter): route, cast the activations where the format
    multiplies in f16, the gate/up GEMM with its SwiGLU, the down GEMM weighted per slot, and (`combine`) the
    combine that adds each token's slots (and the split-K parts) in a fixed order."""
    num_experts, hidden, inter = _expert_dims(fmt, w13, w2)
    tokens, top_k = expert_ids.shape
    if x.shape != (tokens, hidden):
        raise ValueError(f"x must be [{tokens}, {hidden}], got {tuple(x.shape)}")
    config = _call_config(x, expert_ids, fmt, num_experts, hidden, inter, config)
    if routing is not None and routing.block_m != config.block_m:
        raise ValueError(f"routing was built for block_m={routing.block_m}, the kernels use {config.block_m}")
    split_down = _splits(config, fmt, hidden, inter)[1]
    if combine and out is None:
        out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=x.device)
    elif combine and (out.shape != (tokens, hidden) or out.dtype != torch.bfloat16 or out.stride(1) != 1):
        raise ValueError(f"out must be a bf16 [{tokens}, {hidden}] tensor with unit column stride")
    y = torch.empty(split_down, tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    if tokens:
        _expert_kernels(x, expert_ids, routing_weights, fmt, w13, w2, w13_scale, w2_scale, w13_outer, w2_outer,
                        gate_cap, up_cap, routing, config, y)  # fmt: skip
    if not combine:
        return y.view(split_down, tokens, top_k, hidden)
    if tokens:
        block = min(1024, _next_pow2(hidden))
        _kernels()._combine_kernel[(tokens, _cdiv(hidden, block))](
            y, expert_ids.contiguous(), out, out.stride(0), tokens * top_k, hidden, num_experts, TOPK=top_k,
            SPLIT_K=split_down, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def _call_config(x, expert_ids, fmt, num_experts, hidden, inter, config: KernelConfig | None) -> KernelConfig:
    """The tile shape of a call: `config` checked against what the device and shapes allow, or `pick_config`'s."""
    register_gemv = _register_gemv_usable(x, fmt, hidden, inter)
    if config is None:
        multiprocessors = torch.cuda.get_device_properties(x.device).multi_processor_count if register_gemv else 0
        return pick_config(expert_ids.numel(), num_experts, fmt, register_gemv, inter=inter,
                           multiprocessors=multiprocessors)  # fmt: skip
    if config.register_gemv and not register_gemv:
        raise ValueError("register_gemv needs NVFP4 (MXFP8) experts with H and I multiples of 256 (128) on a CUDA "
                         "GPU of compute capability >= 8.9 and a Triton with Gluon; leave config=None to let "
                         "pick_config choose")
    return config


def _expert_kernels(x, expert_ids, routing_weights, fmt, w13, w2, w13_scale, w2_scale, w13_outer, w2_outer, gate_cap,
                    up_cap, routing, config, y) -> None:
    """Everything before the combine, for T > 0 tokens: route, cast the activations, the gate/up GEMM with its
    SwiGLU, and the down GEMM's routing-weighted slot rows into y [down split, slots, H] fp32."""
    num_experts, hidden, inter = _expert_dims(fmt, w13, w2)
    tokens, top_k = expert_ids.shape
    x = x.to(torch.bfloat16)
    if x.stride(1) != 1:
        x = x.contiguous()
    slot_weights = routing_weights.reshape(-1).float().contiguous()  # also the placeholder of unused arguments
    weights = _kernel_weights(fmt, w13, w2, w13_scale, w2_scale, w13_outer, w2_outer, slot_weights)
    split_gate_up, split_down = _splits(config, fmt, hidden, inter)
    tickets = None
    if config.register_gemv and split_gate_up > 1:  # one per (tile, feature block) of the gate/up grid
        blocks = inter // _register_kernels().FEATURES.value
        tiles = max_tiles(expert_ids.numel(), num_experts, config.block_m)
        tickets = torch.empty(tiles * blocks, dtype=torch.int32, device=x.device)
    routing, x_in, x_scale, act, tickets = _routing_and_inputs(x, expert_ids, routing, num_experts, inter, fmt, config,
                                                               slot_weights, tickets)  # fmt: skip
    problem = _Problem(tokens, top_k, hidden, inter, num_experts, fmt, config, routing)
    partial = torch.empty(split_gate_up if split_gate_up > 1 else 0, problem.slots, 2 * inter, dtype=torch.float32,
                          device=x.device)  # fmt: skip
    _gate_up(problem, weights, x_in, x_scale, act, gate_cap, up_cap, split_gate_up,
             partial if split_gate_up > 1 else y, tickets)  # fmt: skip
    if split_gate_up > 1 and tickets is None:
        _kernels()._swiglu_kernel[(_cdiv(problem.slots, 16), _cdiv(inter, 128))](
            partial, routing.expert_offsets, act, act.stride(0), problem.slots, num_experts, inter, float(gate_cap),
            float(up_cap), FMT=problem.code, SPLIT_K=split_gate_up, BR=16, BC=128, num_warps=4,
        )  # fmt: skip
    _down(problem, weights, act, slot_weights, split_down, y)


def _runs_kernels(x: torch.Tensor, fmt: str) -> bool:
    """Whether a call on x runs the Triton kernels: CUDA, and for NVFP4 / MXFP8 a GPU with E4M3 conversions."""
    return x.is_cuda and (fmt == "bf16" or _e4m3_conversions(x.device))


def slot_output_parts(x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      fmt: str = "bf16", config: KernelConfig | None = None) -> int:
    """How many parts ``moe_forward(..., combine=False)`` returns for these arguments (the down GEMM's split of
    I). From sizes and the device only, so that a tracer (a fake tensor, `torch.compile`) can shape the result
    without running anything."""
    if not _runs_kernels(x, fmt):
        return 1
    num_experts, hidden, inter = _expert_dims(fmt, w13, w2)
    return _splits(_call_config(x, expert_ids, fmt, num_experts, hidden, inter, config), fmt, hidden, inter)[1]


def moe_forward(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    fmt: str = "bf16",
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_outer: torch.Tensor | None = None,
    w2_outer: torch.Tensor | None = None,
    gate_cap: float = 4.0,
    up_cap: float = 25.0,
    routing: Routing | None = None,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    combine: bool = True,
) -> torch.Tensor:
    """Routed-expert block: ``out[t] = sum_j routing_weights[t, j] * down(act(gate_up(x[t])))`` in bf16.

    Args:
        x: ``[T, H]`` bf16 hidden states.
        expert_ids: ``[T, top_k]`` integer expert per slot; ids outside ``[0, E)`` are dropped.
        routing_weights: ``[T, top_k]`` fp32.
        w13: gate rows then up rows, ``[E, 2I, H]`` bf16 / ``[E, 2I, H]`` float8_e4m3fn (mxfp8) /
            ``[E, 2I, H/2]`` uint8 packed E2M1 (nvfp4).
        w2: ``[E, H, I]`` in the same format (``[E, H, I/2]`` for nvfp4).
        fmt: ``"bf16"``, ``"mxfp8"`` or ``"nvfp4"``.
        w13_scale, w2_scale: mxfp8 uint8 E8M0 ``[E, N, K/32]``; nvfp4 float8_e4m3fn ``[E, N, K/16]``.
        w13_outer, w2_outer: nvfp4 fp32 outer multipliers, ``[E]``/``[E, 1]``/``[E, 2]`` (gate, up) and
            ``[E]``/``[E, 1]``.
        gate_cap, up_cap: softcaps of the SwiGLU.
        routing: a :func:`route` result to reuse (its ``block_m`` must match the config).
        config: override the tile shape (:func:`pick_config` otherwise).
        out: optional bf16 ``[T, H]`` destination (a static buffer for CUDA graphs).
        combine: False skips the sum: returns the terms of it, each slot's routing-weighted output, fp32
            ``[parts, T, top_k, H]`` (``parts``: the down GEMM's split of I, :func:`slot_output_parts`), for a
            caller that adds them inside a kernel of its own instead of a launch here. Added per token in slot
            order, each slot's parts in order, and rounded to bf16, they are ``moe_forward``'s output bit for
            bit. The rows of dropped slots are not written: skip them, as the sum does.

    CUDA tensors run the Triton kernels (no host sync, deterministic, graph-capturable); other devices, and
    NVFP4 / MXFP8 on GPUs without E4M3 conversions (compute capability < 8.9), run :func:`moe_forward_reference`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    if fmt != "bf16" and (w13_scale is None or w2_scale is None):
        raise ValueError(f"{fmt} needs w13_scale and w2_scale")
    if fmt == "nvfp4" and (w13_outer is None or w2_outer is None):
        raise ValueError("nvfp4 needs w13_outer and w2_outer (fp32 multipliers per expert)")
    if not combine and out is not None:
        raise ValueError("out is the destination of the sum: combine=False returns the slots' rows instead")
    if _runs_kernels(x, fmt):
        return _moe_forward_triton(x, expert_ids, routing_weights, w13, w2, fmt, w13_scale, w2_scale,
                                   w13_outer, w2_outer, gate_cap, up_cap, routing, config, out, combine)
    result = moe_forward_reference(
        x, expert_ids, routing_weights, w13, w2, fmt, w13_scale=w13_scale, w2_scale=w2_scale,
        w13_outer=w13_outer, w2_outer=w2_outer, gate_cap=gate_cap, up_cap=up_cap, combine=combine,
    )
    if out is None:
        return result
    return out.copy_(result)
