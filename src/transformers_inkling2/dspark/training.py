"""Distilling a DSpark drafter from its frozen target (`inkling2 train-dspark`): for users who fine-tune the target
and need its drafter to follow, or who train one for a model that has none.

Teacher forcing, as in the DSpark paper: the target runs once over a text window; blocks are cut at random anchor
positions, each block sees the context features of the real text before its anchor, and the Markov head is fed the
real previous tokens. Per block position k (weight `exp(-k / 4)`), the loss is
`0.1 * CE(draft logits, next token) + 0.9 * L1(draft probabilities, target probabilities) + BCE(confidence, the draft's
argmax equals the target's)`. Only the drafter's weights train; the embedding and lm_head stay the target's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers.utils import logging
from transformers.utils.logging import tqdm

from ..configuration_inkling2 import Inkling2DSparkConfig
from ..modeling.modeling_inkling2_dspark import ContextView, Inkling2DSparkDrafter

logger = logging.get_logger(__name__)

CE_WEIGHT, L1_WEIGHT = 0.1, 0.9
POSITION_DECAY = 4.0


def default_dspark_config(text_config, block_size: int = 7, num_target_layers: int = 5, **overrides):
    """A drafter sized to a target that has none: the target's attention shape, evenly spaced tapped layers (the
    last one excluded), two layers, an MLP twice the width, a context window of the target's sliding window."""
    last = text_config.num_hidden_layers - 1
    count = min(num_target_layers, last)
    layer_ids = sorted({round(1 + i * (last - 2) / max(count - 1, 1)) for i in range(count)})
    fields = dict(
        block_size=block_size,
        target_layer_ids=[min(i, last - 1) for i in layer_ids],
        hidden_size=text_config.hidden_size,
        num_attention_heads=text_config.num_attention_heads,
        num_key_value_heads=text_config.num_key_value_heads,
        head_dim=text_config.head_dim,
        intermediate_size=2 * text_config.hidden_size,
        markov_rank=min(256, text_config.hidden_size),
        context_window=text_config.sliding_window_size,
        # the official mask id is an unused (padding) row of Inkling-2's vocabulary; smaller vocabularies: the last row
        mask_token_id=200064 if text_config.vocab_size > 200064 else text_config.vocab_size - 1,
    )
    fields.update(overrides)
    return Inkling2DSparkConfig(**fields)


def attach_new_drafter(model, dspark_config: Inkling2DSparkConfig, seed: int = 0) -> Inkling2DSparkDrafter:
    """Gives `model` a freshly initialized drafter (recorded in its config, so that save_pretrained keeps it)."""
    text_config = model.config.get_text_config()
    dspark_config.check_fits_target(text_config)
    torch.manual_seed(seed)
    drafter = Inkling2DSparkDrafter(dspark_config, text_config.vocab_size)
    for module in drafter.modules():
        model._init_weights(module)
    return model.set_dspark(drafter)


def position_weights(block_size: int, device) -> torch.Tensor:
    weights = torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / POSITION_DECAY)
    return weights / weights.sum()


def teacher_forced_loss(model, input_ids: torch.LongTensor, anchors: torch.LongTensor) -> dict[str, torch.Tensor]:
    """The drafter's loss on blocks cut at `anchors` (shared by the batch rows) of `input_ids` [batch, T], its parts,
    and `agreement`: per block position, how often the draft's argmax is the target's (teacher-forced)."""
    drafter = model.dspark
    block = drafter.config.block_size
    batch, length = input_ids.shape
    offsets = torch.arange(block, device=input_ids.device)
    positions = anchors[:, None] + offsets  # block slot (a, k) sits at anchor a + k and predicts the token after it
    with torch.no_grad():
        target = model(input_ids, output_hidden_states=True, use_cache=False, logits_to_keep=positions.flatten())
        target_probabilities = torch.softmax(target.logits.float(), -1).view(batch, len(anchors), block, -1)
        block_ids = input_ids[:, anchors][..., None].repeat(1, 1, block)
        block_ids[..., 1:] = drafter.config.mask_token_id
        block_embeddings = model.get_input_embeddings()(block_ids)
    features = drafter.context_features(target.hidden_states)
    keys_values = drafter.context_keys_values(features)
    view = ContextView(
        anchor_positions=anchors,
        key_positions=torch.arange(length, device=input_ids.device),
        key_is_real=torch.ones(batch, length, dtype=torch.bool, device=input_ids.device),
        block_size=block,
        window=drafter.config.context_window,
        num_buckets=drafter.config.distance_buckets,
    )
    keys, values = zip(*keys_values)
    hidden = drafter.block_hidden_states(block_embeddings, keys, values, view).view(batch, len(anchors), block, -1)
    head_dtype = model.get_output_embeddings().weight.dtype
    base_logits = model.compute_logits(hidden.flatten(1, 2).to(head_dtype)).view(batch, len(anchors), block, -1)
    labels = input_ids[:, positions + 1]  # [batch, anchors, block]
    previous = input_ids[:, positions]  # teacher forcing: the real token before each slot
    state = drafter.initial_state(batch * len(anchors), hidden)
    weights = position_weights(block, input_ids.device)
    totals = {"ce": 0.0, "l1": 0.0, "confidence": 0.0, "agreement": torch.zeros(block, device=input_ids.device)}
    for k in range(block):
        state, logits, confidence = drafter.head_step(
            state, previous[..., k].flatten(), hidden[:, :, k].flatten(0, 1), base_logits[:, :, k].flatten(0, 1)
        )
        teacher = target_probabilities[:, :, k].flatten(0, 1)
        totals["ce"] = totals["ce"] + weights[k] * F.cross_entropy(logits, labels[..., k].flatten())
        totals["l1"] = totals["l1"] + weights[k] * (torch.softmax(logits, -1) - teacher).abs().sum(-1).mean()
        agrees = (logits.argmax(-1) == teacher.argmax(-1)).float()
        totals["agreement"][k] = agrees.mean().detach()
        if confidence is not None:
            totals["confidence"] = totals["confidence"] + weights[k] * F.binary_cross_entropy(confidence, agrees)
    totals["loss"] = CE_WEIGHT * totals["ce"] + L1_WEIGHT * totals["l1"] + totals["confidence"]
    return totals


