"""Every Triton and Gluon kernel of the package and of the `inkling2_moe` hub kernel, compiled for Hopper (sm_90a) and
Blackwell (sm_100a) on this CPU, at the specializations the dispatch launches; and what the dispatch picks on each GPU
generation, the device capability mocked.

How: the real host code (the hub kernel's `moe_forward`, the attention backends, the prompt convolution) runs on CPU
tensors of Inkling-2-Small's sizes that report `is_cuda`, with `torch.cuda.get_device_capability` answering the mocked
capability; Triton's launches are recorded instead of run. Each recorded launch then goes through Triton's own launch
path in warm-up mode against an offline driver that names the target, so Triton specializes it exactly as on that GPU
and its bundled LLVM and ptxas build the cubin (`triton.compile` needs no GPU, only a target). Expert weights of the
model's size lie on sparse files: the host code only passes their pointers and strides, nothing is read or committed.

The cubins are then read back as SASS (Triton's bundled cuobjdump): no spilled register may be loaded or stored
inside a loop, but in one known specialization.

`pytest -s` prints the counts and the MMA instructions per target (docs/kernels.md, "Blackwell"), and each
specialization's registers, local accesses and longest loop ("Register spills").
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from triton import knobs  # noqa: E402
from triton import language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from inkling2_helpers import on_mocked_gpu  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from transformers_inkling2 import Inkling2TextConfig  # noqa: E402
from transformers_inkling2.backends.attention import prefill_kernel  # noqa: E402
from transformers_inkling2.backends.attention.flex import (  # noqa: E402
    inkling2_decode_attention,
    inkling2_triton_attention,
)
from transformers_inkling2.backends.attention.relative_logits import aligned_product  # noqa: E402
from transformers_inkling2.backends.convolution import fused_prompt_convolution  # noqa: E402
from transformers_inkling2.backends.kernel_loading import CHECKOUT_KERNEL, moe_kernel  # noqa: E402
from transformers_inkling2.cache.common import MAX_STEP_TOKENS  # noqa: E402

MODEL = Inkling2TextConfig()  # the defaults are Inkling-2-Small's sizes
HOPPER, BLACKWELL, BLACKWELL_ULTRA, RTX_BLACKWELL, AMPERE = (9, 0), (10, 0), (10, 3), (12, 0), (8, 0)
COMPILED_ON = {90: HOPPER, 100: BLACKWELL}  # target -> the capability whose launches are compiled for it
MOE_TOKENS = (1, 8, 64, 2048, 8192)  # decode, a verification batch, many users, prefill chunks (pick_config's ranges)
PROMPT_TOKENS = 512
PACKAGE_SOURCES = Path(prefill_kernel.__file__).resolve().parents[2]  # src/transformers_inkling2/
KERNEL_DEFINITION = re.compile(r"^@(?:triton|gluon)\.jit\b.*\n(?:@.*\n)*def (\w+_kernel)\(", re.MULTILINE)
MMA = re.compile(r"\b(wgmma\.mma_async|tcgen05\.mma|mma\.sync)\b")


@dataclasses.dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    grid: tuple
    options: dict

    @property
    def name(self) -> str:
        return kernel_name(self.kernel)


def kernel_name(kernel: JITFunction) -> str:
    """`module.function`, the module without its package (the hub kernel's package name carries a build digest)."""
    return f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.fn.__name__}"


