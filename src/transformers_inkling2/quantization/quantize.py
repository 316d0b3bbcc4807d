"""`inkling2 quantize`: turn a BF16 checkpoint (original layout) into the official mixed layout.

Routed experts of layers below `--mxfp8-from` (40 in Inkling-2-Small) become NVFP4 (E2M1 codes, E4M3 block scales
per 16 inputs, fp32 `weight_scale_2` multipliers per expert, per gate/up half for w13), the others MXFP8 (E4M3 values,
E8M0 block scales per 32 inputs). Everything else is copied unchanged. It streams: one shard in memory at a time,
one expert tensor converted at a time, so it runs on checkpoints much larger than memory. It writes the shards, the
index, the config (without a `quantization_config`), a `hf_quant_config.json` naming each layer's format, and copies
the tokenizer and processor files and the drafter's `mtp.safetensors` (BF16 in the official checkpoints too).
"""

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..version import __version__
from . import formats as qf

EXPERT_WEIGHT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(w13_weight|w2_weight)$")
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json",
                "preprocessor_config.json", "generation_config.json", "special_tokens_map.json", "mtp.safetensors")


def quantize_expert(name: str, weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors replacing one BF16 expert weight ([E, N, K]; w13 rows interleaved gate/up)."""
    if fmt == "mxfp8":
        values, scale = qf.mxfp8_quantize(weight, name=name)
        return {name: values, f"{name}_scale": scale}
    is_w13 = name.endswith("w13_weight")
    packed, block_scale, outer = qf.nvfp4_quantize(weight, per_half=is_w13, gate_up_layout="interleaved", name=name)
    return {name: packed, f"{name}_scale": block_scale, f"{name}_scale_2": outer}


def expert_format(layer: int, mxfp8_from: int) -> str:
    return "nvfp4" if layer < mxfp8_from else "mxfp8"


def quantize_checkpoint(source: str | Path, target: str | Path, mxfp8_from: int = 40) -> Path:
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    index_file = source / "model.safetensors.index.json"
    shards = (
        sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        if index_file.exists()
        else ["model.safetensors"]
    )
    weight_map, layer_formats = {}, {}
    for shard in tqdm(shards, desc="Quantizing shards"):
        tensors = {}
        with safe_open(source / shard, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                match = EXPERT_WEIGHT.search(name)
                if match is None:
                    tensors[name] = tensor
                    continue
                layer = int(match.group(1))
                if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                    raise qf.QuantizedFormatError(f"{name} is already {tensor.dtype}: quantize a BF16 checkpoint.")
                layer_formats[name.removesuffix(f".{match.group(2)}")] = expert_format(layer, mxfp8_from)
                tensors.update(quantize_expert(name, tensor, expert_format(layer, mxfp8_from)))
        save_file(tensors, target / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))

    if index_file.exists():
        (target / index_file.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    sidecar = {
        "producer": {"name": "transformers-inkling2", "version": __version__},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {name: {"quant_algo": fmt.upper()} for name, fmt in sorted(layer_formats.items())},
        },
    }
    (target / "hf_quant_config.json").write_text(json.dumps(sidecar, indent=2))
    for file in COPIED_FILES:
        if (source / file).exists():
            shutil.copy(source / file, target / file)
    return target
