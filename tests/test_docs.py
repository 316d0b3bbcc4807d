"""Every fenced code block of README.md and docs/*.md (not docs/dev/) runs, so that the docs cannot drift from the code.

How a block is treated depends on its language tag (`docs_blocks.py` extracts the blocks; ids like
`docs/loading.md:38`, the line of the opening fence):

- ```python: runs in a fresh interpreter (a subprocess, `cwd` a temporary folder, a timeout), after the
  SUBSTITUTIONS below (the embedded tiny model, saved once per session, stands in for Hub ids and placeholder
  paths). A block that continues an earlier one (it uses its `model`, `inputs`, `config`, ...) gets that context
  from CONTEXT; a block that cannot run here is in SKIP with its reason.
- ```bash / ```sh: each command (continuations joined, comments dropped) either runs (the `inkling2` command and
  `python examples/...`, which work on CPU in seconds, after the same SUBSTITUTIONS) or is in SKIP with its reason.
  Anything else fails: a new command nobody classified is never skipped silently.
- ```console: a transcript; its `$ ` commands run like bash ones and must print the listed output.
- plain ``` (or ```text): an output listing or a diagram, not executed (the tag is the marker). So that a
  command cannot hide in one, a plain block with a line that looks like a command (`python ...`, `pip ...`,
  `inkling2 ...`, `$ ...`) fails: tag it bash (or console).
- any other tag fails.

SKIP and CONTEXT are keyed by (file, a distinctive line of the block or command); an entry that matches nothing
fails `test_tables_match_the_docs`, so the tables cannot go stale either.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from docs_blocks import REPO, Block, all_blocks, shell_commands

PYTHON_TAGS = {"python", "py"}
SHELL_TAGS = {"bash", "sh", "shell"}
CONSOLE_TAGS = {"console"}
OUTPUT_TAGS = {"", "text"}  # output listings, diagrams, formulas: not executed
LOOKS_LIKE_A_COMMAND = re.compile(r"^\s*(\$ |python3? |pip3? |inkling2\b|torchrun |export |pytest |bash )")
RUNNABLE_COMMAND = re.compile(r"^(inkling2\b|python3? examples/)")  # the commands that run on CPU in seconds
TIMEOUT_S = 300

# (file glob, regex, replacement, why): applied in order to python blocks and commands before they run.
# {ckpt} is the saved tiny model (multimodal, with a DSpark drafter, and the real processor), {image} a small PNG,
# {repo} the checkout, {python} this interpreter.
SUBSTITUTIONS = [
    ("*", r"/?path/to/Inkling-2-Small|thinkingmachines/Inkling-2-Small", "{ckpt}", "the Hub id: the tiny model"),
    ("*", r"path/to/checkpoint|path/to/bf16-checkpoint", "{ckpt}", "placeholder paths: the tiny model"),
    ("*", r"path/to/mixed", "mixed", "an output folder in the temporary cwd"),
    ("*", r"https://example\.com/cat\.png", "{image}", "no network: a local PNG"),
    ("*", r"max_new_tokens=\d+", "max_new_tokens=8", "a few tokens show that the call works"),
    ("*", r"max_steps=\d+", "max_steps=2", "two training steps show that the loop works"),
    ("*", r"(train-dspark .*)--steps \d+", "\\1--steps 1 --window 32 --batch-size 1", "one small step shows that it trains"),
    ("docs/finetuning.md", r"--model merged\b", "--model {ckpt}", "the merged model of the block before"),
    ("*", r"^python examples/finetune_lora\.py(?!.*--steps)", "\\g<0> --steps 1", "one step, not 30"),
    ("*", r"^python3? (?=examples/)", "{python} ", "this interpreter"),
    ("*", r"(?<![\w/])(examples|benchmarks|hub_kernels)/", "{repo}/\\1/", "paths relative to the checkout"),
]

# (file, distinctive line): why the block (python) or the command (bash) does not run here.
SKIP = {
    ("README.md", 'pip install torch==2.13.0 -e ".[test]" && inkling2 '): "installs packages",
    ("README.md", 'pip install torch==2.13.0 -e ".[test]" && python -m pytest'): "installs packages, runs the tests",
    ("docs/attention.md", "python -m pytest -q tests/backends/test_attention_backends.py  "): "runs a test file (CI runs it)",
    ("docs/attention.md", "tests/backends/test_attention_backends.py -m gpu"): "needs a GPU",
    ("docs/attention.md", "python3 -m pip install -q --no-index"): "installs packages",
    ("docs/attention.md", "export PYTHONPATH=$PWD/src:/tmp/site"): "sets up the benchmark shell (needs the wheels above)",
    ("docs/attention.md", "python3 benchmarks/attention.py"): "a GPU benchmark (one H200)",
    ("docs/attention.md", "python3 benchmarks/decode.py"): "a GPU benchmark (one H200)",
    ("docs/serving.md", 'pip install "transformers-inkling2[serve]"'): "installs packages",
    ("docs/serving.md", "inkling2 serve --model /path/to/Inkling-2-Small"): "serves until stopped (blocks)",
    ("docs/serving.md", "inkling2 serve                "): "serves until stopped (blocks)",
    ("docs/serving.md", "inkling2 serve --model PATH --max-num-seqs 128"): "serves until stopped (blocks)",
    ("docs/serving.md", "inkling2 serve --model PATH --dspark"): "serves until stopped (blocks)",
    ("docs/nano.md", "inkling2 serve"): "serves until stopped (blocks)",
    ("docs/serving.md", "client = OpenAI("): "a client of a running `inkling2 serve`; `tools=[...]` is a placeholder",
    ("docs/serving.md", "python -m pytest -q tests/serving"): "runs test files (CI runs them)",
    ("docs/conversations.md", "pytest tests/processing/test_chat_template.py"): "runs test files (CI runs them)",
    ("docs/dspark.md", "inkling2 train-dspark --model MERGED_MODEL"): "a usage synopsis ([...] are optional arguments)",
    ("docs/finetuning.md", "--model PATH --device cuda"): "needs a GPU and a full checkpoint",
    # the example tokenizes its corpus first: about a minute a run on 2 cores; the plain run above stays
    ("docs/finetuning.md", "finetune_lora.py --expert-lora"): "slow on CPU (a minute); tests/test_lora.py covers it",
    ("docs/finetuning.md", "finetune_lora.py --quantized"): "slow on CPU (a minute); tests/test_lora.py covers it",
    ("docs/kernels.md", "python hub_kernels/build.py"): "rebuilds hub_kernels/*/build/ in the shared checkout",
    ("docs/parallel.md", "# generate_tp.py: torchrun starts it"): "a torchrun script: needs one GPU per rank",
    ("docs/parallel.md", "torchrun --nproc_per_node 4 generate_tp.py"): "needs 4 GPUs",
    ("docs/parallel.md", "torchrun --nnodes 2 --node_rank 0"): "needs two trays of 4 GPUs",
    ("docs/parallel.md", "torchrun --nnodes 2 --node_rank 1"): "needs two trays of 4 GPUs",
}

# Code that a fragment needs: a snippet of SNIPPETS, or (file, distinctive line) of an earlier block, which then
# runs first (with its own context).
SNIPPETS = {
    "generate": """
