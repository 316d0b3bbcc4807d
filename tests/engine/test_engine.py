"""`Inkling2Engine`: sequences served together yield what each yields alone through generate() (greedy in fp32:
token for token; seeded sampling: the tokens of `torch.manual_seed(seed)` + `generate(do_sample=True)`, whatever runs
beside them), across continuous admission, chunked prefill, preemption, DSpark with per-row acceptance, images,
cancellation and stops; on a GPU, with the decode steps replayed as CUDA graphs."""

import pytest
import torch
from inkling2_helpers import (
    IMAGE_TOKEN,
    MULTIMODAL_CONFIG,
    ORACLE_TEXT_CONFIG,
    build_with_drafter,
    cast_keeping_fp32_modules,
    images,
)

from transformers_inkling2 import (
    Inkling2Config,
    Inkling2ForCausalLM,
    Inkling2ForConditionalGeneration,
    Inkling2TextConfig,
)
from transformers_inkling2.engine import Inkling2Engine, RequestTooLong, SamplingParams
from transformers_inkling2.engine import drafting, scheduler
from transformers_inkling2.tiny import randomize_

LENGTHS = [3, 70, 21, 9, 40, 1, 33]


@pytest.fixture(scope="module")
def model():
    return randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**ORACLE_TEXT_CONFIG)), seed=2).eval()


@pytest.fixture(scope="module")
def drafting_model():
    return build_with_drafter(seed=3)


def prompts(seed=0, lengths=LENGTHS):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 490, (length,), generator=generator).tolist() for length in lengths]


def alone(model, prompt, new_tokens, **sampling):
    """The reference: the prompt by itself through generate()."""
    output = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, **sampling
    )
    return output[0, len(prompt) :].tolist()


def engine_for(model, **options):
    settings = dict(max_num_seqs=3, page_size=64, max_model_len=256, max_step_tokens=24)
    return Inkling2Engine(model, **{**settings, **options})


def test_greedy_rows_served_together_equal_each_alone(model):
    """More requests than rows (admitted as rows free up), prompts longer than the step budget (prefilled in chunks
    between decode steps), different lengths to generate."""
    requests = prompts()
    budgets = [12, 5, 17, 8, 3, 20, 10]
    engine = engine_for(model)
    outputs = engine.generate(requests, [SamplingParams(max_new_tokens=n) for n in budgets])
    assert outputs == [alone(model, p, n, do_sample=False) for p, n in zip(requests, budgets)]
    assert engine.scheduler.pages.free_count == engine.cache.num_pages - 1  # every page back


def test_a_step_interleaves_prompt_chunks_with_decode_rows(model):
    engine = engine_for(model, max_step_tokens=16)
    engine.add_request(prompts(1, [5])[0], SamplingParams(max_new_tokens=30))
    engine.step()  # the short prompt is prefilled: it decodes from now on
    engine.add_request(prompts(2, [50])[0], SamplingParams(max_new_tokens=30))
    plan = engine.scheduler.schedule()
    assert len(plan.decode) == 1 and [(end - first) for _, first, end in plan.prefill] == [15]


def test_preempted_sequences_resume_with_the_same_tokens(model, monkeypatch):
    preempted = []
    original = scheduler.Scheduler._preempt
    monkeypatch.setattr(scheduler.Scheduler, "_preempt", lambda self, s: (preempted.append(s), original(self, s)))
    requests = prompts(3, [60, 50, 55])
    engine = engine_for(model, num_pages=4, max_step_tokens=256)  # 3 pages of 64 tokens for three sequences
    outputs = engine.generate(requests, SamplingParams(max_new_tokens=40))
    assert preempted, "the pool was meant to run out"
    assert outputs == [alone(model, p, 40, do_sample=False) for p in requests]


def test_seeded_sampling_equals_generate_and_ignores_its_neighbours(model):
    requests = prompts(4, [11, 30, 6])
    sampling = dict(temperature=0.7, top_p=0.9, top_k=20)
    seeded = SamplingParams(max_new_tokens=12, seed=7, **sampling)
    torch.manual_seed(7)
    expected = alone(model, requests[0], 12, do_sample=True, **sampling)
    assert engine_for(model).generate(requests[:1], [seeded]) == [expected]
    neighbours = [seeded, SamplingParams(max_new_tokens=9, temperature=1.3), SamplingParams(max_new_tokens=15)]
    assert engine_for(model).generate(requests, neighbours)[0] == expected


def test_stop_tokens_end_a_row_and_are_kept(model):
    request = prompts(5, [12])[0]
    expected = alone(model, request, 10, do_sample=False)
    engine = engine_for(model)
    engine.add_request(request, SamplingParams(max_new_tokens=10, stop_token_ids=(expected[3],)))
    outputs = list(engine.stream())
    assert [t for o in outputs for t in o.new_token_ids] == expected[: expected.index(expected[3]) + 1]
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"


