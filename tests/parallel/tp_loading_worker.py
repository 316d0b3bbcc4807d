"""Run by `test_tensor_parallel_loading.py` under `torchrun --nproc_per_node 4` (gloo, CPU): every rank loads the
same official-layout checkpoints with `tp_plan="auto"`, counting what it reads from their files and what reaches it
through collectives; rank 0 then loads each in one process (counted too: the count's own check) and every rank
compares its logits with that model's.

How bytes read are counted: every imported module that holds safetensors' `safe_open` (transformers' loader,
safetensors' `load_file`, which reads the drafter's `mtp.safetensors`, our header checks) is handed a counting one.
Its handles give out tensors only through reads that record, per stored tensor, the bytes they return (`slice[...]`,
`get_tensor`, `get_tensors`; any other access raises, so no read escapes the count): the bytes copied out of the
file, in their stored dtype, before any cast. That is what the loader asks the file for, not what the disk serves:
with safetensors' default mmap backend the kernel pages in the 4 KiB pages under those bytes (and reads ahead), and
at toy width, where a tensor spans a page or two, pages would say nothing about a rank's share.

What a rank holds of a split tensor comes from its own reads or from another rank: every operation run while loading
passes through a dispatch mode that adds up the bytes of the tensors handed to collectives (`c10d` and functional
collectives alike dispatch through it).

Usage: torchrun --nproc_per_node 4 tests/parallel/tp_loading_worker.py CHECKPOINTS_DIR REPORT.json
CHECKPOINTS_DIR holds `bf16/` and `quantized/`. Rank 0 writes every rank's report; the test reads it.
"""

import os
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import safetensors
import torch
import torch.distributed as dist
from rank_report import write_every_ranks_report
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.core_model_loading import WeightConverter, rename_source_key

from transformers_inkling2 import Inkling2ForConditionalGeneration

READS: dict[str, list[int]] = defaultdict(list)  # stored tensor -> bytes of each read of it


class CountingSlice:
    """A stored tensor whose reads are counted."""

    def __init__(self, name: str, stored):
        self.name, self.stored = name, stored

    def get_shape(self):
        return self.stored.get_shape()

    def get_dtype(self):
        return self.stored.get_dtype()

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self.stored[index]
        READS[self.name].append(tensor.numel() * tensor.element_size())
        return tensor


class CountingHandle:
    """An open safetensors file whose tensors come out only through counted reads."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def metadata(self):
        return self.handle.metadata()

    def get_slice(self, name: str) -> CountingSlice:
        return CountingSlice(name, self.handle.get_slice(name))

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[...]

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.get_tensor(name) for name in self.keys()}


def count_safetensors_reads() -> None:
    """Gives every imported module that holds safetensors' `safe_open` the counting one."""
    original = safetensors.safe_open

    def counting_open(*args, **kwargs):
        return CountingHandle(original(*args, **kwargs))

    for module in list(sys.modules.values()):
        if getattr(module, "safe_open", None) is original:
            module.safe_open = counting_open


class CollectiveBytes(TorchDispatchMode):
    """Adds up the bytes of the tensors every collective is handed (its input and output buffers)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
            self.bytes += sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        return func(*args, **(kwargs or {}))


def load(folder: Path, **kwargs) -> tuple:
    """The model, what loading it read ({stored tensor: [bytes of each read]}) and the bytes its collectives moved."""
    READS.clear()
    with warnings.catch_warnings(), CollectiveBytes() as collectives:
        warnings.filterwarnings("ignore", message=".*tp_plan.*deprecated")  # `tp_plan=` is still the short way
        model = Inkling2ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, **kwargs)
    return model, dict(READS), collectives.bytes


def split_stored_tensors(model, stored_names) -> list[str]:
    """The stored tensors that load into a split (`Shard`) tensor of the model, renamed the way the loader renamed
    them (with the conversions it used)."""
    state, conversions = model.state_dict(), model._weight_conversions
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    split = []
    for name in stored_names:
        target, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, state)
        tensor = state.get(target)
        if isinstance(tensor, DTensor) and any(isinstance(placement, Shard) for placement in tensor.placements):
            split.append(name)
    return sorted(split)


def logits(model) -> torch.Tensor:
    input_ids = torch.randint(0, 499, (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # contiguous: the logits are a slice (the unpadded vocabulary); broadcast sent wrong values
        return model(input_ids, use_cache=False).logits.contiguous()


def check(folder: Path) -> dict:
    split, reads, collective_bytes = load(folder, tp_plan="auto")
    split_logits = logits(split)
    expected, single_process_reads = torch.empty_like(split_logits), None
    if dist.get_rank() == 0:
        reference, single_process_reads, _ = load(folder)
        expected = logits(reference)
    dist.broadcast(expected, src=0)
    return {
        "reads": reads,
        "split": split_stored_tensors(split, reads),
        "collective_bytes": collective_bytes,
        "logits": ((split_logits - expected).abs().max() / expected.abs().max()).item(),
        "single_process_reads": single_process_reads,
    }


def main(checkpoints: str, report_file: str) -> None:
    torch.set_num_threads(1)
    count_safetensors_reads()
    report = {name: check(Path(checkpoints) / name) for name in ("bf16", "quantized")}
    write_every_ranks_report(report, report_file)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*sys.argv[1:])
