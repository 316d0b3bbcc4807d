"""Achieved HBM bandwidth of the inkling2_moe hub kernel on decode shapes (one GPU).

For NVFP4, MXFP8 (and BF16) experts at Inkling-2-Small size (E=384, H=4608, I=2304, top-8) and
T = 1, 8, 64, 256 tokens: time of one whole `moe_forward` (routing + both GEMMs + combine), as the median
replay of a CUDA graph holding R calls with R different routings and inputs (so repeats are not served
from L2), divided by R. Bandwidth = bytes of the ACTIVE experts' weights and scales (each read once) /
time. Next to it: `torch._grouped_mm` on BF16 weights with the same routings (same accounting with BF16
bytes), and the measured device-to-device copy bandwidth (bytes read + written) as the ceiling.
Also: a small sweep of decode tile shapes (for NVFP4 / MXFP8 decode, whose default on Hopper is the Gluon
register-GEMV path, the Triton kernels and other K splits next to it), and prefill (T = 2048, 8192) throughput in TFLOP/s. Alone:
`--sweep-only` (a wider decode tile sweep), `--prefill-sweep` (prefill tile shapes at 8192 tokens next to
`torch._grouped_mm`), `--split-sweep` (the register kernels' K split, at full width and at one GPU's TP4/EP4 share),
`--profile` (device time of each kernel of a decode-size call).

    python hub_kernels/inkling2_moe/benchmarks/moe_kernels.py [--out DIR] \
        [--quick | --sweep-only | --prefill-sweep | --split-sweep | --profile]

Prints a table and writes `moe_kernels_bench.md` + `.json` under --out (default $OUT, else ./).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).resolve().parents[1]
BUILDER = KERNEL_DIR.parent / "build.py"  # hub_kernels/build.py (kernel-builder's step for this pure-Python kernel)
E, H, I, K = 384, 4608, 2304, 8
ROTATIONS = 8


def load_kernel():
    """The kernel's build through `kernels` (built first when missing or stale); its sources without `kernels`."""
    try:
        from kernels import get_local_kernel
    except ImportError:
        sys.path.insert(0, str(KERNEL_DIR / "torch-ext"))
        import inkling2_moe

        return inkling2_moe
    if BUILDER.is_file():
        spec = importlib.util.spec_from_file_location("_hub_kernels_build", BUILDER)
        builder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builder)
        builder.ensure_built(KERNEL_DIR)
    return get_local_kernel(KERNEL_DIR)


