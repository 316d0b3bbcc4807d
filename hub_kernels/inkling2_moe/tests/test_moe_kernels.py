"""The `inkling2_moe` hub kernel: loading, references, Triton kernels.

* CPU: the build loads through `kernels.get_local_kernel`; its dequantizers agree bit for bit with the tests'
  format oracle (`moe_format_oracle.py`, written from the formats' bit rules); the routing is a stable grouping with
  consistent offsets and tiles; `moe_forward_reference` matches a naive per-token float64 oracle built on the
  format oracle; results are bitwise reproducible; the layer face calls the op.
* Triton interpreter (when triton is installed; a subprocess, since TRITON_INTERPRET is read at import):
  routing kernels equal the reference exactly; the expert kernels in their fp32-dot variant (the
  interpreter's bf16 dot and bf16 arithmetic are unreliable) match an oracle that emulates the
  interpreter's truncating bf16 casts.
* GPU (`-m gpu`, needs CUDA): full Inkling-2-Small size (E=384, H=4608, I=2304, top-8) for T in
  (1, 8, 64, 2048, 8192) and all three formats against a dequantize-then-matmul oracle, determinism,
  routing equality, CUDA-graph capture; the NVFP4 / MXFP8 register-GEMV kernels (the decode default on Hopper)
  against the Triton kernels and the oracle, with K splits, dropped ids and small shapes.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import moe_format_oracle as qf
import pytest
import torch
from moe_kernel_helpers import (
    FORMATS,
    KERNEL_DIR,
    VARIANT_DIR,
    kwargs_of,
    load_kernel,
    naive_oracle,
    needs_triton,
    oracle_dequant,
    quantized_weights,
    random_byte_weights,
    realistic_routing,
    rel_err,
    run_under_triton_interpreter,
    softcap,
)


@pytest.fixture(scope="module")
def km():
    return load_kernel()


# ------------------------------------------------------------------------------------------ packaging


def test_kernel_loads_through_kernels_package():
    kernels = pytest.importorskip("kernels")
    from kernels._rust import Backend, Build, Metadata

    module = kernels.get_local_kernel(KERNEL_DIR)
    assert Path(module.__file__).resolve().parent.parent == VARIANT_DIR  # the build, this torch's variant
    for name in ("route", "moe_forward", "route_reference", "moe_forward_reference", "dequantize_reference",
                 "layers"):
        assert hasattr(module, name), name
    assert hasattr(module.layers, "Inkling2MoE")
    meta = Metadata.read_from_file(VARIANT_DIR / "metadata.json")
    assert meta.name.python_name == "inkling2_moe" and meta.version == 1 and meta.python_depends == []
    assert meta.backend.backend_type == (Backend.CUDA if torch.version.cuda else Backend.CPU)
    Build.open(KERNEL_DIR)  # build.toml parses and validates
    assert "triton" not in json.loads((VARIANT_DIR / "metadata.json").read_text())["python-depends"]


def test_layer_is_a_valid_kernels_layer(km):
    """The check `kernels` runs on a hub layer before swapping it in (a private function: kernels 0.19 moved it)."""
    pytest.importorskip("kernels")
    try:
        from kernels._internals.layer.layer import _validate_layer
    except ImportError:  # kernels < 0.19
        from kernels.layer.layer import _validate_layer
    from torch import nn

    class Experts(nn.Module):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError

    _validate_layer(check_cls=Experts, cls=km.layers.Inkling2MoE, repo="local")


def test_kernelize_swaps_in_the_layer():
    """The documented route into a model: `use_kernel_forward_from_hub` + a local layer repository."""
    kernels = pytest.importorskip("kernels")
    from torch import nn

    @kernels.use_kernel_forward_from_hub("Inkling2MoE")
    class Experts(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.gate_up_proj, self.down_proj = w["w13"], w["w2"]
            self.gate_cap, self.up_cap = 4.0, 25.0

        def kernel_weights(self):
            return dict(w13=self.gate_up_proj, w2=self.down_proj, fmt="bf16")

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return torch.zeros_like(hidden_states)

    gen = torch.Generator().manual_seed(8)
    w = quantized_weights("bf16", 4, 64, 32, gen)
    repo = kernels.LocalLayerRepository(repo_path=KERNEL_DIR, layer_name="Inkling2MoE")
    with kernels.use_kernel_mapping({"Inkling2MoE": {"cpu": repo}}):
        module = kernels.kernelize(Experts(w), mode=kernels.Mode.INFERENCE, device="cpu")
    x = torch.randn(3, 64, generator=gen).bfloat16()
    ids, rw = realistic_routing(3, 4, 2, gen)
    expected = load_kernel().moe_forward_reference(x, ids, rw, w["w13"], w["w2"], "bf16")
    assert torch.equal(module(x, ids, rw), expected)


# ------------------------------------------------------------------------------------------ references


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("style", ["quantized", "random_bytes"])
def test_dequantize_reference_matches_the_format_oracle(km, fmt, style):
    gen = torch.Generator().manual_seed(1)
    make = quantized_weights if style == "quantized" else random_byte_weights
    w = make(fmt, 3, 64, 32, gen)
    for which, halves in (("w13", 2), ("w2", 1)):
        ours = km.dequantize_reference(fmt, w[which], w[f"{which}_scale"], w.get(f"{which}_outer"), halves=halves)
        assert torch.equal(ours, oracle_dequant(fmt, w, which)), which


@pytest.mark.parametrize("outer_shape", ["[E]", "[E,1]", "[E,2]"])
def test_nvfp4_outer_multiplier_shapes(km, outer_shape):
    gen = torch.Generator().manual_seed(2)
    w = quantized_weights("nvfp4", 4, 32, 16, gen, per_half=outer_shape == "[E,2]")
    outer = w["w13_outer"]
    if outer_shape == "[E,1]":
        outer = outer[:, None]
    ours = km.dequantize_reference("nvfp4", w["w13"], w["w13_scale"], outer, halves=2)
    ref = qf.nvfp4_dequantize(w["w13"], w["w13_scale"], outer)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [(1, 8, 2, 16), (13, 8, 3, 16), (200, 16, 4, 64),
                                                               (37, 384, 8, 16), (29, 16, 4, 8)])
def test_route_reference_properties(km, tokens, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(3)
    ids, _ = realistic_routing(tokens, num_experts, top_k, gen)
    ids[0, -1] = -1  # dropped slot (expert parallelism: not on this rank)
    r = km.route_reference(ids, num_experts, block_m)
    s = tokens * top_k
    flat = ids.reshape(-1)
    sorted_slots = r.sorted_slots.long()
    assert torch.equal(torch.sort(sorted_slots).values, torch.arange(s))  # a permutation
    assert torch.equal(r.slot_position.long()[sorted_slots], torch.arange(s))  # and its inverse
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)[sorted_slots]
    assert bool((key[1:] >= key[:-1]).all())  # grouped by expert
    same = key[1:] == key[:-1]
    assert bool((sorted_slots[1:][same] > sorted_slots[:-1][same]).all())  # stable: slot order inside
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    assert torch.equal(r.expert_offsets.long()[1:] - r.expert_offsets.long()[:-1], counts)
    assert int(r.expert_offsets[-1]) == s - 1
    # every routed sorted position lies in exactly one tile of its own expert
    assert r.tile_expert.numel() == km.max_tiles(s, num_experts, block_m) == -(-s // block_m) + min(num_experts, s)
    covered = torch.zeros(s, dtype=torch.long)
    for e, start in zip(r.tile_expert.tolist(), r.tile_start.tolist()):
        if e < 0:
            continue
        end = min(start + block_m, int(r.expert_offsets[e + 1]))
        assert int(r.expert_offsets[e]) <= start < end
        covered[start:end] += 1
    assert torch.equal(covered[: s - 1], torch.ones(s - 1, dtype=torch.long)) and covered[s - 1] == 0
    valid = r.tile_expert >= 0
    assert bool(valid[: int(valid.sum())].all())  # valid tiles first


def test_softcapped_swiglu_reference(km):
    g = torch.linspace(-40, 40, 801)
    u = torch.linspace(60, -60, 801)
    expected = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)  # sigmoid of the raw gate
    torch.testing.assert_close(km.softcapped_swiglu_reference(g, u), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_forward_reference_matches_naive_oracle(km, fmt):
    gen = torch.Generator().manual_seed(4)
    num_experts, hidden, inter, tokens, top_k = 8, 64, 32, 9, 3
    w = quantized_weights(fmt, num_experts, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids, rw = realistic_routing(tokens, num_experts, top_k, gen)
    ids[2, 1] = -1  # dropped
    out = km.moe_forward_reference(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    expected = naive_oracle(x, ids, rw, w, fmt)
    assert rel_err(out, expected) < 2e-3
    # the public op dispatches to the reference on CPU
    assert torch.equal(km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w)), out)


def test_moe_forward_without_the_combine_returns_its_terms(km):
    gen = torch.Generator().manual_seed(7)
    w = quantized_weights("nvfp4", 6, 64, 32, gen)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    ids, rw = realistic_routing(5, 6, 3, gen)
    ids[1, 2] = 9  # dropped
    rows = km.moe_forward(x, ids, rw, w["w13"], w["w2"], "nvfp4", **kwargs_of(w), combine=False)
    assert rows.shape == (1, 5, 3, 64) and rows.dtype == torch.float32
    assert km.slot_output_parts(x, ids, w["w13"], w["w2"], "nvfp4") == 1  # the reference path: one part
    assert torch.count_nonzero(rows[0, 1, 2]) == 0 and torch.count_nonzero(rows[0, 1, 1]) > 0
    total = rows[0, :, 0] + rows[0, :, 1] + rows[0, :, 2]  # slot order, as the sum
    assert torch.equal(total.bfloat16(), km.moe_forward(x, ids, rw, w["w13"], w["w2"], "nvfp4", **kwargs_of(w)))
    with pytest.raises(ValueError, match="combine=False"):
        km.moe_forward(x, ids, rw, w["w13"], w["w2"], "nvfp4", **kwargs_of(w), combine=False, out=torch.empty_like(x))


def test_moe_forward_reference_is_deterministic(km):
    gen = torch.Generator().manual_seed(5)
    w = random_byte_weights("nvfp4", 6, 64, 32, gen)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    ids, rw = realistic_routing(5, 6, 2, gen)
    a = km.moe_forward(x, ids, rw, w["w13"], w["w2"], "nvfp4", **kwargs_of(w))
    b = km.moe_forward(x, ids, rw, w["w13"], w["w2"], "nvfp4", **kwargs_of(w))
    assert torch.equal(a, b)
    assert rel_err(a, naive_oracle(x, ids, rw, w, "nvfp4")) < 2e-3


def test_layer_forward_calls_the_op(km):
    gen = torch.Generator().manual_seed(6)
    w = quantized_weights("mxfp8", 4, 64, 32, gen)
    layer = km.layers.Inkling2MoE()  # stands in for the module `kernelize` binds it to
    layer.kernel_weights = lambda: dict(fmt="mxfp8", **w)
    layer.gate_cap, layer.up_cap = 3.0, 20.0
    x = torch.randn(2, 3, 64, generator=gen).bfloat16()
    ids, rw = realistic_routing(6, 4, 2, gen)
    out = layer(x, ids, rw)
    expected = km.moe_forward_reference(x.reshape(6, 64), ids, rw, w["w13"], w["w2"], "mxfp8", **kwargs_of(w),
                                        gate_cap=3.0, up_cap=20.0)
    assert torch.equal(out, expected.reshape(2, 3, 64))


def test_routing_is_graph_sized(km):
    """Sizes of every routing tensor depend on (slots, experts, block_m) only."""
    gen = torch.Generator().manual_seed(7)
    a = km.route_reference(torch.zeros(16, 8, dtype=torch.long), 384, 16)  # all on one expert
    ids, _ = realistic_routing(16, 384, 8, gen)
    b = km.route_reference(ids, 384, 16)
    for f in ("sorted_slots", "slot_position", "expert_offsets", "tile_expert", "tile_start"):
        assert getattr(a, f).shape == getattr(b, f).shape, f


def test_pick_config_sends_only_quantized_decode_to_the_register_kernels(km):
    assert km.pick_config(8, 384, "nvfp4", register_gemv=True).register_gemv
    assert km.pick_config(8, 384, "nvfp4", register_gemv=True).block_m == 8  # one routing tile per program
    assert not km.pick_config(8, 384, "nvfp4").register_gemv  # device or shapes do not allow them
    assert km.pick_config(8, 384, "mxfp8", register_gemv=True).register_gemv
    assert not km.pick_config(8, 384, "bf16", register_gemv=True).register_gemv
    assert km.pick_config(64 * 8, 384, "nvfp4", register_gemv=True).register_gemv
    assert km.pick_config(64 * 8, 384, "mxfp8", register_gemv=True).register_gemv
    assert not km.pick_config(96 * 8, 384, "mxfp8", register_gemv=True).register_gemv  # Triton is faster there
    assert not km.pick_config(256 * 8, 384, "nvfp4", register_gemv=True).register_gemv  # ~10 slots per expert
    assert not km.pick_config(8192 * 8, 384, "nvfp4", register_gemv=True).register_gemv  # prefill


def test_pick_config_splits_the_register_reductions_where_the_grid_leaves_sms_idle(km):
    """One token's 2 of 96 experts (one GPU's share at TP4/EP4) make a gate/up grid of 144 programs; split 7 ways it
    still fits one wave of an H200 (132 SMs x 8), so the reductions split (gate/up 6 of its 18 steps, down 3 of 9).
    8 of 384 experts (576 programs) or 16 of 96 already fill the wave and stay whole."""
    h200 = dict(register_gemv=True, inter=2304, multiprocessors=132)
    sparse = km.pick_config(2, 96, "nvfp4", **h200)
    assert sparse.register_gemv and sparse.split_k == 7
    steps = (4608 // 256, 2304 // 256)  # 256-input steps of the gate/up and the down reduction
    assert [km.ops._steps_split(n, sparse.split_k) for n in steps] == [6, 3]
    assert km.pick_config(2, 96, "mxfp8", **h200).split_k == 7
    assert km.pick_config(8, 384, "nvfp4", **h200).split_k == 1
    assert km.pick_config(16, 96, "nvfp4", **h200).split_k == 1
    assert km.pick_config(2, 96, "nvfp4", register_gemv=True).split_k == 1  # the GPU's size not given
    assert km.pick_config(2, 96, "nvfp4", **{**h200, "multiprocessors": 264}).split_k == 14  # a GPU twice the size
    assert km.pick_config(0, 0, "nvfp4", **h200).register_gemv  # no slots, no experts: still a valid config


# ------------------------------------------------------------------------------------------ interpreter

_INTERPRETER_SCRIPT = textwrap.dedent(
    r"""
    import json, sys
    import torch

    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    import inkling2_moe as km
    from inkling2_moe import ops
    import moe_kernel_helpers as t

    results = {}
    gen = torch.Generator().manual_seed(11)
    # pairwise ranks in one launch with the tiles (<= 64 slots: the first three), in two (<= 2048; the last with
    # more programs than experts), then histograms (> 2048)
    for tokens, experts, top_k, bm in [(3, 8, 2, 16), (1, 384, 8, 8), (8, 384, 8, 8), (40, 16, 8, 16),
                                       (77, 384, 8, 16), (300, 16, 2, 64), (1000, 8, 2, 16), (300, 16, 8, 16),
                                       (40, 384, 8, 8)]:
        ids, _ = t.realistic_routing(tokens, experts, top_k, gen)
        ids[0, 0] = -1
        a, b = km.route_reference(ids, experts, bm), ops._route_triton(ids, experts, bm)
        results[f"route {tokens}x{top_k} E{experts} bm{bm}"] = all(
            torch.equal(getattr(a, f), getattr(b, f))
            for f in ("sorted_slots", "slot_position", "expert_offsets", "tile_expert", "tile_start"))

    # a decode-size NVFP4 call routes and converts x in one launch (`_route_and_convert_kernel`): the same routing as
    # the reference, the same f16 rows and scales as the conversion kernel alone (token 2 beyond f16 range)
    x = (torch.randn(5, 256, generator=gen) * torch.tensor([1.0, 1.0, 2.0**20, 1.0, 1.0])[:, None]).bfloat16()
    ids, _ = t.realistic_routing(5, 16, 4, gen)
    ids[1, 2] = -1
    cfg = km.pick_config(ids.numel(), 16, "nvfp4")
    tickets = torch.full((1500,), 7, dtype=torch.int32)  # the split register GEMM's counters, which it zeroes
    routing, x_in, x_scale, _, zeroed = ops._routing_and_inputs(x, ids, None, 16, 64, "nvfp4", cfg, x, tickets)
    a = km.route_reference(ids, 16, cfg.block_m)
    x16, xs = torch.empty(5, 256, dtype=torch.float16), torch.empty(5)
    ops._kernels()._x_to_f16_kernel[(5,)](x, x.stride(0), x16, xs, 256, DEINTERLEAVE=True, BLOCK=256)
    results["route and convert in one launch"] = (
        all(torch.equal(getattr(a, f), getattr(routing, f))
            for f in ("sorted_slots", "slot_position", "expert_offsets", "tile_expert", "tile_start"))
        and torch.equal(x_in, x16) and torch.equal(x_scale, xs) and bool(xs[2] > 1)
        and zeroed is tickets and not tickets.any())

    def trunc_bf16(v):  # the interpreter casts fp32 -> bf16 by truncation
        return (v.float().contiguous().view(torch.int32) & -65536).view(torch.float32)

    def oracle(x, ids, rw, w, fmt):
        w13 = t.oracle_dequant(fmt, w, "w13", torch.float32).double()
        w2 = t.oracle_dequant(fmt, w, "w2", torch.float32).double()
        inter = w2.shape[-1]
        y = torch.zeros(x.shape, dtype=torch.float64)
        for i in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[i, j])
                if e < 0:
                    continue
                h = w13[e] @ x[i].double()
                g, u = h[:inter], h[inter:]
                act = trunc_bf16(t.softcap(g, 4.0) * torch.sigmoid(g) * t.softcap(u, 25.0)).double()
                y[i] += float(rw[i, j]) * (w2[e] @ act)
        return trunc_bf16(y)

    configs = [None, km.KernelConfig(16, 16, 16, 32, 4, 1), km.KernelConfig(32, 32, 64, 64, 4, 1),
               km.KernelConfig(16, 32, 32, 32, 4, 1, split_k=2)]
    for fmt in ("bf16", "mxfp8", "nvfp4"):
        w = t.quantized_weights(fmt, 8, 128, 64, gen)
        x = torch.randn(11, 128, generator=gen)
        x[4] *= 2.0 ** 20  # beyond f16 range: the NVFP4 path must rescale this token
        x = x.bfloat16()
        ids, rw = t.realistic_routing(11, 8, 2, gen)
        ids[3, 1] = -1
        ref = oracle(x, ids, rw, w, fmt)
        for cfg in configs:
            poison = torch.full((11, 128), float("nan"), dtype=torch.bfloat16)
            out = ops._moe_forward_triton(x, ids, rw, w["w13"], w["w2"], fmt, w.get("w13_scale"),
                                          w.get("w2_scale"), w.get("w13_outer"), w.get("w2_outer"), 4.0, 25.0,
                                          None, cfg, poison)
            results[f"moe {fmt} {cfg}"] = t.rel_err(out, ref)
            # without the combine: the slots' rows, which added in its order give its output bit for bit
            rows = ops._moe_forward_triton(x, ids, rw, w["w13"], w["w2"], fmt, w.get("w13_scale"),
                                           w.get("w2_scale"), w.get("w13_outer"), w.get("w2_outer"), 4.0, 25.0,
                                           None, cfg, combine=False)
            total = torch.zeros(11, 128)
            for j in range(ids.shape[1]):
                routed = ((ids[:, j] >= 0) & (ids[:, j] < 8))[:, None]
                for part in range(rows.shape[0]):
                    total = total + torch.where(routed, rows[part, :, j], 0.0)
            results[f"rows {fmt} {cfg}"] = (trunc_bf16(total) - out.float()).abs().max().item()
    print(json.dumps(results))
    """
)


@needs_triton
def test_triton_kernels_under_interpreter():
    results = run_under_triton_interpreter(_INTERPRETER_SCRIPT, str(VARIANT_DIR), str(Path(__file__).parent))
    for name, value in results.items():
        if name.startswith("route"):
            assert value is True, name
        elif name.startswith("rows"):
            assert value == 0.0, (name, value)
        else:
            assert value < 1e-4, (name, value)


# ------------------------------------------------------------------------------------------ GPU

FULL = dict(num_experts=384, hidden=4608, inter=2304, top_k=8)
_GPU_WEIGHTS: dict = {}


def full_size_weights(fmt):
    if fmt not in _GPU_WEIGHTS:
        _GPU_WEIGHTS.clear()
        torch.cuda.empty_cache()
        gen = torch.Generator(device="cuda").manual_seed(100 + FORMATS.index(fmt))
        _GPU_WEIGHTS[fmt] = random_byte_weights(fmt, FULL["num_experts"], FULL["hidden"], FULL["inter"], gen,
                                                device="cuda")
    return _GPU_WEIGHTS[fmt]


def gpu_oracle(x, ids, rw, w, fmt):
    """Per active expert: the format oracle's dequant to bf16, cuBLAS matmuls (fp32 accumulate)."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    y = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    exact = tokens <= 256  # fp32 matmuls for small batches; bf16-output cuBLAS beyond (time)
    for e in torch.unique(flat).tolist():
        slots = torch.nonzero(flat == e).squeeze(1)
        w13 = oracle_dequant(fmt, w, "w13", experts=slice(e, e + 1))[0]
        w2 = oracle_dequant(fmt, w, "w2", experts=slice(e, e + 1))[0]
        inter = w2.shape[-1]
        xe = x[slots // top_k]
        h = (xe.float() @ w13.float().T) if exact else (xe @ w13.T).float()
        act = (softcap(h[:, :inter], 4.0) * torch.sigmoid(h[:, :inter]) * softcap(h[:, inter:], 25.0)).bfloat16()
        y[slots] = ((act.float() @ w2.float().T) if exact else (act @ w2.T).float()) * rw.reshape(-1)[slots, None]
    return y.view(tokens, top_k, -1).sum(1)


GPU_CASES = [(fmt, tokens) for fmt in ("nvfp4", "mxfp8", "bf16") for tokens in (1, 4, 8, 64, 2048, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,tokens", [("nvfp4", 1), ("mxfp8", 8), ("bf16", 4)])
@pytest.mark.parametrize("experts,top_k", [(FULL["num_experts"], FULL["top_k"]), (FULL["num_experts"] // 4, 2)])
def test_gpu_terms_without_the_combine_add_up_to_its_output(km, fmt, tokens, experts, top_k):
    """`combine=False` at full size, and where one GPU of EP4 routes a token to 2 of its 96 experts (a sparse grid:
    the register kernels split their reductions, so the down GEMM returns several parts): the rows added in slot
    order, each slot's parts in order, are the combined output bit for bit."""
    w = {name: tensor[:experts] for name, tensor in full_size_weights(fmt).items()}
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, FULL["hidden"], generator=gen, device="cuda").bfloat16()
    ids, rw = realistic_routing(tokens, experts, top_k, gen, device="cuda")
    out = km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w))
    rows = km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w), combine=False)
    assert rows.shape[0] == km.slot_output_parts(x, ids, w["w13"], w["w2"], fmt)
    total = torch.zeros(tokens, FULL["hidden"], device="cuda")
    for slot in range(top_k):
        for part in range(rows.shape[0]):
            total = total + rows[part, :, slot]
    assert torch.equal(total.bfloat16(), out)
    if (fmt, tokens, top_k) == ("nvfp4", 1, 2):
        assert rows.shape[0] > 1  # the case this test is for


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,tokens", GPU_CASES)
def test_gpu_full_size_matches_oracle(km, fmt, tokens):
    torch.backends.cuda.matmul.allow_tf32 = False
    w = full_size_weights(fmt)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, FULL["hidden"], generator=gen, device="cuda").bfloat16()
    ids, rw = realistic_routing(tokens, FULL["num_experts"], FULL["top_k"], gen, device="cuda")
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w), out=out)
    again = km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w))
    assert bool(torch.isfinite(out).all())
    assert torch.equal(out, again)  # bitwise reproducible
    err = rel_err(out, gpu_oracle(x, ids, rw, w, fmt))
    print(f"[{fmt} T={tokens}] rel err {err:.2e}")
    assert err <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 2048, 8192])
