"""The multimodal Inkling2: image features from the ViT replace the `<|unused_200054|>` placeholder tokens, then
the text decoder runs as usual (its routed experts are transformers `@use_experts_implementation` experts: the
multimodal heads record and return their `router_logits` too).

`Inkling2Model` is the ViT plus the text decoder; `Inkling2ForConditionalGeneration` adds the language-model head
and generate(). Images are encoded once, in the prefill; generate() drops them from later steps.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPooling, MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils import can_return_tuple

from ..cache.dynamic import Inkling2Cache
from ..configuration_inkling2 import Inkling2Config
from .modeling_inkling2_text import (
    Inkling2LanguageModelingMixin,
    Inkling2PreTrainedModel,
    Inkling2TextModel,
    output_switches,
)
from .modeling_inkling2_vision import Inkling2VisionModel


@dataclass
class Inkling2ModelOutputWithPast(MoeModelOutputWithPast):
    """`image_hidden_states`: the image features that replaced the placeholders, [image tokens, hidden]."""

    image_hidden_states: torch.Tensor | None = None


@dataclass
class Inkling2CausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    image_hidden_states: torch.Tensor | None = None


class Inkling2MultimodalPreTrainedModel(Inkling2PreTrainedModel):
    """Sub-models (the ViT, the text decoder) initialize their own weights."""

    config: Inkling2Config
    _no_split_modules = ["Inkling2DecoderLayer", "Inkling2VisionEncoderLayer", "Inkling2DSparkDrafter"]


class Inkling2Model(Inkling2MultimodalPreTrainedModel):
    def __init__(self, config: Inkling2Config):
        super().__init__(config)
        self.language_model = Inkling2TextModel(config.text_config)
        self.vision_tower = Inkling2VisionModel(config.vision_config)
        self.post_init()

    @can_return_tuple
    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.LongTensor, **kwargs
    ) -> BaseModelOutputWithPooling:
        """The ViT's outputs for these images, as transformers' vision-language models return them: `pooler_output`
        holds each image's features (`[its image tokens, text hidden]`, one per placeholder token), `hidden_states`
        and `attentions` the ViT's layers when asked (`output_hidden_states`, `output_attentions`, or the vision
        config's); `return_dict=False` gives the tuple."""
        outputs = self.vision_tower(pixel_values=pixel_values, image_grid_thw=image_grid_thw, **kwargs, return_dict=True)
        outputs.pooler_output = outputs.pooler_output.split(image_grid_thw.prod(-1).tolist())
        return outputs

    def place_image_features(self, input_ids, inputs_embeds, image_features) -> torch.Tensor:
        """Writes the image features over the placeholder embeddings, checking that their counts agree."""
        image_token_id = self.config.image_token_id
        if input_ids is not None:
            placeholders = input_ids == image_token_id
        else:
            placeholder_embedding = self.get_input_embeddings()(torch.tensor(image_token_id, device=inputs_embeds.device))
            placeholders = (inputs_embeds == placeholder_embedding).all(-1)
        count = int(placeholders.sum())
        if count != image_features.shape[0]:
            raise ValueError(
                f"The text has {count} image placeholder tokens (`<|unused_200054|>`, id {image_token_id}) but the "
                f"images give {image_features.shape[0]} features. Each image needs exactly one placeholder per "
                "feature: build the inputs with the Inkling2 processor (or its chat template), which expands each "
                "image into the right number of placeholders."
            )
        mask = placeholders.unsqueeze(-1).expand_as(inputs_embeds)
        return inputs_embeds.masked_scatter(mask, image_features.to(inputs_embeds.device, inputs_embeds.dtype))

    def prompt_embeddings(self, input_ids, pixel_values=None, image_grid_thw=None, inputs_embeds=None):
        """(input embeddings with the image features at their placeholders, the image features or None)."""
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is None:
            return inputs_embeds, None
        if image_grid_thw is None:
            raise ValueError("`pixel_values` come with `image_grid_thw` (both are outputs of the image processor).")
        image_features = torch.cat(self.get_image_features(pixel_values, image_grid_thw).pooler_output)
        return self.place_image_features(input_ids, inputs_embeds, image_features), image_features

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Inkling2Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> Inkling2ModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        inputs_embeds, image_features = self.prompt_embeddings(input_ids, pixel_values, image_grid_thw, inputs_embeds)
        placeholders = input_ids is not None and (input_ids == self.config.image_token_id).any()
        if image_features is None and past_key_values is None and placeholders:
            raise ValueError(
                "The text has image placeholder tokens but no `pixel_values` were given: pass the images too."
            )
        outputs = self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            prefill_chunk_size=kwargs.get("prefill_chunk_size"),
            cache_position=kwargs.get("cache_position"),
            return_dict=True,
            **output_switches(kwargs),
        )
        return Inkling2ModelOutputWithPast(
            last_hidden_state=outputs.last_hidden_state,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            image_hidden_states=image_features,
        )


class Inkling2ForConditionalGeneration(Inkling2LanguageModelingMixin, Inkling2MultimodalPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {}
    _keys_to_ignore_on_load_unexpected = [r"^mtp\."]

    def __init__(self, config: Inkling2Config):
        super().__init__(config)
        self.model = Inkling2Model(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.init_dspark(config)
        self.post_init()

    def get_image_features(self, pixel_values, image_grid_thw, **kwargs) -> BaseModelOutputWithPooling:
        return self.model.get_image_features(pixel_values, image_grid_thw, **kwargs)

    def dspark_prompt_embeddings(self, input_ids, pixel_values=None, image_grid_thw=None, **model_kwargs):
        return self.model.prompt_embeddings(input_ids, pixel_values, image_grid_thw)[0]

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Inkling2Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> Inkling2CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            prefill_chunk_size=kwargs.pop("prefill_chunk_size", None),
            cache_position=kwargs.pop("cache_position", None),
            return_dict=True,
            **output_switches(kwargs),
        )
        logits, loss = self.logits_and_loss(outputs.last_hidden_state, logits_to_keep, labels, **kwargs)
        return Inkling2CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            image_hidden_states=outputs.image_hidden_states,
        )


__all__ = ["Inkling2Model", "Inkling2ForConditionalGeneration"]
