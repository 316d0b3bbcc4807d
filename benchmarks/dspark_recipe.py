"""Can the distillation recipe make a drafter follow a predictable target? A CPU check in a few minutes.

A tiny Inkling2 target (`tiny.tiny_text_config`, hidden 96) memorizes a synthetic corpus: 12 random 80-token
sequences over a 60-token vocabulary, concatenated in random order, so that the next token is fixed by the last few
(except at the joins). A fresh drafter is then distilled from it with `train_dspark` (the paper's loss) at each
`--learning-rates`, and its teacher-forced agreement with the target (argmax equal, per block slot) is measured on
new concatenations of the same sequences. A drafter that stays far below the target's predictability points at the
recipe (or a bug), not at the data.

    python3 benchmarks/dspark_recipe.py [--target-steps 300] [--drafter-steps 600] [--learning-rates 1e-3 3e-3 1e-2]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from transformers_inkling2 import Inkling2ForCausalLM  # noqa: E402
from transformers_inkling2.dspark.training import (  # noqa: E402
    attach_new_drafter,
    default_dspark_config,
    random_anchors,
    teacher_forced_loss,
    token_windows,
    train_dspark,
)
from transformers_inkling2.tiny import tiny_text_config  # noqa: E402

VOCAB, SEQUENCES, SEQUENCE_LENGTH, WINDOW = 60, 12, 80, 128


def synthetic_stream(sequences: list[torch.Tensor], count: int, seed: int) -> torch.Tensor:
    order = torch.randint(0, len(sequences), (count,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([sequences[i] for i in order])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-steps", type=int, default=300)
    parser.add_argument("--drafter-steps", type=int, default=600)
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, VOCAB, (SEQUENCE_LENGTH,), generator=generator) for _ in range(SEQUENCES)]
    train, held_out = synthetic_stream(sequences, 600, seed=1), synthetic_stream(sequences, 40, seed=2)
    config = tiny_text_config(vocab_size=64, unpadded_vocab_size=VOCAB, hidden_size=96, sliding_window_size=64,
                              rel_extent=64, eos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    model = Inkling2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    for _, input_ids in zip(range(args.target_steps), token_windows(train, WINDOW, 16, seed=1)):
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    print(f"target: {args.target_steps} steps in {time.perf_counter() - start:.0f} s, last loss {loss.item():.3f}")

    windows = torch.stack([held_out[s : s + WINDOW] for s in range(0, len(held_out) - WINDOW, 250)])
    anchors = random_anchors(WINDOW, 7, 64, torch.Generator().manual_seed(0), "cpu")
    print("| learning rate | drafter loss first -> last | agreement by block slot (1..7) |\n|---|---|---|")
    for learning_rate in args.learning_rates:
        attach_new_drafter(model, default_dspark_config(config, mask_token_id=VOCAB))
        batches = token_windows(train, WINDOW, 16, seed=2)
        losses = train_dspark(model, batches, args.drafter_steps, learning_rate, anchors_per_window=32)
        with torch.no_grad():
            agreement = teacher_forced_loss(model, windows, anchors)["agreement"].tolist()
        print(
            f"| {learning_rate:g} | {losses[0]:.3f} -> {losses[-1]:.3f} | {' '.join(f'{a:.2f}' for a in agreement)} |"
        )


if __name__ == "__main__":
    main()
