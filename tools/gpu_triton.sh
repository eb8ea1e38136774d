#!/usr/bin/env bash
# The Pallas-Triton kernels and the XLA paths on a GPU, in parts that fit one device call; each
# command has its own timeout and prints "== rc N":
#
#   bash tools/gpu_triton.sh probe OUT       # the toolchain: XLA's Triton floor, ptxas, sm80 PTX
#   bash tools/gpu_triton.sh sweep OUT       # knobs (benchmarks/diagnostics/triton_sweep.py)
#   bash tools/gpu_triton.sh tests OUT       # pytest -m gpu on both kernels' test files
#   bash tools/gpu_triton.sh decode OUT      # the 9-row decode table, pallas_triton beside
#                                            # the deprecated Pallas-Triton kernel, cuDNN, XLA
#   bash tools/gpu_triton.sh prefill OUT     # ragged prefill vs cuDNN causal, 4k-16k
#
# OLD_XLA: a file holding an earlier decode XLA path, timed beside the current one in the sweep.
set -u
PART=${1:?part: probe, sweep, tests, decode or prefill}
DEST=${2:-benchmarks/results}
mkdir -p "$DEST"
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jpaged_jax_cache}
PY=${PYTHON:-python3}
. "$(dirname "$0")/gpu_tag.sh"  # TAG: the GPU in result file names

run() {  # run SECONDS LOG command...
  local limit=$1 log=$2
  shift 2
  echo "== $*"
  timeout "$limit" "$@" 2>&1 | grep -v -E "^[WI][0-9]{4} " | tee -a "$log"
  echo "== rc ${PIPESTATUS[0]}"
}

probe() {
  "$PY" - <<'EOF'
import glob, os, subprocess, jax
print("device", jax.devices()[0].device_kind, jax.devices()[0].compute_capability, jax.__version__)
libs = [p for d in __import__("sys").path for p in glob.glob(os.path.join(d, "jax_plugins", "*", "*.so"))]
for lib in libs:
    out = subprocess.run(["grep", "-a", "-o", "-E", "Triton support is only enabled for [A-Za-z ]+[^\"]{0,80}", lib],
                         capture_output=True, text=True).stdout
    print(os.path.basename(lib), "| Triton floor:", sorted(set(out.splitlines()))[:3])
ptxas = glob.glob(os.path.join(os.path.dirname(jax.__file__), "..", "nvidia", "*", "bin", "ptxas"))
print("ptxas", ptxas[:1])
EOF
}

sm80_ptx() {  # PTX of the decode kernel as XLA built it for this GPU, assembled for sm80/sm75
  rm -rf /tmp/tdump && XLA_FLAGS="--xla_dump_to=/tmp/tdump" "$PY" - <<'EOF'
import jax, jax.numpy as jnp, math
from pallas_kernels.paged_attention import kernel_triton as kt
q = jnp.ones((4, 32, 128), jnp.bfloat16); kv = jnp.ones((8, 64, 16, 128), jnp.bfloat16)
t = jnp.zeros((4, 8), jnp.int32); n = jnp.full((4,), 100, jnp.int32)
jax.block_until_ready(jax.jit(lambda *a: kt.paged_attention_pallas_triton(*a, sm_scale=0.1, num_splits=1))(q, kv, kv, t, n))
EOF
  local ptxas
  ptxas=$(ls "$("$PY" -c 'import jax,os;print(os.path.dirname(jax.__file__))')"/../nvidia/*/bin/ptxas 2>/dev/null | head -1)
  for f in $(grep -l "paged_decode_triton" /tmp/tdump/*.ptx 2>/dev/null | head -1); do
    echo "ptx $f: $(grep -c -E 'wgmma|cp.async.bulk' "$f") wgmma/TMA lines, $(grep -c 'mma.sync' "$f") mma.sync"
    for arch in sm_80 sm_75; do
      sed -E "s/^\.target sm_[0-9a]+/.target $arch/" "$f" > "/tmp/k_$arch.ptx"
      [ -n "$ptxas" ] && "$ptxas" -arch="$arch" "/tmp/k_$arch.ptx" -o "/tmp/k_$arch.cubin" 2>&1 | tail -3
      echo "ptxas $arch rc $?"
    done
  done
}

case "$PART" in
  probe)  # shell functions: no per-command timeout (give the call's own)
    probe 2>&1 | tee -a "$DEST/probe.log"
    sm80_ptx 2>&1 | tee -a "$DEST/probe.log"
    ;;
  sweep)
    run "${BENCH_TIMEOUT:-300}" "$DEST/sweep.log" "$PY" benchmarks/diagnostics/triton_sweep.py \
      --old-xla "${OLD_XLA:-}" ${SWEEP_ARGS:-} --out "$DEST/triton_sweep_${TAG}.json"
    ;;
  tests)
    XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.18} run "${TEST_TIMEOUT:-240}" "$DEST/tests.log" \
      "$PY" -m pytest -m gpu -q -rf -p no:cacheprovider -p no:benchmark -n "${TEST_WORKERS:-4}" \
      --durations=5 tests/kernels/paged_attention/test_paged_attention_triton.py \
      tests/kernels/ragged_paged_attention/test_ragged_triton.py ${TEST_ARGS:-}
    ;;
  decode)
    run "${BENCH_TIMEOUT:-300}" "$DEST/decode.log" "$PY" benchmarks/decode_attention.py --quick \
      --calls 30 --rounds 3 ${DECODE_ARGS:-} --out "$DEST/decode_triton_${TAG}.json"
    ;;
  prefill)
    run "${BENCH_TIMEOUT:-300}" "$DEST/prefill.log" "$PY" benchmarks/prefill_attention.py \
      --impl pallas_triton --also pallas_gpu --lengths ${LENGTHS:-4096 8192 16384} --skip-jax-fa3 \
      --calls 5 --rounds 3 ${PREFILL_ARGS:-} --out "$DEST/prefill_triton_${TAG}.json"
    ;;
  *) echo "unknown part $PART" && exit 2 ;;
esac
