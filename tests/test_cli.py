"""The `inkling2` command on the embedded tiny model."""

import subprocess
import sys

from transformers_inkling2.cli import main


def test_main_job_generates_with_the_embedded_tiny_model(capsys):
    main(["--max-new-tokens", "4", "--prompt", "Hello"])
    out = capsys.readouterr().out
    assert "RANDOM weights" in out  # labelled as a random model
    assert "[prompt] Hello" in out
    assert "4 new tokens" in out and "tokens/s" in out


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "transformers_inkling2", "generate", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "tokens/s" in result.stdout
