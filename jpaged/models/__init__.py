"""Flax NNX decoder-only transformers on the paged KV cache, and Hugging Face checkpoint loading."""

from jpaged.models._config import ModelConfig as ModelConfig
from jpaged.models._config import RopeScaling as RopeScaling
from jpaged.models._config import llama3_2_1b as llama3_2_1b
from jpaged.models._config import llama3_8b as llama3_8b
from jpaged.models._config import tiny as tiny
from jpaged.models._llama import LlamaForCausalLM as LlamaForCausalLM
from jpaged.models._llama import init_random as init_random
from jpaged.models._llama import param_shapes as param_shapes
from jpaged.models._loader import from_pretrained as from_pretrained
from jpaged.models._loader import load_config as load_config
from jpaged.models._loader import load_params as load_params
from jpaged.models._loader import load_tokenizer as load_tokenizer
from jpaged.models._protocol import AttentionMetadata as AttentionMetadata
from jpaged.models._protocol import PagedModel as PagedModel
from jpaged.models._protocol import batch_metadata as batch_metadata
from jpaged.models._protocol import paged_attention_layer as paged_attention_layer
