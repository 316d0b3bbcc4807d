"""DSpark speculative decoding for `generate(dspark=True)`: the drafter proposes `block_size` tokens, the target
checks them all in one forward pass, and the longest acceptable prefix plus one token of the target's own is kept.

One step, for every row of the batch at once:
1. draft: one drafter pass over the block `[anchor, mask, ...]`, then the Markov head walks the block, sampling (or
   taking the argmax of) each draft from the processed draft logits; the draft probabilities `q` are kept;
2. verify: the target runs on `[anchor, draft_1, ..., draft_L]`; the logits processors (temperature, top-k/p, ...)
   see each position's own prefix, giving the target distributions `p`;
3. accept (lossless): greedy decoding accepts a draft iff it is the target's argmax; sampling accepts draft `d` with
   probability `min(1, p(d) / q(d))`, and at the first rejection draws from `normalize(max(p - q, 0))` (all accepted:
   a bonus token from the last `p`). The output distribution is exactly the target's;
4. commit: the caches keep the anchor and the accepted drafts. Rows accept different counts, so every row keeps the
   batch's largest count and a row that accepted fewer moves right by the difference (`shift_rows_right`): its
   rejected tokens fall off the end and become left padding, its physical positions stay shared with the batch.

Positions are physical (the target's cache), so padding masks, sliding windows and relative biases stay valid; the
`position_ids` that drive the full layers' log scaling count each row's real tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.utils import ModelOutput

from ..cache.common import MAX_STEP_TOKENS, shift_rows_right
from ..cache.dynamic import Inkling2Cache
from ..cache.static import Inkling2StaticCache
from ..modeling.modeling_inkling2_dspark import ContextView, Inkling2DSparkContextCache, Inkling2DSparkStaticContext
from .decode_graphs import capture_graph

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass
class Inkling2DSparkGenerateOutput(ModelOutput):
    """What `generate(dspark=True, return_dict_in_generate=True)` returns.

    Args:
        sequences: prompts and generated tokens, `[batch, length]`, right-padded with the pad token.
        num_steps: draft-and-verify steps (one drafter pass and one target pass each).
        mean_accepted_length: tokens committed per step and row, the target's own token included (1 to block_size+1).
        position_acceptance: `[block_size]`, the fraction of row-steps whose draft k was accepted (with all before it).
    """

    sequences: torch.LongTensor | None = None
    num_steps: int | None = None
    mean_accepted_length: float | None = None
    position_acceptance: torch.Tensor | None = None


@dataclass
class DSparkOptions:
    """`draft_sample_method`: "probabilistic" samples drafts from the drafter's processed distribution (the best
    acceptance when sampling); "greedy" drafts its argmax. `confidence_threshold`: stop a draft at the first position
    where the confidence head of any unfinished row falls below it (fewer tokens to verify)."""

    draft_sample_method: str = "probabilistic"
    confidence_threshold: float | None = None

    def __post_init__(self):
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"`draft_sample_method` must be one of {DRAFT_SAMPLE_METHODS}, got {self.draft_sample_method!r}."
            )


def dspark_decoding_method(options: DSparkOptions, streamer):
    """The callable handed to `GenerationMixin.generate(custom_generate=...)`: transformers prepares the inputs,
    cache, logits processors and stopping criteria, then calls it (without the streamer, which we bind here)."""
    return functools.partial(dspark_decoding, options=options, streamer=streamer)


def check_dspark_request(model, generation_config) -> None:
    """Clear errors for what DSpark decoding cannot do."""
    drafter = getattr(model, "dspark", None)
    if drafter is None:
        raise ValueError(
            "`dspark=True` needs a DSpark drafter, and this model has none (its config has no `dspark_config`, or the "
            "checkpoint's `mtp.safetensors` could not be mapped: see the warning at load time). Generate without "
            "`dspark`, or train a drafter with `inkling2 train-dspark`."
        )
    if generation_config.num_beams > 1:
        raise ValueError("DSpark decoding samples or takes the argmax; beam search (`num_beams > 1`) is not supported.")
    if generation_config.output_scores or generation_config.output_logits or generation_config.output_attentions:
        raise ValueError(
            "DSpark decoding returns sequences and acceptance statistics; `output_scores`, `output_logits` and "
            "`output_attentions` are not available with `dspark=True`."
        )
    if drafter.config.block_size + 1 > MAX_STEP_TOKENS:
        raise ValueError(
            f"The drafter's block size {drafter.config.block_size} needs a cache rollback margin of "
            f"{drafter.config.block_size + 1}; Inkling2Cache keeps {MAX_STEP_TOKENS}."
        )


def pad_token_id(generation_config) -> int:
    """The pad token (generate() defaults it to EOS); 0 when neither is set."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    eos = getattr(generation_config, "_eos_token_tensor", None)
    if pad is None and eos is not None:
        pad = eos.flatten()[0]
    return 0 if pad is None else int(pad)


