"""The fused decode kernel (`decode_kernel.decode_attention`) with every batch row at its own position and with keys
and values in pages (a block table), against its PyTorch path (`inkling2_decode_attention`) and the eager reference.

The same comparisons run twice: small, on CPU under Triton's interpreter (fp32 MMAs there), and at full size on a
GPU (marked `gpu`). Bounds: relative L2 error <= 1e-5 in fp32; in bf16 at most 1.5x the PyTorch path's own bf16
error plus 1e-3, both against fp32 references computed on CPU (on CUDA the PyTorch path would run the kernel).
"""

from __future__ import annotations

import pytest
import torch
from inkling2_helpers import call_under_triton_interpreter, needs_triton, random_inputs

from transformers_inkling2.backends.attention.flex import inkling2_decode_attention
from transformers_inkling2.modeling.attention import eager_attention

FP32_BOUND = 1e-5
SMALL = dict(heads=4, kv_heads=2, head_dim=16, extent=40)  # 2 query heads per kv head
FULL = dict(heads=48, kv_heads=8, head_dim=128, extent=1024, device="cuda")


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def cast(inputs: dict, dtype: torch.dtype) -> dict:
    return {key: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t for key, t in inputs.items()}


def rows_at(ends, length: int, device) -> torch.Tensor:
    """[B, length] positions, row b ending at ends[b]."""
    return torch.tensor(ends, device=device)[:, None] + torch.arange(1 - length, 1, device=device)


def rows_inputs(seed: int, queries: int, keys: int, query_ends, **options) -> dict:
    """`random_inputs` with the queries of row b ending at query_ends[b] and keys at positions arange(K): rows
    ending before K have keys past their queries, to be masked."""
    inputs = random_inputs(seed, batch=len(query_ends), queries=queries, keys=keys, **options)
    inputs["query_positions"] = rows_at(query_ends, queries, inputs["query"].device)
    inputs["key_positions"] = torch.arange(keys, device=inputs["query"].device)
    return inputs


def per_row_cases(seed: int, queries: int, keys: int, query_ends, key_ends, **sizes) -> dict:
    """name -> (kernel inputs, reference inputs): per-row queries (`rows_inputs`); keys at positions arange(K)
    shared by the batch, or per row in a ring ending at key_ends[b] (slot = position mod K, as the static cache's
    sliding layers hold them), where positions past a row's queries must be masked."""
    inputs = rows_inputs(seed, queries, keys, query_ends, **sizes)
    positions = rows_at(key_ends, keys, inputs["query"].device)
    ring = dict(inputs, key_positions=torch.empty_like(positions).scatter_(1, positions.remainder(keys), positions))
    return {f"{queries} queries, shared keys": (inputs, inputs),
            f"{queries} queries, keys per row in a ring": (ring, ring)}


def in_pages(inputs: dict, page_size: int, seed: int) -> tuple[dict, dict]:
    """(kernel inputs, reference inputs): the keys and values of `inputs` in shuffled page pools with a block table,
    as a paged cache holds them, and the pages gathered back to [B, Hkv, K, D]. The last row's first page is the
    first row's (a shared prefix; its own page stays in the pool, unused). The key and value pools are views into
    one [pages, 2, Hkv, page_size, D] buffer: pages apart by more than their size."""
    batch, kv_heads, keys, head_dim = inputs["key"].shape
    pages = keys // page_size
    shuffled = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed)).to(inputs["key"].device)

    def pool(tensor):
        return tensor.view(batch, kv_heads, pages, page_size, head_dim).transpose(1, 2).flatten(0, 1)[shuffled]

    pools = torch.stack([pool(inputs["key"]), pool(inputs["value"])], 1)
    block_table = shuffled.argsort().view(batch, pages).int()
    block_table[-1, 0] = block_table[0, 0]

    def gathered(pool):
        return pool[block_table].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, keys, head_dim)

    paged = dict(inputs, key=pools[:, 0], value=pools[:, 1], block_table=block_table, page_size=page_size)
    return paged, dict(inputs, key=gathered(pools[:, 0]), value=gathered(pools[:, 1]))


def paged_cases(seed: int, queries: int, keys: int, query_ends, page_size: int, padding, **sizes) -> dict:
    """name -> (kernel inputs, reference inputs): per-row queries (`rows_inputs`) over paged keys, without padding
    and with row b left-padded by padding[b] keys."""
    cases = {}
    for name, row_padding in (("no padding", (0,)), ("padding", padding)):
        inputs = rows_inputs(seed, queries, keys, query_ends, padding=row_padding, **sizes)
        cases[f"{queries} queries, paged, {name}"] = in_pages(inputs, page_size, seed)
    return cases


