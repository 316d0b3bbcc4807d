"""transformers-inkling2: Thinking Machines' Inkling-2-Small for Hugging Face transformers.

The data path, module by module:
    configuration_inkling2   configs (official `config.json` names)
    modeling_inkling2_text   the text decoder: attention residuals, gated relative-bias attention, short
                             convolutions, MoE; `Inkling2ForCausalLM`
    attention                attention backends (`attn_implementation`), the eager reference first
    cache_inkling2           `Inkling2Cache`: keys/values + short-convolution states, rollback for speculation
    checkpoint_conversion    original checkpoint names <-> ours (load and save)

Importing the package registers every class with transformers' Auto classes, ahead of transformers' own
`inkling2` entries, and registers the checkpoint renamings for our model types.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_inkling2 import Inkling2Cache
from .checkpoint_conversion import register_conversion_mappings
from .configuration_inkling2 import Inkling2Config, Inkling2TextConfig, Inkling2VisionConfig
from .modeling_inkling2_text import Inkling2ForCausalLM, Inkling2PreTrainedModel, Inkling2TextModel

__version__ = "0.1.0"


def _register() -> None:
    for config_class in (Inkling2Config, Inkling2TextConfig, Inkling2VisionConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(Inkling2TextConfig, Inkling2TextModel, exist_ok=True)
    AutoModelForCausalLM.register(Inkling2TextConfig, Inkling2ForCausalLM, exist_ok=True)
    register_conversion_mappings()


_register()

__all__ = [
    "Inkling2Cache",
    "Inkling2Config",
    "Inkling2ForCausalLM",
    "Inkling2PreTrainedModel",
    "Inkling2TextConfig",
    "Inkling2TextModel",
    "Inkling2VisionConfig",
]
