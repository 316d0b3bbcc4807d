"""Checkpoints with NVFP4 / MXFP8 routed experts: detection, loading, saving, the quantize tool and their errors."""

import json
import shutil
from unittest.mock import Mock

import pytest
import torch
from inkling2_helpers import ORACLE_TEXT_CONFIG
from safetensors.torch import load_file, save_file

from transformers_inkling2 import Inkling2ForCausalLM, Inkling2TextConfig
from transformers_inkling2.modeling.experts import Inkling2Experts
from transformers_inkling2.quantization import formats as qf
from transformers_inkling2.quantization.experts import Inkling2QuantizedExperts
from transformers_inkling2.quantization.quantize import quantize_checkpoint
from transformers_inkling2.tiny import randomize_

# hidden 64 and expert width 32: whole MXFP8 (32) and NVFP4 (16) blocks
CONFIG = {**ORACLE_TEXT_CONFIG, "num_hidden_layers": 6, "n_layers_per_attn_res_block": 3}
INPUT_IDS = torch.randint(0, 500, (2, 13), generator=torch.Generator().manual_seed(0))


def logits(model):
    with torch.no_grad():
        return model(INPUT_IDS, use_cache=False).logits


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A BF16 checkpoint and its quantized version: layers 0-3 NVFP4, 4-5 MXFP8."""
    root = tmp_path_factory.mktemp("quantized")
    model = randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**CONFIG)), seed=1).eval()
    model.save_pretrained(root / "bf16")
    quantize_checkpoint(root / "bf16", root / "mixed", mxfp8_from=4)
    return root


def dequantized_model(folder, expert_tensors):
    """A BF16-expert model whose expert weights are `expert_tensors` ({layer: (gate_up, down)} fp32)."""
    model = Inkling2ForCausalLM.from_pretrained(folder / "bf16")
    for layer, (gate_up, down) in expert_tensors.items():
        model.model.layers[layer].mlp.experts.gate_up_proj.data = gate_up
        model.model.layers[layer].mlp.experts.down_proj.data = down
    return model


def dequantize_checkpoint_experts(folder):
    """{layer: (gate_up, down)} decoded from the quantized checkpoint's tensors with the format reference."""
    tensors = load_file(folder / "model.safetensors")
    experts = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        prefix = f"model.llm.layers.{layer}.mlp.experts."
        decoded = []
        for matrix in ("w13_weight", "w2_weight"):
            weight, scale = tensors[prefix + matrix], tensors[prefix + matrix + "_scale"]
            outer = tensors.get(prefix + matrix + "_scale_2")
            decoded.append(
                qf.dequantize_expert_weights(weight, scale, outer, interleaved=matrix == "w13_weight", dtype=torch.float32)
            )
        experts[layer] = tuple(decoded)
    return experts


def test_quantize_tool_writes_the_official_mixed_layout(checkpoints):
    tensors = load_file(checkpoints / "mixed" / "model.safetensors")
    w13 = "model.llm.layers.{}.mlp.experts.w13_weight"
    assert tensors[w13.format(0)].dtype == torch.uint8 and tensors[w13.format(0)].shape == (8, 64, 32)
    assert tensors[w13.format(0) + "_scale"].dtype == torch.float8_e4m3fn
    assert tensors[w13.format(0) + "_scale_2"].shape == (8, 2)  # gate and up halves
    assert tensors[w13.format(5)].dtype == torch.float8_e4m3fn and tensors[w13.format(5) + "_scale"].dtype == torch.uint8
    sidecar = json.loads((checkpoints / "mixed" / "hf_quant_config.json").read_text())
    assert sidecar["quantization"]["quantized_layers"]["model.llm.layers.4.mlp.experts"]["quant_algo"] == "MXFP8"