def test_gpu_route_matches_reference(km, tokens):
    gen = torch.Generator(device="cuda").manual_seed(tokens + 1)
    ids, _ = realistic_routing(tokens, 384, 8, gen, device="cuda")
    ids[0, 0] = -1
    cfg = km.pick_config(tokens * 8, 384, "nvfp4")
    a, b = km.route(ids, 384, cfg.block_m), km.route_reference(ids.cpu(), 384, cfg.block_m)
    for f in ("sorted_slots", "slot_position", "expert_offsets", "tile_expert", "tile_start"):
        assert torch.equal(getattr(a, f).cpu(), getattr(b, f)), f


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(km):
    w = full_size_weights("nvfp4")
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(8, FULL["hidden"], generator=gen, device="cuda").bfloat16()
    ids, rw = realistic_routing(8, 384, 8, gen, device="cuda")
    out = torch.empty_like(x)
    km.moe_forward(x, ids, rw, w["w13"], w["w2"], "nvfp4", **kwargs_of(w), out=out)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        km.moe_forward(x, ids, rw, w["w13"], w["w2"], "nvfp4", **kwargs_of(w), out=out)
    new_ids, new_rw = realistic_routing(8, 384, 8, gen, device="cuda")
    x.copy_(torch.randn(8, FULL["hidden"], generator=gen, device="cuda").bfloat16())
    ids.copy_(new_ids)
    rw.copy_(new_rw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, km.moe_forward(x, ids, rw, w["w13"], w["w2"], "nvfp4", **kwargs_of(w)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,split", [("nvfp4", 2), ("nvfp4", 4), ("mxfp8", 4), ("bf16", 4)])
def test_gpu_split_k_matches_oracle(km, fmt, split):
    """The optional split-K path (partials summed in a fixed order) at full size, T=3."""
    w = full_size_weights(fmt)
    gen = torch.Generator(device="cuda").manual_seed(31 + split)
    x = torch.randn(3, FULL["hidden"], generator=gen, device="cuda").bfloat16()
    ids, rw = realistic_routing(3, FULL["num_experts"], FULL["top_k"], gen, device="cuda")
    cfg = km.KernelConfig(**{**km.pick_config(24, 384, fmt).__dict__, "split_k": split})
    out = km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w), config=cfg)
    assert torch.equal(out, km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w), config=cfg))
    assert rel_err(out, gpu_oracle(x, ids, rw, w, fmt)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("tokens,split", [(1, 1), (1, 3), (8, 1), (8, 2), (64, 1), (96, 1)])
def test_gpu_register_gemv_matches_triton_and_oracle(km, fmt, tokens, split):
    """The fast NVFP4 / MXFP8 decode path (Gluon, weights straight into MMA registers) against the Triton
    kernels (the reference GPU path) and the dequantize-then-matmul oracle, on fresh random data at full size."""
    w = full_size_weights(fmt)
    gen = torch.Generator(device="cuda").manual_seed(700 + tokens + split)
    x = torch.randn(tokens, FULL["hidden"], generator=gen, device="cuda").bfloat16()
    ids, rw = realistic_routing(tokens, FULL["num_experts"], FULL["top_k"], gen, device="cuda")
    ids[0, -1] = -1  # a dropped slot
    # the register kernels' config (MXFP8 at T = 96 is past where pick_config takes them, and still valid)
    register = km.KernelConfig(**{**km.pick_config(8, 384, fmt, register_gemv=True).__dict__, "split_k": split})
    assert register.register_gemv
    out = km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w), config=register)
    assert torch.equal(out, km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w), config=register))
    triton = km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w),
                            config=km.pick_config(tokens * 8, 384, fmt))
    oracle = gpu_oracle(x, ids.clamp(min=0), rw * (ids >= 0), w, fmt)
    print(f"[register {fmt} T={tokens} split={split}] vs oracle {rel_err(out, oracle):.2e}, "
          f"Triton vs oracle {rel_err(triton, oracle):.2e}")
    assert rel_err(out, oracle) <= 1e-2
    assert rel_err(out, triton) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_gpu_default_config_splits_a_sparse_register_grid(km, fmt):
    """One token over 96 experts, top-2 (one GPU's share at TP4/EP4), full-size experts: the default config splits the
    reductions (`_register_split`), and the result matches the split sums' SwiGLU in its own launch bit for bit, the
    unsplit register kernels and the oracle."""
    w = {name: tensor[:96] for name, tensor in full_size_weights(fmt).items()}
    gen = torch.Generator(device="cuda").manual_seed(61)
    x = torch.randn(1, FULL["hidden"], generator=gen, device="cuda").bfloat16()
    ids, rw = realistic_routing(1, 96, 2, gen, device="cuda")
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    picked = km.pick_config(2, 96, fmt, register_gemv=True, inter=FULL["inter"], multiprocessors=multiprocessors)
    assert picked.split_k > 1
    out = km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w))
    assert torch.equal(out, km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w), config=picked))
    # the SwiGLU of the split sums in the gate/up kernel's last program per block, as `_swiglu_kernel` computes it
    # (a routing given: the routing launch does not zero the programs' counters, so the separate kernel runs)
    routing = km.route(ids, 96, picked.block_m)
    assert torch.equal(out, km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w), config=picked,
                                           routing=routing))
    unsplit = km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w),
                             config=km.pick_config(2, 96, fmt, register_gemv=True))
    assert rel_err(out, unsplit) <= 1e-2
    assert rel_err(out, gpu_oracle(x, ids, rw, w, fmt)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_gpu_register_gemv_small_shapes_match_reference(km, fmt):
    """A small model (16 experts, H=512, I=256; every tile partly filled) through the default decode path
    against the PyTorch reference on CPU."""
    gen = torch.Generator().manual_seed(5)
    w = random_byte_weights(fmt, 16, 512, 256, gen)
    x = torch.randn(5, 512, generator=gen)
    x[1] *= 2.0**20  # beyond f16 range: the token is rescaled on its way in and back in the epilogue
    x = x.bfloat16()
    ids, rw = realistic_routing(5, 16, 3, gen)
    ids[2, 1] = -1
    expected = km.moe_forward_reference(x, ids, rw, w["w13"], w["w2"], fmt, **kwargs_of(w))
    on_gpu = {k: v.cuda() for k, v in w.items()}
    assert km.pick_config(15, 16, fmt, register_gemv=True).register_gemv
    out = km.moe_forward(x.cuda(), ids.cuda(), rw.cuda(), on_gpu["w13"], on_gpu["w2"], fmt, **kwargs_of(on_gpu))
    assert rel_err(out.cpu(), expected) <= 1e-2


@pytest.mark.gpu
def test_gpu_register_gemv_mxfp8_scales_outside_f16_range(km):
    """E8M0 scales from 2**-27 to 2**13 and byte 0 (2**-127): the register kernels apply them in fp32 to each
    32-input block's product, so scales far outside f16's range stay exact (against the CPU reference)."""
    gen = torch.Generator().manual_seed(9)
    w = random_byte_weights("mxfp8", 8, 512, 256, gen)
    for name in ("w13_scale", "w2_scale"):
        scale = torch.randint(100, 141, w[name].shape, generator=gen, dtype=torch.uint8)
        w[name] = torch.where(torch.rand(scale.shape, generator=gen) < 0.05, 0, scale).to(torch.uint8)
    x = torch.randn(4, 512, generator=gen).bfloat16()
    ids, rw = realistic_routing(4, 8, 2, gen)
    expected = km.moe_forward_reference(x, ids, rw, w["w13"], w["w2"], "mxfp8", **kwargs_of(w))
    on_gpu = {k: v.cuda() for k, v in w.items()}
    out = km.moe_forward(x.cuda(), ids.cuda(), rw.cuda(), on_gpu["w13"], on_gpu["w2"], "mxfp8", **kwargs_of(on_gpu),
                         config=km.pick_config(8, 8, "mxfp8", register_gemv=True))
    assert torch.isfinite(expected.float()).all()
    assert rel_err(out.cpu(), expected) <= 1e-2


@pytest.mark.gpu
def test_gpu_register_gemv_refuses_other_formats(km):
    w = {k: v.cuda() for k, v in random_byte_weights("bf16", 4, 512, 256, torch.Generator().manual_seed(0)).items()}
    x = torch.randn(2, 512, device="cuda").bfloat16()
    ids, rw = realistic_routing(2, 4, 2, torch.Generator().manual_seed(1))
    register = km.pick_config(4, 4, "nvfp4", register_gemv=True)
    with pytest.raises(ValueError, match="register_gemv needs NVFP4"):
        km.moe_forward(x, ids.cuda(), rw.cuda(), w["w13"], w["w2"], "bf16", **kwargs_of(w), config=register)
