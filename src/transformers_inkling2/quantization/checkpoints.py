"""Reading and writing checkpoints whose routed experts are NVFP4 and/or MXFP8 (everything else stays BF16).

Before the model is built, `detect_expert_quantization` reads the safetensors headers (not the data) and decides,
per layer, how the experts are stored, from the tensors' dtypes and shapes:

| format | `w13_weight` / `w2_weight` | `*_weight_scale` | outer scale |
|---|---|---|---|
| bf16  | bf16/fp16/fp32 [E, 2I, H] / [E, H, I] | none | none |
| nvfp4 | uint8, two E2M1 codes a byte [E, N, K/2] | float8_e4m3fn [E, N, K/16] | fp32 `*_weight_scale_2` (ModelOpt multiplier), `*_weight_global_scale` (compressed-tensors divisor) or `*_weight_amax` (+ `*_weight_outer_scale_denominator`); [E] or, for w13, [E, 2] (gate, up) |
| mxfp8 | float8_e4m3fn [E, N, K] | uint8 E8M0 [E, N, K/32] | none |

A `hf_quant_config.json` sidecar, when present, is cross-checked against what the tensors say. The result goes
into `text_config.expert_quantization`, so the model builds `Inkling2QuantizedExperts` where needed and loading is a
renaming (`modeling/checkpoint_conversion.py`). After loading, `validate_quantized_experts` rejects NaN or infinite
scales.
"""

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from transformers.utils import logging

from ..modeling.loading_checks import tensor_headers
from ..modeling.tensors import local_tensor
from . import formats as qf
from .experts import NVFP4_OUTER_SCALES, Inkling2QuantizedExperts

logger = logging.get_logger(__name__)

EXPERT_TENSOR = re.compile(
    r"layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<matrix>w13_weight|w2_weight|gate_up_proj|down_proj)(?:_(?P<suffix>\w+))?$"
)
FLOAT_DTYPES = {"BF16", "F16", "F32"}
FP8_DTYPES = {"F8_E4M3"}
BYTE_DTYPES = {"U8", "F8_E8M0"}


class ExpertTensor:
    def __init__(self, name: str, dtype: str, shape: list[int]):
        self.name, self.dtype, self.shape = name, dtype, shape

    def __repr__(self):
        return f"{self.name} ({self.dtype} {self.shape})"


def read_expert_tensors(checkpoint: str | Path, revision: str | None = None) -> dict[int, dict[tuple[str, str], ExpertTensor]]:
    """{layer: {(matrix, suffix): tensor}} of the routed-expert tensors."""
    layers: dict[int, dict] = defaultdict(dict)
    for name, dtype, shape in tensor_headers(str(checkpoint), revision):
        match = EXPERT_TENSOR.search(name)
        if match:
            matrix = "gate_up" if match["matrix"] in ("w13_weight", "gate_up_proj") else "down"
            layers[int(match["layer"])][(matrix, match["suffix"] or "")] = ExpertTensor(name, dtype, list(shape))
    return layers