def test_quantize_tool_copies_the_drafters_mtp_file_unchanged(checkpoints, tmp_path):
    """The official layout ships the BF16 drafter as `mtp.safetensors` beside the shards: quantizing keeps it."""
    shutil.copytree(checkpoints / "bf16", tmp_path / "bf16")
    drafter = {"mtp.fc.weight": torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).bfloat16()}
    save_file(drafter, tmp_path / "bf16" / "mtp.safetensors")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "mixed", mxfp8_from=4)
    assert torch.equal(load_file(tmp_path / "mixed" / "mtp.safetensors")["mtp.fc.weight"], drafter["mtp.fc.weight"])


def test_quantized_model_equals_the_model_on_explicitly_dequantized_weights(checkpoints):
    quantized = Inkling2ForCausalLM.from_pretrained(checkpoints / "mixed")
    formats = [type(layer.mlp.experts).__name__ + getattr(layer.mlp.experts, "format", "") for layer in quantized.model.layers]
    assert formats == ["Inkling2QuantizedExpertsnvfp4"] * 4 + ["Inkling2QuantizedExpertsmxfp8"] * 2
    # experts stay packed: no floating-point copy of them anywhere in the model
    assert not any(isinstance(module, Inkling2Experts) for module in quantized.modules())
    reference = dequantized_model(checkpoints, dequantize_checkpoint_experts(checkpoints / "mixed"))
    expected = logits(reference)
    assert (logits(quantized) - expected).abs().max() <= 1e-4
    # and quantization changed the model a little, not nothing
    assert (logits(Inkling2ForCausalLM.from_pretrained(checkpoints / "bf16")) - expected).abs().max() > 1e-3


def test_quantized_model_saves_the_same_layout_back(checkpoints, tmp_path):
    Inkling2ForCausalLM.from_pretrained(checkpoints / "mixed").save_pretrained(tmp_path)
    saved, original = load_file(tmp_path / "model.safetensors"), load_file(checkpoints / "mixed" / "model.safetensors")
    assert saved.keys() == original.keys()
    for name in saved:
        assert saved[name].dtype == original[name].dtype
        assert torch.equal(saved[name].view(torch.uint8) if saved[name].element_size() == 1 else saved[name],
                           original[name].view(torch.uint8) if original[name].element_size() == 1 else original[name]), name


