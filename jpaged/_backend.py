"""Backend facts: re-exported from ``pallas_kernels._backend``, where dispatch reads them.
``auto_route()`` says which kernel ``implementation=None`` tries on this machine and why."""

from pallas_kernels._backend import AutoRoute as AutoRoute
from pallas_kernels._backend import auto_route as auto_route
from pallas_kernels._backend import default_platform as default_platform
from pallas_kernels._backend import gpu_compute_capability as gpu_compute_capability
from pallas_kernels._backend import gpu_num_sms as gpu_num_sms
from pallas_kernels._backend import has_mosaic_gpu as has_mosaic_gpu
