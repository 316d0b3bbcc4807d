"""Fenced code blocks of README.md and docs/*.md (not docs/dev/), for `tests/test_docs.py`.

A block is a line that opens with three backticks and an optional language tag, up to the next line of three
backticks. `Block.key` ("docs/loading.md:38", the line of the opening fence) is the test id.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[^\s`]*)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root, e.g. "docs/loading.md"
    line: int  # 1-based line of the opening fence
    lang: str  # the tag, lower case; "" for a plain fence
    text: str

    @property
    def key(self) -> str:
        return f"{self.file}:{self.line}"


def doc_files() -> list[str]:
    return ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]


def extract_blocks(file: str) -> list[Block]:
    lines = (REPO / file).read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{file}:{start + 1}: code fence never closed")
        indent = len(match.group("indent"))
        text = "\n".join(line[indent:] if line[:indent].isspace() else line for line in body)
        blocks.append(Block(file, start + 1, match.group("lang").lower(), text + "\n"))
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for file in doc_files() for block in extract_blocks(file)]


def shell_commands(text: str) -> list[str]:
    """The commands of a bash block: backslash continuations joined, blank lines and `#` comment lines dropped."""
    commands, current = [], ""
    for line in text.split("\n"):
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        line = current + line
        current = ""
        if line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands
