"""Attention backends of Inkling2 and their shared reference, the eager backend.

Every backend computes, for each query head, softmax attention over the visible keys with
- a relative bias `bias[i, j] = relative_logits[i, i - j]` for `0 <= i - j < extent`, else 0, where
  `relative_logits = relative_states @ bank` is [batch, heads, queries, extent];
- one extra zero-value logit per query and head (the sink), which only absorbs probability mass.

A backend is a function `(query, key, value, relative_logits, sinks, query_positions, key_positions,
key_padding, sliding_window, scaling) -> [batch, queries, heads, head_dim]` registered with
`register_attention_backend` under the name users pass as `attn_implementation` (the fast ones live in
`backends/attention/`). Positions are physical stream positions: 1-D and shared by the batch, or [batch, queries]
and [batch, keys] when every row has its own (the serving engine's decode steps, at most `MAX_STEP_TOKENS` queries:
only the eager and decode paths take them); `key_padding` is [batch, keys] (True = real token) or None. Key
positions need not ascend: the static cache's sliding-window rings hold keys in slot order (see `ANY_ORDER_FALLBACK`
for backends that need order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .interfaces import ATTENTION_BACKENDS


def position_distance(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """`query position - key position`, [batch or 1, 1, queries, keys], for shared (1-D) or per-row (2-D) positions."""
    distance = query_positions[..., :, None] - key_positions[..., None, :]
    return distance.view(-1, 1, *distance.shape[-2:])


def visible_keys(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """[batch or 1, 1, queries, keys] True where a query may attend to a key: causal, in the window, not padding."""
    distance = position_distance(query_positions, key_positions)
    visible = distance >= 0
    if sliding_window is not None:
        visible = visible & (distance < sliding_window)
    if key_padding is not None:
        visible = visible & key_padding[:, None, None, :].bool()
    return visible


def relative_bias(
    relative_logits: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor:
    """Expands [batch, heads, queries, extent] relative logits to a [batch, heads, queries, keys] bias."""
    extent = relative_logits.shape[-1]
    distance = position_distance(query_positions, key_positions)
    in_range = (distance >= 0) & (distance < extent)
    index = distance.clamp(0, extent - 1).expand(*relative_logits.shape[:2], -1, -1)
    return relative_logits.gather(-1, index).masked_fill(~in_range, 0.0)


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    relative_logits: torch.Tensor,
    sinks: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    sliding_window: int | None,
    scaling: float,
    probabilities_out: list | None = None,
) -> torch.Tensor:
    """The reference: materializes the [queries, keys] scores. query [B, H, Q, D]; key/value [B, Hkv, K, D];
    sinks [B, H, Q]. Scores and softmax in fp32; a query that sees no key puts all its mass on the sink. With
    `probabilities_out` (a list), the attention probabilities [B, H, Q, K] (the sink's share left out) are appended
    to it: what `output_attentions=True` returns."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)

    scores = torch.matmul(query, key.transpose(2, 3)).float() * scaling
    scores = scores + relative_bias(relative_logits.float(), query_positions, key_positions)
    scores = scores.masked_fill(~visible_keys(query_positions, key_positions, key_padding, sliding_window), -torch.inf)
    with_sink = torch.cat([scores, sinks.float().unsqueeze(-1)], dim=-1)
    probabilities = F.softmax(with_sink, dim=-1)[..., :-1].to(value.dtype)
    if probabilities_out is not None:
        probabilities_out.append(probabilities)
    return torch.matmul(probabilities, value).transpose(1, 2)


AttentionBackend = Callable[..., torch.Tensor]
ATTENTION_BACKENDS.register("eager", eager_attention)
# Steps of at most 8 queries over the static cache's sliding-window rings hand over keys in slot order; a backend
# registered with `keys_in_any_order=False` (it needs `key_positions = k0 + arange(K)`) runs `ANY_ORDER_FALLBACK`
# for them instead.
ANY_ORDER_FALLBACK = "inkling2_decode"
# Keys held in pages (`Inkling2PagedCache`, the serving engine's decode steps) reach this backend, with a `block_table`
# and a `page_size`: it reads them where they are (on CUDA, in the kernel) instead of a gathered copy of every row's.
PAGED_KEYS_BACKEND = "inkling2_decode"


def default_attention_backend() -> str:
    """What a model uses when the caller names no `attn_implementation`: the backend registered with
    `default=True` (the package registers one that picks the fastest path per call), else the eager reference."""
    return next((name for name in ATTENTION_BACKENDS if ATTENTION_BACKENDS.traits(name).get("default")), "eager")


def get_attention_backend(name: str | None, keys_in_order: bool = True) -> AttentionBackend:
    name = name or "eager"
    if not keys_in_order and not ATTENTION_BACKENDS.traits(name).get("keys_in_any_order", True):
        name = ANY_ORDER_FALLBACK
    return ATTENTION_BACKENDS.get(name)


def register_attention_backend(
    name: str, backend: AttentionBackend | str, keys_in_any_order: bool = True, default: bool = False
) -> None:
    """Makes `attn_implementation=name` select `backend` (a function, or `"module:attribute"` imported on first use)
    in the Inkling2 text layers; `default=True` makes it what models use when no `attn_implementation` is asked for
    (`default_attention_backend`).

    The name is also registered with transformers' `AttentionInterface`: `from_pretrained`, `from_config` and
    `set_attn_implementation` only accept names registered there, and the name also reaches the vision tower of the
    multimodal model, which calls its backend with transformers' signature. Such layers (no relative bias, no sink)
    get transformers' SDPA under the same name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ATTENTION_BACKENDS.register(name, backend, keys_in_any_order=keys_in_any_order, default=default)
    AttentionInterface.register(name, sdpa_attention_forward)
