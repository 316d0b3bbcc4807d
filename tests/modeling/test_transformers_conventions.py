"""transformers' calling conventions on our models: checkpointing as Trainer 5.23 asks for it, tuples on request,
and the config's output switches."""

from unittest.mock import Mock, patch

import pytest
import torch

from transformers_inkling2 import build_tiny_causal_lm, build_tiny_model


def test_activation_checkpointing_takes_transformers_keywords_and_trains():
    model = build_tiny_causal_lm().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={}, every_n_layers=2)  # what Trainer 5.23 passes
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [i % 2 == 0 for i in range(6)]
    model.activation_checkpointing_enable(offload=False)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_training_gives_the_gradients_of_plain_training(use_reentrant):
    """Reentrant checkpointing only carries gradients through a layer's positional tensors: the attention-residual
    blocks travel as one, so every parameter (the embedding, read again by every later mix, too) gets its gradient."""
    model = build_tiny_causal_lm().train()
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(2))

    def gradients():
        model.zero_grad()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    checkpointed = gradients()
    assert checkpointed.keys() == plain.keys() and "model.embed_tokens.weight" in plain
    for name, gradient in plain.items():
        torch.testing.assert_close(checkpointed[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("build", [build_tiny_causal_lm, build_tiny_model], ids=["causal_lm", "multimodal"])
def test_return_dict_false_gives_the_tuple_of_the_output(build):
    model = build().eval()
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        as_dict = model(input_ids=ids)
        as_tuple = model(input_ids=ids, return_dict=False)
        base = model.model(input_ids=ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and isinstance(base, tuple)
    torch.testing.assert_close(as_tuple[0], as_dict.logits, rtol=0, atol=0)
    torch.testing.assert_close(base[0], model.model(input_ids=ids).last_hidden_state, rtol=0, atol=0)


def test_config_output_hidden_states_is_read():
    model = build_tiny_causal_lm().eval()
    ids = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(2))
    assert model(input_ids=ids).hidden_states is None
    model.config.output_hidden_states = True
    hidden = model(input_ids=ids).hidden_states
    assert hidden is not None and len(hidden) == model.config.num_hidden_layers + 1
    assert model(input_ids=ids, output_hidden_states=False).hidden_states is None


def test_get_image_features_returns_the_vision_output_with_each_images_features():
    from inkling2_helpers import images

    model = build_tiny_model().eval()
    pixel_values, grid = images((2, 3), (1, 2))
    with torch.no_grad():
        outputs = model.get_image_features(pixel_values, grid, output_hidden_states=True)
        as_tuple = model.get_image_features(pixel_values, grid, return_dict=False)
        vision = model.model.vision_tower(pixel_values=pixel_values, image_grid_thw=grid)
    assert [f.shape[0] for f in outputs.pooler_output] == [6, 2]
    torch.testing.assert_close(torch.cat(outputs.pooler_output), vision.pooler_output, rtol=0, atol=0)
    assert len(outputs.hidden_states) == model.config.vision_config.num_hidden_layers + 1
    assert isinstance(as_tuple, tuple)


def test_get_image_features_returns_each_layers_attention_per_image():
    from inkling2_helpers import images

    model = build_tiny_model().eval()
    pixel_values, grid = images((2, 3), (1, 2))
    with torch.no_grad():
        outputs = model.get_image_features(pixel_values, grid, output_attentions=True)
        plain = model.get_image_features(pixel_values, grid)
    vision = model.config.vision_config
    heads, lengths = vision.num_attention_heads, [1 + 4 * 6, 1 + 4 * 2]  # a class token, then 4 patches a token
    assert len(outputs.attentions) == vision.num_hidden_layers and plain.attentions is None
    for layer in outputs.attentions:
        assert [tuple(image.shape) for image in layer] == [(1, heads, n, n) for n in lengths]
        torch.testing.assert_close(layer[0].sum(-1), torch.ones(1, heads, lengths[0]))
    torch.testing.assert_close(torch.cat(outputs.pooler_output), torch.cat(plain.pooler_output))


def test_heads_record_router_logits_and_hidden_states_by_index_or_from_the_config():
    model = build_tiny_causal_lm().eval()
    ids = torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(input_ids=ids, output_hidden_states=True, output_router_logits=True)
        some = model(input_ids=ids, output_hidden_states=[0, -1])
        model.config.output_hidden_states = True
        from_config = model(input_ids=ids)
    config = model.config
    assert len(full.router_logits) == config.num_hidden_layers
    assert full.router_logits[0].shape == (2 * 5, config.n_routed_experts) and some.router_logits is None
    assert len(full.hidden_states) == len(some.hidden_states) == config.num_hidden_layers + 1
    assert all(state is None for state in some.hidden_states[1:-1])
    for index in (0, -1):
        torch.testing.assert_close(some.hidden_states[index], full.hidden_states[index])
    torch.testing.assert_close(from_config.hidden_states[3], full.hidden_states[3])


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_experts_implementation_runs_transformers_function_and_equals_the_reference(implementation, dtype):
    """`set_experts_implementation` reaches transformers' own experts functions (through its registry, as its common
    test checks), which run our softcapped gate and equal the reference loop."""
    from transformers.integrations import moe

    model = build_tiny_causal_lm().eval().to(dtype)
    experts = model.model.layers[0].mlp.experts
    mocks = {name: Mock(wraps=moe.ALL_EXPERTS_FUNCTIONS[name]) for name in ("grouped_mm", "batched_mm")}
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(5, model.config.hidden_size, generator=generator).to(dtype)
    ids = torch.randint(0, model.config.n_routed_experts, (5, model.config.num_experts_per_tok), generator=generator)
    weights = torch.rand(5, model.config.num_experts_per_tok, generator=generator)
    with torch.no_grad(), patch.dict(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, mocks):
        model.set_experts_implementation("eager")
        reference = experts(x, ids, weights).float()
        assert not any(mock.called for mock in mocks.values())
        model.set_experts_implementation(implementation)
        output = experts(x, ids, weights).float()
    assert [name for name, mock in mocks.items() if mock.called] == [implementation]
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(output, reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())


def test_experts_refuse_transformers_fused_implementations_that_ignore_the_softcaps():
    model = build_tiny_causal_lm().eval()
    model.config._experts_implementation = "sonicmoe"
    with pytest.raises(ValueError, match="experts_implementation"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("attn_implementation", ["eager", "inkling2_flex"])
def test_output_attentions_gives_each_layers_probabilities_and_leaves_the_output_unchanged(attn_implementation):
    from transformers_inkling2 import Inkling2Cache

    model = build_tiny_causal_lm().eval()
    model.set_attn_implementation(attn_implementation)
    ids = torch.randint(0, 1000, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(input_ids=ids)
        traced = model(input_ids=ids, output_attentions=True)
        if attn_implementation == "eager":  # transformers allows the config switch with eager attention only
            model.config.output_attentions = True
        per_call = {} if attn_implementation == "eager" else {"output_attentions": True}
        cache = Inkling2Cache(model.config)
        model(input_ids=ids[:, :8], past_key_values=cache, **per_call)
        step = model(input_ids=ids[:, 8:], past_key_values=cache, **per_call)
    assert plain.attentions is None
    torch.testing.assert_close(traced.logits, plain.logits, rtol=1e-5, atol=1e-5)
    assert len(traced.attentions) == model.config.num_hidden_layers
    heads = model.config.swa_num_attention_heads
    for probabilities in traced.attentions:
        assert probabilities.shape == (2, heads, 11, 11)
        assert (probabilities.triu(1) == 0).all()  # causal
        assert (probabilities.sum(-1) <= 1 + 1e-5).all()  # the sink takes the rest
    assert step.attentions[0].shape[-2] == 3 and step.attentions[0].shape[-1] >= 11