class OfflineDriver:
    """What Triton's launch path asks the active driver for, answered for a GPU that is not here: compiles only."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return ("offline", self.target.arch)  # the key of the kernels' per-device compile caches

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def on_gpu(capability: tuple[int, int]):
    """Host code inside sees CUDA tensors on a GPU of `capability`; the Triton / Gluon launches it makes are recorded
    (yielded list), not run."""
    launches = []

    def record(kernel, *args, grid, warmup, **options):
        launches.append(Launch(kernel, args, grid, options))

    with mock.patch.object(JITFunction, "run", record), on_mocked_gpu(capability):
        yield launches


def compile_for(arch: int, launches: list[Launch]) -> dict[str, list]:
    """Each launch compiled for `arch` through Triton's launch path (warm-up: no launch), two at a time; returns the
    compiled kernels (cubin and all) by kernel name, one per specialization."""
    with (
        mock.patch.object(driver, "_active", OfflineDriver(arch)),
        ThreadPoolExecutor(min(2, os.cpu_count() or 1)) as threads,
        triton.AsyncCompileMode(threads),
    ):
        for launch in launches:
            launch.kernel.run(*launch.args, grid=launch.grid, warmup=True, **launch.options)
    compiled = collections.defaultdict(list)
    for kernel in {id(launch.kernel): launch.kernel for launch in launches}.values():
        compiled[kernel_name(kernel)] += kernel.device_caches[("offline", arch)][0].values()
    return compiled


# --- the model's calls, at its sizes --------------------------------------------------------------------------------


def sparse_tensor(folder: Path, shape, dtype) -> torch.Tensor:
    """A tensor on a sparse file of its size: pointers and strides of a real one, no memory."""
    path = folder / f"{len(os.listdir(folder))}.bin"
    size = math.prod(shape) * dtype.itemsize
    with open(path, "wb") as file:
        file.truncate(size)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8).view(dtype).view(shape)


def expert_weights(folder: Path) -> dict[str, dict]:
    """`moe_forward`'s weight arguments per format, in the checkpoint's layouts (docs/quantization.md)."""
    experts, hidden, inter = MODEL.n_routed_experts, MODEL.hidden_size, MODEL.moe_intermediate_size

    def pair(dtype, packing=1):
        return dict(w13=sparse_tensor(folder, (experts, 2 * inter, hidden // packing), dtype),
                    w2=sparse_tensor(folder, (experts, hidden, inter // packing), dtype))  # fmt: skip

    def scales(dtype, block):
        return {f"{name}_scale": sparse_tensor(folder, (*weight.shape[:2], weight.shape[2] // block), dtype)
                for name, weight in (("w13", bf16["w13"]), ("w2", bf16["w2"]))}  # fmt: skip

    bf16 = pair(torch.bfloat16)
    outer = dict(w13_outer=torch.ones(experts, 2), w2_outer=torch.ones(experts))
    return {
        "bf16": dict(fmt="bf16", **bf16),
        "mxfp8": dict(fmt="mxfp8", **pair(torch.float8_e4m3fn), **scales(torch.uint8, 32)),
        "nvfp4": dict(fmt="nvfp4", **pair(torch.uint8, packing=2), **scales(torch.float8_e4m3fn, 16), **outer),
    }


@functools.cache
def routed_tokens(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, expert ids (top-k of random scores) and routing weights of `tokens` tokens (made once: every recording
    reads them)."""
    scores = torch.rand(tokens, MODEL.n_routed_experts, generator=torch.Generator().manual_seed(tokens))
    ids = scores.topk(MODEL.num_experts_per_tok).indices
    weights = torch.full(ids.shape, 1 / MODEL.num_experts_per_tok)
    return torch.empty(tokens, MODEL.hidden_size, dtype=torch.bfloat16), ids, weights


def routed_experts_calls(weights: dict[str, dict]) -> None:
    """The model's expert calls (`inkling2::routed_experts` -> `moe_forward`) at the batch sizes where `pick_config`
    changes its choice, every format; and, so that every kernel compiles, split K (`KernelConfig.split_k`) in both
    kernel families."""
    moe = moe_kernel()
    for tokens in MOE_TOKENS:
        x, ids, routing_weights = routed_tokens(tokens)
        for fmt_weights in weights.values():
            moe.moe_forward(x, ids, routing_weights, **fmt_weights)
        if tokens == 8:
            for fmt, register in (("mxfp8", False), ("nvfp4", True)):
                config = moe.pick_config(ids.numel(), MODEL.n_routed_experts, fmt, register_gemv=register)
                moe.moe_forward(x, ids, routing_weights, **weights[fmt], config=dataclasses.replace(config, split_k=2))


@functools.cache
def attention_inputs(queries: int, keys: int, *, padded: bool = False, prompt: bool = False) -> dict:
    """One layer's attention inputs at the model's head counts, bf16; prompts' relative logits in the layout the model
    writes for them (`aligned_product`). Made once (a bf16 product on the CPU takes seconds); never changed."""
    heads, kv_heads, dim = MODEL.num_attention_heads, MODEL.num_key_value_heads, MODEL.head_dim
    states = torch.zeros(1, heads, queries, MODEL.d_rel, dtype=torch.bfloat16)
    projection = torch.zeros(MODEL.d_rel, MODEL.rel_extent, dtype=torch.bfloat16)
    return dict(
        query=torch.empty(1, heads, queries, dim, dtype=torch.bfloat16),
        key=torch.empty(1, kv_heads, keys, dim, dtype=torch.bfloat16),
        value=torch.empty(1, kv_heads, keys, dim, dtype=torch.bfloat16),
        relative_logits=aligned_product(states, projection) if prompt else states @ projection,
        sinks=torch.empty(1, heads, queries, dtype=torch.bfloat16),
        query_positions=torch.arange(keys - queries, keys),
        key_positions=torch.arange(keys),
        key_padding=torch.ones(1, keys, dtype=torch.bool) if padded else None,
        scaling=MODEL.head_dim**-0.5,
    )


