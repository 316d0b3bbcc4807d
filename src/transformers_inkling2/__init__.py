"""transformers-inkling2: Thinking Machines' Inkling-2-Small for Hugging Face transformers.

The data path, folder by folder (each folder imports only the ones above it):

    configuration_inkling2   configs (official `config.json` names): a pure description
    cache/                   `Inkling2Cache` (keys/values + short-convolution states, rollback) and the fixed-buffer
                             `Inkling2StaticCache`; `common` holds what both share (the step limit, row shifts)
    processing/              tokenizer (o200k + the 60 Inkling tokens), image processor (40x40 pixel blocks),
                             processor, chat template, response parsing
    modeling/                the reference model: text decoder, ViT, multimodal model, DSpark drafter, checkpoint
                             names; fast paths reach it only through the registries of `modeling/interfaces.py`
    backends/                attention backends and their Triton / Gluon kernels, the fused prompt convolution, the
                             `inkling2_moe` hub kernel loader
    quantization/            NVFP4 / MXFP8 formats, packed expert modules, detection at load, `inkling2 quantize`
    parallel/                tensor / expert parallel styles (`tp_plan="auto"`), the memory planner
    generation/              generate() hooks: DSpark decoding, decode steps replayed as CUDA graphs
    dspark/                  the drafter's `mtp.safetensors` loader and `inkling2 train-dspark`
    serving/                 `inkling2 serve`: the OpenAI-compatible server
    finetuning, tiny, cli    LoRA targets and guard, the embedded tiny model, the `inkling2` command

This file is the one place that knows all of them: importing the package registers every class with transformers'
Auto classes (ahead of transformers' own `inkling2` entries), the checkpoint renamings, and the package's fast paths
in the model's registries, by name: they are imported when a model is built or a step first needs them, not here.
Every public name is importable from here.
"""

import importlib

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMultimodalLM,
    AutoProcessor,
    AutoTokenizer,
)
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from .cache.dynamic import Inkling2Cache
from .cache.static import Inkling2StaticCache
from .configuration_inkling2 import Inkling2Config, Inkling2DSparkConfig, Inkling2TextConfig, Inkling2VisionConfig
from .modeling.attention import eager_attention, register_attention_backend
from .modeling.checkpoint_conversion import register_conversion_mappings
from .modeling.interfaces import EXPERT_STORAGES, GENERATION_HOOKS, KERNELS, LOADING_HOOKS
from .modeling.modeling_inkling2 import Inkling2ForConditionalGeneration, Inkling2Model
from .modeling.modeling_inkling2_dspark import Inkling2DSparkDrafter
from .modeling.modeling_inkling2_text import Inkling2ForCausalLM, Inkling2PreTrainedModel, Inkling2TextModel
from .modeling.modeling_inkling2_vision import Inkling2VisionModel
from .parallel.planning import format_plan, memory_plan
from .parallel.tensor_parallel import register_parallel_styles, validate_parallel_size
from .processing.image_processing_inkling2 import Inkling2ImageProcessor, Inkling2ImageProcessorPil
from .processing.processing_inkling2 import Inkling2MultimodalProcessor, Inkling2Processor
from .processing.response_parsing import Inkling2ResponseParser, Inkling2ResponseStreamer, parse_response
from .processing.tokenization_inkling2 import Inkling2Tokenizer, build_inkling2_tokenizer
from .tiny import (
    TINY_MODEL_LABEL,
    build_tiny_causal_lm,
    build_tiny_model,
    build_tiny_processor,
    tiny_config,
    tiny_dspark_config,
    tiny_text_config,
)
from .version import __version__

_PACKAGE = __name__


