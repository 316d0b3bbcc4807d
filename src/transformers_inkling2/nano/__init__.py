"""Inkling-2-Nano: Inkling-2-Small's architecture at toy width, trained (`inkling2 train-nano`), shipped inside the
package as the embedded default model of the `inkling2` command, the server and the docs' examples.

`checkpoint/` is an ordinary checkpoint folder (`from_pretrained` reads it; experts NVFP4 in layers 0-5 and MXFP8 in
6-7, a DSpark drafter, the tokenizer and processor, and `training_report.json`). docs/nano.md says what it learned,
how, and how well.
"""

from pathlib import Path

NANO_CHECKPOINT = Path(__file__).resolve().parent / "checkpoint"
NANO_LABEL = "embedded Inkling-2-Nano (trained toy model: picture questions, three tools, Python documentation)"


def load_nano(device="cpu", dtype=None, path=NANO_CHECKPOINT):
    """(model, processor) of the shipped Inkling-2-Nano (or of `path`, one that `inkling2 train-nano` wrote), with its
    DSpark drafter; fp32 on a CPU, bf16 on a GPU."""
    import torch

    from ..modeling.modeling_inkling2 import Inkling2ForConditionalGeneration
    from ..processing.processing_inkling2 import Inkling2Processor

    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = Inkling2ForConditionalGeneration.from_pretrained(path, dtype=dtype, device_map=device)
    return model.eval(), Inkling2Processor.from_pretrained(path)


__all__ = ["NANO_CHECKPOINT", "NANO_LABEL", "load_nano"]
