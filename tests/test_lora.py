"""LoRA through PEFT: attention adapters on a model with NVFP4 / MXFP8 experts (train, checkpoint, save, load, merge),
adapters on BF16 experts through `target_parameters`, and the clear error for expert adapters on quantized experts.

The target lists are the package's (`transformers_inkling2.finetuning`), which the example and the docs use."""

import re
import warnings

import pytest
import torch
from inkling2_helpers import ORACLE_TEXT_CONFIG
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer, ParamWrapper
from peft.tuners.tuners_utils import NoMatchingPeftModuleError
from safetensors.torch import load_file

from transformers_inkling2 import Inkling2ForCausalLM, Inkling2ForConditionalGeneration, Inkling2TextConfig
from transformers_inkling2.finetuning import (
    DEFAULT_LORA_TARGET_MODULES,
    EXPERT_LORA_TARGET_PARAMETERS,
    refuse_lora_on_quantized_experts,
)
from transformers_inkling2.modeling.experts import Inkling2Experts
from transformers_inkling2.quantization.experts import Inkling2QuantizedExperts
from transformers_inkling2.quantization.quantize import quantize_checkpoint
from transformers_inkling2.tiny import randomize_, tiny_config

# PEFT 0.21 reads transformers' deprecated `is_gradient_checkpointing` alias
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

ATTENTION_TARGETS = DEFAULT_LORA_TARGET_MODULES
EXPERT_TARGETS = EXPERT_LORA_TARGET_PARAMETERS

