"""transformers-inkling2: Thinking Machines' Inkling-2-Small for Hugging Face transformers.

The data path, module by module:
    configuration_inkling2   configs (official `config.json` names)
    modeling_inkling2_text   the text decoder: attention residuals, gated relative-bias attention, short
                             convolutions, MoE; `Inkling2ForCausalLM`
    attention                attention backends (`attn_implementation`), the eager reference first
    fused_convolution        a prompt's short convolutions as one compiled kernel on CUDA
    cache_inkling2           `Inkling2Cache`: keys/values + short-convolution states, rollback for speculation
    static_cache_inkling2    `Inkling2StaticCache`: the same in fixed buffers (`cache_implementation="static"`)
    decode_graphs            decode steps over the static cache replayed as CUDA graphs
    modeling_inkling2_vision the ViT and the merger into the text width
    modeling_inkling2        `Inkling2Model`, `Inkling2ForConditionalGeneration`: image features at the placeholders
    modeling_inkling2_dspark the DSpark drafter: block decoder over the target's hidden states + Markov head
    generation_dspark        `generate(dspark=True)`: draft, verify in one target pass, accept losslessly, roll back
    dspark_checkpoints       the official `mtp.safetensors` -> the drafter (or DSpark disabled with a warning)
    dspark_training          `inkling2 train-dspark`: distill the drafter from its frozen target
    checkpoint_conversion    original checkpoint names <-> ours (load and save)
    quantized_formats        NVFP4 / MXFP8 expert weight codecs (the pure-PyTorch reference)
    tokenization_inkling2    `Inkling2Tokenizer`: o200k_base + the 60 Inkling special tokens
    image_processing_inkling2  `Inkling2ImageProcessorPil`: images -> 40x40 pixel blocks, one per image token
    processing_inkling2      `Inkling2Processor`: tokenizer + image processor + chat template
    chat_template            the Inkling chat format (effort, tools, thinking, images)
    response_parsing         generated text -> {"thinking", "content", "tool_calls"}, also streaming
    serving                  `inkling2 serve`: an OpenAI-compatible server
    experts                  routed experts: BF16 (grouped GEMM) and packed NVFP4 / MXFP8
    quantized_checkpoints    which layers are NVFP4 / MXFP8, read from the tensor headers; scale validation
    quantize                 `inkling2 quantize`: BF16 -> the official mixed layout
    kernel_loading           the `inkling2_moe` hub kernel, through the `kernels` library
    tensor_parallel          `tp_plan="auto"` under torchrun: attention split by heads, experts in blocks
    tiny, cli                the embedded tiny model and the `inkling2` command

Importing the package registers every class with transformers' Auto classes, ahead of transformers' own
`inkling2` entries, and registers the checkpoint renamings for our model types.
"""

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

from .cache_inkling2 import Inkling2Cache
from .checkpoint_conversion import register_conversion_mappings
from .configuration_inkling2 import Inkling2Config, Inkling2DSparkConfig, Inkling2TextConfig, Inkling2VisionConfig
from .decode_graphs import Inkling2DecodeGraphs
from .image_processing_inkling2 import Inkling2ImageProcessorPil
from .modeling_inkling2 import Inkling2ForConditionalGeneration, Inkling2Model
from .modeling_inkling2_text import Inkling2ForCausalLM, Inkling2PreTrainedModel, Inkling2TextModel
from .modeling_inkling2_vision import Inkling2VisionModel
from .processing_inkling2 import Inkling2MultimodalProcessor, Inkling2Processor
from .static_cache_inkling2 import Inkling2StaticCache
from .tokenization_inkling2 import Inkling2Tokenizer

__version__ = "0.1.0"


def _register() -> None:
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
    # a "pil" backend: the built-in image processor needs torchvision, ours does not
    image_processors = {"pil": Inkling2ImageProcessorPil, "torchvision": None}
    AutoImageProcessor.register(Inkling2Config, image_processor_classes=image_processors, exist_ok=True)
    AutoProcessor.register(Inkling2Config, Inkling2MultimodalProcessor, exist_ok=True)
    register_conversion_mappings()


_register()

__all__ = [
    "Inkling2Cache",
    "Inkling2Config",
    "Inkling2DecodeGraphs",
    "Inkling2DSparkConfig",
    "Inkling2ForCausalLM",
    "Inkling2ForConditionalGeneration",
    "Inkling2ImageProcessorPil",
    "Inkling2Model",
    "Inkling2MultimodalProcessor",
    "Inkling2Processor",
    "Inkling2StaticCache",
    "Inkling2VisionModel",
    "Inkling2PreTrainedModel",
    "Inkling2TextConfig",
    "Inkling2TextModel",
    "Inkling2Tokenizer",
    "Inkling2VisionConfig",
]
