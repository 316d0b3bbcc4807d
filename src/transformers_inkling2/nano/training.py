"""`inkling2 train-nano`: trains Inkling-2-Nano from scratch with the package's own model classes, then its DSpark
drafter, quantizes its experts to the official layout and checks it on held-out data.

1. The model: Inkling-2-Small's architecture at toy width (`nano_config`): 8 layers (two of them full attention),
   relative bias, the four convolutions, attention residuals over blocks of 4 layers, 8 routed experts (top-2), a
   4-layer ViT; a tokenizer that keeps o200k's first 8,192 ranks and the 60 special tokens (the whole o200k
   embedding alone, 200k rows, would not fit the 30 MB budget).
2. Next-token loss on what the model writes in the conversations of `data.py` (AdamW, bf16 autocast, fixed seeds).
3. The DSpark drafter, distilled from the frozen model on text conversations (`dspark.training`).
4. `save_pretrained` in BF16, then `quantize_checkpoint`: experts NVFP4 in layers 0-5 and MXFP8 in 6-7, as
   Inkling-2-Small's 0-39 and 40-47.
5. `training_report.json` beside the weights: the losses, the time per phase and the held-out scores.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.utils.logging import tqdm

from ..configuration_inkling2 import Inkling2Config, default_layer_types

NANO_NUM_RANKS = 8192  # o200k's first ranks that Nano's tokenizer keeps
VOCAB_ROW_MULTIPLE = 64  # the embedding's rows: the tokenizer's ids, padded up (8,252 -> 8,256)
NANO_MXFP8_FROM = 6  # layers 0-5 NVFP4, 6-7 MXFP8
NANO_MAX_BYTES = 30 * 1024 * 1024  # the checkpoint ships inside the package
NANO_DEFAULTS = dict(steps=2200, batch_size=128, learning_rate=3e-3, drafter_steps=2400, drafter_batch_size=32,
                     drafter_window=256, seed=0)  # fmt: skip
DRAFTER_KINDS = {"tool": 0.5, "prose": 0.5}  # text conversations: the drafter reads no pictures
# Trained alike, a second drafter layer raised the agreement with the model at block positions 1-5 and the accepted
# length (tool questions 1.77 -> 2.20, documentation 1.47 -> 1.58); three layers with MLPs twice as wide reached 2.53
# on tool questions (documentation 1.50) but would take the checkpoint past 30 MB (benchmarks/nano_drafter.py;
# docs/nano.md). A layer of MLP width 512 costs about 1.2 MB in BF16.
NANO_DRAFTER_LAYERS = 2
# The ViT trains at a tenth of the language model's rate: alone, as a shape classifier, it learns nothing at the
# language model's 3e-3 and 98% of one-shape scenes within 800 steps at 1e-3 or 3e-4 (benchmarks/nano_vision.py).
VISION_LEARNING_RATE_SCALE = 0.1


def build_nano_processor():
    """The tokenizer (o200k's first 8,192 ranks, the 60 special tokens, the chat template) and image processor."""
    from ..processing.image_processing_inkling2 import Inkling2ImageProcessor
    from ..processing.processing_inkling2 import Inkling2Processor
    from ..processing.tokenization_inkling2 import build_inkling2_tokenizer

    tokenizer = build_inkling2_tokenizer(num_ranks=NANO_NUM_RANKS)
    return Inkling2Processor(image_processor=Inkling2ImageProcessor(), tokenizer=tokenizer)


def nano_config(tokenizer) -> Inkling2Config:
    """Inkling-2-Small's architecture at toy width, with the token ids of `tokenizer`."""
    text = dict(
        vocab_size=math.ceil(len(tokenizer) / VOCAB_ROW_MULTIPLE) * VOCAB_ROW_MULTIPLE,
        unpadded_vocab_size=len(tokenizer),
        hidden_size=256,
        num_hidden_layers=8,
        layer_types=default_layer_types(8, full_attention_every=4),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=64,
        sliding_window_size=128,
        rel_extent=128,
        d_rel=8,
        moe_intermediate_size=192,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_layers_per_attn_res_block=4,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, projection_hidden_dim=512,
                  text_hidden_size=256)  # fmt: skip
    image_token_id = tokenizer.convert_tokens_to_ids(tokenizer.image_token)
    return Inkling2Config(text_config=text, vision_config=vision, image_token_id=image_token_id)


def learning_rate_schedule(steps: int, warmup: int):
    """Linear warm-up, then cosine decay to a tenth."""
    return lambda step: min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step / steps, 1))))


def written_token_loss(model, batch: dict) -> torch.Tensor:
    """Cross-entropy on the tokens the model writes (labels other than -100), with logits computed only there: most
    tokens are prompts, and fp32 logits over the whole batch would cost more than the rest of the step."""
    labels = batch["labels"]
    inputs = {name: value for name, value in batch.items() if name != "labels"}
    hidden = model.model(**inputs, use_cache=False, return_dict=True).last_hidden_state
    targets = labels[:, 1:]
    written = targets != -100
    logits = model.compute_logits(hidden[:, :-1][written][None])[0]
    return F.cross_entropy(logits, targets[written])


