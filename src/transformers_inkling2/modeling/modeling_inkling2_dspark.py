"""The DSpark drafter: a small block decoder that reads the target's own hidden states and proposes
`block_size` tokens per decoding step, which the target then verifies in one pass (`generation/dspark.py`).

Data path of one draft:
1. Context features: the outputs of the target's `target_layer_ids` at every committed position, concatenated,
   projected by `fc` and RMS-normalized. Each drafter layer turns them into keys/values once and keeps them in an
   `Inkling2DSparkContextCache` (the last `context_window + 8` positions; `Inkling2DSparkStaticContext` keeps them
   in fixed rings when decoding over the static cache).
2. The block `[last committed token, mask x (block_size - 1)]`, embedded with the target's embedding plus a learned
   per-position embedding, goes through `num_draft_layers` decoder layers (`Inkling2DSparkLayer`). Their attention
   takes queries from the block and keys/values from the context and the block: every block position sees the whole
   block (the block is not causal) and the committed positions less than `context_window` before it, with a learned
   per-head bias by distance for the context and by (query, key) slot for the block. Keys and queries are
   RMS-normalized per head; a dense SwiGLU MLP follows.
3. Base logits `U_k = lm_head(h_k)` with the target's head; the recurrent Markov head (`head_type="rnn"`) then walks
   the block position by position and adds a low-rank bias that depends on the token drafted just before, so that
   the drafts of one block agree with each other. The confidence head predicts whether draft k will be accepted.

The drafter shares the target's embedding and lm_head: they are passed in, never owned, so the checkpoint stores
them once. Its own weights live under `dspark.` in our checkpoints (`dspark/checkpoints.py` maps the original
`mtp.safetensors`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.common import MAX_STEP_TOKENS, initial_slot_positions, keep_last, shift_rows_right, write_by_position
from ..configuration_inkling2 import Inkling2DSparkConfig
from .norms import Inkling2RMSNorm

HIDDEN = float("-inf")


class Inkling2DSparkContextCache:
    """Per drafter layer, the keys and values ([batch, kv_heads, time, head_dim]) of the latest committed positions'
    context features, and whether each position is a real token of its row ([batch, time]). Positions are the target
    cache's physical positions; rows move right together with the target cache (`shift_rows_right`)."""

    def __init__(self, num_layers: int, context_window: int, rollback_margin: int = MAX_STEP_TOKENS):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.real: torch.Tensor | None = None
        self.max_positions = context_window + rollback_margin
        self.seen_tokens = 0

    def append(self, layer_keys_values: list[tuple[torch.Tensor, torch.Tensor]], real: torch.Tensor) -> None:
        """The next positions' keys/values of every layer and their real-token flags [batch, new]."""
        for i, (keys, values) in enumerate(layer_keys_values):
            self.keys[i] = keep_last(self.keys[i], keys, 2, self.max_positions)
            self.values[i] = keep_last(self.values[i], values, 2, self.max_positions)
        self.real = keep_last(self.real, real, 1, self.max_positions)
        self.seen_tokens += real.shape[1]

    def crop(self, count: int) -> None:
        """Drops the newest `count` positions."""
        if count <= 0:
            return
        self.keys = [k[:, :, : k.shape[2] - count] for k in self.keys]
        self.values = [v[:, :, : v.shape[2] - count] for v in self.values]
        self.real = self.real[:, : self.real.shape[1] - count]
        self.seen_tokens -= count

    def shift_rows_right(self, shifts: torch.Tensor) -> None:
        self.keys = [shift_rows_right(k, shifts, 2) for k in self.keys]
        self.values = [shift_rows_right(v, shifts, 2) for v in self.values]
        self.real = shift_rows_right(self.real, shifts, 1)

    def view(self):
        """(keys per layer, values per layer, key positions [time], real flags [batch, time])."""
        first = self.seen_tokens - self.real.shape[1]
        return self.keys, self.values, torch.arange(first, self.seen_tokens, device=self.real.device), self.real


