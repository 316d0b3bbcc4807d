"""Where `inkling2 train-nano`'s time goes: the training conversations' throughput (DataLoader workers alone), and
one training step of Inkling-2-Nano (its loss: `written_token_loss`) per attention implementation, with the
fastest step's top CUDA kernels.

    python benchmarks/nano_training.py [--steps 20] [--workers 12]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import transformers_inkling2  # noqa: F401  (registers the attention backends)
from transformers_inkling2.nano.data import ConversationDataset, collate
from transformers_inkling2.nano.training import build_nano_processor, nano_config, written_token_loss


def batches(processor, count: int, batch_size: int, workers: int):
    loader = torch.utils.data.DataLoader(
        ConversationDataset(processor, "benchmark", count * batch_size),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=functools.partial(collate, pad_token_id=processor.tokenizer.pad_token_id),
    )
    return list(loader)


def step_time(model, data, device) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for batch in data:
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
    return sorted(times[2:])[len(times[2:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()
    device = torch.device("cuda")
    processor = build_nano_processor()
    start = time.perf_counter()
    data = batches(processor, args.steps, args.batch_size, args.workers)
    elapsed = time.perf_counter() - start
    tokens = sum(batch["input_ids"].numel() for batch in data)
    print(f"data: {args.steps} batches of {args.batch_size} in {elapsed:.1f} s with {args.workers} workers "
          f"({elapsed / args.steps * 1000:.0f} ms a batch, {tokens / len(data):.0f} padded tokens a batch)")  # fmt: skip
    config = nano_config(processor.tokenizer)
    rows, fastest = [], None
    for attention in ("inkling2_auto", "eager"):
        torch.manual_seed(0)
        model = transformers_inkling2.Inkling2ForConditionalGeneration._from_config(
            config, attn_implementation=attention
        ).to(device)
        model.train()
        rows.append((attention, step_time(model, data, device)))
        if fastest is None or rows[-1][1] < fastest[1]:
            fastest = attention, rows[-1][1], model
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step_time(fastest[2], data[:3], device)
    print(f"the {fastest[0]} step's kernels:")
    print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    for attention, seconds in rows:
        print(f"| {attention} | {seconds * 1000:.1f} ms a step |")

if __name__ == "__main__":
    main()
