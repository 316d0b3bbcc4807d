"""`inkling2 plan` refuses sizes that cannot be, naming them, instead of dividing by zero or printing -0.00 GiB."""

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


@pytest.mark.parametrize("argv, named", [(["--tp", "0"], "`tp` = 0"), (["--context", "-5"], "`context` = -5")])
def test_the_plan_command_says_what_is_wrong(argv, named):
    with pytest.raises(SystemExit) as stopped:
        main(["plan", *argv])
    assert named in str(stopped.value) and str(stopped.value).startswith("inkling2 plan:")
