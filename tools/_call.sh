#!/usr/bin/env bash
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 400 python3 benchmarks/stream_bound.py --out $OUT/stream_bound_s20.json 2>&1 | grep -v -E "^[WI][0-9]{4} " | tee $OUT/stream.txt | tail -40
