"""Builders and helpers shared by the test modules of every folder (imported as `inkling2_helpers`; the root
`pytest.ini` puts `tests/` on `sys.path`). Fixtures and the `gpu` marker are in `conftest.py`.

Tiny configs; our model and transformers' built-in `inkling2` (the oracle) on equal weights; greedy references; the
Triton-interpreter runner; attention inputs; multimodal prompts; a DSpark drafter and planted drafts; static-cache
steps; a mocked GPU for host code. Never a test module: nothing here is collected.
"""

import collections
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import transformers_inkling2  # noqa: F401  (registers our classes)
from transformers_inkling2 import Inkling2ForCausalLM, Inkling2StaticCache, Inkling2TextConfig
from transformers_inkling2.tiny import randomize_, tiny_dspark_config

# 12 layers: full attention at 5 and 11, attention-residual blocks opening at 0 and 6; short windows so that a
# 21-token prompt crosses both the sliding window (8) and the relative-bias extent (12); a log-scaling floor
# inside the prompt so that the full layers' scaling is exercised.
ORACLE_TEXT_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    unpadded_vocab_size=500,
    sliding_window_size=8,
    rel_extent=12,
    d_rel=4,
    eos_token_id=None,
    log_scaling_n_floor=6,
)


# Runs Triton kernels on CPU tensors under Triton's interpreter, in a subprocess (TRITON_INTERPRET is read when
# triton is imported). The prelude works around numpy >= 2.4 refusing int() of a 1-element 1-d array, which
# triton 3.6's interpreter does for `range(..)` bounds held in tensors. CI installs triton 3.6.0 (`.ci/run`).
INTERPRETER_PRELUDE = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
from triton.runtime import interpreter as _interp

_original_patch = getattr(_interp, "_patch_lang_tensor", None)  # (other triton versions need no patch)


def _patch_lang_tensor(tensor, scope):
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if _original_patch is not None:
    _interp._patch_lang_tensor = _patch_lang_tensor
"""
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_under_triton_interpreter(script: str, *args: str) -> dict:
    """Runs `script` (which prints a JSON object as its last line) under the interpreter; returns that object.

    On one thread: the references there are computed in a fresh process, and a fresh process's first parallel
    vector-math call can race in MKL. `torch.exp` of a contiguous fp32 tensor goes to MKL's vector math in chunks
    of at least 2048 elements, one per thread; after triton's import, in 7 of 379 processes on 2 threads the first
    such call gave the first thread's chunk at about 12-bit accuracy (1.5e-4 relative; 3.8e-5 on the decode
    kernel's reference, above its 1e-5 bound), and the next call was exact. 0 of 200 on one thread."""
    env = dict(
        os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p)
    )
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETER_PRELUDE + script, *args], env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_CALL_SCRIPT = r"""
import importlib, json, sys
sys.path[:0] = sys.argv[1:3]  # tests/ (inkling2_helpers) and the test module's folder
print(json.dumps(getattr(importlib.import_module(sys.argv[3]), sys.argv[4])()))
"""


def call_under_triton_interpreter(function) -> dict:
    """`function()`, a test module's function without arguments that returns JSON-able results, run under the
    interpreter (`run_under_triton_interpreter`); returns its results."""
    path = Path(sys.modules[function.__module__].__file__)
    return run_under_triton_interpreter(
        _CALL_SCRIPT, str(Path(__file__).parent), str(path.parent), path.stem, function.__name__
    )


def build_pair(seed: int = 0, dtype=torch.float32, **overrides):
    """(ours, built-in) Inkling2ForCausalLM with identical random weights, in eval mode."""
    from transformers.models.inkling2 import configuration_inkling2 as builtin_config
    from transformers.models.inkling2 import modeling_inkling2 as builtin

    from transformers_inkling2 import Inkling2ForCausalLM, Inkling2TextConfig

    fields = {**ORACLE_TEXT_CONFIG, **overrides}
    ours = randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**fields)), seed).eval()
    oracle = builtin.Inkling2ForCausalLM(builtin_config.Inkling2TextConfig(**fields)).eval()
    oracle.load_state_dict(ours.state_dict(), strict=True)
    return cast_keeping_fp32_modules(ours, dtype), cast_keeping_fp32_modules(oracle, dtype)


def cast_keeping_fp32_modules(model, dtype):
    """Casts like `from_pretrained(dtype=...)`: modules listed in `_keep_in_fp32_modules_strict` stay fp32 (the
    model's list, or for a part of a model such as a decoder layer, the Inkling2 models' list)."""
    from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2PreTrainedModel

    keep = getattr(model, "_keep_in_fp32_modules_strict", Inkling2PreTrainedModel._keep_in_fp32_modules_strict)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not any(pattern in name for pattern in keep):
            tensor.data = tensor.data.to(dtype)
    return model


