"""`inkling2 plan` refuses sizes and memory that cannot be, naming them, instead of dividing by zero or printing
-0.00 GiB."""

import pytest

from transformers_inkling2 import Inkling2Config, memory_plan
from transformers_inkling2_cli import main


@pytest.mark.parametrize(
    "sizes, named",
    [({"tp": 0}, "`tp` = 0"), ({"context": -5}, "`context` = -5"), ({"batch": 0}, "`batch` = 0"),
     ({"tp": 2, "ep": -1}, "`ep` = -1"), ({"prefill_chunk": 0}, "`prefill_chunk` = 0")],
)
def test_memory_plan_refuses_sizes_below_one(sizes, named):
    with pytest.raises(ValueError, match=named):
        memory_plan(Inkling2Config(), **sizes)


@pytest.mark.parametrize(
    "argv, named",
    [(["--tp", "0"], "`tp` = 0."), (["--ep", "0"], "`ep` = 0."), (["--context", "-5"], "`context` = -5"),
     (["--max-num-seqs", "0"], "`max_num_seqs` = 0"), (["--max-step-tokens", "-1"], "`max_step_tokens` = -1"),
     (["--page-size", "96"], "power of two of at least 64, got 96"), (["--page-size", "32"], "got 32"),
     (["--gpu-gib", "-1"], "positive, finite number of GiB, got -1.0"), (["--gpu-gib", "nan"], "got nan"),
     (["--gpu-gib", "inf"], "got inf"), (["--gpu-gib", "0"], "got 0.0"), (["--dspark"], "DSpark drafter")],
)
def test_the_plan_command_says_what_is_wrong(argv, named, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--tp", "4", *argv])
    assert named in str(stopped.value) and str(stopped.value).startswith("inkling2 plan:")
    assert capsys.readouterr().out == ""  # refused before any table


def test_a_tp_of_zero_is_blamed_on_tp_alone():
    """--ep defaults to --tp: naming an `ep` nobody gave would send the user looking for it."""
    with pytest.raises(ValueError) as refused:
        memory_plan(Inkling2Config(), tp=0)
    assert str(refused.value) == "A memory plan needs positive whole numbers: `tp` = 0."