def _register_auto_classes() -> None:
    for config_class in (Inkling2Config, Inkling2TextConfig, Inkling2VisionConfig, Inkling2DSparkConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(Inkling2TextConfig, Inkling2TextModel, exist_ok=True)
    AutoModel.register(Inkling2VisionConfig, Inkling2VisionModel, exist_ok=True)
    AutoModel.register(Inkling2Config, Inkling2Model, exist_ok=True)
    AutoModelForCausalLM.register(Inkling2TextConfig, Inkling2ForCausalLM, exist_ok=True)
    # the official checkpoints are multimodal: as a causal LM they load with their image support
    AutoModelForCausalLM.register(Inkling2Config, Inkling2ForConditionalGeneration, exist_ok=True)
    AutoModelForImageTextToText.register(Inkling2Config, Inkling2ForConditionalGeneration, exist_ok=True)
    AutoModelForMultimodalLM.register(Inkling2Config, Inkling2ForConditionalGeneration, exist_ok=True)
    for config_class in (Inkling2Config, Inkling2TextConfig):
        AutoTokenizer.register(config_class, tokenizer_class=Inkling2Tokenizer, exist_ok=True)
    # ours for either backend: the built-in image processor needs torchvision, ours does not. Checkpoints made for
    # the built-in port name `Inkling2Processor` / `Inkling2ImageProcessor`: ours carry the same names, the image
    # processor's found through this registration, the processor's once transformers' own name entry is gone
    image_processors = {"pil": Inkling2ImageProcessor, "torchvision": Inkling2ImageProcessor}
    AutoImageProcessor.register(Inkling2Config, image_processor_classes=image_processors, exist_ok=True)
    AutoProcessor.register(Inkling2Config, Inkling2Processor, exist_ok=True)
    PROCESSOR_MAPPING_NAMES.pop(Inkling2Config.model_type, None)


def _register_fast_paths() -> None:
    """The package's backends, by `"module:attribute"` name (see `modeling/interfaces.py`)."""
    flex = f"{_PACKAGE}.backends.attention.flex"
    register_attention_backend("inkling2_flex", f"{flex}:inkling2_flex_attention")
    register_attention_backend("inkling2_triton", f"{flex}:inkling2_triton_attention")
    register_attention_backend("inkling2_decode", f"{flex}:inkling2_decode_attention")
    register_attention_backend("inkling2_auto", f"{flex}:inkling2_auto_attention", default=True)
    register_attention_backend("inkling2_flex_decode", f"{flex}:inkling2_flex_decode_attention", keys_in_any_order=False)
    for fmt in ("nvfp4", "mxfp8"):
        EXPERT_STORAGES.register(fmt, f"{_PACKAGE}.quantization.experts:Inkling2QuantizedExperts")
    KERNELS.register("prompt_convolution", f"{_PACKAGE}.backends.convolution:fused_prompt_convolution")
    KERNELS.register("step_convolution", f"{_PACKAGE}.backends.convolution:fused_step_convolution")
    KERNELS.register("routed_experts", f"{_PACKAGE}.backends.kernel_loading:routed_experts")
    KERNELS.register("routed_expert_terms", f"{_PACKAGE}.backends.kernel_loading:routed_expert_terms")
    KERNELS.register("input_projections", f"{_PACKAGE}.backends.projections:input_projections")
    KERNELS.register("top_k_routing", f"{_PACKAGE}.backends.routing:top_k_routing")
    KERNELS.register("relative_logits_layout", f"{_PACKAGE}.backends.attention.relative_logits:aligned_product")
    KERNELS.register("attention_step", f"{_PACKAGE}.backends.attention.step:fused_attention_step")
    KERNELS.register("key_value_step", f"{_PACKAGE}.backends.key_value_step:fused_key_value_step")
    KERNELS.register("residual_mix", f"{_PACKAGE}.backends.residual_mix:fused_residual_mix")
    KERNELS.register(
        "residual_mix_after_sublayer", f"{_PACKAGE}.backends.residual_mix:fused_residual_mix_after_sublayer"
    )
    KERNELS.register(
        "residual_step_convolution", f"{_PACKAGE}.backends.residual_mix:fused_residual_step_convolution"
    )
    quantized = f"{_PACKAGE}.quantization.checkpoints"
    LOADING_HOOKS.register("expert_storage", f"{quantized}:attach_expert_quantization", stage="config")
    LOADING_HOOKS.register("bundled_drafter", f"{_PACKAGE}.dspark.checkpoints:load_bundled_drafter", stage="model")
    LOADING_HOOKS.register("expert_scales", f"{quantized}:check_loaded_experts", stage="model")
    GENERATION_HOOKS.register("generate", f"{_PACKAGE}.generation.hooks:generate_with_dspark")
    GENERATION_HOOKS.register("compiled_call", f"{_PACKAGE}.generation.hooks:decode_graphs_call")


_register_auto_classes()
register_conversion_mappings()
register_parallel_styles()
_register_fast_paths()

# Public names of the layers above the model, imported on first access (`transformers_inkling2.serve`, ...).
_LAZY_NAMES = {
    "Inkling2DecodeGraphs": "generation.decode_graphs",
    "DSparkOptions": "generation.dspark",
    "Inkling2DSparkGenerateOutput": "generation.dspark",
    "Inkling2QuantizedExperts": "quantization.experts",
    "quantize_checkpoint": "quantization.quantize",
    "attach_new_drafter": "dspark.training",
    "default_dspark_config": "dspark.training",
    "train_dspark": "dspark.training",
    "load_mtp_drafter": "dspark.checkpoints",
    "DEFAULT_LORA_TARGET_MODULES": "finetuning",
    "refuse_lora_on_quantized_experts": "finetuning",
    "serve": "serving.server",
    "Inkling2Server": "serving.server",
    "ServerSettings": "serving.settings",
}


def __getattr__(name: str):
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{_PACKAGE}.{_LAZY_NAMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


__all__ = [
    "DEFAULT_LORA_TARGET_MODULES",
    "DSparkOptions",
    "Inkling2Cache",
    "Inkling2Config",
    "Inkling2DSparkConfig",
    "Inkling2DSparkDrafter",
    "Inkling2DSparkGenerateOutput",
    "Inkling2DecodeGraphs",
    "Inkling2ForCausalLM",
    "Inkling2ForConditionalGeneration",
    "Inkling2ImageProcessor",
    "Inkling2ImageProcessorPil",
    "Inkling2Model",
    "Inkling2MultimodalProcessor",
    "Inkling2PreTrainedModel",
    "Inkling2Processor",
    "Inkling2QuantizedExperts",
    "Inkling2ResponseParser",
    "Inkling2ResponseStreamer",
    "Inkling2StaticCache",
    "Inkling2TextConfig",
    "Inkling2TextModel",
    "Inkling2Tokenizer",
    "Inkling2VisionConfig",
    "Inkling2VisionModel",
    "TINY_MODEL_LABEL",
    "__version__",
    "attach_new_drafter",
    "build_inkling2_tokenizer",
    "build_tiny_causal_lm",
    "build_tiny_model",
    "build_tiny_processor",
    "default_dspark_config",
    "eager_attention",
    "format_plan",
    "load_mtp_drafter",
    "memory_plan",
    "parse_response",
    "quantize_checkpoint",
    "refuse_lora_on_quantized_experts",
    "register_attention_backend",
    "serve",
    "tiny_config",
    "tiny_dspark_config",
    "tiny_text_config",
    "train_dspark",
    "validate_parallel_size",
]
