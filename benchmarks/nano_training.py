"""Where `inkling2 train-nano`'s time goes: the training conversations' throughput (DataLoader workers alone), and
one training step of Inkling-2-Nano (its loss: `written_token_loss`) per attention implementation and per kind of
batch (training's batches hold one kind each: `OneKindBatches`), with the fastest step's top CUDA kernels.

    python benchmarks/nano_training.py [--steps 20] [--workers 12] [--attention inkling2_auto eager]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import transformers_inkling2  # noqa: F401  (registers the attention backends)
from transformers_inkling2.nano.data import ConversationDataset, OneKindBatches, collate
from transformers_inkling2.nano.training import build_nano_processor, nano_config, written_token_loss


def batches(processor, count: int, batch_size: int, workers: int) -> list[tuple[str, dict]]:
    """(kind, batch) of the first `count` steps of a training stream."""
    sampler = OneKindBatches("benchmark", batch_size, count)
    loader = torch.utils.data.DataLoader(
        ConversationDataset(processor, "benchmark", count * batch_size),
        batch_sampler=sampler,
        num_workers=workers,
        collate_fn=functools.partial(collate, pad_token_id=processor.tokenizer.pad_token_id),
    )
    return [(sampler.kind(step), batch) for step, batch in enumerate(loader)]


def step_times(model, data, device) -> dict[str, float]:
    """Median seconds of a step per kind of batch, and over all (`"all"`), the first two steps left out."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _, batch in data:
        batch = {name: value.to(device) for name, value in batch.items()}
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = written_token_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    kinds = [kind for kind, _ in data]
    medians = {}
    for kind in (*sorted(set(kinds)), "all"):
        kept = sorted(t for i, t in enumerate(times) if i >= 2 and kind in (kinds[i], "all"))
        medians[kind] = kept[len(kept) // 2] if kept else float("nan")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--attention", nargs="+", default=["inkling2_auto", "eager"])
    args = parser.parse_args()
    device = torch.device("cuda")
    processor = build_nano_processor()
    start = time.perf_counter()
    data = batches(processor, args.steps, args.batch_size, args.workers)
    elapsed = time.perf_counter() - start
    tokens = sum(batch["input_ids"].numel() for _, batch in data)
    print(f"data: {args.steps} batches of {args.batch_size} in {elapsed:.1f} s with {args.workers} workers "
          f"({elapsed / args.steps * 1000:.0f} ms a batch, {tokens / len(data):.0f} padded tokens a batch)")  # fmt: skip
    config = nano_config(processor.tokenizer)
    rows, fastest = [], None
    for attention in args.attention:
        torch.manual_seed(0)
        model = transformers_inkling2.Inkling2ForConditionalGeneration._from_config(
            config, attn_implementation=attention
        ).to(device)
        model.train()
        rows.append((attention, step_times(model, data, device)))
        if fastest is None or rows[-1][1]["all"] < fastest[1]:
            fastest = attention, rows[-1][1]["all"], model
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step_times(fastest[2], data[:3], device)
    kernels = [event for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    print(f"the {fastest[0]} step's kernels over 3 steps: {len(kernels)} launched, "
          f"{sum(event.time_range.elapsed_us() for event in kernels) / 1000:.1f} ms of GPU time")  # fmt: skip
    print(profile.key_averages().table(sort_by="device_time_total", row_limit=25))
    for attention, medians in rows:
        print(f"| {attention} | " + " | ".join(f"{kind}: {s * 1000:.1f} ms a step" for kind, s in medians.items()) + " |")

if __name__ == "__main__":
    main()
