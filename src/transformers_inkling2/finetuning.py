"""Fine-tuning Inkling2 with PEFT LoRA: the default targets and the guard for quantized experts.

LoRA goes on the attention projections of the text decoder: `DEFAULT_LORA_TARGET_MODULES` is a regex (PEFT
full-matches it against module names) for `model.layers.N.self_attn.{q,k,v,r,o,gate}_proj` in Inkling2ForCausalLM
and `model.language_model.layers.N...` in the multimodal model; a plain list ["q_proj", ...] would also catch the
ViT's projections. It leaves out the router (`mlp.gate`), `sink_proj` (one logit per head) and the dynamic
convolutions' `weight_proj`. BF16 routed experts are stacked parameters that PEFT adapts per expert through
`target_parameters` (`EXPERT_LORA_TARGET_PARAMETERS`); quantized ones cannot be adapted, and
`refuse_lora_on_quantized_experts` says so. See docs/finetuning.md.
"""

from collections.abc import Iterable

from torch import nn

from .quantization.experts import Inkling2QuantizedExperts

DEFAULT_LORA_TARGET_MODULES = r"(?:.*\.)?(?:model|language_model)\.layers\.\d+\.self_attn\.(?:q|k|v|r|o|gate)_proj"
EXPERT_LORA_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def refuse_lora_on_quantized_experts(model: nn.Module, target_parameters: Iterable[str] | None) -> None:
    """Raises when PEFT `target_parameters` (matched as PEFT does: a full name, or a suffix after a dot) name tensors of
    `Inkling2QuantizedExperts`. Those are frozen buffers, not parameters: PEFT skips them without an error that says so
    (beside attention targets the adapter simply leaves those experts untouched), and a LoRA delta on packed NVFP4 /
    MXFP8 codes would mean nothing without their block scales."""
    targets = list(target_parameters or ())
    hits, formats = [], set()
    for module_name, module in model.named_modules():
        if not isinstance(module, Inkling2QuantizedExperts):
            continue
        for buffer_name, _ in module.named_buffers(recurse=False):
            name = f"{module_name}.{buffer_name}"
            if any(name == target or name.endswith(f".{target}") for target in targets):
                hits.append(name)
                formats.add(module.format.upper())
    if hits:
        more = f" and {len(hits) - 1} more" if len(hits) > 1 else ""
        raise ValueError(
            f"LoRA on the routed experts needs BF16 experts, but target_parameters={targets} name packed "
            f"{'/'.join(sorted(formats))} expert weights ({hits[0]}{more}). Quantized experts are frozen buffers: PEFT "
            "cannot adapt them, and a delta on packed codes without their block scales would be wrong. Either load a "
            "checkpoint with BF16 experts and keep target_parameters=['mlp.experts.gate_up_proj', "
            "'mlp.experts.down_proj'], or train an attention-only adapter: drop target_parameters and target the "
            "attention projections with target_modules (see docs/finetuning.md)."
        )