def layer_format(tensors: dict[tuple[str, str], ExpertTensor], hidden: int, inner: int) -> tuple[str, set, bool]:
    """(format, NVFP4 outer-scale suffixes, outer scale per gate/up half) of one layer's experts."""
    formats, outer_scales, per_half = set(), set(), False
    for matrix, rows, columns in (("gate_up", 2 * inner, hidden), ("down", hidden, inner)):
        weight, scale = tensors.get((matrix, "")), tensors.get((matrix, "scale"))
        if weight is None:
            raise qf.QuantizedFormatError(f"The {matrix} expert weight of a layer is missing (found {list(tensors.values())}).")
        if weight.dtype in FLOAT_DTYPES and weight.shape[1:] == [rows, columns] and scale is None:
            formats.add("bf16")
        elif weight.dtype in FP8_DTYPES and weight.shape[1:] == [rows, columns]:
            expect(scale, BYTE_DTYPES, [weight.shape[0], rows, columns // qf.MXFP8_BLOCK_SIZE], "MXFP8 block scales", weight)
            formats.add("mxfp8")
        elif weight.dtype in BYTE_DTYPES and weight.shape[1:] == [rows, columns // 2]:
            expect(scale, FP8_DTYPES, [weight.shape[0], rows, columns // qf.NVFP4_BLOCK_SIZE], "NVFP4 block scales", weight)
            outer = {suffix for (m, suffix) in tensors if m == matrix and suffix in NVFP4_OUTER_SCALES}
            if not outer:
                raise qf.QuantizedFormatError(
                    f"{weight} is NVFP4 but no outer scale was found beside it; expected one of "
                    f"{[f'{weight.name}_{name}' for name in NVFP4_OUTER_SCALES]}."
                )
            outer_scales |= outer
            per_half |= matrix == "gate_up" and tensors[(matrix, sorted(outer)[0])].shape[-1:] == [2]
            formats.add("nvfp4")
        else:
            raise qf.QuantizedFormatError(
                f"Unknown expert weight layout: {weight}. Expected BF16 [E, {rows}, {columns}], MXFP8 "
                f"float8_e4m3fn [E, {rows}, {columns}] or NVFP4 uint8 [E, {rows}, {columns // 2}]."
            )
    if len(formats) != 1:
        raise qf.QuantizedFormatError(f"A layer mixes expert formats {sorted(formats)}: {list(tensors.values())}.")
    known = {("gate_up", ""), ("down", ""), ("gate_up", "scale"), ("down", "scale")}
    known |= {(m, name) for m in ("gate_up", "down") for name in outer_scales}
    unknown = [tensor for key, tensor in tensors.items() if key not in known]
    if unknown:
        raise qf.QuantizedFormatError(f"Unknown expert tensors beside {formats.pop()} weights: {unknown}.")
    return formats.pop(), outer_scales, per_half


def expect(tensor, dtypes: set, shape: list[int], what: str, weight: ExpertTensor) -> None:
    if tensor is None or tensor.dtype not in dtypes or tensor.shape != shape:
        raise qf.QuantizedFormatError(
            f"{weight} needs {what} of dtype {sorted(dtypes)} and shape {shape} beside it, found {tensor}."
        )


def detect_expert_quantization(checkpoint: str | Path, text_config, revision: str | None = None) -> dict | None:
    """The `expert_quantization` entry of the text config for a checkpoint (None: all experts BF16)."""
    layers = read_expert_tensors(checkpoint, revision)
    if not layers:
        return None
    missing = sorted(set(range(text_config.num_hidden_layers)) - set(layers))
    if missing:
        raise qf.QuantizedFormatError(f"No routed-expert tensors for layers {missing} in {checkpoint}.")
    formats, outer_scales, per_half = [], set(), False
    for layer in range(text_config.num_hidden_layers):
        fmt, outer, half = layer_format(layers[layer], text_config.hidden_size, text_config.moe_intermediate_size)
        formats.append(fmt)
        outer_scales |= outer
        per_half |= half
    sidecar = Path(checkpoint) / "hf_quant_config.json"
    if sidecar.exists():
        cross_check_sidecar(json.loads(sidecar.read_text()), formats)
    if set(formats) == {"bf16"}:
        return None
    return {"formats": formats, "nvfp4_outer_scales": sorted(outer_scales), "nvfp4_outer_per_half": per_half}


def cross_check_sidecar(sidecar: dict, formats: list[str]) -> None:
    """A `hf_quant_config.json` that names a format per layer must agree with the tensors."""
    for layer, fmt in sidecar_formats(sidecar).items():
        if layer < len(formats) and formats[layer] != fmt:
            raise qf.QuantizedFormatError(
                f"hf_quant_config.json says layer {layer}'s experts are {fmt}, but its tensors are {formats[layer]}."
            )


def sidecar_formats(sidecar: dict) -> dict[int, str]:
    """{layer: format} for every entry of the sidecar that names an expert layer and an NVFP4/MXFP8 algorithm."""
    found = {}

    def visit(node, path):
        if isinstance(node, dict):
            algorithm = str(node.get("quant_algo", "")).lower()
            layer = re.search(r"layers\.(\d+)\.mlp\.experts", path)
            if layer and algorithm in ("nvfp4", "mxfp8"):
                found[int(layer[1])] = algorithm
            for key, value in node.items():
                visit(value, f"{path}.{key}")

    visit(sidecar, "")
    return found


def check_loaded_experts(model: torch.nn.Module, checkpoint, revision: str | None, loading_info: dict) -> None:
    """The `from_pretrained` step (a "model" hook of `modeling.interfaces.LOADING_HOOKS`) that checks the scales."""
    validate_quantized_experts(model)


def validate_quantized_experts(model: torch.nn.Module) -> None:
    """Raises on NaN or infinite scales (E8M0 byte 255, E4M3 NaN, non-finite outer scales), negative NVFP4 block
    scales and MXFP8 NaN values after loading, once: the kernels and the reference path then decode without
    checking. Under tensor parallelism every rank checks the block of experts it holds."""
    for name, module in model.named_modules():
        if not isinstance(module, Inkling2QuantizedExperts):
            continue
        for matrix in ("gate_up_proj", "down_proj"):
            scale = local_tensor(getattr(module, f"{matrix}_scale"))
            values = qf.e8m0_decode(scale) if module.format == "mxfp8" else scale.float()
            if module.format == "nvfp4" and bool((values < 0).any()):
                raise qf.QuantizedFormatError(
                    f"{name}.{matrix}_scale holds negative block scales: NVFP4 block scales are non-negative "
                    "(the kernels read them as unsigned E4M3). Re-export or re-quantize these experts."
                )
            if module.format == "mxfp8":
                value_bytes = local_tensor(getattr(module, matrix)).view(torch.uint8)
                if bool(((value_bytes & 0x7F) == 0x7F).any()):
                    raise qf.QuantizedFormatError(
                        f"{name}.{matrix} holds float8_e4m3fn NaN values: the checkpoint is corrupt. Re-export or "
                        "re-quantize these experts."
                    )
            tensors = {f"{name}.{matrix}_scale": values}
            if module.format == "nvfp4":
                tensors[f"{name}.{matrix} outer multiplier"] = module.outer_multiplier(matrix)
            for tensor_name, tensor in tensors.items():
                bad = ~torch.isfinite(tensor)
                if bad.any():
                    raise qf.QuantizedFormatError(
                        f"{tensor_name} holds {int(bad.sum())} NaN or infinite scale(s) (first at index "
                        f"{bad.nonzero()[0].tolist()}): the checkpoint is corrupt or was written with another "
                        "convention. Re-export or re-quantize these experts."
                    )


def attach_expert_quantization(config, checkpoint: str | Path | None, revision: str | None = None) -> None:
    """Records in `config` how the checkpoint stores its experts, before the model is built. A `quantization_config`
    the checkpoint may carry for its experts is dropped: transformers' own quantizers would convert the wrong
    modules (its built-in `inkling2` treats every such checkpoint as MXFP8); our expert modules read the tensors."""
    if checkpoint is None or not (Path(checkpoint).is_dir() or re.fullmatch(r"[\w.-]+/[\w.-]+", str(checkpoint))):
        return
    text_config = config.get_text_config()
    try:
        quantization = detect_expert_quantization(checkpoint, text_config, revision)
    except (OSError, ValueError) as error:
        if Path(checkpoint).is_dir() or isinstance(error, qf.QuantizedFormatError):
            raise
        # a Hub id whose headers cannot be read here (offline, no such repo): transformers' own loading will say
        # what is wrong, or load BF16 experts from its cache
        logger.warning(f"Could not read the tensor headers of {checkpoint} ({error}); assuming BF16 experts.")
        return
    if quantization is not None:
        text_config.expert_quantization = quantization
        for holder in {id(config): config, id(text_config): text_config}.values():
            if getattr(holder, "quantization_config", None) is not None:
                del holder.quantization_config
