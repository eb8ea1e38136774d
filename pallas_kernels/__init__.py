"""Pallas paged-attention kernels (Mosaic GPU, Mosaic TPU) with plain-jnp references."""
