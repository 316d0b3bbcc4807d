"""The drafter's weights in the official repos: a separate `mtp.safetensors` beside the target's shards.

Our own checkpoints store the drafter under `dspark.` in the main shards, and it loads with the target. The official
`mtp.safetensors` holds it under `mtp.` or `model.mtp.` with names we only partly know (SPEC §3: `markov_head.*`,
`confidence_head.proj.*`). This module maps the names we know onto `Inkling2DSparkDrafter`, takes the drafter's shape
from the config (or, when the config has no `dspark_config`, from the tensor shapes), and loads it. Anything it cannot
map disables DSpark with a warning that names the tensors: the target itself always loads.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers.utils import logging

from ..configuration_inkling2 import Inkling2DSparkConfig
from ..modeling.modeling_inkling2_dspark import Inkling2DSparkDrafter

logger = logging.get_logger(__name__)

MTP_FILE = "mtp.safetensors"
MTP_PREFIXES = ("model.mtp.", "mtp.")
# original name part -> ours (applied after the prefix is stripped)
MTP_RENAMES = {r"^hidden_norm\.": "context_norm.", r"^final_norm\.": "norm.", r"^enorm\.": "context_norm."}


def find_mtp_file(checkpoint, revision: str | None = None) -> Path | None:
    """The checkpoint's `mtp.safetensors`, downloaded from the Hub when needed; None when it has none."""
    folder = Path(str(checkpoint))
    if folder.is_dir():
        return folder / MTP_FILE if (folder / MTP_FILE).is_file() else None
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(checkpoint)):
        return None
    from huggingface_hub import file_exists, hf_hub_download

    try:
        if not file_exists(str(checkpoint), MTP_FILE, revision=revision):
            return None
        return Path(hf_hub_download(str(checkpoint), MTP_FILE, revision=revision))
    except Exception as error:  # offline, gated, no such repo: the target loads without a drafter
        logger.warning(f"Could not look for {MTP_FILE} in {checkpoint} ({error}); loading without the DSpark drafter.")
        return None


def drafter_state_from_mtp(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(tensors under our drafter names, original names that carry none of the known prefixes)."""
    state, unknown = {}, []
    for name, tensor in tensors.items():
        prefix = next((p for p in MTP_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            unknown.append(name)
            continue
        ours = name[len(prefix) :]
        for pattern, replacement in MTP_RENAMES.items():
            ours = re.sub(pattern, replacement, ours)
        state[ours] = tensor
    return state, unknown


def dspark_config_from_shapes(state: dict[str, torch.Tensor]) -> Inkling2DSparkConfig:
    """The drafter's shape read off its tensors, for checkpoints whose config does not describe it. The tapped
    target layers cannot be read off a shape: the default list is used when its length matches `fc`."""
    try:
        hidden = state["fc.weight"].shape[0]
        layers = 1 + max(int(m.group(1)) for m in (re.match(r"layers\.(\d+)\.", k) for k in state) if m)
        attention = "layers.0.attention."
        head_dim = state[attention + "q_norm.weight"].shape[0]
        heads, buckets = state[attention + "distance_bias"].shape
        fields = dict(
            hidden_size=hidden,
            num_draft_layers=layers,
            head_dim=head_dim,
            num_attention_heads=heads,
            num_key_value_heads=state[attention + "k_proj.weight"].shape[0] // head_dim,
            intermediate_size=state["layers.0.mlp.gate_proj.weight"].shape[0],
            distance_buckets=buckets,
            block_size=state["block_position_embedding"].shape[0],
            head_type="rnn" if "markov_head.w1.weight" in state else "vanilla",
            use_confidence_head="confidence_head.proj.weight" in state,
        )
    except (KeyError, ValueError) as error:
        raise ValueError(f"cannot read the drafter's shape from its tensors (no {error})") from None
    if fields["head_type"] == "rnn":
        fields["markov_rank"] = state["markov_head.w1.weight"].shape[1]
    config = Inkling2DSparkConfig(**fields)
    if len(config.target_layer_ids) * hidden != state["fc.weight"].shape[1]:
        raise ValueError(
            f"`fc` reads {state['fc.weight'].shape[1] // hidden} target layers but which ones is not in the "
            "checkpoint; add a `dspark_config` with `target_layer_ids` to its config.json"
        )
    return config


def load_mtp_drafter(model, mtp_file: Path) -> bool:
    """Loads a checkpoint's `mtp.safetensors` into `model.dspark` (building the drafter when the config had none).
    Returns whether a drafter was loaded; on any mismatch, warns and leaves the model without one."""
    state, unknown = drafter_state_from_mtp(load_file(str(mtp_file)))
    text_config = model.config.get_text_config()
    try:
        if unknown:
            raise ValueError(f"tensors outside {MTP_PREFIXES}: {', '.join(sorted(unknown)[:8])}")
        dspark_config = text_config.dspark_config or dspark_config_from_shapes(state)
        dspark_config.check_fits_target(text_config)
        drafter = Inkling2DSparkDrafter(dspark_config, text_config.vocab_size)
        drafter.load_state_dict(state, strict=True)
    except (ValueError, RuntimeError) as error:
        logger.warning(
            f"DSpark disabled: {mtp_file} does not map onto Inkling2DSparkDrafter ({error}). The target model loaded "
            "normally; `generate(dspark=True)` is unavailable. See docs/dspark.md for the names we map."
        )
        model.dspark = None
        return False
    model.set_dspark(drafter)
    return True


def load_bundled_drafter(model, checkpoint, revision: str | None, loading_info: dict) -> None:
    """The `from_pretrained` step (a "model" hook of `modeling.interfaces.LOADING_HOOKS`) for checkpoints that ship
    the drafter separately: loaded, or disabled with a warning, never an error; its tensors are then not missing."""
    mtp_file = find_mtp_file(checkpoint, revision) if hasattr(model, "dspark") else None
    if mtp_file is not None:
        load_mtp_drafter(model, mtp_file)
        loading_info["missing_keys"] = {k for k in loading_info.get("missing_keys") or () if not k.startswith("dspark.")}


__all__ = ["load_bundled_drafter", "load_mtp_drafter"]
