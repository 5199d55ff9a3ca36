#!/usr/bin/env bash
# The GPU check in one command (see benchmarks/gpu/check.py). On the lent GPU machine, from the repo root,
# with .whl and .gpu carried (made here by `python -m benchmarks.gpu.check --prepare`):
#     bash benchmarks/gpu/check.sh            # writes $OUT/check.json (+ logs, bench/)
# Rehearsal on a CPU machine with the project's venv: bash benchmarks/gpu/check.sh cpu
set -u
device=${1:-cuda}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OUT=${OUT:-/tmp/gpu-check}
py=python3
if [ "$device" = cpu ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
if [ "$device" != cpu ] && [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
[ -d .gpu/tiny-llama ] || { echo "no .gpu/tiny-llama: run 'python -m benchmarks.gpu.check --prepare' first"; exit 2; }
exec $py -m benchmarks.gpu.check --device "$device" --out "$OUT"