def attention_calls() -> None:
    """A prompt chunk through both layer kinds (`inkling2_triton_attention`), and the decode kernel as the caches
    call it: the static cache's sliding ring (with its key mask), a full layer's keys, the engine's pages, a DSpark
    verification step of 8 queries."""
    for window in (MODEL.sliding_window, None):
        inkling2_triton_attention(**attention_inputs(PROMPT_TOKENS, PROMPT_TOKENS, prompt=True), sliding_window=window)
    ring = MODEL.sliding_window - 1 + MAX_STEP_TOKENS
    inkling2_decode_attention(**attention_inputs(1, ring, padded=True), sliding_window=MODEL.sliding_window)
    inkling2_decode_attention(**attention_inputs(1, 4096), sliding_window=None)
    inkling2_decode_attention(**attention_inputs(8, ring, padded=True), sliding_window=MODEL.sliding_window)
    pages = torch.arange(16, dtype=torch.int32)[None]  # a row's pages in a pool of one 256-key page (never read)
    paged = dict(attention_inputs(1, 256), key_positions=torch.arange(16 * 256), query_positions=torch.tensor([4000]))
    inkling2_decode_attention(**paged, sliding_window=None, block_table=pages, page_size=256)
    step_calls(ring, pages)


def step_calls(ring: int, pages: torch.Tensor) -> None:
    """The fused decode step (`decode_kernel.decode_attention_step`) as the model's layers call it: a sliding layer's
    token and verification step over the ring, a full layer's token (with its log scale), a paged token."""
    from transformers_inkling2.backends.attention.decode_kernel import decode_attention_step

    heads, dim, d_rel = MODEL.num_attention_heads, MODEL.head_dim, MODEL.d_rel
    for queries, keys, window in ((1, ring, MODEL.sliding_window), (8, ring, MODEL.sliding_window), (1, 4096, None)):
        inputs = attention_inputs(queries, keys, padded=window is not None)
        step = dict(
            query_states=torch.empty(1, queries, heads, dim, dtype=torch.bfloat16),
            query_scale=torch.empty(heads, dim, dtype=torch.bfloat16),
            query_threshold=15.0,
            relative_states=torch.empty(1, queries, heads, d_rel, dtype=torch.bfloat16),
            relative_scale=torch.empty(heads, d_rel, dtype=torch.bfloat16),
            relative_threshold=15.0,
            bank=torch.empty(d_rel, MODEL.sliding_window if window else MODEL.rel_extent, dtype=torch.bfloat16),
            log_scale=None if window else torch.empty(1, queries),
            gate=torch.empty(1, queries, heads * dim, dtype=torch.bfloat16),
            **{name: inputs[name] for name in ("key", "value", "sinks", "key_positions", "key_padding")},
        )
        positions = inputs["query_positions"]
        decode_attention_step(**step, query_positions=positions, sliding_window=window, scaling=inputs["scaling"])
        if queries == 1 and window is None:
            paged = dict(step, key=inputs["key"][:, :, :256], value=inputs["value"][:, :, :256])
            decode_attention_step(**paged, query_positions=torch.tensor([4000]), sliding_window=None,
                                  scaling=inputs["scaling"], block_table=pages, page_size=256)  # fmt: skip


def convolution_calls() -> None:
    """A prompt's short convolutions over the key/value width and the hidden width, the context time-major as the
    cache joins it."""
    kernel_size = MODEL.conv_kernel_size
    for channels in (MODEL.num_key_value_heads * MODEL.head_dim, MODEL.hidden_size):
        context = torch.empty(1, PROMPT_TOKENS + kernel_size - 1, channels).transpose(1, 2)
        x = torch.empty(1, PROMPT_TOKENS, channels, dtype=torch.bfloat16)
        fused_prompt_convolution(context, x, torch.empty(channels, 1, kernel_size), math.sqrt(kernel_size + 1))


