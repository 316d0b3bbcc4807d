"""`Inkling2Engine`: many requests decoded together on one model, in-process (what `inkling2 serve` runs on).

Each `step()`:
1. the scheduler (`scheduler.py`) admits waiting requests into free rows, gives pages, and plans the step: every row
   past its prompt decodes, and prompt chunks of the rows still prefilling fill the rest of the token budget;
2. one decode forward over rows `0 .. bucket - 1` (every row at its own position: `Inkling2PagedCache`), replayed as
   a CUDA graph per (row bucket, key span bucket) on GPUs. Rows that are still prefilling, and the padding rows of
   the bucket, ride along with a dummy token at their next position: whatever they write there is overwritten by
   their next real step before anything reads it (the same argument as a rejected draft's slots);
3. one forward per prompt chunk (eager; neighbouring rows at the same position side by side), the last chunk's
   logits giving the request's first token;
4. every row's token is chosen with its own parameters (`sampling.py`); finished rows free their place at once.

With `dspark=True` the decode forward verifies a DSpark draft per row (`drafting.py`), and rows accept different
counts: each row simply moves on by its own count.

Results are exact against `generate()`: a greedy sequence gets the tokens it gets alone (fp32; in lower precision up
to the batch-dependent rounding of the GEMMs), and a seeded sampled one the tokens of `torch.manual_seed(seed)` and
`generate(do_sample=True, ...)`, whatever runs beside it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator

import torch

from ..cache.paged import Inkling2PagedCache, check_page_size, pages_that_fit
from ..generation.decode_graphs import capture_graph
from ..modeling.activation_memory import prefill_activation_bytes
from .requests import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, RequestOutput, SamplingParams, Sequence
from .sampling import next_tokens, to_device
from .scheduler import Scheduler

DEFAULT_MAX_MODEL_LEN = 32_768
# (first, end) token ranges of the prompt chunks `warm_up` runs
WARM_UP_CHUNKS = ((0, 97), (0, 64), (64, 161), (161, 164), (164, 1201), (1201, 1203))
WARM_UP_PREFILL_ROWS = (2, 16)  # rows of the side-by-side prompt chunks `warm_up` runs (beside one row's)
RESERVE_SHARE = 0.05  # of the free memory, left for CUDA graphs and the allocator when pages are sized automatically


def power_of_two_at_least(value: int, minimum: int, maximum: int) -> int:
    return min(maximum, max(minimum, 1 << max(0, value - 1).bit_length()))


class Inkling2Engine:
    """Continuous batching over `model` (an Inkling2 causal LM or the multimodal model); see the module docstring.

    Args:
        max_num_seqs: sequences in flight at once (rows of the cache).
        max_model_len: tokens one sequence may reach (prompt and output).
        page_size: tokens per page of the full-attention keys/values (a power of two, at least 64).
        num_pages: pages in the pool; None sizes it from the free GPU memory (what is left after the rows' fixed
            state, one step's activations and `RESERVE_SHARE`), or on CPU from `max_num_seqs * max_model_len`.
        max_step_tokens: tokens one step runs: the decode rows' plus prompt chunks up to this budget.
        use_cuda_graphs: replay decode steps as CUDA graphs (default: on CUDA).
        dspark: decode with the bundled DSpark drafter.
    """

    def __init__(
        self,
        model,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        page_size: int = 256,
        num_pages: int | None = None,
        max_step_tokens: int = 2048,
        use_cuda_graphs: bool | None = None,
        dspark: bool = False,
    ):
        check_page_size(page_size)
        if max_num_seqs < 1 or max_step_tokens < 1:
            raise ValueError("`max_num_seqs` and `max_step_tokens` must be positive.")
        self.model = model.eval()
        self.text_config = model.config.get_text_config()
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        max_model_len = max_model_len or min(self.text_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self.drafter = None
        if dspark:
            from .drafting import RowDrafter

            self.drafter = RowDrafter(model)
        step_tokens = 1 if self.drafter is None else self.drafter.block_size + 1
        pages_per_row = math.ceil((max_model_len + step_tokens) / page_size)
        if num_pages is None:
            num_pages = self.automatic_num_pages(max_num_seqs, page_size, pages_per_row, max_step_tokens)
        self.cache = Inkling2PagedCache(
            self.text_config, max_num_seqs, num_pages, page_size, pages_per_row, device=self.device
        )
        if self.drafter is not None:
            self.drafter.attach(self.cache)
        self.scheduler = Scheduler(self.cache, max_step_tokens, step_tokens)
        self.max_model_len = max_model_len
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.graphs: dict = {}
        self.graph_pool = None
        self.sequences: dict[str, Sequence] = {}
        self.cancelled: set[str] = set()

    def automatic_num_pages(self, max_num_seqs: int, page_size: int, pages_per_row: int, max_step_tokens: int) -> int:
        full = max_num_seqs * pages_per_row + 1
        if self.device.type != "cuda":
            return full
        free, _ = torch.cuda.mem_get_info(self.device)
        # one step's activations, and room for CUDA graphs and the allocator
        reserve = prefill_activation_bytes(self.text_config, max_step_tokens) + RESERVE_SHARE * free
        dspark_config = None if self.drafter is None else self.drafter.config
        pages = pages_that_fit(
            free - reserve, self.text_config, page_size, max_num_seqs, self.dtype.itemsize, dspark_config=dspark_config
        )
        if pages < 2:
            raise ValueError(
                f"No GPU memory is left for the cache's pages: {free / 2**30:.1f} GiB free. Lower `max_num_seqs` "
                "or `max_step_tokens`, or free memory (`inkling2 plan` shows where it goes)."
            )
        return min(pages, full)

    # --- requests -------------------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Iterable[int],
        params: SamplingParams | None = None,
        image_inputs: dict | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queues a request; returns its id. `image_inputs` are the processor's image tensors for the prompt
        (`pixel_values`, `image_grid_thw`), turned into embeddings when the request is admitted. Raises
        `RequestTooLong` (a ValueError) for a request that cannot fit."""
        prompt_ids = [int(token) for token in prompt_ids]
        if not prompt_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        if max(prompt_ids) >= self.text_config.vocab_size or min(prompt_ids) < 0:
            raise ValueError(f"Prompt token ids must lie in [0, {self.text_config.vocab_size}).")
        params = params or SamplingParams()
        room = self.max_model_len - len(prompt_ids)
        params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
        if params.max_new_tokens < 1:
            raise ValueError(
                f"The prompt has {len(prompt_ids)} tokens; this engine holds {self.max_model_len} per sequence "
                "(`max_model_len`). Shorten the prompt."
            )
        sequence = Sequence(prompt_ids, params, image_inputs=image_inputs)
        if request_id is not None:
            if request_id in self.sequences:
                raise ValueError(f"Request id {request_id!r} is already in flight.")
            sequence.request_id = request_id
        self.scheduler.add(sequence)
        self.sequences[sequence.request_id] = sequence
        return sequence.request_id

    def cancel(self, request_id: str) -> None:
        """Stops a request at the next step (its place is freed then; `step()` reports it finished, "cancelled")."""
        if request_id in self.sequences:
            self.cancelled.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- one step -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns what each request that moved got (new tokens, whether it finished)."""
        outputs = [self._finish(self.sequences[i], FINISH_CANCELLED, []) for i in sorted(self.cancelled)]
        self.cancelled.clear()
        plan = self.scheduler.schedule()
        for sequence in plan.admitted:
            self._embed_images(sequence)
        new_tokens: dict[str, list[int]] = {}
        if plan.decode:
            if self.drafter is None:
                tokens = self._decode(plan.decode)
                new_tokens.update({s.request_id: [t] for s, t in zip(plan.decode, tokens)})
            else:
                new_tokens.update(self.drafter.step(self, plan.decode))
        sampled_rows, last_logits = [], []
        for group, first, end in plan.prefill:
            logits = self._prefill(group, first, end)
            if self.drafter is not None:  # the drafter's context of the chunk (its last positions)
                logits, hidden_states = logits
                self.drafter.remember(hidden_states, torch.arange(first, end, device=self.device))
            for row, sequence in enumerate(group):
                if end == len(sequence.tokens):
                    sampled_rows.append(sequence)
                    last_logits.append(logits[row : row + 1])
        if sampled_rows:
            firsts = next_tokens(sampled_rows, torch.cat(last_logits))
            new_tokens.update({s.request_id: [t] for s, t in zip(sampled_rows, firsts)})
        for request_id, tokens in new_tokens.items():
            outputs.append(self._commit(self.sequences[request_id], tokens))
        return outputs

    def _commit(self, sequence: Sequence, tokens: list[int]) -> RequestOutput:
        """Appends a row's new tokens, cut at a stop token or the length limit, and ends the row there."""
        params = sequence.params
        room = params.max_new_tokens - len(sequence.generated)
        kept = tokens[:room]
        stop = next((i for i, token in enumerate(kept) if token in params.stop_token_ids), None)
        if stop is not None:
            kept = kept[: stop + 1]
        sequence.tokens += kept
        sequence.computed = len(sequence.tokens) - 1
        if stop is not None:
            return self._finish(sequence, FINISH_STOP, kept)
        if len(sequence.generated) >= params.max_new_tokens:
            return self._finish(sequence, FINISH_LENGTH, kept)
        return RequestOutput(sequence.request_id, kept)

    def _finish(self, sequence: Sequence, reason: str, tokens: list[int]) -> RequestOutput:
        self.scheduler.remove(sequence)
        del self.sequences[sequence.request_id]
        return RequestOutput(sequence.request_id, tokens, finished=True, finish_reason=reason)

    def _embed_images(self, sequence: Sequence) -> None:
        if sequence.image_inputs is None or sequence.prompt_embeddings is not None:
            return
        inputs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in sequence.image_inputs.items()}
        ids = to_device([sequence.prompt_ids], self.device)
        sequence.prompt_embeddings = self.model.dspark_prompt_embeddings(ids, **inputs)[0]

    # --- forwards -------------------------------------------------------------------------------------------------

    def _prefill(self, group: list[Sequence], first: int, end: int):
        """Positions `first .. end - 1` of every row of `group` (neighbouring slots) in one forward; returns their
        last logits [rows, vocab] (and, with DSpark, the hidden states)."""
        hidden_states = self.drafter is not None
        page = self.cache.page_size
        self.cache.use_rows(group[0].slot, group[-1].slot + 1, math.ceil(end / page) * page)
        if any(s.prompt_embeddings is not None and first < len(s.prompt_ids) for s in group):
            inputs = {"inputs_embeds": torch.stack([self._chunk_embeddings(s, first, end) for s in group])}
        else:
            inputs = {"input_ids": to_device([s.tokens[first:end] for s in group], self.device)}
        output = self.model(
            **inputs,
            cache_position=torch.arange(first, end, device=self.device),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
            prefill_chunk_size=end - first,
            output_hidden_states=hidden_states,
        )
        for sequence in group:
            sequence.computed = end
        return (output.logits[:, -1], output.hidden_states) if hidden_states else output.logits[:, -1]

    def _chunk_embeddings(self, sequence: Sequence, first: int, end: int) -> torch.Tensor:
        """[end - first, hidden]: the prompt's own embeddings (images placed) where the chunk covers the prompt, then
        the generated tokens' (a sequence run again after preemption)."""
        embed = self.model.get_input_embeddings()
        if sequence.prompt_embeddings is None:
            return embed(to_device(sequence.tokens[first:end], self.device))
        prompt_part = min(end, len(sequence.prompt_ids))
        parts = [sequence.prompt_embeddings[first:prompt_part]]
        if end > prompt_part:
            parts.append(embed(to_device(sequence.tokens[max(first, prompt_part) : end], self.device)))
        return torch.cat(parts)

    def decode_inputs(self, rows: list[Sequence], tokens: list[list[int]]) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(row bucket, input ids, positions) of a decode forward over every occupied row: `tokens[i]` for the
        decoding `rows`, a dummy token at the next position of every other row (see the module docstring)."""
        running = self.scheduler.running
        width = len(tokens[0])
        bucket = power_of_two_at_least(len(running), 1, self.cache.max_rows)
        ids = [[0] * width for _ in range(bucket)]
        positions = [[0] * width for _ in range(bucket)]
        for sequence in running:
            positions[sequence.slot] = list(range(sequence.computed, sequence.computed + width))
        for sequence, row_tokens in zip(rows, tokens):
            ids[sequence.slot] = row_tokens
        return bucket, to_device(ids, self.device), to_device(positions, self.device)

    def key_span(self, tokens: int) -> int:
        """The full layers' key span of a decode step feeding `tokens` per row: a bucket over the longest row."""
        longest = max(s.computed for s in self.scheduler.running) + tokens
        return power_of_two_at_least(longest, self.cache.page_size, self.cache.max_row_tokens)

    def run_decode(self, ids: torch.Tensor, positions: torch.Tensor, span: int, hidden_states: bool = False):
        """The decode forward over rows `0 .. len(ids) - 1` attending to `span` full-layer keys: logits [rows,
        tokens, vocab] (and the hidden states), replayed as a CUDA graph per (rows, tokens, key span)."""
        rows = ids.shape[0]

        def forward(ids, positions):
            self.cache.use_rows(0, rows, span)
            output = self.model(
                input_ids=ids,
                cache_position=positions,
                past_key_values=self.cache,
                use_cache=True,
                output_hidden_states=hidden_states,
            )
            return (output.logits, output.hidden_states) if hidden_states else output.logits

        if not self.use_cuda_graphs:
            return forward(ids, positions)
        key = (rows, ids.shape[1], span, hidden_states)
        if key not in self.graphs:
            self.graphs[key] = self._capture(forward, ids, positions)
        graph, inputs, output = self.graphs[key]
        inputs[0].copy_(ids)
        inputs[1].copy_(positions)
        if graph is None:
            return forward(*inputs)
        graph.replay()
        return output

    def _capture(self, forward, ids, positions):
        inputs = (ids.clone(), positions.clone())
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        captured = capture_graph(lambda: forward(*inputs), self.graph_pool, "engine decode step")
        if captured is None:
            return None, inputs, None
        return captured[0], inputs, captured[1]

    def _decode(self, rows: list[Sequence]) -> list[int]:
        _, ids, positions = self.decode_inputs(rows, [[s.tokens[-1]] for s in rows])
        logits = self.run_decode(ids, positions, self.key_span(1))
        slots = to_device([s.slot for s in rows], self.device)
        return next_tokens(rows, logits[:, -1].index_select(0, slots))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Runs prompt chunks of the kinds the scheduler cuts, and the decode step of every row bucket at every key
        span bucket (captured as CUDA graphs on a GPU), before any request: on a GPU, Triton's compilations and the
        graph captures (seconds in all) then happen here, not in the middle of users' streams (a first chunk after
        cached tokens alone cost 5 s there); the server calls it there. Nothing is in flight; the rows written are
        emptied after."""
        if self.has_unfinished():
            raise RuntimeError("warm_up() runs before the first request.")
        # prompt chunks first (they also make the buffers allocated at a first write, the drafter's context among
        # them): from the start and after cached tokens, long and short, of lengths that Triton specializes
        # differently (multiples of 16 or not)
        chunks = [(1, WARM_UP_CHUNKS)]  # and rows side by side, in the batch sizes Triton specializes apart
        chunks += [(rows, WARM_UP_CHUNKS[:3]) for rows in WARM_UP_PREFILL_ROWS if rows <= self.cache.max_rows]
        most_rows = max(rows for rows, _ in chunks)
        dummies = [Sequence([0] * self.cache.max_row_tokens, SamplingParams()) for _ in range(most_rows)]
        for slot, dummy in enumerate(dummies):
            dummy.slot = slot
        for rows, ranges in chunks:
            for first, end in ranges:
                end = min(end, self.scheduler.max_sequence_tokens, first + self.scheduler.max_step_tokens // rows)
                if first < end:
                    output = self._prefill(dummies[:rows], first, end)
                    if self.drafter is not None:
                        self.drafter.remember(output[1], torch.arange(first, end, device=self.device))
        width = 1 if self.drafter is None else self.drafter.block_size + 1
        positions_of_rows = torch.arange(width, device=self.device)
        most = self.cache.max_rows
        for rows in sorted({power_of_two_at_least(n, 1, most) for n in range(1, most + 1)}):
            ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
            positions = positions_of_rows.expand(rows, width)
            span = self.cache.page_size
            while True:
                self.run_decode(ids, positions, span, hidden_states=self.drafter is not None)
                if span >= self.cache.max_row_tokens:
                    break
                span = power_of_two_at_least(span + 1, span, self.cache.max_row_tokens)
            if self.drafter is not None:
                self.cache.use_rows(0, rows, self.cache.page_size)
                self.drafter.draft([None] * rows, ids[:, 0], positions[:, :1])
        for row in range(self.cache.max_rows):
            self.cache.reset_row(row)

    # --- convenience ----------------------------------------------------------------------------------------------

    def stream(self) -> Iterator[RequestOutput]:
        """Steps until every request has finished, yielding each step's outputs."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None):
        """Runs `prompts` together to the end; returns each one's generated token ids, in order."""
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        generated = {request_id: [] for request_id in ids}
        for output in self.stream():
            if output.request_id in generated:
                generated[output.request_id] += output.new_token_ids
        return [generated[request_id] for request_id in ids]


__all__ = ["Inkling2Engine"]