# --- a checkpoint written by hand from the format rules, independently of our writer ---------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def hand_nvfp4(generator, experts, rows, columns, per_half):
    """Random codes and block scales; compressed-tensors' `weight_global_scale` (a divisor). Returns the tensors
    and the fp32 weights they encode, rows interleaved (gate, up) as in the original layout."""
    codes = torch.randint(0, 16, (experts, rows, columns), generator=generator, dtype=torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble: even input index
    magnitude = torch.tensor(E2M1)[(codes & 7).long()]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    scale_bytes = torch.randint(0x30, 0x48, (experts, rows, columns // 16), generator=generator, dtype=torch.uint8)
    block_scale = scale_bytes.view(torch.float8_e4m3fn)
    global_scale = torch.rand(experts, 2 if per_half else 1, generator=generator) * 4 + 0.5
    divisor_per_row = global_scale.repeat_interleave(rows // global_scale.shape[1], dim=1) if not per_half else \
        global_scale[:, None, :].expand(experts, rows // 2, 2).reshape(experts, rows)
    weights = values * block_scale.float().repeat_interleave(16, -1) / divisor_per_row[..., None]
    return packed, block_scale, global_scale.squeeze(-1) if not per_half else global_scale, weights


def hand_mxfp8(generator, experts, rows, columns):
    value_bytes = torch.randint(0, 256, (experts, rows, columns), generator=generator, dtype=torch.uint8)
    value_bytes[(value_bytes & 0x7F) == 0x7F] = 0x38  # E4M3's NaN bytes are not weights
    scale_bytes = torch.randint(118, 130, (experts, rows, columns // 32), generator=generator, dtype=torch.uint8)
    weights = value_bytes.view(torch.float8_e4m3fn).float() * torch.exp2(scale_bytes.float() - 127).repeat_interleave(32, -1)
    return value_bytes.view(torch.float8_e4m3fn), scale_bytes, weights


def deinterleave(rows_interleaved):
    return torch.cat([rows_interleaved[:, 0::2], rows_interleaved[:, 1::2]], dim=1)


def write_hand_checkpoint(checkpoints, target, damage=None):
    """Layer 0 NVFP4 (global-scale divisor, per-half w13), layer 1 MXFP8, the rest as in the BF16 checkpoint."""
    tensors = load_file(checkpoints / "bf16" / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    experts, inner, hidden = CONFIG["n_routed_experts"], CONFIG["moe_intermediate_size"], CONFIG["hidden_size"]
    expected = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        prefix = f"model.llm.layers.{layer}.mlp.experts."
        if layer == 0:
            w13, s13, g13, f13 = hand_nvfp4(generator, experts, 2 * inner, hidden, per_half=True)
            w2, s2, g2, f2 = hand_nvfp4(generator, experts, hidden, inner, per_half=False)
            tensors.update({prefix + "w13_weight": w13, prefix + "w13_weight_scale": s13, prefix + "w13_weight_global_scale": g13,
                            prefix + "w2_weight": w2, prefix + "w2_weight_scale": s2, prefix + "w2_weight_global_scale": g2})
        elif layer == 1:
            w13, s13, f13 = hand_mxfp8(generator, experts, 2 * inner, hidden)
            w2, s2, f2 = hand_mxfp8(generator, experts, hidden, inner)
            tensors.update({prefix + "w13_weight": w13, prefix + "w13_weight_scale": s13,
                            prefix + "w2_weight": w2, prefix + "w2_weight_scale": s2})
        else:
            continue
        expected[layer] = (deinterleave(f13), f2)
    if damage:
        damage(tensors)
    target.mkdir()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text((checkpoints / "bf16" / "config.json").read_text())
    return expected


def test_reader_accepts_a_checkpoint_written_by_hand_from_the_format_rules(checkpoints, tmp_path):
    expected = write_hand_checkpoint(checkpoints, tmp_path / "hand")
    quantized = Inkling2ForCausalLM.from_pretrained(tmp_path / "hand")
    assert quantized.config.expert_quantization["formats"][:2] == ["nvfp4", "mxfp8"]
    assert quantized.config.expert_quantization["nvfp4_outer_scales"] == ["global_scale"]
    for layer, (gate_up, down) in expected.items():
        experts = quantized.model.layers[layer].mlp.experts
        decoded_gate_up, decoded_down = experts.expert_weights(3)
        # the divisor becomes a multiplier: equal up to one rounding
        assert torch.allclose(decoded_gate_up, gate_up[3], rtol=1e-6, atol=0)
        assert torch.allclose(decoded_down, down[3], rtol=1e-6, atol=0)
    assert (logits(quantized) - logits(dequantized_model(checkpoints, expected))).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t["model.llm.layers.1.mlp.experts.w2_weight_scale"].view(-1).__setitem__(7, 255), "NaN or infinite"),
        (lambda t: t.__setitem__("model.llm.layers.0.mlp.experts.w2_weight_scale", torch.zeros(8, 64, 3, dtype=torch.float8_e4m3fn)), r"needs NVFP4 block scales .* shape \[8, 64, 2\]"),
        (lambda t: t.pop("model.llm.layers.0.mlp.experts.w13_weight_global_scale"), "no outer scale"),
        (lambda t: t.__setitem__("model.llm.layers.1.mlp.experts.w13_weight", torch.zeros(8, 64, 64, dtype=torch.int8)), "Unknown expert weight layout"),
        (lambda t: t.__setitem__("model.llm.layers.1.mlp.experts.w13_weight_bias", torch.zeros(8)), "Unknown expert tensors"),
        (lambda t: t["model.llm.layers.0.mlp.experts.w2_weight_scale"].view(torch.uint8).view(-1).__setitem__(5, 0xB8), "negative block scales"),
        (lambda t: t["model.llm.layers.1.mlp.experts.w13_weight"].view(torch.uint8).view(-1).__setitem__(9, 0x7F), "float8_e4m3fn NaN values"),
    ],
    ids=["nan-scale", "scale-shape", "no-outer-scale", "unknown-dtype", "unknown-tensor", "negative-scale", "nan-value"],
)
def test_broken_quantized_checkpoints_are_clear_errors(checkpoints, tmp_path, damage, message):
    write_hand_checkpoint(checkpoints, tmp_path / "broken", damage)
    with pytest.raises(qf.QuantizedFormatError, match=message):
        Inkling2ForCausalLM.from_pretrained(tmp_path / "broken")


def test_sidecar_that_disagrees_with_the_tensors_is_a_clear_error(checkpoints, tmp_path):
    write_hand_checkpoint(checkpoints, tmp_path / "sidecar")
    sidecar = {"quantization": {"quantized_layers": {"model.llm.layers.0.mlp.experts": {"quant_algo": "MXFP8"}}}}
    (tmp_path / "sidecar" / "hf_quant_config.json").write_text(json.dumps(sidecar))
    with pytest.raises(qf.QuantizedFormatError, match="says layer 0's experts are mxfp8, but its tensors are nvfp4"):
        Inkling2ForCausalLM.from_pretrained(tmp_path / "sidecar")


def test_grouped_bf16_experts_equal_the_reference_loop():
    config = Inkling2TextConfig(**CONFIG)
    experts = randomize_(Inkling2Experts(config), seed=2)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=generator)
    expert_ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(37)])
    weights = torch.rand(37, 2, generator=generator) * 4
    config._experts_implementation = "eager"
    reference = experts(x, expert_ids, weights)
    config._experts_implementation = "grouped_mm"
    assert (experts(x, expert_ids, weights) - reference).abs().max() <= 1e-5 * reference.abs().max()
    experts_bf16, x_bf16 = experts.to(torch.bfloat16), x.to(torch.bfloat16)
    grouped = experts_bf16(x_bf16, expert_ids, weights).float()
    config._experts_implementation = "eager"
    loop = experts_bf16(x_bf16, expert_ids, weights).float()
    assert ((grouped - loop).norm() / loop.norm()).item() <= 1e-2


def test_grouped_experts_split_long_inputs_into_chunks_with_the_same_result(monkeypatch):
    from transformers.integrations import moe

    from transformers_inkling2.modeling import experts as experts_module

    config = Inkling2TextConfig(**CONFIG)
    config._experts_implementation = "grouped_mm"
    experts = randomize_(Inkling2Experts(config), seed=4)
    generator = torch.Generator().manual_seed(4)
    x, expert_ids = torch.randn(50, 64, generator=generator), torch.randint(0, 8, (50, 2), generator=generator)
    weights = torch.rand(50, 2, generator=generator)
    whole = experts(x, expert_ids, weights)
    monkeypatch.setattr(experts_module, "MAX_GROUPED_ELEMENTS", 2 * 2 * 64 * 7)  # chunks of 7 tokens
    grouped = Mock(wraps=moe.grouped_mm_experts_forward)
    monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, "grouped_mm", grouped)
    assert torch.allclose(experts(x, expert_ids, weights), whole, atol=1e-6, rtol=1e-5)
    assert grouped.call_count == 8


def test_quantized_experts_are_frozen_and_survive_a_dtype_cast(checkpoints):
    quantized = Inkling2ForCausalLM.from_pretrained(checkpoints / "mixed")
    experts = quantized.model.layers[0].mlp.experts
    assert isinstance(experts, Inkling2QuantizedExperts)
    assert not any(name.startswith("model.layers.0.mlp.experts") for name, _ in quantized.named_parameters())
    before = {name: buffer.clone() for name, buffer in experts.named_buffers()}
    quantized.to(torch.bfloat16)
    for name, buffer in experts.named_buffers():
        assert buffer.dtype == before[name].dtype and torch.equal(buffer.view(torch.uint8), before[name].view(torch.uint8))


def test_small_modules_keep_dequantized_experts_that_follow_their_buffers(checkpoints, monkeypatch):
    """The CPU reference path keeps the dequantized experts of small modules: the same logits as dequantizing at every
    use, a fresh dequantization once a packed buffer is written in place, and no cache past the size bound."""
    from transformers_inkling2.quantization import experts as experts_module

    quantized = Inkling2ForCausalLM.from_pretrained(checkpoints / "mixed")
    cached = logits(quantized)
    experts = quantized.model.layers[0].mlp.experts
    assert experts.__dict__["_dequantized"][1]  # the forward filled it
    monkeypatch.setattr(experts_module, "DEQUANTIZED_CACHE_BYTES", 0)
    assert torch.equal(logits(quantized), cached)
    monkeypatch.undo()
    before = experts.expert_weights(1)[0].clone()
    with torch.no_grad():
        experts.gate_up_proj[1].bitwise_xor_(0x11)  # other E2M1 codes in place: same pointer, a new version
    after = experts.expert_weights(1)[0]
    assert not torch.equal(after, before) and torch.equal(after, experts.dequantized_expert(1)[0])
    large = Inkling2ForCausalLM.from_pretrained(checkpoints / "mixed").model.layers[0].mlp.experts
    monkeypatch.setattr(experts_module, "DEQUANTIZED_CACHE_BYTES", 1)
    large.expert_weights(0)
    assert "_dequantized" not in large.__dict__


def test_quantized_experts_built_on_the_meta_device_materialize_with_to_empty():
    """`to_empty()` (meta-device construction, then storage on a real device) gives the packed buffers their own
    dtypes and shapes, where a move would find no data to copy."""
    formats = ["nvfp4"] * 3 + ["mxfp8"] * 3
    config = Inkling2TextConfig(**CONFIG, expert_quantization={"formats": formats, "nvfp4_outer_scales": ["scale_2"]})
    with torch.device("meta"):
        model = Inkling2ForCausalLM(config)
    packed = {name: (buffer.dtype, buffer.shape) for name, buffer in model.named_buffers() if ".experts." in name}
    model.to_empty(device="cpu")
    assert packed and all(buffer.device.type == "cpu" for buffer in model.buffers())
    assert {name: (b.dtype, b.shape) for name, b in model.named_buffers() if ".experts." in name} == packed


@pytest.mark.parametrize("layer", [0, 5], ids=["nvfp4", "mxfp8"])
def test_the_hub_kernel_loads_and_its_reference_agrees_with_the_model_on_cpu(checkpoints, layer):
    """The kernel the model loads (`kernel_loading.moe_kernel`, through the `kernels` library) takes the experts'
    buffers as they are; on CPU tensors it runs its own PyTorch reference."""
    experts = Inkling2ForCausalLM.from_pretrained(checkpoints / "mixed").model.layers[layer].mlp.experts
    generator = torch.Generator().manual_seed(layer)
    x = torch.randn(9, 64, generator=generator)
    expert_ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=generator)
    kernel = experts.run_kernel(x, expert_ids, weights)
    reference = experts.loop_over_experts(x, expert_ids, weights)
    assert ((kernel - reference).norm() / reference.norm()).item() <= 1e-2


