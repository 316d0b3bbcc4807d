"""`inkling2 train-nano` end to end at toy size on the CPU: it trains (pausing and resuming exactly), distills the
drafter, quantizes and writes a checkpoint that loads and answers; its command-line defaults are the recipe's
(`NANO_DEFAULTS`)."""

import json

import pytest
import torch

from transformers_inkling2.nano.training import NANO_DEFAULTS, NANO_DRAFTER_LAYERS, NANO_MAX_BYTES, NANO_MXFP8_FROM
from transformers_inkling2_cli import build_parser, main


def test_the_command_line_defaults_are_the_recipe():
    args = build_parser().parse_args(["train-nano", "--output", "x"])
    for name in ("steps", "batch_size", "learning_rate", "drafter_steps", "seed"):
        assert getattr(args, name) == NANO_DEFAULTS[name], name


def test_train_nano_writes_a_quantized_checkpoint_with_its_drafter_and_report(tmp_path, capsys):
    from transformers_inkling2.nano import load_nano

    out = tmp_path / "nano"
    command = ["train-nano", "--output", str(out), "--steps", "3", "--batch-size", "4", "--drafter-steps", "2",
               "--workers", "0", "--held-out", "0", "--device", "cpu"]  # fmt: skip
    main([*command, "--max-minutes", "0"])  # a machine that runs commands for a limited time: pause, then again
    assert "paused at step 1 of 3" in capsys.readouterr().out and not out.exists()
    main(command)
    assert f"wrote {out}" in capsys.readouterr().out and not (tmp_path / "nano.partial").exists()
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 3 and report["invocations"] == 2 and report["timings"]["model_s"] > 0
    formats = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert sorted({entry["quant_algo"] for entry in formats.values()}) == ["MXFP8", "NVFP4"]
    assert all((entry["quant_algo"] == "NVFP4") == (int(name.split(".")[-3]) < NANO_MXFP8_FROM)
               for name, entry in formats.items())  # fmt: skip
    assert report["checkpoint_bytes"] <= NANO_MAX_BYTES  # every size is the recipe's, only the steps are few
    model, processor = load_nano(path=out)
    assert len(model.dspark.layers) == NANO_DRAFTER_LAYERS
    inputs = processor.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")  # fmt: skip
    assert model.generate(**inputs, max_new_tokens=3, do_sample=False).shape[1] == inputs["input_ids"].shape[1] + 3
    assert torch.isfinite(model(**inputs).logits).all()


def test_a_paused_run_resumed_trains_exactly_as_one_that_never_stopped(tmp_path):
    """Each invocation builds the model afresh, as `train_nano` does; a deadline already past pauses after one step."""
    from transformers_inkling2 import Inkling2ForConditionalGeneration
    from transformers_inkling2.nano.training import build_nano_processor, nano_config, train_language_model

    processor = build_nano_processor()

    def train(state, deadline=None):
        torch.manual_seed(0)
        model = Inkling2ForConditionalGeneration(nano_config(processor.tokenizer))
        return model, train_language_model(model, processor, 3, 2, 1e-3, 0, 0, state, deadline)

    straight, done = train(tmp_path / "straight")
    assert done.step == 3 and (tmp_path / "straight" / "training.pt").exists()  # kept until the checkpoint is written
    for step in (1, 2):
        _, paused = train(tmp_path / "paused", deadline=0.0)
        assert paused.step == step and (tmp_path / "paused" / "training.pt").exists()
    resumed, finished = train(tmp_path / "paused")
    assert finished.step == 3 and finished.invocations == 3 and finished.losses == done.losses
    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name


def test_a_run_that_fails_after_the_model_trained_continues_with_the_drafter(tmp_path, monkeypatch):
    """The recipe's first H200 run lost 19 minutes of the model's training to an error in the drafter's phase."""
    from transformers_inkling2.nano import load_nano, training

    def fails(*args):
        raise OSError("no drafter")

    drafter = training.train_nano_drafter
    monkeypatch.setattr(training, "train_nano_drafter", fails)
    arguments = dict(steps=2, batch_size=2, drafter_steps=2, workers=0, held_out=0, device="cpu")
    with pytest.raises(OSError, match="no drafter"):
        training.train_nano(tmp_path / "nano", **arguments)
    trained = torch.load(tmp_path / "nano.partial" / "training.pt", weights_only=True)["model"]
    monkeypatch.setattr(training, "train_nano_drafter", drafter)
    monkeypatch.setattr(training, "written_token_loss", lambda *args: pytest.fail("the model was trained again"))
    report = training.train_nano(tmp_path / "nano", **arguments)
    assert report["invocations"] == 2 and not (tmp_path / "nano.partial").exists()
    model, _ = load_nano(path=tmp_path / "nano")
    embedding = next(tensor for name, tensor in trained.items() if name.endswith("embed_tokens.weight"))
    assert torch.equal(model.get_input_embeddings().weight, embedding.bfloat16().float())


def test_the_drafters_text_comes_back_from_the_workers_in_few_tensors():
    """Each tensor a DataLoader worker returns holds a file descriptor while it lives: the drafter's 32,768
    conversations, once returned one by one and kept, ran out of them on the H200."""
    import resource

    from transformers_inkling2.nano.training import build_nano_processor, drafter_text

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        text = drafter_text(build_nano_processor(), seed=0, conversations=400, workers=2)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert text.ndim == 1 and len(text) > 400 * 50


def test_the_vision_tower_trains_at_a_tenth_of_the_rate_and_norms_without_decay():
    from transformers_inkling2 import Inkling2ForConditionalGeneration
    from transformers_inkling2.nano.training import build_nano_processor, nano_config, parameter_groups

    model = Inkling2ForConditionalGeneration(nano_config(build_nano_processor().tokenizer))
    groups = parameter_groups(model, 3e-3)
    grouped = [id(p) for group in groups for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each parameter once
    rate = {id(p): group["lr"] for group in groups for p in group["params"]}
    decay = {id(p): group["weight_decay"] for group in groups for p in group["params"]}
    for name, parameter in model.named_parameters():
        assert rate[id(parameter)] == pytest.approx(3e-4 if name.startswith("model.vision_tower.") else 3e-3), name
        assert (decay[id(parameter)] > 0) == (parameter.ndim >= 2 and "norm" not in name), name
