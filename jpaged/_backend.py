"""Backend facts: re-exported from ``pallas_kernels._backend``, where dispatch reads them."""

from pallas_kernels._backend import default_platform as default_platform
from pallas_kernels._backend import gpu_compute_capability as gpu_compute_capability
from pallas_kernels._backend import gpu_num_sms as gpu_num_sms
from pallas_kernels._backend import has_mosaic_gpu as has_mosaic_gpu
