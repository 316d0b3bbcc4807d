"""What the finite-weight check of `from_pretrained` costs on full-width Inkling-2-Small layers (one GPU).

    python3 benchmarks/loading_checks.py [--device cuda] [--experts bf16 nvfp4 mxfp8] [--out DIR]

Builds one decoder layer of each kind at full width (sliding and full attention; BF16, NVFP4 and MXFP8 experts)
directly on the GPU with random weights, and times `loading_checks.raise_on_non_finite_weights` on it (warm, median
of 5), with the bytes it reads (floating tensors only: packed NVFP4 / MXFP8 bytes have no NaN, their scales are
checked by the quantization loader).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from random_weights import expert_format_of, fill_random_, seeded_generator  # noqa: E402

from transformers_inkling2 import Inkling2TextConfig  # noqa: E402
from transformers_inkling2.modeling.loading_checks import raise_on_non_finite_weights  # noqa: E402
from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2DecoderLayer  # noqa: E402

KINDS = {"sliding": "hybrid_sliding", "full": "hybrid"}
DEVICE = "cuda"


def build_layer(kind: str, expert_format: str) -> torch.nn.Module:
    formats = None if expert_format == "bf16" else {"formats": [expert_format], "nvfp4_outer_scales": ["scale_2"]}
    config = Inkling2TextConfig(num_hidden_layers=1, layer_types=[KINDS[kind]], expert_quantization=formats)
    with torch.device(DEVICE):
        layer = Inkling2DecoderLayer(config, 0).to(torch.bfloat16)  # packed experts keep their dtypes
    for module_name, module in layer.named_modules():
        packed = expert_format_of(module)
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            full = f"{module_name}.{name}"
            generator = seeded_generator(full, DEVICE)
            # expert by expert: a whole [384, 4608, 4608] draw in fp32 would take tens of GB
            for part in tensor if tensor.dim() == 3 and packed is None else [tensor]:
                fill_random_(part, full, packed, generator)
    return layer


def checked_bytes(layer: torch.nn.Module) -> int:
    tensors = [*layer.parameters(), *layer.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point() and t.element_size() > 1)


def time_check(layer: torch.nn.Module, repeats: int = 5) -> float:
    raise_on_non_finite_weights(layer)  # warm-up
    times = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        raise_on_non_finite_weights(layer)  # ends with a host synchronization
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (a BF16 layer needs about 25 GB there)")
    parser.add_argument("--experts", nargs="+", default=["bf16", "nvfp4", "mxfp8"], choices=["bf16", "nvfp4", "mxfp8"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    rows = []
    for expert_format in args.experts:
        for kind in KINDS:
            layer = build_layer(kind, expert_format)
            seconds, size = time_check(layer), checked_bytes(layer)
            rows.append({"layer": kind, "experts": expert_format, "checked_GB": size / 1e9, "ms": seconds * 1e3,
                         "GB_per_s": size / seconds / 1e9})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            del layer
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
        (args.out / "loading_checks.json").write_text(json.dumps({"device": device, "rows": rows}))


if __name__ == "__main__":
    main()