def step_convolution_calls() -> None:
    """A decode step's short convolution over the static cache's ring: one token with and without a padding mask, a
    DSpark verification step of 8 (`convolution_kernel.step_convolution`, as `fused_step_convolution` calls it), each
    also with a residual added, and from the top-8 experts' terms in one and in three parts (a decoder layer's end,
    `step_convolution`'s terms)."""
    from transformers_inkling2.backends.convolution_kernel import step_convolution

    kernel_size, channels = MODEL.conv_kernel_size, MODEL.hidden_size
    history = kernel_size - 1
    for tokens, mask in ((1, None), (1, torch.ones(1, 1, dtype=torch.int64)), (8, torch.ones(1, 8, dtype=torch.int64))):
        ring = torch.empty(1, channels, history + 8)
        slots = (torch.empty(history, dtype=torch.int64), torch.empty(history, dtype=torch.bool))
        x = torch.empty(1, tokens, channels, dtype=torch.bfloat16)
        weight = torch.empty(channels, kernel_size)
        step_convolution(x, mask, ring, *slots, torch.empty(tokens, dtype=torch.int64), weight, kernel_size**0.5)
        # a decoder layer's end, the partial block added (`residual_mix.fused_residual_step_convolution`)
        step_convolution(x, mask, ring, *slots, torch.empty(tokens, dtype=torch.int64), weight, kernel_size**0.5,
                         torch.empty(1, tokens, channels))  # fmt: skip
        for parts in (1, 3):
            terms = torch.empty(parts, tokens, MODEL.num_experts_per_tok, channels)
            ids = torch.empty(tokens, MODEL.num_experts_per_tok, dtype=torch.int64)
            step_convolution(x, mask, ring, *slots, torch.empty(tokens, dtype=torch.int64), weight, kernel_size**0.5,
                             torch.empty(1, tokens, channels), terms, ids, MODEL.n_routed_experts)  # fmt: skip


def key_value_step_calls() -> None:
    """A layer's step keys and values computed and cached (`key_value_kernel.key_value_step`, as
    `fused_key_value_step` calls it): one token with and without a padding mask, a DSpark verification step of 8; a
    sliding layer's (fp32 weights) and a full one's (bf16 static weights by lag, and per-token taps)."""
    from transformers_inkling2.backends.key_value_kernel import key_value_step

    kernel_size, kv_heads, head_dim = MODEL.conv_kernel_size, MODEL.swa_num_key_value_heads, MODEL.swa_head_dim
    width, history, slots = kv_heads * head_dim, kernel_size - 1, MODEL.sliding_window - 1 + MAX_STEP_TOKENS
    for tokens, mask in ((1, None), (1, torch.ones(1, 1, dtype=torch.int64)), (8, torch.ones(1, 8, dtype=torch.int64))):
        states = torch.empty(1, tokens, width, dtype=torch.bfloat16)
        rings = [torch.empty(1, width, history + MAX_STEP_TOKENS) for _ in range(2)]
        step = (torch.empty(history, dtype=torch.int64), torch.empty(history, dtype=torch.bool))
        cached = [torch.empty(1, kv_heads, slots, head_dim, dtype=torch.bfloat16) for _ in range(2)]
        ring_slots = torch.empty(tokens, dtype=torch.int64)
        full_layer = dict(key_taps=torch.empty(1, tokens, kv_heads * kernel_size, dtype=torch.bfloat16))
        full_layer["value_taps"] = full_layer["key_taps"]
        for weight_dtype, taps in ((torch.float32, {}), (torch.bfloat16, full_layer)):
            weights = [torch.empty(kernel_size, width, dtype=weight_dtype).T for _ in range(2)]
            key_value_step(states, states, mask, *rings, *step, ring_slots, *weights, math.sqrt(kernel_size + 1),
                           MODEL.qk_l2_clip_threshold, MODEL.rms_norm_eps, *cached,
                           torch.empty(1, slots, dtype=torch.bool), torch.empty(slots, dtype=torch.int64), ring_slots,
                           ring_slots, **taps)  # fmt: skip