def real_positions(padding_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among its row's real tokens (padding at 0)."""
    return (padding_mask.long().cumsum(-1) - 1).clamp(min=0)


def processed(logits_processor, prefix: torch.Tensor | None, logits: torch.Tensor, device) -> torch.Tensor:
    """fp32 scores on `device` (the lm_head may sit on another GPU), after the logits processors if there are any
    (then `prefix` is the token sequence they see)."""
    logits = logits.to(device, torch.float32)
    return logits_processor(prefix, logits) if logits_processor else logits


class DSparkDecoder:
    """The decoding state between steps; `step()` is one draft-verify-commit round for the whole batch."""

    def __init__(self, model, cache, logits_processor, generation_config, options: DSparkOptions):
        self.model, self.cache, self.options = model, cache, options
        # over a static cache on a GPU, verification passes replay as CUDA graphs (`generation_config.disable_compile`)
        runner = None
        if isinstance(cache, Inkling2StaticCache) and model._valid_auto_compile_criteria(
            {"past_key_values": cache}, generation_config
        ):
            runner = model.get_compiled_call(generation_config.compile_config)
        self.forward = runner or model
        self.drafter = model.dspark
        self.block_size = self.drafter.config.block_size
        self.logits_processor = logits_processor
        self.do_sample = generation_config.do_sample
        self.pad_token_id = pad_token_id(generation_config)
        context = Inkling2DSparkStaticContext if isinstance(cache, Inkling2StaticCache) else Inkling2DSparkContextCache
        self.context = context(len(self.drafter.layers), self.drafter.config.context_window)
        # with the target's steps, the context append of the verified positions replays as a CUDA graph, and so
        # does the draft when nothing in it needs the host: no logits processor reading the growing prefix, no
        # confidence threshold deciding where to stop
        self.graphs = runner is not None and runner.use_cuda_graphs
        self.graph_drafts = self.graphs and not logits_processor and options.confidence_threshold is None
        self.draft_graph: CapturedCall | None = None
        self.context_graph: CapturedCall | None = None
        self.step_count = 0
        self.accepted_counts: list[int] = []

    # --- helpers ----------------------------------------------------------------------------------------------------

    def target(self, attention_mask: torch.Tensor | None, **inputs):
        """A target forward over new tokens; `attention_mask` covers the cached and the new tokens (None: no padding)."""
        return self.forward(attention_mask=attention_mask, past_key_values=self.cache, use_cache=True, **inputs)

    def context_keys_values(self, hidden_states: tuple[torch.Tensor, ...], keep: int):
        """The drafter's context keys/values of the last `keep` positions the target just ran."""
        features = self.drafter.context_features(tuple(h[:, -keep:] for h in hidden_states))
        return self.drafter.context_keys_values(features)

    def remember_context(self, hidden_states: tuple[torch.Tensor, ...], real: torch.Tensor) -> None:
        """Appends the context of the last positions the target just ran, `real` [batch, positions] saying which are
        real tokens."""
        self.context.append(self.context_keys_values(hidden_states, real.shape[1]), real)

    def remember_verified(self, hidden_states: tuple[torch.Tensor, ...], candidates: torch.Tensor) -> None:
        """Appends the context of every position of a verification pass over `candidates` [batch, verified] (real
        tokens; `commit` then takes back the rejected ones). With graphs: one replay instead of the drafter's
        projections launched one by one."""
        real = torch.ones_like(candidates, dtype=torch.bool)
        if not self.graphs:
            self.remember_context(hidden_states, real)
            return
        verified = candidates.shape[1]
        start = torch.full((1,), self.context.seen_tokens, device=candidates.device)
        if self.context_graph is None:

            def write(start, real, *hidden_states):
                positions = start + torch.arange(verified, device=start.device)
                self.context.write(self.context_keys_values(hidden_states, verified), real, positions)

            self.context_graph = CapturedCall(write, [start, real, *hidden_states], "DSpark context")
        self.context_graph(start, real, *hidden_states)
        self.context.seen_tokens += verified

    def pick(self, scores: torch.Tensor, sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(token, its distribution or None for an argmax) from processed scores [rows, vocab]."""
        if not sample:
            return scores.argmax(-1), None
        probabilities = torch.softmax(scores, dim=-1)
        # a draw from `probabilities`: argmax p_i / E_i over independent E_i ~ Exp(1) (no host sync, unlike
        # torch.multinomial, so a draft can be captured in a CUDA graph)
        return (probabilities / torch.empty_like(probabilities).exponential_()).argmax(-1), probabilities

    # --- prefill ----------------------------------------------------------------------------------------------------

    def prefill(self, input_ids, attention_mask, prompt_embeddings, prefill_chunk_size) -> torch.Tensor:
        """Runs the prompt; the last `context_window + 8` positions also feed the drafter's context. Returns the first
        generated token of every row."""
        batch, length = input_ids.shape
        self.padding_mask = (
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        self.tokens = input_ids
        self.has_padding = not bool(self.padding_mask.all())
        positions = real_positions(self.padding_mask)
        keep = min(length, self.context.max_positions)
        mask = self.padding_mask if self.has_padding else None
        if length > keep:  # the head of a long prompt needs no hidden states (and may go in chunks)
            self.target(
                None if mask is None else mask[:, : length - keep],
                inputs_embeds=prompt_embeddings[:, : length - keep],
                position_ids=positions[:, : length - keep],
                prefill_chunk_size=prefill_chunk_size,
                logits_to_keep=1,
            )
        output = self.target(
            mask,
            inputs_embeds=prompt_embeddings[:, length - keep :],
            position_ids=positions[:, length - keep :],
            output_hidden_states=True,
            logits_to_keep=1,
        )
        self.real_lengths = self.padding_mask.long().sum(-1)
        self.context.seen_tokens = length - keep
        self.remember_context(output.hidden_states, self.padding_mask[:, -keep:])
        scores = processed(self.logits_processor, input_ids, output.logits[:, -1], input_ids.device)
        first, _ = self.pick(scores, self.do_sample)
        return first

    # --- one step ---------------------------------------------------------------------------------------------------

    def draft(self, anchor: torch.Tensor, alive: list[bool]):
        """Drafts for every row: tokens [batch, L], draft distributions [batch, L, vocab] (None for argmax drafts)."""
        device = self.drafter.fc.weight.device  # the drafter sits on one device (`_no_split_modules`)
        anchor_position = torch.full((1,), self.cache.get_seq_length(), device=device)
        if not self.graph_drafts:
            drafts, distributions = self.draft_block(anchor.to(device), anchor_position, alive)
        else:
            if self.draft_graph is None:
                run = functools.partial(self.draft_block, alive=None)
                self.draft_graph = CapturedCall(run, [anchor.to(device), anchor_position], "DSpark draft")
            drafts, distributions = self.draft_graph(anchor, anchor_position)
        return drafts.to(anchor.device), None if distributions is None else distributions.to(anchor.device)

    def draft_block(self, anchor: torch.Tensor, anchor_position: torch.Tensor, alive: list[bool] | None):
        """One drafter pass over `[anchor, mask, ...]` at `anchor_position` ([1]), then the head walks the block.
        `alive` (the unfinished rows) only matters with a confidence threshold."""
        batch = anchor.shape[0]
        mask_id = self.drafter.config.mask_token_id
        block_ids = torch.cat([anchor[:, None], anchor.new_full((batch, self.block_size - 1), mask_id)], dim=1)
        device = anchor.device
        embeddings = self.model.get_input_embeddings()(block_ids)[:, None].to(device)
        keys, values, key_positions, key_is_real = self.context.view()
        view = ContextView(
            anchor_positions=anchor_position,
            key_positions=key_positions,
            key_is_real=key_is_real.to(device),
            block_size=self.block_size,
            window=self.drafter.config.context_window,
            num_buckets=self.drafter.config.distance_buckets,
        )
        hidden = self.drafter.block_hidden_states(embeddings, keys, values, view)
        base_logits = self.model.compute_logits(hidden).to(device)
        sample = self.do_sample and self.options.draft_sample_method == "probabilistic"
        state = self.drafter.initial_state(batch, hidden)
        previous = anchor
        prefix = (
            torch.cat([self.tokens, anchor[:, None].to(self.tokens.device)], 1).to(device)
            if self.logits_processor
            else None
        )
        drafts, distributions = [], []
        for k in range(self.block_size):
            state, logits, confidence = self.drafter.head_step(state, previous, hidden[:, k], base_logits[:, k])
            threshold = self.options.confidence_threshold
            if k > 0 and threshold is not None and confidence is not None:
                if bool((confidence[torch.tensor(alive, device=confidence.device)] < threshold).any()):
                    break
            scores = processed(self.logits_processor, prefix, logits, device)
            previous, distribution = self.pick(scores, sample)
            drafts.append(previous)
            distributions.append(distribution)
            if prefix is not None:
                prefix = torch.cat([prefix, previous[:, None]], dim=1)
        return torch.stack(drafts, dim=1), (torch.stack(distributions, dim=1) if sample else None)

    def verify(self, anchor: torch.Tensor, drafts: torch.Tensor, draft_distributions: torch.Tensor | None):
        """Target pass over [anchor, drafts]; returns (accepted draft counts [batch], the target's next token per row,
        the target's hidden states)."""
        num_drafts = drafts.shape[1]
        candidates = torch.cat([anchor[:, None], drafts], dim=1)
        positions = self.real_lengths[:, None] + torch.arange(num_drafts + 1, device=drafts.device)
        mask = None
        if self.has_padding:
            mask = torch.cat([self.padding_mask, torch.ones_like(candidates, dtype=torch.bool)], dim=1)
        output = self.target(mask, input_ids=candidates, position_ids=positions, output_hidden_states=True)
        if self.logits_processor:  # every position sees its own prefix
            prefix, seen = torch.cat([self.tokens, candidates], dim=1), self.tokens.shape[1]
            scores = torch.stack(
                [
                    processed(self.logits_processor, prefix[:, : seen + j + 1], output.logits[:, j], drafts.device)
                    for j in range(num_drafts + 1)
                ],
                dim=1,
            )
        else:
            scores = processed(None, None, output.logits, drafts.device)
        if not self.do_sample:
            return *greedy_acceptance(scores, drafts), output.hidden_states
        return *sampled_acceptance(scores, drafts, draft_distributions), output.hidden_states

    def commit(self, kept: list[int], hidden_states, candidates: torch.Tensor):
        """Keeps `kept[b]` of the tokens just verified in every cache (see the module docstring): every row keeps the
        batch's largest count, and a row that keeps fewer moves right, its rejected tokens turning into padding."""
        most, verified = max(kept), candidates.shape[1]
        self.cache.crop(most - verified)
        self.remember_verified(hidden_states, candidates)
        self.context.crop(verified - most)
        self.padding_mask = torch.cat([self.padding_mask, torch.ones_like(candidates[:, :most], dtype=torch.bool)], 1)
        self.tokens = torch.cat([self.tokens, candidates[:, :most]], dim=1)
        if min(kept) < most:
            shifts = torch.tensor([most - k for k in kept], device=candidates.device)
            self.cache.shift_rows_right(shifts)
            self.context.shift_rows_right(shifts)
            self.padding_mask = shift_rows_right(self.padding_mask, shifts, 1)
            # the prefix the logits processors see: new padding slots hold the pad token, as left padding does
            self.tokens = shift_rows_right(self.tokens, shifts, 1).masked_fill(~self.padding_mask, self.pad_token_id)
            self.has_padding = True
        self.real_lengths = self.real_lengths + torch.tensor(kept, device=candidates.device)

    def step(self, anchor: torch.Tensor, alive: list[bool]) -> tuple[torch.Tensor, list[list[int]]]:
        """One round: returns (the next anchor [batch], every row's new tokens as a list: its accepted drafts and
        the target's own token)."""
        drafts, draft_distributions = self.draft(anchor, alive)
        accepted, next_token, hidden_states = self.verify(anchor, drafts, draft_distributions)
        new_tokens = torch.cat([drafts, drafts[:, :1]], dim=1)
        new_tokens[torch.arange(len(anchor), device=drafts.device), accepted] = next_token
        # one transfer to the host (one wait for the device) for the counts and the tokens
        rows = torch.cat([accepted[:, None], new_tokens], dim=1).tolist()
        counts = [row[0] + 1 for row in rows]
        most_alive = max(c for c, a in zip(counts, alive) if a)
        # a finished row keeps what the others keep: its content no longer matters, only the shared length
        self.commit(
            [c if a else most_alive for c, a in zip(counts, alive)],
            hidden_states,
            torch.cat([anchor[:, None], drafts], 1),
        )
        self.step_count += 1
        self.accepted_counts += [c - 1 for c, a in zip(counts, alive) if a]
        return next_token, [row[1 : 1 + count] for row, count in zip(rows, counts)]


def greedy_acceptance(scores: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted draft counts [batch], the target's next token [batch]) from the target's processed scores [batch,
    drafts + 1, vocab] of a verification pass: a draft is accepted while it is the target's argmax."""
    choices = scores.argmax(-1)
    accepted = (drafts == choices[:, : drafts.shape[1]]).long().cumprod(-1).sum(-1)
    return accepted, choices[torch.arange(len(drafts), device=drafts.device), accepted]


def sampled_acceptance(
    scores: torch.Tensor,
    drafts: torch.Tensor,
    draft_distributions: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lossless rule of the module docstring for sampling: draft `d` is accepted with probability `min(1, p(d) /
    q(d))`, and the first rejection draws from `normalize(max(p - q, 0))` (all accepted: from the last `p`).
    `draft_distributions` None: argmax drafts (a point mass on each). `generator`: a request's own random stream."""
    rows = torch.arange(len(drafts), device=drafts.device)
    num_drafts = drafts.shape[1]
    target = torch.softmax(scores, dim=-1)
    if draft_distributions is None:
        draft_distributions = torch.zeros_like(target[:, :num_drafts]).scatter_(-1, drafts[..., None], 1.0)
    p_draft = target[:, :num_drafts].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = draft_distributions.gather(-1, drafts[..., None]).squeeze(-1)
    uniform = torch.rand(p_draft.shape, generator=generator, device=p_draft.device, dtype=p_draft.dtype)
    keep = uniform * q_draft < p_draft  # u < p/q without dividing by a zero q
    accepted = keep.long().cumprod(-1).sum(-1)
    padded_q = torch.cat([draft_distributions, torch.zeros_like(target[:, :1])], dim=1)
    residual = (target[rows, accepted] - padded_q[rows, accepted]).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target[rows, accepted])
    return accepted, torch.multinomial(residual, 1, generator=generator).squeeze(-1)


class CapturedCall:
    """`run(*inputs)` as a CUDA graph (a draft over the static context rings, a context append): the tensor inputs
    are copied into the graph's own buffers, the graph replays, and its output, in the graph's memory, is read before
    the next call. Runs eagerly when the call cannot be captured (a warning says why)."""

    def __init__(self, run, inputs: list[torch.Tensor], what: str):
        self.run, self.inputs = run, [tensor.clone() for tensor in inputs]
        # a pool of its own: the target's graphs must not reuse the memory of the drafts they verify
        self.captured = capture_graph(lambda: run(*self.inputs), torch.cuda.graph_pool_handle(), what)

    def __call__(self, *inputs: torch.Tensor):
        for buffer, tensor in zip(self.inputs, inputs):
            buffer.copy_(tensor)
        if self.captured is None:
            return self.run(*self.inputs)
        graph, output = self.captured
        graph.replay()
        return output


def tokens_to_keep(new_tokens, generated_lengths, budget, eos_ids, extra_criteria, sequence_of_row):
    """How many of each row's new tokens (lists of ints) to keep, and whether the row is done: at EOS (kept), at the
    token budget (exact), or where any other stopping criterion fires, checked token by token."""
    keep, done = [], []
    for row, tokens in enumerate(new_tokens):
        count, finished = len(tokens), False
        for j, token in enumerate(tokens):
            stop = generated_lengths[row] + j + 1 >= budget or token in eos_ids
            if not stop and extra_criteria:
                stop = bool(extra_criteria(sequence_of_row(row, tokens[: j + 1]), None).any())
            if stop:
                count, finished = j + 1, True
                break
        keep.append(count)
        done.append(finished)
    return keep, done


def dspark_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    options: DSparkOptions | None = None,
    **model_kwargs,
):
    """The decoding loop (called by `generate`; see the module docstring)."""
    check_dspark_request(model, generation_config)
    if input_ids.shape[1] == 0 or model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "DSpark decoding starts from `input_ids` (the drafter embeds tokens); pass them, not `inputs_embeds`."
        )
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(
            "Streaming takes one sequence (as transformers' streamers do); DSpark got a batch of "
            f"{input_ids.shape[0]}. Stream batch 1, or drop the streamer."
        )
    cache = model_kwargs.get("past_key_values")
    if not isinstance(cache, (Inkling2Cache, Inkling2StaticCache)) or cache.get_seq_length() != 0:
        raise ValueError("DSpark decoding starts from an empty Inkling2 cache (let generate() create it).")
    batch, prompt_length = input_ids.shape
    device = input_ids.device
    budget = generation_config.max_length - prompt_length
    if isinstance(cache, Inkling2StaticCache) and batch > 1:
        # rows that accept fewer tokens than the step's most gain padding: the stream grows by up to a whole block
        # per step while such a row gains one token
        block = model.dspark.config.block_size + 1
        cache = model.static_cache(batch, max(cache.max_cache_len, prompt_length + block * (budget + 1)))
    decoder = DSparkDecoder(model, cache, logits_processor, generation_config, options or DSparkOptions())
    eos = generation_config._eos_token_tensor
    eos_ids = set() if eos is None else set(eos.flatten().tolist())
    # a list of its own kind: it is called on each kept token's sequence, as generate() calls its criteria
    extra_criteria = StoppingCriteriaList(
        [c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    )
    generated: list[list[int]] = [[] for _ in range(batch)]
    alive = [True] * batch

    def sequence_of_row(row, new):
        return torch.cat([input_ids[row], torch.tensor(generated[row] + new, device=device, dtype=torch.long)])[None]

    def emit(rows: list[list[int]]) -> None:
        keep, done = tokens_to_keep(rows, [len(g) for g in generated], budget, eos_ids, extra_criteria, sequence_of_row)
        for row in range(batch):
            if alive[row]:
                if row == 0 and streamer is not None:
                    streamer.put(torch.tensor(rows[row][: keep[row]]))
                generated[row] += rows[row][: keep[row]]
                alive[row] = not done[row]

    with torch.no_grad():
        embeddings = model.dspark_prompt_embeddings(input_ids, **model_kwargs)
        anchor = decoder.prefill(
            input_ids, model_kwargs.get("attention_mask"), embeddings, model_kwargs.get("prefill_chunk_size")
        )
        emit([[token] for token in anchor.tolist()])
        while any(alive):
            anchor, rows = decoder.step(anchor, alive)
            emit(rows)
    if streamer is not None:
        streamer.end()

    width = max(len(g) for g in generated)
    padded = [g + [decoder.pad_token_id] * (width - len(g)) for g in generated]
    sequences = torch.cat([input_ids, torch.tensor(padded, device=device, dtype=input_ids.dtype)], dim=1)
    if not generation_config.return_dict_in_generate:
        return sequences
    accepted = torch.tensor(decoder.accepted_counts, dtype=torch.long)
    positions = torch.arange(decoder.block_size)
    return Inkling2DSparkGenerateOutput(
        sequences=sequences,
        num_steps=decoder.step_count,
        mean_accepted_length=float((accepted + 1).float().mean()) if len(accepted) else None,
        position_acceptance=(accepted[:, None] > positions).float().mean(0) if len(accepted) else None,
    )


__all__ = [
    "DSparkOptions",
    "Inkling2DSparkGenerateOutput",
    "dspark_decoding",
    "greedy_acceptance",
    "sampled_acceptance",
]
