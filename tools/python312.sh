#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter, or fails saying what to install.
# jax >= 0.11 needs Python 3.12: on 3.11, pip silently resolves jax 0.10.2.
set -euo pipefail
for cand in "${PYTHON:-}" python3.12 python3; do
  [ -n "$cand" ] || continue
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    command -v "$cand"; exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V); do
    p="$(pyenv root)/versions/$v/bin/python"
    if [ -x "$p" ]; then echo "$p"; exit 0; fi
  done
fi
echo "error: jpaged needs Python >= 3.12 (jax >= 0.11 does). Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
exit 1
