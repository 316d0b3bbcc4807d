"""The `inkling2` command on the embedded Inkling-2-Nano."""

import subprocess
import sys

import pytest

from transformers_inkling2_cli import SUBCOMMANDS, build_parser, main

# `--help` and argument errors are answered before any of these is imported (they take seconds)
HEAVY_MODULES = ("torch", "transformers", "triton", "transformers_inkling2")


def test_main_job_generates_with_the_embedded_nano_model(capsys):
    main(["--max-new-tokens", "4", "--prompt", "Hello"])
    out = capsys.readouterr().out
    assert "[model] embedded Inkling-2-Nano" in out
    assert "[prompt] Hello" in out
    assert "4 new tokens" in out and "tokens/s" in out


def test_main_job_asks_about_a_picture_it_draws_and_prints_the_answer(capsys):
    """The default run: a scene drawn from --seed (printed with what it shows), a question about it, the streamed
    reply (thinking, then the answer) and the parsed answer."""
    main(["--seed", "1"])
    out = capsys.readouterr().out
    picture = out.split("[picture] ")[1].split("\n")[0]
    assert "The picture shows" in picture and "picture.png" in picture
    assert "[prompt] " in out and "<|content_thinking|>I see " in out
    answer = out.split("[answer] ")[1].strip()
    assert answer.startswith("The") and answer.endswith(".")


def test_main_job_takes_an_image_through_the_pipeline(tmp_path, capsys):
    import numpy as np
    import PIL.Image

    PIL.Image.fromarray(np.full((50, 90, 3), 128, dtype=np.uint8)).save(tmp_path / "grey.png")
    main(["--max-new-tokens", "3", "--image", str(tmp_path / "grey.png")])
    out = capsys.readouterr().out
    assert "[image: " in out and "3 new tokens" in out


def test_dspark_and_static_cache_flags_give_the_same_greedy_reply_through_the_image_pipeline(tmp_path, capsys):
    import numpy as np
    import PIL.Image

    PIL.Image.fromarray(np.full((50, 90, 3), 99, dtype=np.uint8)).save(tmp_path / "grey.png")
    replies = []
    for flags in ([], ["--dspark"], ["--static-cache"], ["--dspark", "--static-cache", "--compile"]):
        main(["--max-new-tokens", "10", "--image", str(tmp_path / "grey.png"), *flags])
        out = capsys.readouterr().out
        replies.append(out.split("[reply] ")[1].split("\n[")[0])
        if "--dspark" in flags:
            assert "[dspark] accepted length " in out and "speedup" in out
        else:
            assert "10 new tokens" in out
    assert replies[0] == replies[1] == replies[2] == replies[3]


def test_compile_applies_without_naming_the_static_cache():
    """On a GPU the static cache is generate()'s default, so `--compile` alone compiles its captured steps."""
    from transformers import CompileConfig

    from transformers_inkling2.cli import compile_config

    assert isinstance(compile_config(build_parser().parse_args(["generate", "--compile"])), CompileConfig)
    assert compile_config(build_parser().parse_args(["generate"])) is None


def test_serve_engine_flags_fill_the_server_settings():
    from transformers_inkling2.cli import server_settings

    def engine_fields(*flags):
        settings = server_settings(build_parser().parse_args(["serve", *flags]), "m", None)
        return (settings.max_num_seqs, settings.page_size, settings.num_pages, settings.max_step_tokens,
                settings.max_model_len, settings.dspark)  # fmt: skip

    assert engine_fields() == (64, 256, None, 2048, None, False)
    flags = ["--max-num-seqs", "8", "--page-size", "128", "--num-pages", "100", "--max-step-tokens", "512",
             "--max-model-len", "2048", "--dspark"]  # fmt: skip
    assert engine_fields(*flags) == (8, 128, 100, 512, 2048, True)


@pytest.mark.parametrize(
    "flags,message",
    [(["--max-num-seqs", "0"], "max_num_seqs must be a positive integer, got 0"),
     (["--max-step-tokens", "-5"], "max_step_tokens must be a positive integer, got -5"),
     (["--page-size", "100"], "`page_size` must be a power of two of at least 64, got 100"),
     (["--page-size", "32"], "`page_size` must be a power of two of at least 64, got 32"),
     (["--num-pages", "1"], r"num_pages must be an integer >= 2 \(page 0 is reserved\)")],
)  # fmt: skip
def test_bad_engine_flags_are_refused_before_the_model_loads(flags, message, capsys):
    with pytest.raises(SystemExit, match=f"inkling2 serve: {message}"):
        main(["serve", *flags])
    assert "[model]" not in capsys.readouterr().out


def test_main_job_on_a_text_only_checkpoint_uses_the_text_generation_pipeline(tmp_path, capsys):
    from transformers_inkling2.processing.tokenization_inkling2 import build_inkling2_tokenizer
    from transformers_inkling2.tiny import build_tiny_causal_lm

    build_tiny_causal_lm().save_pretrained(tmp_path)
    build_inkling2_tokenizer().save_pretrained(tmp_path)
    main(["--model", str(tmp_path), "--max-new-tokens", "3"])
    assert "3 new tokens" in capsys.readouterr().out


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "transformers_inkling2", "generate", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "tokens/s" in result.stdout


def parse_in_fresh_interpreter(argv: list[str]) -> subprocess.CompletedProcess:
    """Runs the installed `inkling2` entry point on `argv` (arguments that end in parsing) and prints the heavy
    modules it imported."""
    script = (
        "import sys\n"
        "from importlib.metadata import entry_points\n"
        "(command,) = entry_points(group='console_scripts', name='inkling2')\n"
        "try:\n"
        f"    command.load()({argv!r})\n"
        "finally:\n"
        f"    print('loaded:', *sorted(name for name in {HEAVY_MODULES!r} if name in sys.modules))\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)


@pytest.mark.parametrize("command", [[], *([name] for name in SUBCOMMANDS)], ids=lambda c: " ".join(c) or "top")
def test_help_imports_nothing_heavy(command):
    result = parse_in_fresh_interpreter([*command, "--help"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: inkling2 {' '.join(command)}".rstrip())
    assert result.stdout.rstrip().endswith("loaded:")


def test_a_bad_argument_is_refused_before_anything_heavy_is_imported():
    result = parse_in_fresh_interpreter(["plan", "--tp", "four"])
    assert result.returncode == 2
    assert "argument --tp: invalid int value: 'four'" in result.stderr
    assert result.stdout.rstrip().endswith("loaded:")