@dataclass
class Progress:
    """Where a paused `train-nano` stands (`progress.json` in the state folder, beside `training.pt`)."""

    step: int = 0
    losses: list = field(default_factory=list)
    seconds: float = 0.0  # spent on the model in earlier invocations
    invocations: int = 0

    @classmethod
    def load(cls, state: Path) -> Progress:
        file = state / "progress.json"
        return cls(**json.loads(file.read_text())) if file.exists() else cls()

    def save(self, state: Path) -> None:
        (state / "progress.json").write_text(json.dumps(asdict(self)))


def parameter_groups(model, learning_rate: float) -> list[dict]:
    """AdamW's groups: weight decay on matrices but not norms, the vision tower at VISION_LEARNING_RATE_SCALE of the
    rate."""
    vision = {id(p) for p in model.model.vision_tower.parameters()}
    groups = []
    for in_vision in (False, True):
        for decays in (True, False):
            params = [p for n, p in model.named_parameters()
                      if (id(p) in vision) == in_vision and (p.ndim >= 2 and "norm" not in n) == decays]  # fmt: skip
            scale = VISION_LEARNING_RATE_SCALE if in_vision else 1.0
            groups.append({"params": params, "lr": learning_rate * scale, "weight_decay": 0.05 if decays else 0.0})
    return groups


