"""The DSpark drafter (`dspark/`, the drafter model in `modeling/modeling_inkling2_dspark.py`): its config, its
checkpoints (saved with the target, the official `mtp.safetensors` loader) and its training. Decoding with it:
`tests/generation/test_dspark_decoding.py`."""

import json
import logging

import pytest
import torch
from inkling2_helpers import (
    DRAFTER,
    MULTIMODAL_CONFIG,
    ORACLE_TEXT_CONFIG,
    build_with_drafter,
    dspark_generate,
    greedy_generate,
    left_padded_batch,
)
from safetensors.torch import load_file, save_file

from transformers_inkling2 import (
    Inkling2Config,
    Inkling2DSparkConfig,
    Inkling2ForCausalLM,
    Inkling2ForConditionalGeneration,
    Inkling2TextConfig,
)


@pytest.fixture(scope="module")
def model():
    return build_with_drafter()


# --- config --------------------------------------------------------------------------------------------------------


def test_config_defaults_and_mirroring():
    config = Inkling2DSparkConfig()
    assert (config.block_size, config.markov_rank, config.head_type, config.mask_token_id) == (7, 256, "rnn", 200064)
    multimodal = Inkling2Config(**MULTIMODAL_CONFIG, dspark_config=DRAFTER)
    assert multimodal.text_config.dspark_config is multimodal.dspark_config


# --- checkpoints ---------------------------------------------------------------------------------------------------


def test_save_and_load_keep_the_drafter(model, tmp_path):
    model.save_pretrained(tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    # the target's renamings to the original layout leave the drafter's names alone
    assert {name for name in names if name.startswith("dspark.")} == {f"dspark.{k}" for k in model.dspark.state_dict()}
    loaded = Inkling2ForCausalLM.from_pretrained(tmp_path).eval()
    for name, tensor in model.dspark.state_dict().items():
        assert torch.equal(loaded.dspark.state_dict()[name], tensor), name
    input_ids, attention_mask = left_padded_batch(seed=13, length=9, pad=2)
    assert torch.equal(
        dspark_generate(loaded, input_ids, attention_mask, 10), greedy_generate(model, input_ids, attention_mask, 10)
    )


def write_official_layout(model, folder, drafter_names=lambda name: f"model.mtp.{name}", with_config=True):
    """The target as usual plus the drafter in a separate `mtp.safetensors`."""
    target = Inkling2ForCausalLM(Inkling2TextConfig(**ORACLE_TEXT_CONFIG))
    target.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("dspark.")})
    target.save_pretrained(folder)
    drafter = {drafter_names(name): tensor.contiguous() for name, tensor in model.dspark.state_dict().items()}
    save_file(
        {name.replace("context_norm.", "hidden_norm."): t for name, t in drafter.items()}, folder / "mtp.safetensors"
    )
    if with_config:
        config = json.loads((folder / "config.json").read_text())
        config["dspark_config"] = DRAFTER
        (folder / "config.json").write_text(json.dumps(config))


def test_mtp_file_loads_into_the_drafter(model, tmp_path):
    write_official_layout(model, tmp_path)
    loaded = Inkling2ForCausalLM.from_pretrained(tmp_path).eval()
    for name, tensor in model.dspark.state_dict().items():
        assert torch.equal(loaded.dspark.state_dict()[name], tensor), name


def test_unmappable_mtp_file_disables_dspark_with_a_warning(model, tmp_path, caplog):
    write_official_layout(model, tmp_path, drafter_names=lambda name: f"speculator.{name}")
    with caplog.at_level(logging.WARNING):
        loaded = Inkling2ForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.dspark is None
    assert "DSpark disabled" in caplog.text and "speculator." in caplog.text
    input_ids, attention_mask = left_padded_batch(seed=14, length=9, pad=2)
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids, attention_mask=attention_mask).logits,
            model(input_ids, attention_mask=attention_mask).logits,
        )


def test_mtp_file_without_a_drafter_config_needs_the_tapped_layers(model, tmp_path, caplog):
    """Without `dspark_config`, the shape is read off the tensors, but the tapped layers cannot be: disabled."""
    write_official_layout(model, tmp_path, with_config=False)
    with caplog.at_level(logging.WARNING):
        loaded = Inkling2ForCausalLM.from_pretrained(tmp_path)
    assert loaded.dspark is None and "target_layer_ids" in caplog.text


# --- training ------------------------------------------------------------------------------------------------------


def test_a_drafter_distilled_from_its_target_drafts_several_tokens_per_step():
    """End to end on a deterministic language (a 13-token cycle): train the target, let it write its own training
    text, distill the drafter, and decode with it; the drafts must be accepted several at a time."""
    from transformers_inkling2.dspark.training import (
        attach_new_drafter,
        default_dspark_config,
        target_written_windows,
        token_windows,
        train_dspark,
        window_batches,
    )

    torch.manual_seed(0)
    model = build_with_drafter(seed=2, drafter=dict(target_layer_ids=[1, 3]), num_hidden_layers=6, layer_types=None)
    tokens = torch.randperm(40)[torch.arange(5000) % 13]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _, input_ids in zip(range(40), token_windows(tokens, 48, 8)):
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    attach_new_drafter(model, default_dspark_config(model.config, num_draft_layers=1, markov_rank=16))
    windows = target_written_windows(model, tokens, count=16, window=48, batch_size=16)
    losses = train_dspark(model, window_batches(windows, 8), steps=200, learning_rate=3e-3, anchors_per_window=8)
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5])
    prompt = tokens[None, 3:23]
    out = dspark_generate(model, prompt, torch.ones_like(prompt), 40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy_generate(model, prompt, torch.ones_like(prompt), 40))
    assert out.mean_accepted_length >= 4


def test_train_dspark_command_writes_a_loadable_model(tmp_path):
    from transformers_inkling2_cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The sea is calm tonight. The tide is full, the moon lies fair upon the straits. " * 20)
    main(["train-dspark", "--output", str(tmp_path / "out"), "--corpus", str(corpus), "--steps", "2", "--window", "64",
          "--batch-size", "2", "--anchors", "4", "--device", "cpu", "--self-distill", "2"])  # fmt: skip
    assert Inkling2ForConditionalGeneration.from_pretrained(tmp_path / "out").dspark is not None


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_drafter_attention_equals_sdpa(dtype, tolerance):
    """The drafter's plain-matmul attention against PyTorch's SDPA on fresh random inputs, grouped heads, masked keys."""
    from transformers_inkling2.modeling.modeling_inkling2_dspark import attend

    generator = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(shape, generator=generator).to(dtype) for shape in ((2, 8, 14, 16), (2, 2, 30, 16), (2, 2, 30, 16)))
    bias = torch.randn(2, 8, 14, 30, generator=generator)
    bias[..., :5] = float("-inf")
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=bias, enable_gqa=True
    )
    actual = attend(q, k, v, bias).float()
    assert (actual - expected).norm() / expected.norm() < tolerance
