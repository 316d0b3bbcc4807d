"""`inkling2 train-nano` end to end at toy size on the CPU: it trains, distills the drafter, quantizes and writes a
checkpoint that loads and answers; its command-line defaults are the shipped weights' recipe."""

import json

import torch

from transformers_inkling2.nano.training import NANO_DEFAULTS, NANO_MXFP8_FROM
from transformers_inkling2_cli import build_parser, main


def test_the_command_line_defaults_are_the_shipped_recipe():
    args = build_parser().parse_args(["train-nano", "--output", "x"])
    for name in ("steps", "batch_size", "learning_rate", "drafter_steps", "seed"):
        assert getattr(args, name) == NANO_DEFAULTS[name], name


def test_train_nano_writes_a_quantized_checkpoint_with_its_drafter_and_report(tmp_path, capsys):
    from transformers_inkling2.nano import load_nano

    out = tmp_path / "nano"
    main(["train-nano", "--output", str(out), "--steps", "3", "--batch-size", "4", "--drafter-steps", "2",
          "--workers", "0", "--held-out", "0", "--device", "cpu"])  # fmt: skip
    assert f"wrote {out}" in capsys.readouterr().out
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 3 and len(report["loss_every_100_steps"]) == 1 and report["timings"]["total_s"] > 0
    formats = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert sorted({entry["quant_algo"] for entry in formats.values()}) == ["MXFP8", "NVFP4"]
    assert all((entry["quant_algo"] == "NVFP4") == (int(name.split(".")[-3]) < NANO_MXFP8_FROM)
               for name, entry in formats.items())  # fmt: skip
    model, processor = load_nano(path=out)
    assert model.dspark is not None
    inputs = processor.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")  # fmt: skip
    assert model.generate(**inputs, max_new_tokens=3, do_sample=False).shape[1] == inputs["input_ids"].shape[1] + 3
    assert torch.isfinite(model(**inputs).logits).all()