def left_padded_batch(seed: int = 0, length: int = 21, pad: int = 5, vocab: int = 500):
    """Two rows; the second is left-padded by `pad` tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (2, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :pad] = 0
    return input_ids, attention_mask


def positions_from_mask(attention_mask):
    """What generate() passes: positions count real tokens only."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def greedy_by_recomputation(model, input_ids, attention_mask, new_tokens, **inputs):
    """Reference: every step runs the whole sequence again (images included), without a cache."""
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(
                input_ids,
                attention_mask=attention_mask,
                position_ids=positions_from_mask(attention_mask),
                use_cache=False,
                **inputs,
            ).logits[:, -1]
        input_ids = torch.cat([input_ids, logits.argmax(-1, keepdim=True)], dim=1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
    return input_ids


def greedy_generate(model, input_ids, attention_mask, new_tokens, **inputs):
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **inputs,
    )


# --- multimodal prompts -----------------------------------------------------------------------------------------------

IMAGE_TOKEN = 499  # inside the oracle config's 512-token vocabulary
VISION_CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, projection_hidden_dim=64, text_hidden_size=64)
MULTIMODAL_CONFIG = dict(text_config=ORACLE_TEXT_CONFIG, vision_config=VISION_CONFIG, image_token_id=IMAGE_TOKEN)


def images(*token_grids, seed=0):
    """Random pixel blocks for images of the given (token rows, token cols)."""
    generator = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, rows, cols] for rows, cols in token_grids])
    pixel_values = torch.rand(int(grid.prod(-1).sum()), 40, 40, 3, generator=generator) * 2 - 1
    return pixel_values, grid


