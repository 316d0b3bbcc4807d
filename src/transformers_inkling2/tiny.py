"""The embedded default model: the real architecture and tokenizer at toy width, with random weights.

It lets the `inkling2` command, the examples and the tests run anywhere without downloading 394 GB. Its text is
random: it exists to exercise the code path, and everything that prints from it says so.
"""

from __future__ import annotations

import re

import torch

from .configuration_inkling2 import Inkling2Config, Inkling2DSparkConfig, Inkling2TextConfig

TINY_MODEL_LABEL = "embedded tiny Inkling2 (real architecture and tokenizer, RANDOM weights: its text is noise)"


def tiny_text_config(**overrides) -> Inkling2TextConfig:
    """Six layers (one full-attention layer, one attention-residual block boundary after the first), 8 experts,
    the full vocabulary; windows short enough that short prompts already cross them."""
    fields = dict(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=16,
        rel_extent=16,
        d_rel=4,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_layers_per_attn_res_block=3,
        max_position_embeddings=4096,
    )
    fields.update(overrides)
    return Inkling2TextConfig(**fields)


def tiny_dspark_config(**overrides) -> Inkling2DSparkConfig:
    """A DSpark drafter for the tiny text decoder: one layer of the tiny attention shape, Markov rank 16."""
    fields = dict(
        target_layer_ids=[1, 3, 4],
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        markov_rank=16,
        num_draft_layers=1,
        context_window=16,
        distance_buckets=8,
    )
    fields.update(overrides)
    return Inkling2DSparkConfig(**fields)


def tiny_config(image_token_id: int | None = None, **text_overrides) -> Inkling2Config:
    """The tiny text decoder with a two-layer ViT of width 32 in front; a smaller `vocab_size` needs an
    `image_token_id` inside it."""
    vision = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, projection_hidden_dim=64, text_hidden_size=64
    )
    image_token = {} if image_token_id is None else {"image_token_id": image_token_id}
    return Inkling2Config(text_config=tiny_text_config(**text_overrides).to_dict(), vision_config=vision, **image_token)


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> torch.nn.Module:
    """Draws every parameter and buffer from a seeded normal distribution, the zero-initialized ones (attention-
    residual queries, dynamic-convolution taps, router bias) too, so that no part of the model is inert. Norm
    weights and scales are drawn around 1. Buffers that are not saved (the ViT's rotary frequencies) are computed,
    not weights: they keep their values."""
    generator = torch.Generator().manual_seed(seed)
    saved = model.state_dict(keep_vars=True).keys()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or name not in saved:
                continue
            values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * std
            if re.search(r"(l2_clip\.scale|norm[^.]*\.weight)$", name):
                values = values + 1.0
            tensor.copy_(values.to(tensor.dtype))
    return model


def build_tiny_causal_lm(seed: int = 0, **config_overrides):
    """The embedded text model, deterministic for a given seed."""
    from .modeling.modeling_inkling2_text import Inkling2ForCausalLM

    model = Inkling2ForCausalLM(tiny_text_config(**config_overrides))
    return randomize_(model, seed).eval()


def build_tiny_model(seed: int = 0, dspark: bool = False, **text_overrides):
    """The embedded multimodal model (`Inkling2ForConditionalGeneration`), deterministic for a given seed; with a
    (random) DSpark drafter when `dspark`."""
    from .modeling.modeling_inkling2 import Inkling2ForConditionalGeneration

    config = tiny_config(**text_overrides)
    if dspark:
        config.dspark_config = config.text_config.dspark_config = tiny_dspark_config()
    return randomize_(Inkling2ForConditionalGeneration(config), seed).eval()


def build_tiny_processor():
    """The real tokenizer, chat template and image processor."""
    from .processing.image_processing_inkling2 import Inkling2ImageProcessor
    from .processing.processing_inkling2 import Inkling2Processor
    from .processing.tokenization_inkling2 import build_inkling2_tokenizer

    return Inkling2Processor(image_processor=Inkling2ImageProcessor(), tokenizer=build_inkling2_tokenizer())
