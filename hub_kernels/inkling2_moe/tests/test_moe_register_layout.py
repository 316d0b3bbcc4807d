"""The index logic of the NVFP4 / MXFP8 register-GEMV kernels (`inkling2_moe/register_kernels.py`), replayed on CPU.

There is no Gluon interpreter: the GPU tests (test_moe_kernels.py, `-m gpu`) run the kernels, and these
check, without a GPU, that the nibble decode (`_DECODE`, executed here instruction by instruction) gives the
E2M1 values, and that the weight and activation relabelings (`WEIGHTS_ORDER`, `ACTIVATIONS_ORDER`, and MXFP8's
`MX_*_ORDER`) pair every weight with its own input, so that changing one without the other fails here first.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import moe_format_oracle as qf
import pytest
import torch
from moe_kernel_helpers import VARIANT_DIR

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                or importlib.util.find_spec("triton.experimental.gluon") is None,
                                reason="the kernel module needs Triton with Gluon")


@pytest.fixture(scope="module")
def rk():
    sys.path.insert(0, str(VARIANT_DIR))
    try:
        from inkling2_moe import register_kernels
    finally:
        sys.path.remove(str(VARIANT_DIR))
    return register_kernels


def run_decode_asm(asm: str, words: torch.Tensor) -> list[torch.Tensor]:
    """Executes the shl / shr / and / or lines of the kernel's PTX on 32-bit words ($4); returns $0..$3."""
    registers = {"$4": words.to(torch.int64)}
    mask = 0xFFFFFFFF

    def value(operand):
        return registers[operand] if operand in registers else int(operand, 0)

    for op, dst, a, b in re.findall(r"(\w+)\.b32\s+([$\w]+),\s*([$\w]+),\s*([$\w]+);", asm):
        x, y = value(a), value(b)
        registers[dst] = {"shl": lambda: (x << y) & mask, "shr": lambda: x >> y, "and": lambda: x & y,
                          "or": lambda: x | y}[op]()
    return [registers[f"${i}"] for i in range(4)]


def halves_as_f16(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    as_f16 = [((word >> shift) & 0xFFFF).to(torch.int16).view(torch.float16).float() for shift in (0, 16)]
    return as_f16[0], as_f16[1]


def test_decode_gives_e2m1_values_in_the_documented_positions(rk):
    """Output element p of the low / high tensor is the low / high nibble of byte (0, 2, 1, 3)[p] of the word,
    as f16 equal to the E2M1 value times 2**-14 (every code, subnormals and negative zero included)."""
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4096, 4), generator=gen, dtype=torch.int64)
    data[:256, 0] = torch.arange(256)  # every byte value in byte 0
    words = data[:, 0] | data[:, 1] << 8 | data[:, 2] << 16 | data[:, 3] << 24
    out = run_decode_asm(rk._DECODE.value, words)
    low = [*halves_as_f16(out[0]), *halves_as_f16(out[1])]
    high = [*halves_as_f16(out[2]), *halves_as_f16(out[3])]
    for position, byte in enumerate((0, 2, 1, 3)):
        for decoded, nibbles in ((low[position], data[:, byte] & 0xF), (high[position], data[:, byte] >> 4)):
            expected = qf.e2m1_decode(nibbles.to(torch.uint8)).float() * 2.0**-14
            assert torch.equal(decoded, expected)
            assert torch.equal(torch.signbit(decoded), (nibbles & 8) > 0)  # -0 stays -0
    assert rk.DECODE_SCALE.value == 2.0**14


def test_operand_relabelings_pair_each_weight_with_its_input(rk):
    """Relabel which input every position holds, on both sides, exactly as the kernel's reshapes and
    permutes do; each operand input index must then name the same input in A (weights) and B (activations)."""
    rows, step_bytes, bits = rk.ROWS.value, rk.STEP_BYTES.value, rk.BYTE_BITS.value
    assert 2**bits == step_bytes
    j = torch.arange(step_bytes)
    byte_of_position = (j & ~3) | ((j & 1) << 1) | ((j >> 1) & 1)  # bits 0 and 1 swapped (the decode)
    weights = byte_of_position.expand(rows, step_bytes)  # even inputs 2 * byte (odd: 2 * byte + 1)
    a = weights.reshape([rows] + [2] * bits).permute(rk.WEIGHTS_ORDER.value).reshape(rows, step_bytes)
    activations = j.expand(8, step_bytes)  # de-interleaved x: value j of a half is input 2 j (or 2 j + 1)
    b = activations.reshape([8] + [2] * bits).permute(rk.ACTIVATIONS_ORDER.value).reshape(step_bytes, 8)
    assert torch.equal(a, b[:, :1].T.expand(rows, step_bytes))
    assert torch.equal(b, b[:, :1].expand(step_bytes, 8))
    # every 8 consecutive positions share one block scale (16 inputs = 8 bytes): the swap stays inside a word
    assert torch.equal(byte_of_position // 8, j // 8)


def test_lane_positions_become_the_operands_lane_inputs(rk):
    """Positions 16 t (t = lane % 4) must land on operand inputs 2 t (mma.sync's lane mapping); registers may go
    anywhere. The GPU compile checks the full layouts (`assert_trivial`); this names the rule."""
    rows, step_bytes, bits = rk.ROWS.value, rk.STEP_BYTES.value, rk.BYTE_BITS.value
    positions = torch.arange(step_bytes).expand(rows, step_bytes)
    relabeled = positions.reshape([rows] + [2] * bits).permute(rk.WEIGHTS_ORDER.value).reshape(rows, step_bytes)
    for t in range(4):
        assert relabeled[0, 2 * t].item() == 16 * t


def test_mxfp8_relabelings_pair_each_weight_with_its_input_and_lane(rk):
    """MXFP8 blocks: byte p of a block is input p on both sides (no decode swap); after the relabelings, every
    operand input names the same input in A and B, and bytes 8 t (lane t's first) land on operand input 2 t."""
    rows, block, bits = rk.ROWS.value, rk.MX_BLOCK.value, rk.MX_BLOCK_BITS.value
    assert 2**bits == block and rk.MX_STEP_BLOCKS.value * block == rk.STEP_BYTES.value
    p = torch.arange(block)
    a = p.expand(rows, block).reshape([rows] + [2] * bits).permute(rk.MX_WEIGHTS_ORDER.value).reshape(rows, block)
    b = p.expand(8, block).reshape([8] + [2] * bits).permute(rk.MX_ACTIVATIONS_ORDER.value).reshape(block, 8)
    assert torch.equal(a, b[:, :1].T.expand(rows, block))
    assert torch.equal(b, b[:, :1].expand(block, 8))
    for t in range(4):
        assert a[0, 2 * t].item() == 8 * t
