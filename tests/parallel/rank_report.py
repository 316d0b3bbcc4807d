"""How the torchrun workers of these tests finish: every rank's report gathered, rank 0 writing them to the file the
test reads, the process group closed."""

import json
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # shorter than the test's launch timeout: a hang fails here, with its call


def write_every_ranks_report(report: dict, report_file: Path | str) -> None:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        Path(report_file).write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    dist.destroy_process_group()