def residual_mix_calls() -> None:
    """A decode step's attention-residual mixes (`residual_mix_kernel`, as `backends/residual_mix.py` calls it): before
    a sliding layer's attention (one query) with the fewest and the most completed blocks, before a full layer's
    (three queries) for one token and a DSpark verification step of 8; before the MoE with the post-attention
    convolution over the ring (one token with and without a padding mask, the partial block continued or restarted;
    8 tokens), and with the convolution's output given; and at a batch large enough for the wider chunk
    (`WIDE_FROM_ROWS`), before both sublayers."""
    from transformers_inkling2.backends.residual_mix_kernel import (
        WIDE_FROM_ROWS,
        residual_mix,
        residual_mix_after_sublayer,
    )

    hidden, kernel_size = MODEL.hidden_size, MODEL.conv_kernel_size
    most_blocks = MODEL.num_hidden_layers // MODEL.n_layers_per_attn_res_block
    norms = [torch.empty(hidden, dtype=torch.bfloat16) for _ in range(3)]
    wide = WIDE_FROM_ROWS

    def stream(batch: int, tokens: int, blocks: int) -> tuple:
        return torch.empty(batch, tokens, hidden), torch.empty(batch, tokens, blocks, hidden)

    mixes = ((1, 1, 1, 1), (1, 1, most_blocks, 1), (1, 1, most_blocks, 3), (1, 8, most_blocks, 3),
             (wide, 1, most_blocks, 1), (wide, 1, most_blocks, 3))  # (batch, tokens, blocks, queries)
    for batch, tokens, blocks, queries in mixes:
        for opens_block in (False, True):  # a layer that opens a block also stores the stack
            residual_mix(*stream(batch, tokens, blocks), torch.empty(queries, hidden), norms[:queries],
                         MODEL.rms_norm_eps, torch.bfloat16, opens_block)  # fmt: skip
    history = kernel_size - 1
    after_sublayer = ((1, 1, False, True, True), (1, 1, True, True, True), (1, 1, False, False, True),
                      (1, 8, True, True, True), (1, 1, False, True, False), (wide, 1, True, True, True))
    for batch, tokens, mask, continued, convolved in after_sublayer:
        partial, blocks = stream(batch, tokens, most_blocks)
        output = torch.empty(batch, tokens, hidden, dtype=torch.bfloat16)
        ring = (
            (torch.empty(batch, hidden, history + 8), torch.empty(history, dtype=torch.int64),
             torch.empty(history, dtype=torch.bool), torch.empty(tokens, dtype=torch.int64),
             torch.empty(hidden, kernel_size))
            if convolved else (None,) * 5
        )  # fmt: skip
        residual_mix_after_sublayer(
            partial if continued else None, output,
            torch.ones(batch, tokens, dtype=torch.bool) if mask else None, *ring, math.sqrt(kernel_size + 1), blocks,
            torch.empty(1, hidden), norms[:1], MODEL.rms_norm_eps, torch.bfloat16,
        )  # fmt: skip


def router_calls() -> None:
    """A decode step's router (`router_kernel.top_k_routing`), one and 16 rows."""
    from transformers_inkling2.backends.router_kernel import top_k_routing

    experts, hidden = MODEL.n_routed_experts, MODEL.hidden_size
    for rows in (1, 16):
        x = torch.empty(rows, hidden, dtype=torch.bfloat16)
        top_k_routing(x, torch.empty(experts, hidden), torch.empty(experts), MODEL.num_experts_per_tok, 2.5)


def projection_calls() -> None:
    """A decode step's six input projections of a sliding layer, one and 16 rows (the kernel's row range), at full
    width (`TILE`) and with a quarter of the heads, as one GPU of TP4 has them (`DEEP_TILE`)."""
    from transformers_inkling2.backends.projection_kernel import grouped_projections

    hidden = MODEL.hidden_size
    for ranks in (1, 4):
        heads, kv_heads = MODEL.swa_num_attention_heads // ranks, MODEL.swa_num_key_value_heads // ranks
        widths = [heads * MODEL.head_dim] * 2 + [heads * MODEL.d_rel, heads] + [kv_heads * MODEL.head_dim] * 2
        for rows in (1, 16):
            x = torch.empty(rows, hidden, dtype=torch.bfloat16)
            grouped_projections([x] * 6, [torch.empty(n, hidden, dtype=torch.bfloat16) for n in widths])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[tuple[int, int], tuple[list[Launch], set[str]]]:
    """Per GPU generation, for the model's calls: the kernel launches, and the expert formats that took the hub
    kernel's PyTorch reference (stubbed: on sparse weights it would read gigabytes of zeros)."""
    weights = expert_weights(tmp_path_factory.mktemp("experts"))
    result = {}
    for capability in (AMPERE, HOPPER, BLACKWELL, BLACKWELL_ULTRA, RTX_BLACKWELL):
        reference = mock.Mock(side_effect=lambda x, *args, **kwargs: torch.empty_like(x))
        with on_gpu(capability) as launches, mock.patch.object(moe_kernel().ops, "moe_forward_reference", reference):
            routed_experts_calls(weights)
            attention_calls()
            convolution_calls()
            step_convolution_calls()
            key_value_step_calls()
            residual_mix_calls()
            projection_calls()
            router_calls()
        result[capability] = launches, {call.args[5] for call in reference.call_args_list}
    return result