def test_cancelled_requests_free_their_row_and_pages(model):
    engine = engine_for(model)
    first = engine.add_request(prompts(6, [20])[0], SamplingParams(max_new_tokens=50))
    second = engine.add_request(prompts(7, [20])[0], SamplingParams(max_new_tokens=5))
    engine.step()
    engine.cancel(first)
    outputs = engine.step()
    assert any(o.request_id == first and o.finish_reason == "cancelled" for o in outputs)
    assert engine.num_running == 1 and engine.scheduler.running[0].request_id == second
    list(engine.stream())
    assert engine.num_running == 0 and engine.scheduler.pages.free_count == engine.cache.num_pages - 1


def test_requests_that_cannot_fit_are_refused_clearly(model):
    engine = engine_for(model, num_pages=3)
    with pytest.raises(RequestTooLong, match="exceed what one sequence can hold"):
        engine.add_request(prompts(8, [100])[0], SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="must lie in"):
        engine.add_request([1, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="power of two"):
        Inkling2Engine(model, page_size=100)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_dspark_rows_accept_different_counts_and_yield_plain_greedy(drafting_model, monkeypatch):
    """Drafts planted from each row's greedy continuation, wrong at a random position per row and step: rows accept
    different counts in one step, and every row still yields exactly its plain greedy tokens."""
    requests = prompts(9, [17, 45, 4, 30])
    expected = [alone(drafting_model, p, 24, do_sample=False) for p in requests]
    continuation = {tuple(p): p + e + [0] * 16 for p, e in zip(requests, expected)}
    generator = torch.Generator().manual_seed(0)
    accepted_per_step = []
    original_step = drafting.RowDrafter.step

    def planted(self, by_slot, anchors, anchor_positions):
        drafts, distributions = self.draft_block(by_slot, anchors, anchor_positions)
        for slot, sequence in enumerate(by_slot):
            if sequence is not None:
                full = next(c for p, c in continuation.items() if list(p) == sequence.prompt_ids)
                good = torch.tensor(full[len(sequence.tokens) : len(sequence.tokens) + self.block_size])
                wrong = int(torch.randint(0, self.block_size + 1, (1,), generator=generator))
                good[wrong:] = (good[wrong:] + 1) % 490
                drafts[slot] = good
        return drafts, distributions

    def counting_step(self, engine, rows):
        before = {s.request_id: s.accepted_drafts for s in rows}
        result = original_step(self, engine, rows)
        accepted_per_step.append({s.accepted_drafts - before[s.request_id] for s in rows})
        return result

    monkeypatch.setattr(drafting.RowDrafter, "draft_block", drafting.RowDrafter.draft, raising=False)
    monkeypatch.setattr(drafting.RowDrafter, "draft", planted)
    monkeypatch.setattr(drafting.RowDrafter, "step", counting_step)
    engine = engine_for(drafting_model, max_num_seqs=4, max_step_tokens=64, dspark=True)
    assert engine.generate(requests, SamplingParams(max_new_tokens=24)) == expected
    assert any(len(counts) > 1 for counts in accepted_per_step)


def test_dspark_with_its_own_drafter_equals_plain_greedy(drafting_model):
    requests = prompts(10, [13, 38, 7])
    engine = engine_for(drafting_model, dspark=True)
    assert engine.generate(requests, SamplingParams(max_new_tokens=20)) == [
        alone(drafting_model, p, 20, do_sample=False) for p in requests
    ]


def test_dspark_seeded_sampling_ignores_its_neighbours(drafting_model):
    requests = prompts(11, [9, 25, 14])
    seeded = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=3)
    by_itself = engine_for(drafting_model, dspark=True).generate(requests[:1], [seeded])
    others = [SamplingParams(max_new_tokens=10, temperature=1.1), SamplingParams(max_new_tokens=12)]
    together = engine_for(drafting_model, dspark=True).generate(requests, [seeded, *others])
    assert together[0] == by_itself[0] and len(by_itself[0]) == 16


def chunk_rows(engine, monkeypatch) -> list[int]:
    """The rows of every prompt chunk `engine` runs from now on."""
    rows, original = [], engine._prefill

    def recording(group, first, end):
        rows.append(len(group))
        return original(group, first, end)

    monkeypatch.setattr(engine, "_prefill", recording)
    return rows


@pytest.mark.parametrize("dspark", [False, True])
def test_requests_admitted_together_prefill_side_by_side(drafting_model, dspark, monkeypatch):
    """Neighbouring rows at the same position share a chunk (one forward); each still gets what it gets alone."""
    requests = prompts(17, [30, 30, 30, 12, 30])
    engine = engine_for(drafting_model, max_num_seqs=4, max_step_tokens=48, dspark=dspark)
    rows = chunk_rows(engine, monkeypatch)
    outputs = engine.generate(requests, SamplingParams(max_new_tokens=9))
    assert outputs == [alone(drafting_model, p, 9, do_sample=False) for p in requests]
    assert rows[:2] == [4, 2]  # 4 x 12 (finishes the 12-token prompt), then the two that 2 x 18 finishes