def test_the_hub_kernel_is_one_opaque_op_under_torch_compile(checkpoints):
    """`torch.compile` (the compiled decode steps, fullgraph) calls the kernel as the custom op
    `inkling2::routed_experts` instead of tracing into it: traced, its Gluon decode kernels would go to Inductor's
    Triton compiler, which cannot build them."""
    from transformers_inkling2.backends.kernel_loading import routed_experts

    experts = Inkling2ForCausalLM.from_pretrained(checkpoints / "mixed").model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(3, 64, generator=generator)
    expert_ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(3)])
    weights = torch.rand(3, 2, generator=generator)
    graphs = []

    def recording_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(experts.run_kernel, backend=recording_backend, fullgraph=True)
    assert torch.equal(compiled(x, expert_ids, weights), experts.run_kernel(x, expert_ids, weights))
    targets = [node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.inkling2.routed_experts.default in targets
    kernel_arguments = dict(gate_cap=experts.gate_cap, up_cap=experts.up_cap, **experts.kernel_weights())
    torch.library.opcheck(routed_experts, (x.to(torch.bfloat16), expert_ids, weights), kernel_arguments,
                          test_utils="test_faketensor")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [0, 5], ids=["nvfp4", "mxfp8"])
def test_compiled_decode_calls_the_gluon_kernels_as_they_are(tmp_path, layer):
    """Decode-size calls with widths the Gluon register kernels take (H, I multiples of 256), compiled like the
    decode steps of `generate(..., compile_config=...)`: the same output as eager, bit for bit."""
    config = {**CONFIG, "hidden_size": 256, "moe_intermediate_size": 256, "n_routed_experts": 16, "num_experts_per_tok": 4}
    model = randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**config)), seed=8).eval()
    model.save_pretrained(tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "mixed", mxfp8_from=4)
    quantized = Inkling2ForCausalLM.from_pretrained(tmp_path / "mixed", dtype=torch.bfloat16)
    experts = quantized.model.layers[layer].mlp.experts.to("cuda")
    compiled = torch.compile(experts, fullgraph=True)
    generator = torch.Generator().manual_seed(layer)
    for tokens in (1, 4):
        x = torch.randn(tokens, 256, generator=generator).to("cuda", torch.bfloat16)
        expert_ids = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(tokens)]).cuda()
        weights = (torch.rand(tokens, 4, generator=generator) * 2).cuda()
        with torch.no_grad():
            assert torch.equal(compiled(x, expert_ids, weights), experts(x, expert_ids, weights))


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [0, 5], ids=["nvfp4", "mxfp8"])
def test_quantized_experts_on_gpu_run_the_hub_kernel_and_match_the_reference(tmp_path, layer):
    """On CUDA the packed experts of a loaded model go through the inkling2_moe kernel; the reference dequantizes
    each expert (fp32). Compared on one MoE layer with the same routing, fresh random bf16 activations."""
    config = {**CONFIG, "hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 16, "num_experts_per_tok": 4}
    model = randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**config)), seed=6).eval()
    model.save_pretrained(tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "mixed", mxfp8_from=4)
    quantized = Inkling2ForCausalLM.from_pretrained(tmp_path / "mixed", dtype=torch.bfloat16)
    experts = quantized.model.layers[layer].mlp.experts
    generator = torch.Generator().manual_seed(layer)
    x = torch.randn(37, 256, generator=generator).to(torch.bfloat16)
    expert_ids = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(37)])
    weights = torch.rand(37, 4, generator=generator) * 2
    reference = experts.loop_over_experts(x.float(), expert_ids, weights)
    kernel = experts.to("cuda")(x.cuda(), expert_ids.cuda(), weights.cuda()).float().cpu()
    assert ((kernel - reference).norm() / reference.norm()).item() <= 1e-2