@pytest.fixture(scope="module")
def launches(recorded) -> dict[tuple[int, int], list[Launch]]:
    return {capability: launches for capability, (launches, _) in recorded.items()}


@pytest.fixture(scope="module")
def compiled(launches):
    """`compiled(arch)`: the kernels compiled for a target of COMPILED_ON, compiled on first use."""
    return functools.cache(lambda arch: compile_for(arch, launches[COMPILED_ON[arch]]))


def every_kernel() -> set[str]:
    """`module.function` of every kernel (a `*_kernel` function under `triton.jit` / `gluon.jit`) in the package's and
    the hub kernel's sources, read from the files: a kernel added anywhere there is expected here."""
    sources = [*PACKAGE_SOURCES.rglob("*.py"), *(CHECKOUT_KERNEL / "torch-ext").rglob("*.py")]
    return {f"{path.stem}.{name}" for path in sources for name in KERNEL_DEFINITION.findall(path.read_text())}


def hopper_only(compiled_for_hopper: dict[str, list], launches: list[Launch]) -> set[str]:
    """Gluon kernels whose sm_90a code holds wgmma: Gluon fixes the MMA instruction in the source (Triton kernels are
    lowered again for each target), and wgmma exists only on sm_90a."""
    gluon = {launch.name for launch in launches if launch.kernel.is_gluon()}
    return {name for name in gluon if any("wgmma" in kernel.asm["ptx"] for kernel in compiled_for_hopper[name])}


def names(launches: list[Launch]) -> set[str]:
    return {launch.name for launch in launches}


def signature(launches: list[Launch]) -> set[tuple]:
    """What a list of launches compiles to, target aside: kernel and constexpr / option values."""
    return {(launch.name, tuple(sorted((key, repr(value)) for key, value in launch.options.items())))
            for launch in launches}  # fmt: skip


# --- tests ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(COMPILED_ON))
def test_every_kernel_compiles_to_a_cubin_for_hopper_and_blackwell(compiled, launches, arch):
    hopper = hopper_only(compiled(90), launches[HOPPER]) if arch != 90 else set()
    assert not hopper & names(launches[COMPILED_ON[arch]])  # checked first: LLVM aborts on wgmma for other targets
    kernels = compiled(arch)
    assert set(kernels) == every_kernel() - hopper
    assert all(kernel.asm["cubin"] for specializations in kernels.values() for kernel in specializations)
    target = f"sm_{arch}a"
    assert all(f".target {target}" in k.asm["ptx"] for specializations in kernels.values() for k in specializations)
    count = sum(map(len, kernels.values()))
    mma = collections.Counter(m for ks in kernels.values() for k in ks for m in set(MMA.findall(k.asm["ptx"])))
    print(f"\n{target}: {len(kernels)} kernels, {count} specializations compiled to cubin; MMA kinds: {dict(mma)}")
    for name in sorted(kernels):
        print(f"  {name}: {len(kernels[name])}")


def test_hopper_only_kernels_run_on_hopper_and_never_on_blackwell(compiled, launches):
    hopper = hopper_only(compiled(90), launches[HOPPER])
    assert hopper == {"prefill_gluon._sliding_prefill_kernel"}
    assert hopper <= names(launches[HOPPER])  # the check below is not vacuous
    for capability in (BLACKWELL, BLACKWELL_ULTRA, RTX_BLACKWELL, AMPERE):
        assert not hopper & names(launches[capability]), capability


def test_the_projections_launch_both_tiles(launches):
    """The full-width layer's projections take `TILE`, the TP4-shaped layer's (a grid of at most one program per SM)
    `DEEP_TILE`: both are among the kernels compiled above."""
    from transformers_inkling2.backends.projection_kernel import DEEP_TILE, TILE

    for capability in (HOPPER, BLACKWELL):
        tiles = {(launch.options["BLOCK_N"], launch.options["BLOCK_K"], launch.options["num_warps"],
                  launch.options["STAGES"]) for launch in launches[capability]
                 if launch.name == "projection_kernel._grouped_kernel"}  # fmt: skip
        assert tiles == {TILE, DEEP_TILE}, (capability, tiles)


