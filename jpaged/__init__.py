"""jpaged: paged KV cache, paged attention kernels and an LLM engine in pure JAX."""

from jpaged._attention import paged_attention as paged_attention
from jpaged._attention import ragged_paged_attention as ragged_paged_attention
from jpaged._errors import AllocatorError as AllocatorError
from jpaged._errors import OutOfPagesError as OutOfPagesError

# --- device state (foundation) ---
# --- host allocator (foundation) ---
# --- models ---
# --- engine ---
from jpaged._sampling import BeamSearchParams as BeamSearchParams
from jpaged._sampling import SamplingParams as SamplingParams

__version__ = "0.1.0"
