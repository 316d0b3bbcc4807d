"""The relative logits of a prompt in the layout the prefill kernels read (`prefill_kernel`, `prefill_gluon`).

Registered as the model's `"relative_logits_layout"` kernel (`modeling.interfaces.KERNELS`): for inputs longer than
a decode step, `Inkling2RelativeLogits` writes its product through `aligned_product` instead of a plain matmul.
"""

import math

import torch
import torch.nn.functional as F

ALIGNED_GUARD = 512  # elements; the prefill kernel needs BLOCK_M before and BLOCK_M + BLOCK_N after


def aligned_product(states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`states @ weight` ([batch, heads, queries, extent]) as a view into a padded buffer laid out for the bias loads
    of the prefill kernel (`prefill_kernel`): query rows a pitch apart that is one less than a multiple of
    16, the first row's values starting one element before a 16-byte boundary, so that the run of relative logits a
    kernel tile reads for a row starts on a 16-byte boundary for every row (vector loads instead of element loads);
    and at least `ALIGNED_GUARD` elements of buffer before the first value and after the last, so that tiles on the
    diagonal and at the extent's edge may read past their rows' ends without masks. One matmul writes it (zero
    columns padded into the weight, zero rows into the states); under 2% more bytes at extent 1024."""
    rows, queries, extent = math.prod(states.shape[:-2]), states.shape[-2], weight.shape[-1]
    guard_rows = -(-ALIGNED_GUARD // extent)  # rows of at least `extent` elements before and after each head's rows
    # a tile reads row r from d = c - r on: start + r * (pitch + 1) + c, aligned when start + 1 is and pitch = -1
    # (mod 16); start = guard_rows * pitch + lead, so lead = guard_rows - 1 (mod 8) puts start + 1 on a boundary
    lead = (guard_rows - 1) % 8
    pitch = (extent + lead + 1 + 15) // 16 * 16 - 1
    padded_queries = (queries + 2 * guard_rows + 15) // 16 * 16  # heads a multiple of 16 elements apart
    if rows * padded_queries * pitch >= 2**31:
        raise ValueError(
            f"{queries} tokens in one forward need relative logits of {rows * queries * extent:,} "
            "elements, beyond what attention kernels index (2^31). Feed long prompts in chunks through the cache: "
            "`model(..., prefill_chunk_size=16384)` or `generate(..., prefill_chunk_size=16384)`."
        )
    states = F.pad(states, (0, 0, guard_rows, padded_queries - queries - guard_rows))
    product = states @ F.pad(weight, (lead, pitch - lead - extent))
    return product[..., guard_rows : guard_rows + queries, lead : lead + extent]
