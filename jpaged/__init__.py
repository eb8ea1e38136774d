"""jpaged: paged KV cache, paged attention kernels and an LLM engine in pure JAX."""

# Imports are grouped by area (the comments below), not sorted: one block per owner.
# ruff: noqa: I001

from jpaged._attention import last_auto_choice as last_auto_choice
from jpaged._attention import paged_attention as paged_attention
from jpaged._attention import ragged_paged_attention as ragged_paged_attention
from jpaged._backend import auto_route as auto_route
from jpaged._errors import AllocatorError as AllocatorError
from jpaged._errors import OutOfPagesError as OutOfPagesError

# --- device state (foundation) ---
from jpaged.kv.block_table import BlockTable as BlockTable
from jpaged.kv.block_table import BlockTableDelta as BlockTableDelta
from jpaged.kv.block_table import HostBlockTable as HostBlockTable
from jpaged.kv.block_table import apply_delta as apply_delta
from jpaged.kv.cache import PagedKVCache as PagedKVCache
from jpaged.kv.cache import copy_pages as copy_pages
from jpaged.kv.cache import gather_pages as gather_pages
from jpaged.kv.cache import pages_for_budget as pages_for_budget
from jpaged.kv.cache import scatter_pages as scatter_pages
from jpaged.kv.cache import write_kv as write_kv
from jpaged.kv.cache import write_kv_layer as write_kv_layer

# --- host allocator (foundation) ---
from jpaged.kv.allocator import AllocatorInvariantError as AllocatorInvariantError
from jpaged.kv.allocator import AllocatorStats as AllocatorStats
from jpaged.kv.allocator import BlockAllocator as BlockAllocator
from jpaged.kv.page_groups import PageGroups as PageGroups

# --- models ---
from jpaged import models as models
from jpaged import parallel as parallel
from jpaged.models._protocol import AttentionMetadata as AttentionMetadata

# --- engine ---
from jpaged.engine.sampling import BeamSearchParams as BeamSearchParams
from jpaged.engine.sampling import SamplingParams as SamplingParams
from jpaged.engine.llm import LLM as LLM
from jpaged.engine.outputs import CompletionOutput as CompletionOutput
from jpaged.engine.outputs import RequestOutput as RequestOutput
from jpaged.engine.runner import default_compiler_options as default_compiler_options
from jpaged._assets import demo_model_path as demo_model_path

__version__ = "0.1.0"