def test_the_next_chunk_finishes_the_most_prompts_then_takes_the_most_tokens_and_rows():
    group = [scheduler.Sequence([1] * n, SamplingParams()) for n in (30, 30, 12, 5)]
    assert scheduler.side_by_side(group, 48) == (3, 12)  # finishes 1 (as 1 x 30 and 4 x 5 do) with the most tokens
    assert scheduler.side_by_side(group, 60) == (2, 30)  # finishes 2
    assert scheduler.side_by_side(group, 7) == (1, 7)  # finishes none: the most tokens
    assert scheduler.side_by_side(group[:2], 24) == (2, 12)  # a tie with 1 x 24: fewer forwards


def test_images_in_prompts(monkeypatch):
    """A prompt with an image beside a text prompt of the same length: side by side, from their embeddings."""
    model = randomize_(Inkling2ForConditionalGeneration(Inkling2Config(**MULTIMODAL_CONFIG)), seed=4).eval()
    pixel_values, grid = images((2, 2), seed=1)
    with_image, text_only = prompts(12, [24, 24])
    with_image[5:9] = [IMAGE_TOKEN] * 4
    image_inputs = dict(pixel_values=pixel_values, image_grid_thw=grid)
    expected = model.generate(
        torch.tensor([with_image]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
        **image_inputs,
    )[0, 24:].tolist()  # fmt: skip
    engine = engine_for(model, max_step_tokens=48)  # room for both prompts in one chunk
    rows = chunk_rows(engine, monkeypatch)
    image_request = engine.add_request(with_image, SamplingParams(max_new_tokens=10), image_inputs=image_inputs)
    text_request = engine.add_request(text_only, SamplingParams(max_new_tokens=10))
    outputs = list(engine.stream())
    assert [t for o in outputs if o.request_id == image_request for t in o.new_token_ids] == expected
    text = [t for o in outputs if o.request_id == text_request for t in o.new_token_ids]
    assert text == alone(model, text_only, 10, do_sample=False)
    assert rows[0] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dspark", [False, True])
def test_gpu_engine_equals_generate_and_its_graphs_equal_eager_steps(dspark):
    requests = prompts(14)
    model = build_with_drafter(seed=3).cuda()  # fp32: token for token against generate() (its experts run eagerly)
    outputs = engine_for(model, max_num_seqs=4, dspark=dspark).generate(requests, SamplingParams(max_new_tokens=16))
    assert outputs == [alone(model, p, 16, do_sample=False) for p in requests]
    bf16 = cast_keeping_fp32_modules(build_with_drafter(seed=3), torch.bfloat16).cuda()
    graphs = engine_for(bf16, max_num_seqs=4, dspark=dspark)
    replayed = graphs.generate(requests, SamplingParams(max_new_tokens=16))
    assert graphs.graphs and all(graph is not None for graph, _, _ in graphs.graphs.values())
    eager = engine_for(bf16, max_num_seqs=4, dspark=dspark, use_cuda_graphs=False)
    assert replayed == eager.generate(requests, SamplingParams(max_new_tokens=16))

class BanLowTokens:
    """A request's own logits processor (as the server's grammars are): tokens below 250 never come."""

    def __call__(self, input_ids, scores):
        return scores.index_fill(-1, torch.arange(250, device=scores.device), -float("inf"))


@pytest.mark.parametrize("dspark", [False, True])
def test_logits_processors_of_a_request_apply_to_its_row_only(drafting_model, dspark):
    from transformers import LogitsProcessorList

    requests = prompts(15, [10, 22])
    processor = LogitsProcessorList([BanLowTokens()])
    expected = alone(drafting_model, requests[0], 12, do_sample=False, logits_processor=processor)
    assert min(expected) >= 250
    params = [SamplingParams(max_new_tokens=12, logits_processors=[BanLowTokens()]), SamplingParams(max_new_tokens=12)]
    outputs = engine_for(drafting_model, dspark=dspark).generate(requests, params)
    assert outputs == [expected, alone(drafting_model, requests[1], 12, do_sample=False)]


@pytest.mark.parametrize("dspark", [False, True])
def test_warm_up_runs_every_bucket_and_leaves_the_engine_as_it_was(drafting_model, dspark):
    """What the server runs before its first request on a GPU (there it also compiles and captures; here it runs the
    same forwards eagerly): afterwards requests get what they get without it."""
    requests = prompts(16, [20, 9])
    engine = engine_for(drafting_model, max_num_seqs=2, max_model_len=200, dspark=dspark)
    engine.warm_up()
    assert engine.scheduler.pages.free_count == engine.cache.num_pages - 1
    assert engine.generate(requests, SamplingParams(max_new_tokens=10)) == [
        alone(drafting_model, p, 10, do_sample=False) for p in requests
    ]
    engine.add_request(requests[0])
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warm_up()
