"""Synthetic picture scenes for Inkling-2-Nano: shapes of a few colours on a 3 x 3 grid, sometimes a short word,
drawn with Pillow, and chat turns that describe them or answer a question about them (what a colour, shape, count,
position or word is), with the answer the scene fixes, so that a reply can be scored.

Scenes are 200 x 200 pixels: 5 x 5 image tokens of 40 x 40 pixels (the ViT's 20-pixel patches, merged 2 x 2).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

SIZE = 200
GRID = 3
COLOURS = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "yellow": (240, 200, 20),
    "purple": (148, 70, 190),
    "orange": (245, 127, 14),
}
SHAPES = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
WORDS = ("CAT", "DOG", "SUN", "SEA", "RED", "BOX", "TOP", "MAP", "KEY", "ANT", "OWL", "PEN")
POSITIONS = {
    (0, 0): "at the top left",
    (0, 1): "at the top",
    (0, 2): "at the top right",
    (1, 0): "on the left",
    (1, 1): "in the center",
    (1, 2): "on the right",
    (2, 0): "at the bottom left",
    (2, 1): "at the bottom",
    (2, 2): "at the bottom right",
}
NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six")
# how often each kind of question is asked, where the scene can answer it
QUESTION_KINDS = {"count": 0.2, "count_shape": 0.2, "colour": 0.2, "shape": 0.2, "position": 0.08, "word": 0.05,
                  "describe": 0.07}  # fmt: skip
SCORED_KINDS = ("count", "count_shape", "colour", "shape")  # what the held-out test asks


@dataclass(frozen=True)
class Thing:
    shape: str
    colour: str
    cell: tuple[int, int]  # (row, column) of the 3 x 3 grid

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.shape} {POSITIONS[self.cell]}"


@dataclass
class Scene:
    things: list[Thing]
    word: str | None = None
    word_cell: tuple[int, int] | None = None
    background: tuple[int, int, int] = (255, 255, 255)
    jitter: list[tuple[int, int, int]] = field(default_factory=list)  # per thing: dx, dy, radius

    def inventory(self) -> str:
        """What the model thinks before it answers: 'I see a red circle and a blue square.' (then the word)."""
        names = [f"a {thing.colour} {thing.shape}" for thing in self.things]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        return f"I see {listed}." + (f" The word {self.word} is written." if self.word else "")

    def description(self) -> str:
        """'The picture shows 2 shapes: a red circle at the top left and a blue square in the center.'"""
        count = len(self.things)
        phrases = [thing.phrase for thing in self.things]
        listed = phrases[0] if count == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
        text = f"The picture shows {count} shape{'s' if count > 1 else ''}: {listed}."
        if self.word:
            text += f" The word {self.word} is written {POSITIONS[self.word_cell]}."
        return text


def draw_scene(rng: random.Random) -> tuple[Image.Image, Scene]:
    """A scene of 1 to 4 shapes in distinct cells (colours may repeat, so counts and uniqueness vary), a word in a
    third of them, on a light background."""
    cells = [(row, column) for row in range(GRID) for column in range(GRID)]
    rng.shuffle(cells)
    count = rng.randint(1, 4)
    things = [Thing(rng.choice(SHAPES), rng.choice(list(COLOURS)), cells[i]) for i in range(count)]
    things.sort(key=lambda thing: thing.cell)  # described in reading order
    word, word_cell = (rng.choice(WORDS), cells[count]) if rng.random() < 1 / 3 else (None, None)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    scene = Scene(things, word, word_cell, background)
    image = Image.new("RGB", (SIZE, SIZE), background)
    draw = ImageDraw.Draw(image)
    step = SIZE / GRID
    for thing in things:
        radius = rng.randint(16, 27)
        cx = (thing.cell[1] + 0.5) * step + rng.randint(-6, 6)
        cy = (thing.cell[0] + 0.5) * step + rng.randint(-6, 6)
        colour = COLOURS[thing.colour]
        if thing.shape == "circle":
            draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=colour)
        elif thing.shape == "square":
            draw.rectangle([cx - radius, cy - radius, cx + radius, cy + radius], fill=colour)
        else:
            draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=colour)
    if word:
        x = (word_cell[1] + 0.5) * step
        y = (word_cell[0] + 0.5) * step
        draw.text((x, y), word, fill=(20, 20, 20), anchor="mm", font_size=22)
    return image, scene


def ask(scene: Scene, rng: random.Random, kind: str | None = None) -> tuple[str, str, str]:
    """(kind, question, answer) about `scene`: `kind` from QUESTION_KINDS, or drawn (by their weights) among those
    the scene can answer (a colour question needs a shape that occurs once, a word question a word)."""
    shapes = [thing.shape for thing in scene.things]
    colours = [thing.colour for thing in scene.things]
    unique_shapes = [s for s in SHAPES if shapes.count(s) == 1]
    unique_colours = [c for c in COLOURS if colours.count(c) == 1]
    possible = ["count", "count_shape", "describe"]
    possible += ["colour"] * bool(unique_shapes) + ["shape"] * bool(unique_colours)
    possible += ["position"] * bool(unique_colours) + ["word"] * bool(scene.word)
    kind = kind or rng.choices(possible, weights=[QUESTION_KINDS[k] for k in possible])[0]
    if kind not in possible:
        raise ValueError(f"This scene cannot answer a {kind!r} question.")
    if kind == "count":
        question = rng.choice(["How many shapes are in the picture?", "How many shapes are there?",
                               "Count the shapes in the image."])  # fmt: skip
        count = len(scene.things)
        return kind, question, f"There {'is' if count == 1 else 'are'} {count} shape{'s' * (count > 1)}."
    if kind == "count_shape":
        shape = rng.choice(SHAPES)
        count = shapes.count(shape)
        question = rng.choice([f"How many {PLURALS[shape]} are there?", f"How many {PLURALS[shape]} do you see?"])
        noun = shape if count == 1 else PLURALS[shape]
        return kind, question, f"There {'is' if count == 1 else 'are'} {NUMBER_WORDS[count]} {noun}."
    if kind == "colour":
        shape = rng.choice(unique_shapes)
        thing = scene.things[shapes.index(shape)]
        question = rng.choice([f"What colour is the {shape}?", f"Which colour does the {shape} have?"])
        return kind, question, f"The {shape} is {thing.colour}."
    if kind == "shape":
        colour = rng.choice(unique_colours)
        thing = scene.things[colours.index(colour)]
        question = rng.choice([f"What shape is the {colour} one?", f"Which shape is {colour}?"])
        return kind, question, f"The {colour} shape is a {thing.shape}."
    if kind == "position":
        colour = rng.choice(unique_colours)
        thing = scene.things[colours.index(colour)]
        question = f"Where is the {colour} {thing.shape}?"
        return kind, question, f"The {colour} {thing.shape} is {POSITIONS[thing.cell]}."
    if kind == "word":
        return kind, rng.choice(["What word is written in the picture?", "Which word do you see?"]), (
            f"The word is {scene.word}.")  # fmt: skip
    return kind, rng.choice(["Describe the picture.", "What is in this image?"]), scene.description()


def answer_is_right(kind: str, expected: str, reply: str) -> bool:
    """Whether `reply` gives the answer `expected` (from `ask`) to a question of `kind` in SCORED_KINDS: the same
    number, or the one right colour or shape word and no other."""
    reply, expected = reply.lower(), expected.lower()
    if kind in ("count", "count_shape"):
        numbers = {str(i): i for i in range(10)} | {word: i for i, word in enumerate(NUMBER_WORDS)}
        said = [numbers[w] for w in re.findall(r"[a-z0-9]+", reply) if w in numbers]
        wanted = [numbers[w] for w in re.findall(r"[a-z0-9]+", expected) if w in numbers]
        return said == wanted
    vocabulary = list(COLOURS) if kind == "colour" else list(SHAPES)
    said = {w for w in vocabulary if re.search(rf"\b{w}\b", reply)}
    wanted = {w for w in vocabulary if re.search(rf"\b{w}\b", expected)}
    return said == wanted