class Inkling2DSparkStaticContext:
    """The same in fixed buffers, for decoding over an `Inkling2StaticCache`: rings of `context_window +
    rollback_margin` slots (slot = position mod size) written in place, so that a draft reads the same memory every
    step and can be replayed as a CUDA graph. Never-written slots are not real; taken-back positions lie after the
    next anchor, which never sees them."""

    def __init__(self, num_layers: int, context_window: int, rollback_margin: int = MAX_STEP_TOKENS):
        self.num_layers = num_layers
        self.capacity = self.max_positions = context_window + rollback_margin
        self.keys: list[torch.Tensor] | None = None
        self.values: list[torch.Tensor] | None = None
        self.seen_tokens = 0

    def append(self, layer_keys_values: list[tuple[torch.Tensor, torch.Tensor]], real: torch.Tensor) -> None:
        if self.keys is None:
            self.keys = [k.new_zeros(*k.shape[:2], self.capacity, k.shape[3]) for k, _ in layer_keys_values]
            self.values = [v.new_zeros(*v.shape[:2], self.capacity, v.shape[3]) for _, v in layer_keys_values]
            self.real = torch.zeros(real.shape[0], self.capacity, dtype=torch.bool, device=real.device)
            self.positions = initial_slot_positions(self.capacity, real.device)
        new = real.shape[1]
        self.write(layer_keys_values, real, self.seen_tokens + torch.arange(new, device=real.device))
        self.seen_tokens += new

    def write(
        self, layer_keys_values: list[tuple[torch.Tensor, torch.Tensor]], real: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """The device half of `append` (positions on the device, `seen_tokens` untouched): what a decoding step
        replays as a CUDA graph, advancing `seen_tokens` itself."""
        entries = [(self.real, real.bool(), 1)]
        for ring_keys, ring_values, (keys, values) in zip(self.keys, self.values, layer_keys_values):
            entries += [(ring_keys, keys, 2), (ring_values, values, 2)]
        write_by_position(self.positions, positions, entries)

    def crop(self, count: int) -> None:
        self.seen_tokens -= max(0, count)

    def shift_rows_right(self, shifts: torch.Tensor) -> None:
        for ring, dim in [*((k, 2) for k in self.keys), *((v, 2) for v in self.values), (self.real, 1)]:
            ring.copy_(shift_rows_right(ring, shifts, dim, self.positions))

    def view(self):
        return self.keys, self.values, self.positions, self.real


class Inkling2DSparkAttention(nn.Module):
    """Block queries over [context; block] keys, with learned additive biases (see the module docstring)."""

    def __init__(self, config: Inkling2DSparkConfig):
        super().__init__()
        self.num_heads, self.head_dim, self.block_size = config.num_attention_heads, config.head_dim, config.block_size
        hidden, kv_width = config.hidden_size, config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = Inkling2RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Inkling2RMSNorm(self.head_dim, config.rms_norm_eps)
        self.distance_bias = nn.Parameter(torch.zeros(self.num_heads, config.distance_buckets))
        self.block_bias = nn.Parameter(torch.zeros(self.num_heads, config.block_size, config.block_size))

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, T, hidden] -> keys, values [batch, kv_heads, T, head_dim]."""
        batch, length, _ = x.shape
        keys = self.k_norm(self.k_proj(x).view(batch, length, -1, self.head_dim)).transpose(1, 2)
        values = self.v_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        return keys, values

    def forward(self, x, context_keys, context_values, context_view: "ContextView") -> torch.Tensor:
        """x: [batch, blocks * block_size, hidden]; context keys/values [batch, kv_heads, C, head_dim]."""
        batch, queries, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, queries, -1, self.head_dim)).transpose(1, 2)
        block_keys, block_values = self.keys_values(x)
        keys = torch.cat([context_keys, block_keys], dim=2)
        values = torch.cat([context_values, block_values], dim=2)
        # [heads, (batch,) Q, C] -> [(batch,) heads, Q, C]
        context_bias = self.distance_bias[:, context_view.buckets].movedim(0, -3)
        context_bias = context_bias.masked_fill(~context_view.visible, HIDDEN)
        num_blocks = queries // self.block_size
        same_block = torch.eye(num_blocks, dtype=torch.bool, device=x.device)
        same_block = same_block.repeat_interleave(self.block_size, 0).repeat_interleave(self.block_size, 1)
        block_bias = self.block_bias.repeat(1, num_blocks, num_blocks).masked_fill(~same_block, HIDDEN)
        bias = torch.cat([context_bias, block_bias.expand(batch, -1, -1, -1)], dim=-1)
        return self.o_proj(attend(q, keys, values, bias).transpose(1, 2).reshape(batch, queries, -1))


def attend(queries, keys, values, bias):
    """Softmax attention in plain matmuls, the scores in fp32: queries [b, heads, Q, d], keys/values [b, kv_heads, K,
    d] (query head h reads kv head h // (heads / kv_heads)), bias [b, heads, Q, K]. A draft's shapes change every step
    (the context grows), and SDPA's fused backends may plan per shape; these few small matmuls do not."""
    batch, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.reshape(batch, kv_heads, heads // kv_heads * length, dim)
    scores = (grouped @ keys.transpose(-1, -2)).float().view(batch, heads, length, -1) * dim**-0.5 + bias
    weights = torch.softmax(scores, dim=-1).to(values.dtype).view(batch, kv_heads, heads // kv_heads * length, -1)
    return (weights @ values).view(batch, heads, length, dim)


class ContextView:
    """Which context positions every block query sees, and at which distance bucket; shared by the drafter layers.

    Positions are shared by the batch (`anchor_positions` [blocks], `key_positions` [C]) or every row's own
    ([batch, blocks] and [batch, C]: the serving engine's rows). `buckets` [Q, C] or [batch, Q, C]: `min(query
    position - key position, buckets) - 1`; `visible` [batch, 1, Q, C]: the key is real (padding mask), before the
    query's block, and less than `context_window` before the block's anchor."""

    def __init__(self, anchor_positions, key_positions, key_is_real, block_size: int, window: int, num_buckets: int):
        offsets = torch.arange(block_size, device=anchor_positions.device)
        query_positions = (anchor_positions[..., :, None] + offsets).flatten(-2)
        query_anchors = anchor_positions.repeat_interleave(block_size, dim=-1)
        distance = query_positions[..., :, None] - key_positions[..., None, :]
        self.buckets = distance.clamp(1, num_buckets) - 1
        anchor_distance = query_anchors[..., :, None] - key_positions[..., None, :]
        in_reach = (anchor_distance > 0) & (anchor_distance <= window)
        self.visible = (in_reach & key_is_real[:, None, :])[:, None]


class Inkling2DSparkMLP(nn.Module):
    def __init__(self, config: Inkling2DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Inkling2DSparkLayer(nn.Module):
    """Pre-norm attention and MLP with plain residuals. (Its names differ from the decoder layer's on purpose: the
    target's checkpoint renamings, which match names like `self_attn.q_proj`, must leave the drafter alone.)"""

    def __init__(self, config: Inkling2DSparkConfig):
        super().__init__()
        self.attention_norm = Inkling2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Inkling2DSparkAttention(config)
        self.mlp_layernorm = Inkling2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Inkling2DSparkMLP(config)

    def forward(self, x, context_keys, context_values, context_view: ContextView) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), context_keys, context_values, context_view)
        return x + self.mlp(self.mlp_layernorm(x))


class Inkling2DSparkMarkovHead(nn.Module):
    """The recurrent Markov head: a state of width `rank` that walks the block, fed the token drafted before each
    position, and a low-rank logit bias out of it.

    `e = w1[prev]`, `[g, c, o] = joint_proj([s; e; h])`, `s' = sigmoid(g) s + (1 - sigmoid(g)) tanh(c)`,
    `bias = w2(tanh(o))` (the paper's W1 and W2)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank, bias=True)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, state, previous_ids, hidden):
        """One position: returns (next state, logit bias [.., vocab], embedding of the previous token)."""
        embedded = self.w1(previous_ids)
        gate, candidate, output = self.joint_proj(torch.cat([state, embedded, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return state, self.w2(torch.tanh(output)), embedded


class Inkling2DSparkConfidenceHead(nn.Module):
    """Probability that the draft at a position is accepted, from its hidden state (and the previous token's Markov
    embedding with the RNN head)."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(features).squeeze(-1).float())


class Inkling2DSparkDrafter(nn.Module):
    """The drafter's own weights; see the module docstring. `embed_tokens` and `compute_logits` are the target's."""

    def __init__(self, config: Inkling2DSparkConfig, vocab_size: int):
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * width, width, bias=False)
        self.context_norm = Inkling2RMSNorm(width, config.rms_norm_eps)
        self.block_position_embedding = nn.Parameter(torch.zeros(config.block_size, width))
        self.layers = nn.ModuleList(Inkling2DSparkLayer(config) for _ in range(config.num_draft_layers))
        self.norm = Inkling2RMSNorm(width, config.rms_norm_eps)
        use_markov = config.head_type == "rnn"
        self.markov_head = Inkling2DSparkMarkovHead(vocab_size, config.markov_rank, width) if use_markov else None
        confidence_width = width + (config.markov_rank if use_markov else 0)
        self.confidence_head = Inkling2DSparkConfidenceHead(confidence_width) if config.use_confidence_head else None

    def context_features(self, target_hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The target's `output_hidden_states` (embeddings first) -> context features [batch, T, hidden]."""
        weight = self.fc.weight  # with device_map="auto" the tapped layers may sit on other devices
        tapped = [target_hidden_states[i + 1].to(weight.device, weight.dtype) for i in self.config.target_layer_ids]
        return self.context_norm(self.fc(torch.cat(tapped, dim=-1)))

    def context_keys_values(self, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [layer.attention.keys_values(features) for layer in self.layers]

    def block_hidden_states(self, block_embeddings, context_keys, context_values, context_view) -> torch.Tensor:
        """block_embeddings [batch, blocks, block_size, hidden] (the target's embedding of the block tokens) -> the
        drafter's final hidden states [batch, blocks * block_size, hidden]."""
        x = (block_embeddings.to(self.block_position_embedding.dtype) + self.block_position_embedding).flatten(1, 2)
        for layer, keys, values in zip(self.layers, context_keys, context_values):
            x = layer(x, keys, values, context_view)
        return self.norm(x)

    def head_step(self, state, previous_ids, hidden, base_logits):
        """Position k of the block: (next Markov state, draft logits, acceptance confidence or None).
        `previous_ids` is the token before position k (the anchor for k = 0, else draft k - 1)."""
        embedded = None
        logits = base_logits
        if self.markov_head is not None:
            state, bias, embedded = self.markov_head(state, previous_ids, hidden)
            logits = base_logits + bias[..., : base_logits.shape[-1]].float()
        confidence = None
        if self.confidence_head is not None:
            confidence = self.confidence_head(hidden if embedded is None else torch.cat([hidden, embedded], dim=-1))
        return state, logits, confidence

    def initial_state(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(rows, self.config.markov_rank)


__all__ = ["Inkling2DSparkDrafter", "Inkling2DSparkContextCache", "Inkling2DSparkStaticContext"]