def random_anchors(length: int, block_size: int, count: int, generator: torch.Generator, device) -> torch.LongTensor:
    """`count` distinct anchors with a full block of labels after them, sorted."""
    choices = length - block_size - 1
    if choices < 1:
        raise ValueError(f"Training windows of {length} tokens are too short for blocks of {block_size}.")
    picked = torch.randperm(choices, generator=generator)[: min(count, choices)] + 1
    return picked.sort().values.to(device)


def train_dspark(
    model,
    batches: Iterator[torch.LongTensor],
    steps: int,
    learning_rate: float = 3e-3,
    anchors_per_window: int = 32,
    seed: int = 0,
) -> list[float]:
    """Trains `model.dspark` for `steps` batches of token windows [batch, T] with AdamW (linear warm-up over 5% of
    the steps, cosine decay); everything else stays frozen. Returns the loss of every step."""
    drafter = model.dspark
    if drafter is None:
        raise ValueError("The model has no drafter: attach one first (`attach_new_drafter`, or `--new-drafter`).")
    model.requires_grad_(False)
    model.eval()
    serving_dtype = drafter.fc.weight.dtype
    drafter.float().requires_grad_(True).train()  # fp32 master weights; the frozen target keeps its dtype
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=learning_rate, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step / steps, 1.0))),
    )
    generator = torch.Generator().manual_seed(seed)
    losses = []
    progress = tqdm(range(steps), desc="training the DSpark drafter")
    for _, input_ids in zip(progress, batches):
        anchors = random_anchors(
            input_ids.shape[1], drafter.config.block_size, anchors_per_window, generator, input_ids.device
        )
        parts = teacher_forced_loss(model, input_ids, anchors)
        optimizer.zero_grad(set_to_none=True)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(parts["loss"].detach()))
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    drafter.requires_grad_(False).eval().to(serving_dtype)
    return losses


def token_windows(token_ids: torch.LongTensor, window: int, batch_size: int, seed: int = 0, device="cpu"):
    """Endless batches of random windows [batch_size, window] from one long token stream."""
    generator = torch.Generator().manual_seed(seed)
    starts_range = len(token_ids) - window
    if starts_range < 1:
        raise ValueError(f"The corpus has {len(token_ids)} tokens, fewer than one window of {window}.")
    while True:
        starts = torch.randint(0, starts_range, (batch_size,), generator=generator)
        yield torch.stack([token_ids[s : s + window] for s in starts.tolist()]).to(device)


@torch.no_grad()
def target_written_windows(
    model, token_ids: torch.LongTensor, count: int, window: int, batch_size: int = 64, seed: int = 0
) -> torch.LongTensor:
    """Self-distillation data: `count` windows [count, window] whose first half is corpus text and whose second half
    the target writes itself (sampled at temperature 1, no EOS stop). Drafts are judged against what the target
    would write, so a drafter trained on the target's own text sees at training time the sequences it meets when
    drafting; the prompt half keeps it anchored to the corpus."""
    prompt_length = window // 2
    prompts = next(token_windows(token_ids, prompt_length, count, seed))
    device = model.get_input_embeddings().weight.device
    written = []
    torch.manual_seed(seed)
    for chunk in tqdm(prompts.split(batch_size), desc="the target writes its training text"):
        chunk = chunk.to(device)
        out = model.generate(
            chunk,
            attention_mask=torch.ones_like(chunk),
            max_new_tokens=window - prompt_length,
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=None,
            eos_token_id=None,
            pad_token_id=0,
        )
        written.append(out.cpu())
    return torch.cat(written)


def window_batches(windows: torch.LongTensor, batch_size: int, seed: int = 0, device="cpu"):
    """Endless batches of random rows of `windows` [N, T]."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield windows[torch.randint(0, len(windows), (batch_size,), generator=generator)].to(device)


def offline_english_corpus() -> str:
    """English prose that every Python installation carries: CPython's documentation topics (`pydoc_data`),
    about 800 kB of the Python reference manual."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


__all__ = [
    "attach_new_drafter",
    "default_dspark_config",
    "target_written_windows",
    "teacher_forced_loss",
    "token_windows",
    "train_dspark",
    "window_batches",
]
