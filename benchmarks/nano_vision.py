"""How fast Inkling-2-Nano's ViT can learn shapes, per learning rate: the vision tower alone (`nano_config`'s, with its
projection) and a linear head over its image tokens (the most confident token decides), trained as a classifier of
one-shape scenes (circle, square or triangle) drawn by `nano.scenes`, scored on 200 other scenes. It runs on a CPU.
Why: the shipped weights read circles as squares or triangles in held-out scenes, and the language model's
training trained the ViT at the language model's rate; this isolates the ViT's part (VISION_LEARNING_RATE_SCALE).

    python benchmarks/nano_vision.py [--rates 3e-3 1e-3 3e-4] [--steps 400] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from transformers_inkling2.modeling.modeling_inkling2_vision import Inkling2VisionModel
from transformers_inkling2.nano.scenes import SHAPES, draw_scene
from transformers_inkling2.nano.training import build_nano_processor, nano_config


def one_shape_scenes(processor, count: int, seed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw, shape index) of `count` scenes with a single shape, drawn from `seed`."""
    rng, images, labels = random.Random(seed), [], []
    while len(images) < count:
        image, scene = draw_scene(rng)
        if len(scene.things) == 1:
            images.append(image)
            labels.append(SHAPES.index(scene.things[0].shape))
    inputs = processor.image_processor(images, return_tensors="pt")
    return inputs["pixel_values"], inputs["image_grid_thw"], torch.tensor(labels)


def train(processor, rate: float, steps: int, batch_size: int, test, report_every: int = 100) -> list[tuple]:
    """(step, training loss, test accuracy, seconds) every `report_every` steps of AdamW at `rate`."""
    torch.manual_seed(0)
    vision = Inkling2VisionModel(nano_config(processor.tokenizer).vision_config)
    head = torch.nn.Linear(vision.config.text_hidden_size, len(SHAPES))
    optimizer = torch.optim.AdamW([*vision.parameters(), *head.parameters()], lr=rate)

    def logits(pixel_values, grid):
        tokens = vision(pixel_values=pixel_values, image_grid_thw=grid).pooler_output
        return head(tokens.view(len(grid), -1, tokens.shape[-1])).max(1).values

    rows, start = [], time.perf_counter()
    for step in range(steps + 1):
        pixel_values, grid, labels = one_shape_scenes(processor, batch_size, f"train-{step}")
        loss = F.cross_entropy(logits(pixel_values, grid), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % report_every == 0:
            with torch.no_grad():
                accuracy = (logits(*test[:2]).argmax(-1) == test[2]).float().mean().item()
            rows.append((step, loss.item(), accuracy, time.perf_counter() - start))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", type=float, nargs="+", default=[3e-3, 1e-3, 3e-4])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    processor = build_nano_processor()
    test = one_shape_scenes(processor, 200, "test")
    print("| learning rate | step | training loss | test accuracy (200 scenes) | seconds |")
    for rate in args.rates:
        for step, loss, accuracy, seconds in train(processor, rate, args.steps, args.batch_size, test):
            print(f"| {rate:g} | {step} | {loss:.3f} | {accuracy:.0%} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