@pytest.mark.gpu
def test_bf16_experts_run_the_hub_kernel_for_inference_on_gpu(monkeypatch):
    """BF16 experts on CUDA without gradients take the fused kernel (not the grouped GEMMs) and agree with the
    reference loop; with gradients flowing they run transformers' grouped GEMMs."""
    config = Inkling2TextConfig(**{**CONFIG, "hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 16})
    experts = randomize_(Inkling2Experts(config), seed=7).to("cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(37, 256, generator=generator).to("cuda", torch.bfloat16)
    expert_ids = torch.stack([torch.randperm(16, generator=generator)[:2] for _ in range(37)]).cuda()
    weights = (torch.rand(37, 2, generator=generator) * 2).cuda()
    config._experts_implementation = "eager"
    reference = experts(x.float(), expert_ids, weights).float()
    config._experts_implementation = "grouped_mm"
    from transformers.integrations import moe

    grouped = Mock(wraps=moe.grouped_mm_experts_forward)
    monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, "grouped_mm", grouped)
    with torch.no_grad():
        kernel = experts(x, expert_ids, weights).float()
    assert not grouped.called
    assert ((kernel - reference).norm() / reference.norm()).item() <= 1e-2
    experts(x.requires_grad_(), expert_ids, weights)
    assert grouped.call_count == 1
