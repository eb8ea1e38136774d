# Sourced by the tools/gpu_*.sh scripts: TAG names result files by the GPU they ran on
# (h200, h100, a100, l4, ...; "gpu" where nvidia-smi names none).
TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
  grep -o -i -E "[ABHL][0-9]{2,3}" | head -1 | tr A-Z a-z)
TAG=${TAG:-gpu}
