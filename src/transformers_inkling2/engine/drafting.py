"""DSpark in the engine: every decoding row drafts a block, the target verifies all rows' blocks in one decode
forward, and each row keeps its own accepted count (its length simply moves on by it: rows have their own positions,
so nothing is shifted, unlike `generate(dspark=True)` over a shared-position batch).

The acceptance rules are `generate(dspark=True)`'s (`generation/dspark.py`): greedy rows accept a draft while it is
the target's argmax; sampled rows use the lossless rule with the request's own generator. The drafter's context
(its keys/values of the target's hidden states at committed positions) lives in the paged cache's per-row rings,
written for every prompt chunk and every verified position; positions a row later rejects are overwritten before
any draft can see them.
"""

from __future__ import annotations

import torch

from ..cache.common import MAX_STEP_TOKENS
from ..generation.dspark import greedy_acceptance, sampled_acceptance
from ..modeling.modeling_inkling2_dspark import ContextView
from .requests import Sequence
from .sampling import needs_processing, processed_scores, row_generator, to_device


class RowDrafter:
    """The bundled drafter of `model`, drafting for the engine's rows (see the module docstring)."""

    def __init__(self, model):
        self.model, self.drafter = model, getattr(model, "dspark", None)
        if self.drafter is None:
            raise ValueError(
                "`dspark=True` needs a DSpark drafter, and this model has none (its config has no `dspark_config`). "
                "Serve without DSpark, or train a drafter with `inkling2 train-dspark`."
            )
        self.config = self.drafter.config
        self.block_size = self.config.block_size
        if self.block_size + 1 > MAX_STEP_TOKENS:
            raise ValueError(f"The drafter's block size {self.block_size} exceeds {MAX_STEP_TOKENS - 1}.")

    def attach(self, cache) -> None:
        self.cache = cache
        cache.enable_drafter_context(len(self.drafter.layers), self.config.context_window)

    def remember(self, hidden_states: tuple[torch.Tensor, ...], positions: torch.Tensor) -> None:
        """Context of the positions [rows, tokens] (or [tokens]) the target just ran over the cache's current rows."""
        keep = min(positions.shape[-1], self.cache.context_capacity)
        features = self.drafter.context_features(tuple(h[:, -keep:] for h in hidden_states))
        self.cache.write_context(self.drafter.context_keys_values(features), positions[..., -keep:])

    def step(self, engine, rows: list[Sequence]) -> dict[str, list[int]]:
        """One draft-verify round for the decoding `rows`; returns each one's new tokens (accepted drafts, then the
        target's own)."""
        block = self.block_size
        bucket, ids, positions = engine.decode_inputs(rows, [[s.tokens[-1]] * (block + 1) for s in rows])
        by_slot: list[Sequence | None] = [None] * bucket
        for sequence in rows:
            by_slot[sequence.slot] = sequence
        self.cache.use_rows(0, bucket, self.cache.page_size)
        drafts, distributions = self.draft(by_slot, ids[:, 0], positions[:, :1])
        candidates = torch.cat([ids[:, :1], drafts], dim=1)
        logits, hidden_states = engine.run_decode(candidates, positions, engine.key_span(block + 1), hidden_states=True)
        self.cache.use_rows(0, bucket, self.cache.page_size)  # a replayed graph set nothing on the host
        self.remember(hidden_states, positions)

        slots = to_device([s.slot for s in rows], ids.device)
        row_logits, row_drafts = logits.index_select(0, slots), drafts.index_select(0, slots)
        accepted, following = greedy_acceptance(row_logits, row_drafts)  # kept for the plain greedy rows
        accepted, following = accepted.tolist(), following.tolist()
        for i, sequence in enumerate(rows):
            if needs_processing(sequence):  # each position's scores as its prefix makes them
                scores = processed_scores(sequence, row_logits[i], following=row_drafts[i])[None]
                if sequence.params.sampled:
                    generator = row_generator(sequence, ids.device)
                    q = distributions[sequence.slot][None]
                    count, token = sampled_acceptance(scores, row_drafts[i : i + 1], q, generator)
                else:
                    count, token = greedy_acceptance(scores, row_drafts[i : i + 1])
                accepted[i], following[i] = int(count), int(token)
            sequence.draft_steps += 1
            sequence.accepted_drafts += accepted[i]
        drafted = row_drafts.tolist()
        return {s.request_id: drafted[i][: accepted[i]] + [following[i]] for i, s in enumerate(rows)}

    def draft(self, by_slot: list[Sequence | None], anchors: torch.Tensor, anchor_positions: torch.Tensor):
        """Drafts [rows, block] for the current rows, and for sampled rows the distributions they were drawn from
        (`{slot: [block, vocab]}`); rows without a sequence draft argmaxes nobody reads."""
        rows = len(by_slot)
        mask_id = self.config.mask_token_id
        block_ids = torch.cat([anchors[:, None], anchors.new_full((rows, self.block_size - 1), mask_id)], dim=1)
        embeddings = self.model.get_input_embeddings()(block_ids)[:, None]
        keys, values, key_positions = self.cache.drafter_context()
        view = ContextView(
            anchor_positions=anchor_positions,
            key_positions=key_positions,
            key_is_real=torch.ones_like(key_positions, dtype=torch.bool),
            block_size=self.block_size,
            window=self.config.context_window,
            num_buckets=self.config.distance_buckets,
        )
        hidden = self.drafter.block_hidden_states(embeddings, keys, values, view)
        base_logits = self.model.compute_logits(hidden)
        special = [(slot, s) for slot, s in enumerate(by_slot) if s is not None and needs_processing(s)]
        distributions = {slot: [] for slot, s in special if s.params.sampled}
        state, previous, drafts = self.drafter.initial_state(rows, hidden), anchors, []
        for k in range(self.block_size):
            state, logits, _ = self.drafter.head_step(state, previous, hidden[:, k], base_logits[:, k])
            previous = logits.argmax(-1)
            for slot, sequence in special:
                drafted = torch.stack([d[slot] for d in drafts]) if drafts else None
                scores = processed_scores(sequence, logits[slot : slot + 1], following=drafted)
                if not sequence.params.sampled:
                    previous[slot] = scores[0].argmax()
                    continue
                probabilities = torch.softmax(scores, dim=-1)
                draw = torch.multinomial(probabilities, 1, generator=row_generator(sequence, logits.device))
                previous[slot] = draw[0, 0]
                distributions[slot].append(probabilities[0])
            drafts.append(previous)
        return torch.stack(drafts, dim=1), {slot: torch.stack(d) for slot, d in distributions.items()}

