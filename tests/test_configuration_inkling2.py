"""Config validation (issue #26): every impossible value of every numeric field is an error naming the field, and
the table below covers each numeric field our configs declare, so that a new one needs a decision here."""

import math
import re

import pytest
from huggingface_hub.errors import StrictDataclassError

from transformers_inkling2 import Inkling2Config, Inkling2DSparkConfig, Inkling2TextConfig, Inkling2VisionConfig

NAN, INF = math.nan, math.inf
COUNT = (0, -1)  # sizes, counts, windows
SCALE = (0.0, -1.0, NAN, INF)  # epsilons, thresholds, softcaps
NON_NEGATIVE = (-0.5, NAN, INF)
PROBABILITY = (-0.1, 1.5, NAN)

IMPOSSIBLE = {
    Inkling2TextConfig: {
        **dict.fromkeys(
            ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "sliding_window_size",
             "d_rel", "rel_extent", "log_scaling_n_floor", "max_position_embeddings", "conv_kernel_size",
             "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_layers_per_attn_res_block"),
            COUNT,
        ),  # fmt: skip
        **dict.fromkeys(
            ("rms_norm_eps", "route_scale", "qk_l2_clip_threshold", "rel_l2_clip_threshold", "mlp_gate_softcap",
             "mlp_up_softcap", "final_logit_softcapping"),
            SCALE,
        ),  # fmt: skip
        "unpadded_vocab_size": (0, -1),  # above vocab_size: every row is a real token
        "log_scaling_alpha": NON_NEGATIVE,
        "attention_dropout": PROBABILITY,
        "initializer_range": NON_NEGATIVE,
    },
    Inkling2VisionConfig: {
        **dict.fromkeys(
            ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
             "patch_size", "spatial_merge_size", "posemb_grid_size", "projection_hidden_dim", "text_hidden_size"),
            COUNT,
        ),  # fmt: skip
        "layer_norm_eps": SCALE,
        "mlp_ratio": SCALE,
        "attention_dropout": PROBABILITY,
        "layer_scale_init_value": (NAN, INF),
        "initializer_range": NON_NEGATIVE,
    },
    Inkling2DSparkConfig: {
        **dict.fromkeys(
            ("block_size", "markov_rank", "num_draft_layers", "hidden_size", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size", "context_window", "distance_buckets"),
            COUNT,
        ),  # fmt: skip
        "rms_norm_eps": SCALE,
        "target_layer_ids": ([], [1, -1]),
        "mask_token_id": (-1,),
        "initializer_range": NON_NEGATIVE,
    },
    Inkling2Config: {"image_token_id": (-1, 201024)},
}
# transformers' own convention for these: a warning when an id lies outside the vocabulary
LEFT_TO_TRANSFORMERS = {"pad_token_id", "bos_token_id", "eos_token_id"}


def numeric_fields(config_class) -> set[str]:
    """The fields the class itself declares as ints, floats or lists of them (annotations are strings here)."""
    return {
        name
        for name, annotation in config_class.__annotations__.items()
        if re.search(r"\b(int|float)\b", str(annotation)) and not name.endswith("_config")
    }


@pytest.mark.parametrize("config_class", list(IMPOSSIBLE), ids=lambda c: c.__name__)
def test_every_numeric_field_has_its_impossible_values_listed(config_class):
    assert numeric_fields(config_class) - LEFT_TO_TRANSFORMERS == set(IMPOSSIBLE[config_class])


@pytest.mark.parametrize(
    "config_class, field, value",
    [(cls, field, value) for cls, fields in IMPOSSIBLE.items() for field, values in fields.items() for value in values],
    ids=lambda x: x.__name__ if isinstance(x, type) else repr(x),
)
def test_an_impossible_value_is_an_error_naming_its_field(config_class, field, value):
    with pytest.raises((ValueError, StrictDataclassError), match=f"`{field}`"):
        config_class(**{field: value})


def test_every_error_of_one_config_is_named_at_once():
    with pytest.raises(StrictDataclassError, match=r"`hidden_size` = -8 .*`attention_dropout` = 2\.0 \(must be"):
        Inkling2TextConfig(hidden_size=-8, attention_dropout=2.0)


def test_the_edges_of_the_possible_values_are_accepted():
    Inkling2TextConfig(log_scaling_alpha=0.0, attention_dropout=1.0, initializer_range=0.0)
    Inkling2VisionConfig(attention_dropout=0, layer_scale_init_value=-0.1, initializer_range=0.0)
    Inkling2DSparkConfig(mask_token_id=0, target_layer_ids=[0])
    Inkling2Config(image_token_id=0)


def test_a_smaller_vocabulary_over_a_saved_config_keeps_the_saved_real_vocabulary(tmp_path):
    """transformers' sub-config override (`text_config={"vocab_size": n}`) changes that field only: a real vocabulary
    above the rows means every row is a real token; a real vocabulary of 0 stays an error naming the field."""
    Inkling2Config(text_config={"vocab_size": 99, "unpadded_vocab_size": 99}, image_token_id=3).save_pretrained(tmp_path)
    config = Inkling2Config.from_pretrained(tmp_path, text_config={"vocab_size": 20})
    assert (config.text_config.vocab_size, config.text_config.unpadded_vocab_size) == (20, 99)
    with pytest.raises(StrictDataclassError, match="unpadded_vocab_size"):
        Inkling2TextConfig(vocab_size=20, unpadded_vocab_size=0)