def prompt_with_placeholders(rows, length=24, seed=0):
    """`rows`: per batch row, a list of (start, count) placeholder runs; rows are left-padded by 3 when `pad`."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 490, (len(rows), length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, runs in enumerate(rows):
        for start, count in runs:
            input_ids[row, start : start + count] = IMAGE_TOKEN
    return input_ids, attention_mask


# --- attention inputs -------------------------------------------------------------------------------------------------

def random_inputs(
    seed: int,
    *,
    batch=2,
    heads=12,
    kv_heads=2,
    queries=70,
    keys=None,
    head_dim=16,
    extent=24,
    first_query=0,
    padding=(0, 0),
    query_scale=1.0,
    dtype=torch.float32,
    device="cpu",
):
    """Inputs shaped like `Inkling2Attention` makes them: queries at positions first_query.., keys ending at the last
    query; values RMS-normalized; row b of the batch left-padded by padding[b] keys (in stream order)."""
    keys = queries if keys is None else keys
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(device=device, dtype=dtype)

    value = randn(batch, kv_heads, keys, head_dim)
    value = value * torch.rsqrt(value.float().square().mean(-1, keepdim=True)).to(dtype)
    query_positions = torch.arange(first_query, first_query + queries, device=device)
    key_positions = torch.arange(first_query + queries - keys, first_query + queries, device=device)
    key_padding = None
    if any(padding):
        key_padding = torch.ones(batch, keys, dtype=torch.bool, device=device)
        for row, count in enumerate(padding):
            key_padding[row, :count] = False
    return dict(
        query=randn(batch, heads, queries, head_dim, scale=query_scale),
        key=randn(batch, kv_heads, keys, head_dim),
        value=value,
        relative_logits=randn(batch, heads, queries, extent),
        sinks=randn(batch, heads, queries),
        query_positions=query_positions,
        key_positions=key_positions,
        key_padding=key_padding,
    )


def held_in_a_ring(inputs: dict) -> dict:
    """The same inputs with the keys, values and padding held as the static cache's sliding layers hold them: at
    slot = position mod K (key_positions then lists each slot's position)."""
    slots = inputs["key_positions"].remainder(inputs["key"].shape[2])
    ring = dict(inputs)
    for name, dim in (("key", 2), ("value", 2), ("key_padding", 1)):
        if inputs[name] is not None:
            ring[name] = torch.empty_like(inputs[name]).index_copy_(dim, slots, inputs[name])
    ring["key_positions"] = torch.empty_like(slots).index_copy_(0, slots, inputs["key_positions"])
    return ring


# --- DSpark: a drafter on the oracle config, planted drafts -----------------------------------------------------------

# Three tapped layers of the 12; a context window (16) longer than the target's sliding window (8).
DRAFTER = tiny_dspark_config(
    target_layer_ids=[1, 5, 9], intermediate_size=96, num_draft_layers=2, mask_token_id=498
).to_dict()


def build_with_drafter(seed=3, drafter=None, **overrides):
    config = Inkling2TextConfig(**{**ORACLE_TEXT_CONFIG, **overrides}, dspark_config={**DRAFTER, **(drafter or {})})
    return randomize_(Inkling2ForCausalLM(config), seed).eval()


def dspark_generate(model, input_ids, attention_mask, new_tokens, **kwargs):
    return greedy_generate(model, input_ids, attention_mask, new_tokens, dspark=True, **kwargs)


def plant_drafts(monkeypatch, reference, prompt_mask, seed=0, perfect=False):
    """Replaces the drafter's proposals by the reference continuation, wrong at a random position per row and step
    (or nowhere, when `perfect`). Returns the list of planted error positions (7 = none)."""
    from transformers_inkling2.generation import dspark as dspark_generation

    generator = torch.Generator().manual_seed(seed)
    prompt_real = prompt_mask.sum(-1)
    continuation = torch.cat([reference[:, prompt_mask.shape[1] :], torch.zeros_like(reference[:, :8])], dim=1)
    planted = []

    def draft(self, anchor, alive):
        generated = self.real_lengths - prompt_real + 1  # tokens generated so far, the anchor included
        rows = torch.arange(len(anchor))
        index = (generated[:, None] + torch.arange(self.block_size)).clamp(max=continuation.shape[1] - 1)
        drafts = continuation[rows[:, None], index]  # finished rows go on with junk
        errors = torch.randint(0, self.block_size + 1, (len(anchor),), generator=generator)
        if perfect:
            errors.fill_(self.block_size)
        planted.extend(errors.tolist())
        wrong = errors < self.block_size
        drafts[rows[wrong], errors[wrong]] = (drafts[rows[wrong], errors[wrong]] + 1) % 490
        return drafts, None

    monkeypatch.setattr(dspark_generation.DSparkDecoder, "draft", draft)
    return planted


# --- static cache: steps of fresh tokens ------------------------------------------------------------------------------

def run_steps(model, cache, input_ids, attention_mask, step_sizes, forward=None, crop_after=None):
    """Prefill, then steps of fresh random tokens (2 rows); optionally takes back 3 tokens after step `crop_after`.
    Returns every forward's logits."""
    forward = forward or model
    with torch.no_grad():
        logits = [forward(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache).logits]
        mask = attention_mask
        for step, size in enumerate(step_sizes):
            tokens = torch.randint(0, 500, (2, size), generator=torch.Generator().manual_seed(step)).to(mask.device)
            mask = torch.cat([mask, mask.new_ones(2, size)], dim=1)
            output = forward(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions_from_mask(mask)[:, -size:],
                past_key_values=cache,
            )
            logits.append(output.logits.clone())
            if step == crop_after:
                cache.crop(-3)
                mask = mask[:, :-3]
    return logits


@contextlib.contextmanager
def on_mocked_gpu(capability: tuple[int, int], multiprocessors: int = 132):
    """Host code inside sees every tensor as a CUDA tensor on a GPU of compute `capability` with `multiprocessors` SMs
    (what the dispatch and the launch options read; an H200's by default), while the tensors stay on this CPU."""
    properties = SimpleNamespace(major=capability[0], minor=capability[1], multi_processor_count=multiprocessors)
    with (
        mock.patch("torch.cuda.get_device_capability", return_value=capability),
        mock.patch("torch.cuda.get_device_properties", return_value=properties),
        mock.patch.object(torch.Tensor, "is_cuda", property(lambda tensor: True)),
    ):
        yield


def within(actual, expected, tolerance):
    """max |actual - expected| / max(|expected|, 1) <= tolerance: a relative bound that turns absolute near zero."""
    expected = expected.float()
    return ((actual.float() - expected).abs() / expected.abs().clamp(min=1)).max().item() <= tolerance


def relative_differences(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> list[float]:
    """|actual - expected| / |expected| (L2) of each forward's logits, in order."""
    return [((a - e).norm() / e.norm()).item() for a, e in zip(actual, expected, strict=True)]


def assert_same_logits(expected, actual, atol=1e-4):
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e, atol=atol, rtol=0)


STEPS = [1, 3, 1, 8, 1, 1, 5, 1, 2, 1, 1, 1, 8, 1]  # crosses the window (8) and the extent (12) several times


def set_environment(monkeypatch, values: dict) -> None:
    """Sets each variable to its value, or removes it where the value is None."""
    for name, value in values.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def switched_step_differences(switches: list[str], kernels: list[tuple], device: str = "cpu",
                              dtype=torch.float32) -> dict:  # fmt: skip
    """A tiny model's prefill and decode / verification steps (`STEPS[:6]`: 1, 3, 1, 8, 1, 1 tokens, across the
    window of 8, taking 3 tokens back after the 8, as a rejected draft does) over the static cache with the
    environment `switches` set to "1", then to "0": the largest relative difference of any forward's logits, the
    prefill's, and how many calls the `kernels` ((module, function name) pairs: the fused kernels' entry points,
    counted by wrapping them) took while switched on: in all, and by name."""
    model = build_pair(seed=3, dtype=dtype)[0].to(device)
    input_ids, attention_mask = (t.to(device) for t in left_padded_batch(seed=4))
    calls, originals = collections.Counter(), {(module, name): getattr(module, name) for module, name in kernels}

    def counted(module, name):
        original = originals[module, name]

        def call(*args, **kwargs):
            if os.environ.get(switches[0]) == "1":
                calls[name] += 1
            return original(*args, **kwargs)

        return call

    for module, name in kernels:
        setattr(module, name, counted(module, name))
    logits = {}
    try:
        for switch in ("1", "0"):
            os.environ.update(dict.fromkeys(switches, switch))
            cache = Inkling2StaticCache(model.config, max_cache_len=64)
            logits[switch] = run_steps(model, cache, input_ids, attention_mask, STEPS[:6], crop_after=3)
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)
        for name in switches:
            os.environ.pop(name)
    differences = relative_differences(logits["1"], logits["0"])
    return dict(difference=max(differences), prefill=differences[0], calls=calls.total(), calls_by_kernel=calls)