def train_language_model(model, processor, steps: int, batch_size: int, learning_rate: float, seed: int,
                         workers: int, state: Path, deadline: float | None = None) -> Progress:  # fmt: skip
    """Next-token loss on the conversations of stream `train-{seed}`, from where `state` (a folder) says an earlier
    invocation stopped. Step s trains on the batch `OneKindBatches` gives it whatever the invocation, and the
    optimizer and schedule are saved with the weights, so a run paused at `deadline` (`time.monotonic()`) and resumed
    trains exactly as one that never stopped. The state is saved when training finishes too: a later phase of
    `train_nano` that fails then costs a rerun of that phase, not of the model's training. Returns the progress
    (`step == steps` once finished)."""
    from .data import ConversationDataset, OneKindBatches, collate

    progress = Progress.load(state)
    progress.invocations += 1
    device = model.device
    optimizer = torch.optim.AdamW(parameter_groups(model, learning_rate), betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_schedule(steps, max(1, steps // 20)))
    if progress.step:
        saved = torch.load(state / "training.pt", map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
    if progress.step == steps:  # trained by an earlier invocation, which failed afterwards
        progress.save(state)
        model.eval()
        return progress
    stream = f"train-{seed}"
    loader = torch.utils.data.DataLoader(
        ConversationDataset(processor, stream, steps * batch_size),
        batch_sampler=OneKindBatches(stream, batch_size, steps, first_step=progress.step),
        num_workers=workers,
        collate_fn=functools.partial(collate, pad_token_id=processor.tokenizer.pad_token_id),
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )
    model.train()
    started = time.perf_counter()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    bar = tqdm(loader, desc="training Inkling-2-Nano", total=steps, initial=progress.step)
    for batch in bar:
        batch = {name: value.to(device, non_blocking=True) for name, value in batch.items()}
        with autocast:
            loss = written_token_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        progress.losses.append(float(loss.detach()))
        progress.step += 1
        if progress.step % 50 == 0:
            bar.set_postfix(loss=f"{sum(progress.losses[-50:]) / 50:.3f}")
        if deadline is not None and time.monotonic() > deadline and progress.step < steps:
            break
    bar.close()
    model.eval()
    progress.seconds += time.perf_counter() - started
    state.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict()}, state / "training.pt")  # fmt: skip
    progress.save(state)
    return progress


def drafter_text(processor, seed: int, conversations: int, workers: int) -> torch.LongTensor:
    """One token stream of text conversations (tool use and documentation), for the drafter's windows."""
    from .data import ConversationDataset

    dataset = ConversationDataset(processor, f"train-{seed}-drafter", conversations, kinds=DRAFTER_KINDS)
    # the workers join each batch into one tensor: every tensor that comes back from a worker holds a file
    # descriptor while it lives, and tens of thousands of conversations kept one by one run out of them
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=workers, collate_fn=joined_token_ids)
    return torch.cat(list(loader))


def joined_token_ids(examples: list[dict]) -> torch.LongTensor:
    return torch.cat([example["input_ids"] for example in examples])


def train_nano_drafter(model, processor, steps: int, batch_size: int, window: int, seed: int, workers: int):
    """A DSpark drafter (`NANO_DRAFTER_LAYERS` layers, Markov rank 64) distilled from the trained, frozen model on
    random windows of a stream of text conversations; returns its losses."""
    from ..dspark.training import attach_new_drafter, default_dspark_config, token_windows, train_dspark

    text_config = model.config.get_text_config()
    config = default_dspark_config(text_config, num_draft_layers=NANO_DRAFTER_LAYERS, markov_rank=64,
                                   intermediate_size=512)  # fmt: skip
    attach_new_drafter(model, config, seed=seed)
    # about as many tokens as the windows read (a conversation has some 400), so that windows seldom repeat
    stream = drafter_text(processor, seed, max(2000, steps * batch_size * window // 400), workers)
    batches = token_windows(stream, window, batch_size, seed, model.device)
    return train_dspark(model, batches, steps, learning_rate=3e-3, anchors_per_window=32, seed=seed)


def evaluate_nano(model, processor, count: int = 50) -> dict:
    from .evaluation import dspark_accepted_length, scene_accuracy, tool_accuracy

    scenes, tools = scene_accuracy(model, processor, count), tool_accuracy(model, processor, count)
    return {
        "scene_accuracy": scenes.accuracy,
        "tool_accuracy": tools.accuracy,
        **{f"dspark_accepted_length_{kind}_t{temperature}": dspark_accepted_length(model, processor, temperature, kind)
           for kind in ("prose", "tool") for temperature in (0, 1)},
        "scene_failures": scenes.failures[:10],
        "tool_failures": tools.failures[:10],
    }


def train_nano(output: str | Path, steps: int = NANO_DEFAULTS["steps"], batch_size: int = NANO_DEFAULTS["batch_size"],
               learning_rate: float = NANO_DEFAULTS["learning_rate"],
               drafter_steps: int = NANO_DEFAULTS["drafter_steps"],
               drafter_batch_size: int = NANO_DEFAULTS["drafter_batch_size"],
               drafter_window: int = NANO_DEFAULTS["drafter_window"], seed: int = NANO_DEFAULTS["seed"],
               device: str | torch.device = "cuda", workers: int = 12, held_out: int = 50,
               max_minutes: float | None = None) -> dict:  # fmt: skip
    """Trains, quantizes and saves Inkling-2-Nano to `output`; returns the report it writes there (with the scores on
    `held_out` examples of each kind; 0: none). With `max_minutes`, the model's training stops after that many
    minutes, saves its state in `OUTPUT.partial/` and returns `{"paused_at_step": ..., "steps": ...}`; the same call
    again continues from there (once the model is trained, the drafter and the rest run in one go). The trained model
    stays in `OUTPUT.partial/` until the checkpoint is written, so a call that fails after the model's training
    (in the drafter's, say) continues, called again, with the drafter."""
    from ..modeling.modeling_inkling2 import Inkling2ForConditionalGeneration
    from ..quantization.quantize import quantize_checkpoint
    from . import load_nano

    output, device = Path(output), torch.device(device)
    state = output.with_name(output.name + ".partial")
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    torch.manual_seed(seed)
    processor = build_nano_processor()
    model = Inkling2ForConditionalGeneration(nano_config(processor.tokenizer)).to(device)
    progress = train_language_model(model, processor, steps, batch_size, learning_rate, seed, workers, state, deadline)
    if progress.step < steps:
        return {"paused_at_step": progress.step, "steps": steps, "state": str(state)}
    started = time.perf_counter()
    drafter_losses = train_nano_drafter(model, processor, drafter_steps, drafter_batch_size, drafter_window, seed,
                                        workers)  # fmt: skip
    drafter_seconds = time.perf_counter() - started
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    with tempfile.TemporaryDirectory() as bf16:
        model.to(torch.bfloat16).save_pretrained(bf16)
        processor.save_pretrained(bf16)
        if output.exists():
            shutil.rmtree(output)
        quantize_checkpoint(bf16, output, mxfp8_from=NANO_MXFP8_FROM)
    losses = progress.losses
    report = {
        "command": f"inkling2 train-nano --output {output.name} --steps {steps} --seed {seed}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "steps": steps, "batch_size": batch_size, "learning_rate": learning_rate,
        "drafter_steps": drafter_steps, "seed": seed, "invocations": progress.invocations,
        "loss_every_100_steps": [round(sum(losses[i:i + 100]) / len(losses[i:i + 100]), 4)
                                 for i in range(0, len(losses), 100)],
        "drafter_loss_first_last": [round(drafter_losses[0], 4), round(drafter_losses[-1], 4)],
        "checkpoint_bytes": sum(f.stat().st_size for f in output.iterdir()),
        "timings": {"model_s": round(progress.seconds, 1), "drafter_s": round(drafter_seconds, 1)},
    }  # fmt: skip
    if held_out:  # the shipped (quantized) weights, as users load them
        shipped, _ = load_nano(device, path=output)
        report.update(evaluate_nano(shipped, processor, held_out))
    (output / "training_report.json").write_text(json.dumps(report, indent=2, default=str))
    shutil.rmtree(state, ignore_errors=True)
    return report