# six layers: attention-residual blocks opening at 0 and 3, layer 5 full attention (dynamic convolutions)
CONFIG = {**ORACLE_TEXT_CONFIG, "num_hidden_layers": 6, "n_layers_per_attn_res_block": 3}
LAYERS = CONFIG["num_hidden_layers"]
PROJECTIONS = ("q", "k", "v", "r", "o", "gate")
# 2 x 13 tokens: no activation has the shape of one expert's weights ([64, 64] gate/up, [64, 32] down)
INPUT_IDS = torch.randint(0, 500, (2, 13), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A BF16 checkpoint and its quantized copy: experts of layers 0-2 NVFP4, 3-5 MXFP8."""
    root = tmp_path_factory.mktemp("lora")
    randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**CONFIG)), seed=3).save_pretrained(root / "bf16")
    quantize_checkpoint(root / "bf16", root / "mixed", mxfp8_from=3)
    return root


def load(folder) -> Inkling2ForCausalLM:
    return Inkling2ForCausalLM.from_pretrained(folder).eval()


def lora(model, seed: int = 0, **config):
    """LoRA r=4 on the attention projections (and whatever `config` adds); lora_B random so that it matters."""
    torch.manual_seed(seed)
    config = {"target_modules": ATTENTION_TARGETS, **config}
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **config))


def trainable(model) -> dict[str, torch.nn.Parameter]:
    return {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}


def loss_of(model) -> torch.Tensor:
    input_ids = INPUT_IDS.to(model.device)
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def train(model, steps: int = 8, lr: float = 1e-2) -> list[float]:
    """AdamW steps on one fixed batch; the loss before each step, then the final loss."""
    optimizer = torch.optim.AdamW(trainable(model).values(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        loss = loss_of(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        losses.append(loss_of(model).item())
    return losses


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS, use_cache=False).logits


def packed_experts(model) -> dict[str, torch.Tensor]:
    """Every tensor of the quantized experts, copied; one-byte formats as raw bytes (fp8 has no equality)."""
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, Inkling2QuantizedExperts):
            for buffer_name, buffer in module.named_buffers(recurse=False):
                raw = buffer.view(torch.uint8) if buffer.element_size() == 1 else buffer
                tensors[f"{name}.{buffer_name}"] = (buffer.dtype, raw.detach().clone())
    return tensors


def assert_same_packed_experts(before: dict, after: dict) -> None:
    assert before.keys() == after.keys() and len(before) == LAYERS * 5  # weight, block scale (and outer scale) x 2
    for name, (dtype, raw) in before.items():
        assert after[name][0] == dtype and torch.equal(after[name][1], raw), name


# --- which modules the default targets adapt ------------------------------------------------------------------


def test_default_targets_are_the_text_attention_projections_and_nothing_else():
    expected = {f"layers.{i}.self_attn.{p}_proj" for i in range(LAYERS) for p in PROJECTIONS}

    def adapted(model, **config):
        peft_model = get_peft_model(model, LoraConfig(r=2, **config))
        names = [name for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)]
        return {name.removeprefix("base_model.model.") for name in names}

    text = adapted(Inkling2ForCausalLM(Inkling2TextConfig(**CONFIG)), target_modules=ATTENTION_TARGETS)
    assert text == {f"model.{name}" for name in expected}
    multimodal = Inkling2ForConditionalGeneration(
        tiny_config(image_token_id=499, vocab_size=512, unpadded_vocab_size=500)
    )
    assert adapted(multimodal, target_modules=ATTENTION_TARGETS) == {f"model.language_model.{n}" for n in expected}
    # why a regex: the bare names also catch the ViT's q/k/v_proj
    multimodal = Inkling2ForConditionalGeneration(
        tiny_config(image_token_id=499, vocab_size=512, unpadded_vocab_size=500)
    )
    bare_names = adapted(multimodal, target_modules=[f"{p}_proj" for p in PROJECTIONS])
    assert any(".vision_tower." in name for name in bare_names)


# --- attention LoRA on quantized experts --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_on_quantized(checkpoints):
    """An attention adapter trained on the mixed NVFP4 / MXFP8 model, with what was there before training."""
    model = load(checkpoints / "mixed")
    before = {
        "packed": packed_experts(model),
        "float_tensors": {n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()},
        "logits": logits(model),
    }
    peft_model = lora(model)
    peft_model.print_trainable_parameters()
    losses = train(peft_model)
    return peft_model, losses, before


def test_lora_steps_on_attention_lower_the_loss_of_a_quantized_model(trained_on_quantized):
    peft_model, losses, _ = trained_on_quantized
    names = trainable(peft_model)
    assert len(names) == LAYERS * len(PROJECTIONS) * 2
    assert all(re.search(r"\.lora_[AB]\.default\.weight$", name) for name in names)
    assert losses[1] < losses[0] and losses[-1] < losses[0] - 0.3, losses  # the first step and all of them


def test_training_leaves_quantized_experts_bitwise_unchanged_and_makes_no_float_copy(trained_on_quantized):
    peft_model, _, before = trained_on_quantized
    model = peft_model.get_base_model()
    assert_same_packed_experts(before["packed"], packed_experts(model))
    assert not any(isinstance(module, Inkling2Experts) for module in model.modules())
    # the only new floating-point tensors are the LoRA matrices (PEFT keeps the base weights where they were)
    after = {
        name.replace(".base_layer.", ".")
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_floating_point() and ".lora_" not in name
    }
    assert after == before["float_tensors"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backward_keeps_no_dequantized_expert_weights(checkpoints, device):
    """With gradients flowing the experts take the differentiable reference (on CUDA too, not the fused kernel),
    which dequantizes each expert again in backward instead of keeping it."""
    peft_model = lora(load(checkpoints / "mixed").to(device)).train()
    weights = {t.untyped_storage().data_ptr() for t in peft_model.parameters()}
    hidden, inner = CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    expert_shapes = {(2 * inner, hidden), (hidden, 2 * inner), (hidden, inner), (inner, hidden)}
    kept = []

    def pack(tensor):
        shape, storage = tuple(tensor.shape), tensor.untyped_storage().data_ptr()
        if tensor.is_floating_point() and shape in expert_shapes and storage not in weights:
            kept.append(shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_of(peft_model)
    assert kept == []


def test_adapter_round_trips_exactly(trained_on_quantized, checkpoints, tmp_path):
    peft_model, _, before = trained_on_quantized
    adapted = logits(peft_model)
    assert (adapted - before["logits"]).abs().max() > 1e-2  # the adapter changes the model
    peft_model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert len(saved) == LAYERS * len(PROJECTIONS) * 2
    assert all(".self_attn." in name and ".lora_" in name for name in saved)

    assert torch.equal(logits(PeftModel.from_pretrained(load(checkpoints / "mixed"), tmp_path)), adapted)
    model = load(checkpoints / "mixed")
    model.load_adapter(tmp_path)
    assert torch.equal(logits(model), adapted)


def test_merged_model_equals_the_adapted_model_and_keeps_its_quantized_layout(
    trained_on_quantized, checkpoints, tmp_path
):
    peft_model, _, before = trained_on_quantized
    adapted = logits(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = PeftModel.from_pretrained(load(checkpoints / "mixed"), tmp_path / "adapter").merge_and_unload()
    assert isinstance(merged, Inkling2ForCausalLM) and not any(isinstance(m, LoraLayer) for m in merged.modules())
    torch.testing.assert_close(logits(merged), adapted, rtol=0, atol=2e-5)
    assert_same_packed_experts(before["packed"], packed_experts(merged))
    # and it saves as a quantized checkpoint again
    merged.save_pretrained(tmp_path / "merged")
    assert torch.equal(logits(load(tmp_path / "merged")), logits(merged))
    assert_same_packed_experts(before["packed"], packed_experts(load(tmp_path / "merged")))


# --- gradient checkpointing ---------------------------------------------------------------------------------------


def gradients(model, checkpointing: bool, **checkpointing_kwargs) -> tuple[dict[str, torch.Tensor], int]:
    """LoRA gradients of one forward/backward, and how often layer 0's attention ran (twice when recomputed)."""
    calls = []
    handle = model.get_base_model().model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5.23 names it activation checkpointing
            model.gradient_checkpointing_enable(**checkpointing_kwargs)
    model.train()
    loss_of(model).backward()
    handle.remove()
    grads = {name: parameter.grad.clone() for name, parameter in trainable(model).items()}
    model.zero_grad()
    return grads, len(calls)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("experts", ["mixed", "bf16"])
def test_gradient_checkpointing_gives_the_same_gradients(checkpoints, experts, use_reentrant):
    extra = {"target_parameters": EXPERT_TARGETS} if experts == "bf16" else {}
    reference, calls = gradients(lora(load(checkpoints / experts), **extra), checkpointing=False)
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": use_reentrant}}
    checkpointed, recomputed_calls = gradients(lora(load(checkpoints / experts), **extra), checkpointing=True, **kwargs)
    assert (calls, recomputed_calls) == (1, 2)
    assert reference.keys() == checkpointed.keys() and all(g.abs().max() > 0 for g in reference.values())
    for name in reference:
        torch.testing.assert_close(checkpointed[name], reference[name], rtol=1e-6, atol=1e-8, msg=name)


def test_gradient_checkpointing_works_without_use_cache_false(checkpoints):
    model = lora(load(checkpoints / "mixed"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    model.train()
    model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss.backward()


# --- LoRA on the routed experts -----------------------------------------------------------------------------------


def test_expert_lora_trains_bf16_experts_and_round_trips(checkpoints, tmp_path):
    peft_model = lora(load(checkpoints / "bf16"), target_modules=[], target_parameters=EXPERT_TARGETS)
    wrappers = [m for m in peft_model.modules() if isinstance(m, ParamWrapper)]
    assert sorted(m.parameter_name for m in wrappers) == ["down_proj"] * LAYERS + ["gate_up_proj"] * LAYERS
    initial = {name: p.detach().clone() for name, p in trainable(peft_model).items()}
    assert len(initial) == LAYERS * 2 * 2 and all(".mlp.experts." in name for name in initial)

    losses = train(peft_model)
    assert losses[1] < losses[0] and losses[-1] < losses[0] - 0.3, losses
    for name, parameter in trainable(peft_model).items():
        assert not torch.equal(parameter, initial[name]), f"{name} did not train"

    adapted = logits(peft_model)
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(load(checkpoints / "bf16"), tmp_path)
    assert torch.equal(logits(reloaded), adapted)
    merged = reloaded.merge_and_unload()
    torch.testing.assert_close(logits(merged), adapted, rtol=0, atol=2e-5)
    base = load(checkpoints / "bf16").model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(merged.model.layers[0].mlp.experts.gate_up_proj, base)  # the delta went into the weights


def test_expert_lora_on_quantized_experts_is_a_clear_error(checkpoints):
    model = load(checkpoints / "mixed")
    with pytest.raises(ValueError, match="needs BF16 experts") as error:
        refuse_lora_on_quantized_experts(model, EXPERT_TARGETS)
    message = str(error.value)
    assert "NVFP4" in message and "MXFP8" in message and "model.layers.0.mlp.experts.gate_up_proj" in message
    assert "attention-only adapter" in message
    with pytest.raises(ValueError, match="needs BF16 experts"):
        refuse_lora_on_quantized_experts(model, ["down_proj"])  # any spelling PEFT would match
    # nothing to refuse: attention-only adapters, or expert adapters on BF16 experts
    refuse_lora_on_quantized_experts(model, None)
    refuse_lora_on_quantized_experts(model, ["self_attn.q_proj.weight"])
    refuse_lora_on_quantized_experts(load(checkpoints / "bf16"), EXPERT_TARGETS)


def test_peft_alone_would_not_say_why_quantized_experts_are_skipped(checkpoints):
    """What the guard is for (PEFT 0.21): the packed weights are buffers, which `target_parameters` never sees."""
    with pytest.raises(NoMatchingPeftModuleError, match="no `target_parameters` found"):
        lora(load(checkpoints / "mixed"), target_modules=[], target_parameters=EXPERT_TARGETS)
    with pytest.warns(RuntimeWarning, match="no parameter was matched"):
        peft_model = lora(load(checkpoints / "mixed"), target_parameters=EXPERT_TARGETS)
    assert not any(".experts." in name for name in trainable(peft_model))


def test_adapter_on_dynamic_convolution_taps_round_trips(checkpoints, tmp_path):
    peft_model = lora(load(checkpoints / "mixed"), target_modules=["weight_proj"])
    adapted = logits(peft_model)
    peft_model.save_pretrained(tmp_path)
    assert torch.equal(logits(PeftModel.from_pretrained(load(checkpoints / "mixed"), tmp_path)), adapted)