class CountedLaunches:
    """Stands in for a Triton kernel in its module, counting its launches by the value of one launch option: the
    launches inside a custom op happen at run time, also in a compiled graph (which a Python wrapper of the op would
    only see while tracing)."""

    def __init__(self, module, name: str, option: str):
        self.module, self.name, self.option = module, name, option
        self.kernel, self.counts = getattr(module, name), collections.Counter()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counts[str(kwargs[self.option])] += 1
            return self.kernel[grid](*args, **kwargs)

        return launch

    def __enter__(self):
        setattr(self.module, self.name, self)
        return self.counts

    def __exit__(self, *exc_info):
        setattr(self.module, self.name, self.kernel)


def compiled_step_launches(switches: dict[str, str], kernels: list[tuple], step_sizes: tuple = (1, 1, 1)) -> dict:
    """bf16 decode steps (of `step_sizes` tokens: 1, or a verification step's several) of a tiny model through the
    decode-step runner's compiled step (`fullgraph=True`, backend "eager", recompiles an error) with the environment
    `switches` set, against the same steps run eagerly: the largest relative difference of the logits
    ("difference"), and for each (module, Triton kernel, launch option) of `kernels` the compiled steps' launches of
    the kernel by that option's value ("launches", in order). A fused path must trace whole for the compiled steps to
    take it. Steps of one size only: a step of another size would recompile."""
    import torch._dynamo
    from transformers import CompileConfig

    from transformers_inkling2 import Inkling2DecodeGraphs

    model = cast_keeping_fp32_modules(build_pair(seed=4)[0], torch.bfloat16)  # `torch._grouped_mm` takes bf16 only
    input_ids, attention_mask = left_padded_batch(seed=6)
    with mock.patch.dict(os.environ, switches), contextlib.ExitStack() as stack:
        cache = Inkling2StaticCache(model.config, max_cache_len=64)
        expected = run_steps(model, cache, input_ids, attention_mask, step_sizes)
        torch._dynamo.reset()
        compile_config = CompileConfig(backend="eager", fullgraph=True)
        runner = Inkling2DecodeGraphs(model, use_cuda_graphs=False, min_bucket=64, compile_config=compile_config)
        cache = Inkling2StaticCache(model.config, max_cache_len=64)
        stack.enter_context(torch._dynamo.config.patch(error_on_recompile=True))
        launches = [stack.enter_context(CountedLaunches(*kernel)) for kernel in kernels]
        actual = run_steps(model, cache, input_ids, attention_mask, step_sizes, forward=runner)
    return dict(difference=max(relative_differences(actual, expected)), launches=launches)


# the TP8 launch took 229 s at most on 2 cores that other jobs shared; a hung launch is killed (the worker's
# collectives give up after 5 minutes first and say which one hung)
LAUNCH_TIMEOUT = 600  # seconds


def torchrun(ranks: int, script: Path, *arguments) -> None:
    """Runs `script` on `ranks` CPU processes (skips where torch has no gloo); on a failure or a hang the test fails
    with their output."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torchrun on CPU needs torch.distributed with gloo, which this torch build lacks")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(script), *map(str, arguments)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun and its ranks
            stdout, stderr = process.communicate()
            pytest.fail(f"torchrun ran past {LAUNCH_TIMEOUT} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    assert process.returncode == 0, f"torchrun failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