def test_blackwell_generations_launch_the_same_kernels_as_b200(launches):
    """B300 / GB300 (10.3) and RTX Blackwell (12.0) take exactly what the compiled B200 (10.0) set holds."""
    for capability in (BLACKWELL_ULTRA, RTX_BLACKWELL):
        assert signature(launches[capability]) == signature(launches[BLACKWELL]), capability


def test_blackwell_takes_the_register_kernels_and_the_triton_prefill(launches):
    """The decode GEMMs of NVFP4 / MXFP8 in Gluon (mma.sync, compiled above for sm_100a), and sliding prompts through
    the Triton prefill kernel, which Hopper replaces by its Gluon one."""
    register_kernels = {"register_kernels._gate_up_kernel", "register_kernels._down_kernel"}
    assert register_kernels <= names(launches[BLACKWELL]) & names(launches[HOPPER])

    def prefill_windows(capability):
        return {launch.options["HAS_WINDOW"] for launch in launches[capability]
                if launch.name == "prefill_kernel._prefill_kernel"}  # fmt: skip

    assert prefill_windows(BLACKWELL) == {True, False} and prefill_windows(HOPPER) == {False}


def test_only_ampere_runs_quantized_experts_through_the_reference(recorded):
    """A100 (8.0) has no E4M3 conversions, which every NVFP4 / MXFP8 kernel decodes through: those formats take the
    PyTorch reference there (no Triton / Gluon launch of theirs), BF16 experts and attention the Triton kernels. From
    8.9 on, every format runs the kernels."""
    ampere, to_reference = recorded[AMPERE]
    assert to_reference == {"mxfp8", "nvfp4"}
    assert not any(launch.name.startswith("register_kernels.") for launch in ampere)
    assert {launch.options["FMT"] for launch in ampere if launch.name == "triton_kernels._gate_up_kernel"} == {0}
    assert {"prefill_kernel._prefill_kernel", "decode_kernel._decode_partial_kernel"} <= names(ampere)
    for capability in (HOPPER, BLACKWELL, BLACKWELL_ULTRA, RTX_BLACKWELL):
        assert recorded[capability][1] == set(), capability


DECODE_STEP_KERNELS = {
    "projection_kernel._grouped_kernel",
    "router_kernel._partial_logits_kernel",
    "router_kernel._top_k_kernel",
    "convolution_kernel._step_convolution_kernel",
    "key_value_kernel._key_value_step_kernel",
    "residual_mix_kernel._mix_statistics_kernel",
    "residual_mix_kernel._mix_kernel",
    "decode_kernel._decode_partial_kernel",
    "decode_kernel._decode_merge_kernel",
}


def test_the_decode_steps_kernels_launch_dependent_from_hopper_on(compiled, launches):
    """Programmatic dependent launch (`backends.dependent_launch`): from compute capability 9.0 the decode step's
    kernels launch with it and their code waits for the previous kernel (`griddepcontrol.wait`); on Ampere they launch
    plainly, and the waits are compiled out."""
    for capability in (HOPPER, BLACKWELL, BLACKWELL_ULTRA, RTX_BLACKWELL, AMPERE):
        step = [launch for launch in launches[capability] if launch.name in DECODE_STEP_KERNELS]
        assert names(step) == DECODE_STEP_KERNELS, capability
        dependent = capability >= HOPPER
        assert {(launch.options["PDL"], launch.options["launch_pdl"]) for launch in step} == {(dependent, dependent)}
    for arch in sorted(COMPILED_ON):
        for name in DECODE_STEP_KERNELS:
            assert all("griddepcontrol.wait" in kernel.asm["ptx"] for kernel in compiled(arch)[name]), (arch, name)


# SASS of `cuobjdump -sass`: an instruction's address, a branch (predicated or not) and its target, a local-memory
# load or store; `cuobjdump --dump-resource-usage`: the registers
INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+\S")
BRANCH = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")
LOCAL_ACCESS = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?(?:LDL|STL)\b")
REGISTERS = re.compile(r"\bREG:(\d+)")


@dataclasses.dataclass
class SassReading:
    """What a cubin's SASS says of a kernel's register use. Loops: the address ranges from a backward branch's target
    to the branch."""

    registers: int
    local_accesses: int  # loads and stores of spilled registers, anywhere
    local_accesses_in_loops: int
    longest_loop: int  # instructions