def make_weights(fmt, gen, experts=E):
    def bytes_(lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=gen, device="cuda", dtype=torch.uint8)

    if fmt == "bf16":
        kw = dict(generator=gen, device="cuda", dtype=torch.bfloat16)
        return dict(w13=torch.randn(experts, 2 * I, H, **kw).mul_(0.03), w2=torch.randn(experts, H, I, **kw).mul_(0.03))
    if fmt == "mxfp8":
        def e4m3(shape):
            b = bytes_(0, 256, shape)
            return torch.where((b & 0x7F) == 0x7F, b ^ 0x01, b).view(torch.float8_e4m3fn)

        return dict(w13=e4m3((experts, 2 * I, H)), w13_scale=bytes_(112, 117, (experts, 2 * I, H // 32)),
                    w2=e4m3((experts, H, I)), w2_scale=bytes_(112, 117, (experts, H, I // 32)))
    return dict(
        w13=bytes_(0, 256, (experts, 2 * I, H // 2)),
        w13_scale=bytes_(0x28, 0x41, (experts, 2 * I, H // 16)).view(torch.float8_e4m3fn),
        w13_outer=torch.rand(experts, 2, generator=gen, device="cuda") * 0.01 + 0.004,
        w2=bytes_(0, 256, (experts, H, I // 2)),
        w2_scale=bytes_(0x28, 0x41, (experts, H, I // 16)).view(torch.float8_e4m3fn),
        w2_outer=torch.rand(experts, generator=gen, device="cuda") * 0.01 + 0.004,
    )


def bytes_per_expert(fmt):
    n = 3 * H * I
    return {"bf16": 2 * n, "mxfp8": n + n // 32, "nvfp4": n // 2 + n // 16 + 12}[fmt]


def routing(tokens, gen, experts=E, top_k=K):
    scores = torch.rand(tokens, experts, generator=gen, device="cuda")
    scores = scores + torch.rand(experts, generator=gen, device="cuda") * 0.2
    w, ids = torch.topk(scores, top_k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def inputs(tokens, gen, rotations, experts=E, top_k=K):
    sets = []
    for _ in range(rotations):
        ids, rw = routing(tokens, gen, experts, top_k)
        x = torch.randn(tokens, H, generator=gen, device="cuda").bfloat16()
        sets.append((x, ids, rw, torch.empty(tokens, H, dtype=torch.bfloat16, device="cuda")))
    return sets


def graph_time_ms(calls):
    """Median time of one call: a CUDA graph of all `calls` (each a closure), replayed, / len(calls)."""
    from triton.testing import do_bench

    for c in calls:  # compile / warm outside the graph
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return do_bench(graph.replay, warmup=50, rep=300, return_mode="median") / len(calls)


def copy_bandwidth():
    from triton.testing import do_bench

    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")

    return 2 * n / ms / 1e9  # TB/s... as GB/ms = TB/s


def grouped_mm_moe(x, ids, rw, w13t, w2t, out):
    """Baseline: sort, gather, torch._grouped_mm on BF16 weights, activation, grouped_mm, weighted sum."""
    t = x.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13t.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x[order // K], w13t, offs=offs)
    g, u = h[:, :I].float(), h[:, I:].float()
    act = (4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)).bfloat16()
    y = torch._grouped_mm(act, w2t, offs=offs).float() * rw.reshape(-1)[order, None]
    per_slot = torch.empty(t * K, H, dtype=torch.float32, device=x.device).index_copy_(0, order, y)
    out.copy_(per_slot.view(t, K, H).sum(1))


def write_output(out: str, name: str, text: str) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(text + "\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="skip the sweep and prefill")
    parser.add_argument("--sweep-only", action="store_true", help="only the decode tile sweep (wider)")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only prefill tile shapes at 8192 tokens, 16 and 384 experts, next to torch._grouped_mm")
    parser.add_argument("--split-sweep", action="store_true",
                        help="only the register kernels' K split at T = 1 and 8, 384 experts top-8 and 96 top-2")
    parser.add_argument("--profile", action="store_true",
                        help="only the device time of each kernel of one moe_forward at T = 1, 8, 64 (torch.profiler)")
    args = parser.parse_args()
    if args.sweep_only:
        return wide_sweep(args)
    if args.prefill_sweep:
        return prefill_sweep(args)
    if args.split_sweep:
        return split_sweep(args)
    if args.profile:
        return kernel_profile()
    km = load_kernel()
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    rows, sweep, prefill = [], [], []
    ceiling = copy_bandwidth()
    print(f"device {props.name}, {props.multi_processor_count} SMs; copy bandwidth {ceiling:.2f} TB/s", flush=True)

    token_counts = (1, 8, 64, 256)
    for fmt in ("nvfp4", "mxfp8", "bf16"):
        w = make_weights(fmt, gen)
        kw = {k: v for k, v in w.items() if k not in ("w13", "w2")}
        for tokens in token_counts:
            sets = inputs(tokens, gen, ROTATIONS)
            active = sum(int(torch.unique(ids).numel()) for _, ids, _, _ in sets) / len(sets)
            nbytes = active * bytes_per_expert(fmt)

            def call(s, cfg=None):
                x, ids, rw, out = s
                return lambda: km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kw, out=out, config=cfg)

            ms = graph_time_ms([call(s) for s in sets])
            bw = nbytes / ms / 1e9
            row = dict(fmt=fmt, tokens=tokens, active_experts=active, mbytes=nbytes / 1e6, us=ms * 1e3,
                       tbps=bw, pct=100 * bw / ceiling)
            if fmt == "bf16":
                try:
                    w13t, w2t = w["w13"].transpose(1, 2), w["w2"].transpose(1, 2)
                    gms = graph_time_ms([(lambda s=s: grouped_mm_moe(s[0], s[1], s[2], w13t, w2t, s[3]))
                                         for s in sets])
                    row.update(grouped_mm_us=gms * 1e3, grouped_mm_tbps=nbytes / gms / 1e9)
                except Exception as exc:  # report, don't hide
                    row.update(grouped_mm_error=f"{type(exc).__name__}: {str(exc)[:200]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not args.quick and fmt != "bf16":
                for cfg in sweep_configs(km, fmt, tokens):
                    try:
                        ms_c = graph_time_ms([call(s, cfg) for s in sets])
                        sweep.append(dict(fmt=fmt, tokens=tokens, config=str(cfg), us=ms_c * 1e3,
                                          tbps=nbytes / ms_c / 1e9))
                    except Exception as exc:
                        sweep.append(dict(fmt=fmt, tokens=tokens, config=str(cfg), error=str(exc)[:200]))
                    print(json.dumps(sweep[-1]), flush=True)
        if not args.quick:
            from triton.testing import do_bench

            for tokens in (2048, 8192):
                x, ids, rw, out = inputs(tokens, gen, 1)[0]
                ms = do_bench(lambda: km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kw, out=out),
                              warmup=20, rep=200, return_mode="median")
                flops = 6 * tokens * K * H * I
                entry = dict(fmt=fmt, tokens=tokens, ms=ms, tflops=flops / ms / 1e9)
                if fmt == "bf16":
                    try:
                        w13t, w2t = w["w13"].transpose(1, 2), w["w2"].transpose(1, 2)
                        gms = do_bench(lambda: grouped_mm_moe(x, ids, rw, w13t, w2t, out), warmup=20, rep=200,
                                       return_mode="median")
                        entry.update(grouped_mm_ms=gms, grouped_mm_tflops=flops / gms / 1e9)
                    except Exception as exc:
                        entry.update(grouped_mm_error=str(exc)[:200])
                prefill.append(entry)
                print(json.dumps(entry), flush=True)
        w = kw = None  # free this format's weights before the next
        torch.cuda.empty_cache()

    lines = [
        f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"date {datetime.date.today().isoformat()}",
        f"ceiling: device-to-device copy {ceiling:.2f} TB/s (bytes read + written, 4 GiB, median)",
        "",
        "| format | T | active experts | MB read | time (us) | TB/s | % of copy | grouped_mm bf16 (us, TB/s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gm = (f"{r['grouped_mm_us']:.1f}, {r['grouped_mm_tbps']:.2f}" if "grouped_mm_us" in r
              else r.get("grouped_mm_error", ""))
        lines.append(f"| {r['fmt']} | {r['tokens']} | {r['active_experts']:.1f} | {r['mbytes']:.0f} | "
                     f"{r['us']:.1f} | {r['tbps']:.2f} | {r['pct']:.0f}% | {gm} |")
    if sweep:
        lines += ["", "decode tile sweep (default shown in the table above):", "",
                  "| format | T | config | time (us) | TB/s |", "|---|---|---|---|---|"]
        for s in sweep:
            lines.append(f"| {s['fmt']} | {s['tokens']} | {s['config']} | {s.get('us', float('nan')):.1f} | "
                         f"{s.get('tbps', float('nan')):.2f} |" if "us" in s else
                         f"| {s['fmt']} | {s['tokens']} | {s['config']} | error: {s['error']} | |")
    if prefill:
        lines += ["", "prefill (eager, median):", "", "| format | T | ms | TFLOP/s | grouped_mm bf16 ms (TFLOP/s) |",
                  "|---|---|---|---|---|"]
        for p in prefill:
            gm = (f"{p['grouped_mm_ms']:.2f} ({p['grouped_mm_tflops']:.0f})" if "grouped_mm_ms" in p
                  else p.get("grouped_mm_error", ""))
            lines.append(f"| {p['fmt']} | {p['tokens']} | {p['ms']:.2f} | {p['tflops']:.0f} | {gm} |")
    table = "\n".join(lines)
    print("\n" + table)
    write_output(args.out, "moe_kernels_bench.md", table)
    write_output(args.out, "moe_kernels_bench.json", json.dumps(
        dict(ceiling_tbps=ceiling, decode=rows, sweep=sweep, prefill=prefill), indent=1))


def wide_sweep(args):
    """Decode tile shapes x split-K for NVFP4 and MXFP8, plus the routing alone at T=1 (fixed cost)."""
    km = load_kernel()
    gen = torch.Generator(device="cuda").manual_seed(1)
    ceiling = copy_bandwidth()
    lines = [f"copy {ceiling:.2f} TB/s", "| fmt | T | config | us | TB/s | % |", "|---|---|---|---|---|---|"]
    sets1 = inputs(1, gen, ROTATIONS)
    ms = graph_time_ms([(lambda s=s: km.route(s[1], E, 16)) for s in sets1])
    lines.append(f"| - | 1 | route only | {ms * 1e3:.1f} | | |")
    # NVFP4 packs 64 bytes per weight row in a 128-wide K step: 256-wide steps and deeper pipelines were tried to keep
    # as many bytes in flight per program as MXFP8's 128-wide steps (measured: only 256-wide steps at T=8 gained).
    # 32-wide N tiles (and split K) at T=1: twice the programs, for a GEMM that ncu found short of warps there
    shapes = {"nvfp4": [(64, 64, 128, 4, 3), (32, 32, 128, 4, 3), (64, 64, 256, 4, 3), (64, 64, 128, 4, 5),
                        (32, 32, 256, 4, 4), (32, 64, 256, 4, 3), (64, 64, 256, 8, 4)],
              "mxfp8": [(64, 64, 128, 4, 3), (32, 32, 128, 4, 3), (64, 64, 128, 4, 5), (32, 32, 256, 4, 4),
                        (64, 64, 256, 8, 3)]}
    for fmt in ("nvfp4", "mxfp8"):
        w = make_weights(fmt, gen)
        kw = {k: v for k, v in w.items() if k not in ("w13", "w2")}
        for tokens in (1, 8, 64):
            sets = inputs(tokens, gen, ROTATIONS)
            nbytes = sum(int(torch.unique(ids).numel()) for _, ids, _, _ in sets) / len(sets) * bytes_per_expert(fmt)
            for bn1, bn2, bk, nw, ns in shapes[fmt]:
                for split in ((1, 2) if tokens == 1 and (bk, ns) == (128, 3) else (1,)):
                    cfg = km.KernelConfig(16, bn1, bn2, bk, nw, ns, split)
                    try:
                        ms = graph_time_ms([(lambda s=s: km.moe_forward(s[0], s[1], s[2], w["w13"], w["w2"], fmt,
                                                                        **kw, out=s[3], config=cfg)) for s in sets])
                        bw = nbytes / ms / 1e9
                        lines.append(f"| {fmt} | {tokens} | {bn1}/{bn2}/{bk}/w{nw}/s{ns}/k{split} | {ms * 1e3:.1f} | "
                                     f"{bw:.2f} | {100 * bw / ceiling:.0f}% |")
                    except Exception as exc:
                        lines.append(f"| {fmt} | {tokens} | {cfg} | error {str(exc)[:120]} | | |")
                    print(lines[-1], flush=True)
        w = kw = None  # free this format's weights before the next
        torch.cuda.empty_cache()
    write_output(args.out, "moe_kernels_sweep.md", "\n".join(lines))
    print("\n".join(lines))


def split_sweep(args):
    """The register kernels' K split (`pick_config`'s `_register_split`) where the grid is sparse or full: T = 1 and 8
    over Inkling-2-Small's 384 experts (top-8) and over one GPU's share at TP4/EP4 (96 experts, top-2); the default
    next to fixed splits, NVFP4 and MXFP8."""
    km = load_kernel()
    gen = torch.Generator(device="cuda").manual_seed(2)
    ceiling = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = [f"copy {ceiling:.2f} TB/s, {sms} SMs", "| fmt | experts, top-k | T | split | us | % of copy |",
             "|---|---|---|---|---|---|"]
    for fmt in ("nvfp4", "mxfp8"):
        for experts, top_k in ((E, K), (E // 4, K // 4)):
            w = make_weights(fmt, gen, experts)
            kw = {k: v for k, v in w.items() if k not in ("w13", "w2")}
            for tokens in (1, 8):
                sets = inputs(tokens, gen, ROTATIONS, experts, top_k)
                active = sum(int(torch.unique(ids).numel()) for _, ids, _, _ in sets) / len(sets)
                nbytes = active * bytes_per_expert(fmt)
                default = km.pick_config(tokens * top_k, experts, fmt, register_gemv=True, inter=I, multiprocessors=sms)
                configs = [(f"default ({default.split_k})", None)]
                configs += [(str(split), dataclasses.replace(default, split_k=split)) for split in (1, 2, 3, 6)]
                for name, cfg in configs:
                    ms = graph_time_ms([(lambda s=s, cfg=cfg: km.moe_forward(s[0], s[1], s[2], w["w13"], w["w2"], fmt,
                                                                             **kw, out=s[3], config=cfg))
                                        for s in sets])  # fmt: skip
                    lines.append(f"| {fmt} | {experts}, {top_k} | {tokens} | {name} | {ms * 1e3:.1f} | "
                                 f"{100 * nbytes / ms / 1e9 / ceiling:.0f}% |")
                    print(lines[-1], flush=True)
            w = kw = None  # free these weights before the next
            torch.cuda.empty_cache()
    write_output(args.out, "moe_kernels_split.md", "\n".join(lines))
    print("\n".join(lines))


def kernel_profile():
    """Where one decode-size call goes: device time per kernel (routing, x conversion, the two GEMMs, combine),
    averaged over 5 x ROTATIONS eager calls with different routings (no L2 flush: weights far exceed L2)."""
    km = load_kernel()
    gen = torch.Generator(device="cuda").manual_seed(0)
    repeats = 5
    for fmt in ("nvfp4", "mxfp8", "bf16"):
        w = make_weights(fmt, gen)
        for tokens in (1, 8, 64):
            sets = inputs(tokens, gen, ROTATIONS)

            def run():
                for x, ids, rw, out in sets:
                    km.moe_forward(x, ids, rw, fmt=fmt, out=out, **w)

            run()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                for _ in range(repeats):
                    run()
                torch.cuda.synchronize()
            per_kernel = {}
            for event in profile.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.device_time / (repeats * ROTATIONS)
            ranked = sorted(per_kernel.items(), key=lambda item: -item[1])
            print(f"{fmt} T={tokens}: " + " | ".join(f"{name} {us:.1f} us" for name, us in ranked), flush=True)
        w = None
        torch.cuda.empty_cache()


def prefill_sweep(args):
    """Prefill tile shapes (BM / BN gate_up / BN down / BK / warps / stages) at 8192 tokens: 16 BF16 experts (the
    benchmark slices' experts: 4096 rows each) and 384 experts of each format (170 rows each)."""
    from triton.testing import do_bench

    km = load_kernel()
    gen = torch.Generator(device="cuda").manual_seed(3)
    tokens = 8192
    shapes = [(128, 64, 128, 64, 8, 3), (128, 128, 128, 64, 8, 3), (128, 128, 256, 64, 8, 3),
              (128, 128, 128, 64, 8, 4), (64, 128, 128, 64, 4, 3), (128, 64, 128, 64, 4, 4)]
    lines = ["| experts | fmt | config | ms | TFLOP/s |", "|---|---|---|---|---|"]
    for experts, formats in ((16, ("bf16",)), (E, ("bf16", "nvfp4", "mxfp8"))):
        for fmt in formats:
            w = make_weights(fmt, gen, experts)
            kw = {k: v for k, v in w.items() if k not in ("w13", "w2")}
            x, ids, rw, out = inputs(tokens, gen, 1, experts)[0]
            flops = 6 * tokens * K * H * I
            runs = [("default", lambda: km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kw, out=out))]
            for shape in shapes:
                cfg = km.KernelConfig(*shape)
                runs.append((str(shape), lambda cfg=cfg: km.moe_forward(x, ids, rw, w["w13"], w["w2"], fmt, **kw,
                                                                        out=out, config=cfg)))
            if fmt == "bf16":
                w13t, w2t = w["w13"].transpose(1, 2), w["w2"].transpose(1, 2)
                runs.append(("torch._grouped_mm", lambda: grouped_mm_moe(x, ids, rw, w13t, w2t, out)))
            for name, run in runs:
                try:
                    ms = do_bench(run, warmup=10, rep=100, return_mode="median")
                    lines.append(f"| {experts} | {fmt} | {name} | {ms:.2f} | {flops / ms / 1e9:.0f} |")
                except Exception as exc:
                    lines.append(f"| {experts} | {fmt} | {name} | error {str(exc)[:120]} | |")
                print(lines[-1], flush=True)
            w = kw = None
            torch.cuda.empty_cache()
    write_output(args.out, "moe_kernels_prefill_sweep.md", "\n".join(lines))


def sweep_configs(km, fmt, tokens):
    """Alternatives to the default decode shape (`pick_config`), measured next to it."""
    base = km.pick_config(tokens * K, E, fmt, register_gemv=True)
    if base.register_gemv:  # quantized decode: the Triton kernels, and other splits of the register GEMVs
        splits = [dataclasses.replace(base, split_k=s) for s in (1, 2, 3, 6) if s != base.split_k]
        return [km.pick_config(tokens * K, E, fmt)] + splits
    if tokens == 1:
        return [km.KernelConfig(**{**base.__dict__, "split_k": s}) for s in (2, 4) if s != base.split_k]
    if tokens in (8, 64):
        alt = [km.KernelConfig(16, 32, 32, 128, 4, 4), km.KernelConfig(16, 64, 64, 128, 4, 4)]
        return [c for c in alt if c != base]
    return []


if __name__ == "__main__":
    main()
