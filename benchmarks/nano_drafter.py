"""Which DSpark drafter shape suits Inkling-2-Nano: drafters of the given depths and MLP widths, each distilled from
the shipped model (frozen) by `train_dspark` for the same steps on the same windows of the recipe's drafter text,
then scored as `benchmarks/nano.py` scores the shipped drafter: agreement with the model per block position
(teacher-forced) and accepted length on held-out documentation and tool questions at temperature 0. It runs on a CPU:
the frozen model's outputs are computed once per window (`FrozenTargetOutputs`), as the drafter reads nothing else of
its forward. The shipped drafter's row comes first, for scale (it trained longer, on a GPU).

    python benchmarks/nano_drafter.py [--shapes 1x512 2x512] [--steps 300] [--batch-size 8] [--windows 192]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from transformers_inkling2.dspark.training import attach_new_drafter, default_dspark_config, token_windows, train_dspark
from transformers_inkling2.nano import load_nano
from transformers_inkling2.nano.evaluation import dspark_accepted_length
from transformers_inkling2.nano.training import NANO_DEFAULTS, drafter_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nano import drafter_agreement  # noqa: E402  (the shipped drafter's scoring, shared)


class FrozenTargetOutputs:
    """The frozen model as `train_dspark` sees it, its outputs on `windows` computed once: calling it returns them for
    the rows that `batches()` last yielded (the call follows each batch at once); every other attribute is the
    model's."""

    def __init__(self, model, windows: torch.LongTensor, chunk: int = 16):
        self.model, self.windows, self.rows = model, windows, None
        hidden, logits = [], []
        with torch.no_grad():
            for part in windows.split(chunk):
                out = model(part, output_hidden_states=True, use_cache=False)
                hidden.append(torch.stack(out.hidden_states))
                logits.append(out.logits.to(torch.bfloat16))
        self.hidden, self.logits = torch.cat(hidden, 1), torch.cat(logits)

    def batches(self, batch_size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        while True:
            self.rows = torch.randint(0, len(self.windows), (batch_size,), generator=generator)
            yield self.windows[self.rows]

    def __call__(self, input_ids, logits_to_keep, **kwargs):
        return SimpleNamespace(logits=self.logits[self.rows][:, logits_to_keep].float(),
                               hidden_states=tuple(self.hidden[:, self.rows]))  # fmt: skip

    def __getattr__(self, name):
        return getattr(self.model, name)


def scores(model, processor) -> str:
    agreement, _ = drafter_agreement(model, processor)
    accepted = [dspark_accepted_length(model, processor, 0.0, kind) for kind in ("prose", "tool")]
    parameters = sum(p.numel() for p in model.dspark.parameters())
    return (f"{parameters / 1e6:.2f}M | {' '.join(f'{a:.2f}' for a in agreement)} | {accepted[0]:.2f} | "
            f"{accepted[1]:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["1x512", "2x512"], help="LAYERSxMLP_WIDTH")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--windows", type=int, default=192, help="training windows of 256 tokens")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, processor = load_nano("cpu")
    seed, window = NANO_DEFAULTS["seed"], NANO_DEFAULTS["drafter_window"]
    # some four times the tokens the windows hold (a conversation has about 400), so that windows seldom overlap
    stream = drafter_text(processor, seed, max(200, args.windows * window // 100), workers=2)
    target = FrozenTargetOutputs(model, next(token_windows(stream, window, args.windows, seed)))
    print("| drafter | parameters | agreement per block position | accepted, documentation T=0 | accepted, tool T=0 |")
    print("|---|---|---|---|---|")
    print(f"| shipped | {scores(model, processor)}", flush=True)
    for shape in args.shapes:
        layers, width = (int(n) for n in shape.split("x"))
        config = default_dspark_config(model.config.get_text_config(), num_draft_layers=layers, markov_rank=64,
                                       intermediate_size=width)  # fmt: skip
        attach_new_drafter(model, config, seed=seed)
        start = time.perf_counter()
        losses = train_dspark(target, target.batches(args.batch_size, seed), args.steps, seed=seed)
        trained = f"{args.steps} x {args.batch_size}, loss {losses[0]:.2f} -> {losses[-1]:.2f}"
        print(f"| {layers} x {width} ({trained}, {time.perf_counter() - start:.0f} s) | {scores(model, processor)}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
