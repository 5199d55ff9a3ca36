"""`compress serve`: the server (pipeline/serve/server.py) on an export folder."""
from __future__ import annotations

import sys

import click
from click.core import ParameterSource

from pipeline.app.commands import EPILOG
from pipeline.serve.engines import NAMES as ENGINE_NAMES
from pipeline.serve.engines.base import OPTIONS, ServeOptions
from pipeline.serve.server import serve as run_server


@click.command(epilog=EPILOG)
@click.argument("export_dir", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Bind address; anything but loopback needs an API key.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--engine", default="auto", show_default=True, type=click.Choice(["auto", *ENGINE_NAMES]),
              help="auto: the engine the export's run measured fastest here (its serving.json, at the level "
                   "nearest --slots), else transformers for Hugging Face folders, llama.cpp for a .gguf file; vllm: "
                   "vLLM's server "
                   "from its own environment (scripts/setup.sh), supervised by this process.")
@click.option("--api-key", default=None, help="Key requests must send as 'Authorization: Bearer KEY' "
              "(or set COMPRESS_API_KEY, which keeps it out of the process list).")
@click.option("--slots", default=16, show_default=True, type=click.IntRange(min=1),
              help="Requests generated at once (continuous batching; vLLM's --max-num-seqs).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests waiting for a slot; more get 503 (not vllm: refused when given).")
@click.option("--queue-timeout-s", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Longest wait for a slot before 503 with Retry-After (not vllm).")
@click.option("--max-tokens-limit", default=2048, show_default=True, type=click.IntRange(min=1),
              help="Largest max_tokens a request may ask for (not vllm).")
@click.option("--max-model-len", default=2048, show_default=True, type=click.IntRange(min=2),
              help="Longest prompt + output served (capped at the model's context); sizes the KV cache.")
@click.option("--drain-s", default=10.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM, how long in-flight requests may take to finish.")
@click.option("--start-timeout-s", default=600.0, show_default=True, type=click.FloatRange(min=1),
              help="vllm: longest its start-up may take before exit 4 (it compiles on its first start).")
@click.option("--enforce-eager", is_flag=True, help="vllm: skip its torch.compile step (faster start, slower serving).")
@click.option("--tensor-parallel-size", default=1, show_default=True, type=click.IntRange(min=1),
              help="vllm: ranks the model's heads are split over (one core or GPU each).")
@click.option("--pipeline-parallel-size", default=1, show_default=True, type=click.IntRange(min=1),
              help="vllm: ranks the model's layers are split over (one core or GPU each).")
@click.option("--int8-activations/--no-int8-activations", default=None,
              help="vllm: on a CPU, multiply 4-bit weights with int8-quantized activations (its W4A8 path, "
                   "VLLM_CPU_INT4_W4A8=1) or with 16-bit ones (W4A16, the computation the run scores in process: "
                   "=0); unset: vLLM's own default (W4A8 for 4-bit GPTQ/AWQ in bfloat16 on AMX CPUs).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", default=None, type=click.IntRange(min=1), help="torch threads (default: all cores).")
@click.pass_context
def serve(ctx: click.Context, export_dir: str, host: str, port: int, engine: str, api_key: str | None, slots: int,
          max_queue: int, queue_timeout_s: float, max_tokens_limit: int, max_model_len: int, drain_s: float,
          start_timeout_s: float, enforce_eager: bool, tensor_parallel_size: int, pipeline_parallel_size: int,
          int8_activations: bool | None, device: str, threads: int | None) -> None:
    """Serve EXPORT_DIR over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health) with continuous batching."""
    explicit = frozenset(o for o in OPTIONS if ctx.get_parameter_source(o) is not ParameterSource.DEFAULT)
    opts = ServeOptions(host=host, port=port, key=api_key, slots=slots, max_queue=max_queue,
                        queue_timeout_s=queue_timeout_s, max_tokens_limit=max_tokens_limit,
                        max_model_len=max_model_len, drain_s=drain_s, device=device, threads=threads,
                        start_timeout_s=start_timeout_s, enforce_eager=enforce_eager,
                        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                        int8_activations=int8_activations, explicit=explicit)
    sys.exit(run_server(export_dir, engine, opts))