def read_sass(cubin: bytes, folder: Path) -> SassReading:
    """The cubin read with Triton's bundled cuobjdump (no GPU)."""
    path = folder / "kernel.cubin"
    path.write_bytes(cubin)

    def cuobjdump(option: str) -> str:
        command = [knobs.nvidia.cuobjdump.path, option, str(path)]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout

    sass = cuobjdump("-sass")
    loops = [(int(target, 16), int(at, 16)) for at, target in BRANCH.findall(sass) if int(target, 16) < int(at, 16)]
    accesses = [int(at, 16) for at in LOCAL_ACCESS.findall(sass)]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0], default=(0, -1))
    return SassReading(
        registers=int(REGISTERS.search(cuobjdump("--dump-resource-usage")).group(1)),
        local_accesses=len(accesses),
        local_accesses_in_loops=sum(any(first <= at <= last for first, last in loops) for at in accesses),
        longest_loop=sum(start <= int(at, 16) <= end for at in INSTRUCTION.findall(sass)),
    )


def test_sass_reading_finds_spills_inside_loops(tmp_path):
    """The reading above on a kernel that spills on purpose (a [128, 128] fp32 tile carried through a loop by one
    warp: 512 values a thread, more than a thread's registers), and on one that does not."""

    @triton.jit
    def carried_tile_kernel(x_ptr, steps, N: tl.constexpr):
        offsets = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
        tile = tl.load(x_ptr + offsets)
        for _ in range(steps):
            tile = tile * tile + 1.0
        tl.store(x_ptr + offsets, tile)

    def compiled(size: int) -> bytes:
        source = ASTSource(carried_tile_kernel, {"x_ptr": "*fp32", "steps": "i32", "N": "constexpr"}, {"N": size})
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1)).asm["cubin"]

    spilling, fitting = read_sass(compiled(128), tmp_path), read_sass(compiled(16), tmp_path)
    assert spilling.local_accesses_in_loops > 0 and spilling.registers > 0 and spilling.longest_loop > 0
    assert fitting.local_accesses == 0 and fitting.registers > 0 and fitting.longest_loop > 0


def constants(kernel) -> dict:
    """A compiled kernel's constexprs (and the arguments Triton specialized as constants), strides left out."""
    names = kernel.src.fn.arg_names
    values = {names[key[0]]: value for key, value in kernel.src.constants.items() if value is not None}
    return {name: value for name, value in values.items() if not name.startswith("stride")}


def specialization(kernel) -> str:
    return f"{constants(kernel)}, {kernel.metadata.num_warps} warps"


def known_loop_spill(arch: int, name: str, kernel) -> bool:
    """The one specialization whose loop spills, known and not changed (docs/kernels.md, "Register spills"): the MXFP8
    Triton gate/up GEMM at prefill sizes (128-row tiles, 4 warps) on sm_100a. Unmeasured on a Blackwell GPU."""
    mxfp8 = 1  # the hub kernel's `triton_kernels.FMT_MXFP8`
    values = constants(kernel)
    fmt, rows = values.get("FMT"), values.get("BM")
    return (arch, name, fmt, rows, kernel.metadata.num_warps) == (100, "triton_kernels._gate_up_kernel", mxfp8, 128, 4)


@pytest.mark.parametrize("arch", sorted(COMPILED_ON))
def test_kernels_keep_their_loops_in_registers(compiled, arch, tmp_path):
    """A register spilled inside a loop adds a local-memory round trip to every iteration; a decode step's kernels
    take a few microseconds each. (The fused attention step spilled, before its relative bias took one gather per
    query and an MMA: 255 registers and up to 2,573 local accesses per kernel.) Every specialization the dispatch
    launches on the model's sizes, decode and prefill, but the known one. `pytest -s` prints each reading
    (docs/kernels.md)."""
    print(f"\nsm_{arch}a: registers, local accesses (in loops), instructions in the longest loop")
    spilling, known = [], []
    for name, kernels in sorted(compiled(arch).items()):
        for kernel in kernels:
            reading, described = read_sass(kernel.asm["cubin"], tmp_path), specialization(kernel)
            print(f"  {name} {described}: {reading.registers}, {reading.local_accesses} "
                  f"({reading.local_accesses_in_loops}), {reading.longest_loop}")  # fmt: skip
            if reading.local_accesses_in_loops:
                (known if known_loop_spill(arch, name, kernel) else spilling).append((name, described))
    assert not spilling
    assert len(known) == (arch == 100)  # still there: when it goes, so does the exception