import torch
import transformers_inkling2
from transformers import AutoModelForImageTextToText
model = AutoModelForImageTextToText.from_pretrained({ckpt!r})
processor = transformers_inkling2.Inkling2Processor.from_pretrained({ckpt!r})
messages = [{{"role": "user", "content": [{{"type": "text", "text": "Why is the sky blue?"}}]}}]
inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                       return_tensors="pt")
""",
    "batch": "import torch\nbatch = torch.randint(0, 1000, (2, 24))  # token ids\n",
    "dataset": "dataset = [{{'input_ids': ids, 'labels': ids}} for ids in torch.randint(0, 1000, (8, 24))]\n",
    "base_model": "base_model = AutoModelForCausalLM.from_pretrained({ckpt!r})\n",
    "peft_model": "peft_model = model\n",
    "chat_inputs": """
import torch
from transformers import AutoModelForImageTextToText
model = AutoModelForImageTextToText.from_pretrained({ckpt!r})
inputs = {{"input_ids": torch.tensor([ids])}}
""",
    # the checkout's kernel built as the model's first use builds it (the README's test command runs no build step)
    "kernel_built": "from transformers_inkling2.backends.kernel_loading import local_kernel\nlocal_kernel()\n",
}
LORA_BLOCK = ("docs/finetuning.md", "model = get_peft_model(model, config)")
CONTEXT = {  # (file, distinctive line): (what runs before, what runs after)
    ("docs/kernels.md", "moe = get_local_kernel("): (["kernel_built"], ""),
    ("docs/attention.md", 'cache_implementation="static")          # plain decoding'): (["generate"], ""),
    ("docs/dspark.md", 'draft_sample_method="probabilistic"'): (
        ["generate"], "assert out.sequences.shape[1] > inputs['input_ids'].shape[1]\n"),
    ("docs/finetuning.md", "DEFAULT_LORA_TARGET_MODULES = r"): ([], (
        "import transformers_inkling2.finetuning as f\n"
        "assert (DEFAULT_LORA_TARGET_MODULES, EXPERT_LORA_TARGET_PARAMETERS) == "
        "(f.DEFAULT_LORA_TARGET_MODULES, f.EXPERT_LORA_TARGET_PARAMETERS)\n")),
    LORA_BLOCK: (["batch"], ""),
    ("docs/finetuning.md", "target_parameters=EXPERT_LORA_TARGET_PARAMETERS)"): (
        [LORA_BLOCK], "get_peft_model(AutoModelForCausalLM.from_pretrained({ckpt!r}), config)\n"),
    ("docs/finetuning.md", "refuse_lora_on_quantized_experts(model, config.target_parameters)"): (
        [("docs/finetuning.md", "target_parameters=EXPERT_LORA_TARGET_PARAMETERS)")], ""),
    ("docs/finetuning.md", "Trainer(model=model, args=args"): ([LORA_BLOCK, "dataset"], ""),
    ("docs/finetuning.md", 'model = PeftModel.from_pretrained(base_model, "my-adapter")'): (
        [LORA_BLOCK, "base_model"], ""),
    ("docs/finetuning.md", "merged = peft_model.merge_and_unload()"): ([LORA_BLOCK, "peft_model"], ""),
    ("docs/conversations.md", "reply = parse_response(output[0"): (
        [("docs/conversations.md", "tok = build_inkling2_tokenizer()"), "chat_inputs"], ""),
}


def _matches(block: Block, key: tuple[str, str]) -> bool:
    return block.file == key[0] and key[1] in block.text


def _lookup(table: dict, block: Block, command: str | None = None):
    hits = [k for k in table if k[0] == block.file and k[1] in (command if command is not None else block.text)]
    assert len(hits) <= 1, f"{block.key}: several entries match: {hits}"
    return table[hits[0]] if hits else None


BLOCKS = all_blocks()


def _find(key) -> Block:
    hits = [b for b in BLOCKS if _matches(b, key)]
    assert len(hits) == 1, f"{key} matches {len(hits)} blocks, not one"
    return hits[0]


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, str]:
    """The tiny model (with a DSpark drafter) and its processor saved as a checkpoint, and a small PNG."""
    from PIL import Image

    import transformers_inkling2

    folder = tmp_path_factory.mktemp("docs_assets")
    ckpt = folder / "Inkling-2-Small-tiny"
    transformers_inkling2.build_tiny_model(dspark=True).save_pretrained(ckpt)
    transformers_inkling2.build_tiny_processor().save_pretrained(ckpt)
    Image.new("RGB", (96, 64), (200, 120, 40)).save(folder / "cat.png")
    return {"ckpt": str(ckpt), "image": str(folder / "cat.png"), "repo": str(REPO), "python": sys.executable}


def _substitute(block: Block, text: str, assets: dict[str, str]) -> str:
    for glob, pattern, replacement, _why in SUBSTITUTIONS:
        if Path(block.file).match(glob):
            text = re.sub(pattern, replacement.format(**assets), text, flags=re.MULTILINE)
    return text


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    env.pop("PYTHONPATH", None)
    return env


def _python_source(block: Block, assets: dict[str, str], seen: tuple = ()) -> str:
    before, after = _lookup(CONTEXT, block) or ([], "")
    parts = []
    for item in before:
        if isinstance(item, tuple):
            assert item not in seen, f"{block.key}: circular context"
            parts.append(_python_source(_find(item), assets, (*seen, item)))
        else:
            parts.append(SNIPPETS[item].format(**assets))
    parts += [f"# --- {block.key}\n" + _substitute(block, block.text, assets), after.format(**assets)]
    return "\n".join(parts)


def _run(args, cwd: Path, shell: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, env=_env(), shell=shell, capture_output=True, text=True,
                            timeout=TIMEOUT_S, executable="/bin/bash" if shell else None)
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}"
    return result


def _run_command(block: Block, command: str, assets, cwd: Path) -> str | None:
    """Runs one shell command of a bash / console block; returns its stdout, or None if SKIP lists it."""
    if _lookup(SKIP, block, command) is not None:
        return None
    assert RUNNABLE_COMMAND.match(command), (
        f"{block.key}: unclassified command {command!r}: make it runnable here or add it to SKIP with a reason")
    return _run(_substitute(block, command, assets), cwd, shell=True).stdout


def _check_python(block: Block, assets, tmp_path: Path):
    if (reason := _lookup(SKIP, block)) is not None:
        pytest.skip(reason)
    script = tmp_path / "block.py"
    script.write_text(_python_source(block, assets))
    _run([sys.executable, str(script)], tmp_path)


def _check_shell(block: Block, assets, tmp_path: Path):
    commands = shell_commands(block.text)
    assert commands, f"{block.key}: no command"
    ran = [c for c in commands if _run_command(block, c, assets, tmp_path) is not None]
    if not ran:
        pytest.skip("; ".join(sorted({_lookup(SKIP, block, c) for c in commands})))


def _check_console(block: Block, assets, tmp_path: Path):
    """`$ command` lines, each followed by the output it must print (compared line by line, trailing space ignored)."""
    transcript = re.split(r"^\$ (.*)\n", block.text, flags=re.MULTILINE)
    assert transcript[0].strip() == "", f"{block.key}: a console block starts with a `$ ` command"
    for command, expected in zip(transcript[1::2], transcript[2::2]):
        output = _run_command(block, command, assets, tmp_path)
        if output is not None:
            assert [l.rstrip() for l in output.strip().split("\n")] == [l.rstrip() for l in expected.strip().split("\n")]


def _check_output(block: Block):
    suspicious = [line for line in block.text.split("\n") if LOOKS_LIKE_A_COMMAND.match(line)]
    assert not suspicious, f"{block.key}: a plain block (an output listing) holds commands {suspicious}: tag it bash"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.key for b in BLOCKS])
def test_doc_block(block: Block, tmp_path, request):
    if block.lang in OUTPUT_TAGS:
        _check_output(block)
    elif block.lang in PYTHON_TAGS:
        _check_python(block, request.getfixturevalue("assets"), tmp_path)
    elif block.lang in SHELL_TAGS:
        _check_shell(block, request.getfixturevalue("assets"), tmp_path)
    elif block.lang in CONSOLE_TAGS:
        _check_console(block, request.getfixturevalue("assets"), tmp_path)
    else:
        pytest.fail(f"{block.key}: unknown language tag {block.lang!r}: python, bash, console or plain (output)")


def test_tables_match_the_docs():
    """Every SKIP and CONTEXT entry names exactly one block (SKIP: a python block or a shell command)."""
    for key in CONTEXT:
        _find(key)
        for item in CONTEXT[key][0]:
            assert isinstance(item, tuple) or item in SNIPPETS, item
            if isinstance(item, tuple):
                _find(item)
    for key in SKIP:
        hits = [b for b in BLOCKS if b.file == key[0] and (
            key[1] in b.text if b.lang in PYTHON_TAGS else any(key[1] in c for c in shell_commands(b.text)))]
        assert len(hits) == 1, f"SKIP entry {key} matches {len(hits)} blocks"


def test_blocks_found():
    assert len(BLOCKS) > 30
    assert {b.file for b in BLOCKS} >= {"README.md", "docs/loading.md", "docs/finetuning.md"}