def kernel_errors(cases: dict, windows, dtype=torch.float32) -> dict:
    """name, window -> [relative error of the kernel (inputs in `dtype`) to the fp32 PyTorch path, to fp32 eager,
    of the PyTorch path in `dtype` to its fp32 self]; references on CPU copies."""
    from transformers_inkling2.backends.attention.decode_kernel import decode_attention

    errors = {}
    for name, (inputs, reference) in cases.items():
        reference = {key: t.cpu() if torch.is_tensor(t) else t for key, t in reference.items()}
        for window in windows:
            options = dict(sliding_window=window, scaling=0.25)
            expected = inkling2_decode_attention(**reference, **options)
            assert expected.abs().max() > 0.1  # a live case, not an all-sink one
            fused = decode_attention(**cast(inputs, dtype), **options).cpu()
            assert fused.dtype == dtype and torch.isfinite(fused).all()
            own = inkling2_decode_attention(**cast(reference, dtype), **options)
            errors[f"{name}, window {window}"] = [
                relative_error(fused, expected),
                relative_error(fused, eager_attention(**reference, **options)),
                relative_error(own, expected),
            ]
    return errors


def compiled_difference(inputs: dict) -> float:
    """Max difference of the op under `torch.compile` (fullgraph, as the compiled decode steps run it: its fake
    traces the call) to the op called directly."""
    from transformers_inkling2.backends.attention.decode_kernel import decode_attention

    def attend(**kw):
        return decode_attention(**kw, sliding_window=50, scaling=0.25)

    return (torch.compile(attend, fullgraph=True)(**inputs) - attend(**inputs)).abs().max().item()


def small_per_row_errors() -> dict:
    cases = {}
    for queries in (1, 3):
        cases.update(per_row_cases(queries, queries, 130, (70, 200, 100), (150, 230, 140), **SMALL))
    ring, _ = cases["3 queries, keys per row in a ring"]
    return dict(errors=kernel_errors(cases, (None, 50)), compiled=compiled_difference(ring))


def small_paged_errors() -> dict:
    cases = paged_cases(7, 3, 192, (70, 191, 150), 64, padding=(0, 20, 0), **SMALL)
    paged, _ = cases["3 queries, paged, padding"]
    return dict(errors=kernel_errors(cases, (None, 50)), compiled=compiled_difference(paged))


def assert_within_bounds(errors: dict, count: int, dtype=torch.float32) -> None:
    assert len(errors) == count
    for name, (to_pytorch_path, to_eager, own_error) in errors.items():
        bound = FP32_BOUND if dtype == torch.float32 else 1.5 * own_error + 1e-3
        assert to_pytorch_path <= bound and to_eager <= bound, (name, errors[name])


@needs_triton
def test_kernel_with_positions_per_row_under_the_triton_interpreter():
    """Per-row query positions [B, Q] with key positions shared (1-D) or per row in a ring (2-D, rows wrapped at
    different slots), split over several programs; also under torch.compile."""
    results = call_under_triton_interpreter(small_per_row_errors)
    assert_within_bounds(results["errors"], 8)
    assert results["compiled"] == 0


@needs_triton
def test_paged_kernel_under_the_triton_interpreter():
    """Keys and values in 64-key pages of shuffled, strided pools (two rows sharing a page), per-row query
    positions, with and without padding: as the kernel on the pages gathered back; also under torch.compile."""
    results = call_under_triton_interpreter(small_paged_errors)
    assert_within_bounds(results["errors"], 4)
    assert results["compiled"] == 0


@needs_triton
@pytest.mark.parametrize("pool_page, page_size", [(96, 96), (64, 0), (64, 128)])
def test_pages_that_split_key_blocks_or_disagree_with_the_pools_are_refused(pool_page, page_size):
    from transformers_inkling2.backends.attention.decode_kernel import decode_attention

    inputs, _ = in_pages(random_inputs(8, queries=1, keys=192), pool_page, seed=8)
    with pytest.raises(ValueError, match=f"multiple of 64 .* page length \\({pool_page}\\)"):
        decode_attention(**dict(inputs, page_size=page_size), sliding_window=None, scaling=0.25)


# --- GPU: full size, bf16 and fp32 ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("queries", [1, 8])
def test_gpu_kernel_with_positions_per_row(queries, dtype):
    cases = per_row_cases(queries, queries, 4096, (4500, 7000, 3000), (4600, 7100, 4200), **FULL)
    assert_within_bounds(kernel_errors(cases, (1024, None), dtype), 4, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("queries", [1, 8])
def test_gpu_paged_kernel(queries, dtype):
    cases = paged_cases(queries, queries, 4096, (3000, 4095, 2000), 256, padding=(0, 300, 0), **FULL)
    assert_within_bounds(kernel_errors(cases, (1024, None), dtype), 4, dtype)
