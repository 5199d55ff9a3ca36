"""What every serving engine declares (torch-free: `compress check` reads it before any folder exists).

An engine states the checkpoint formats it serves on each kind of device, the `compress serve` options it applies
(`honours`), whether it is installed here (`missing`), its version, and how it serves a folder on a bound socket
(`serve`). Checkpoint formats are config.json's `quantization_config.quant_method` ("gptq", "awq", "bitsandbytes",
"torchao", "compressed-tensors"), "unquantized" for a plain Hugging Face folder and "gguf" for one .gguf file: the
same names the quantization methods declare as `checkpoint_format` (pipeline/quant/method.py).
"""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pipeline.base.registry import load_work

UNQUANTIZED = "unquantized"
# every `compress serve` option an engine may or may not apply; the transformers engine applies all but PARALLEL
# (one server's model split over ranks: vLLM's tensor and pipeline parallelism) and CHOICES
PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size")
# computations an engine may offer a choice between, one option each (None: the engine's own default). Also
# [validate.serve] engine_options' fields: an engine that does not honour one refuses it (compress check, serve)
CHOICES = ("int8_activations",)  # vLLM's CPU W4A8 path (VLLM_CPU_INT4_W4A8) or W4A16
OPTIONS = ("slots", "max_queue", "queue_timeout_s", "max_tokens_limit", "max_model_len", "threads", "drain_s",
           "enforce_eager", *PARALLEL, *CHOICES)


def device_kind(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


@dataclass(frozen=True)
class ServeOptions:
    """`compress serve`'s options as parsed (the CLI owns their defaults); `explicit`: those the user set."""

    host: str
    port: int
    key: str | None
    slots: int
    max_queue: int
    queue_timeout_s: float
    max_tokens_limit: int
    max_model_len: int
    drain_s: float
    device: str
    threads: int | None
    start_timeout_s: float
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    int8_activations: bool | None = None  # CHOICES; None: the engine's own default
    explicit: frozenset[str] = field(default_factory=frozenset)


class Engine:
    name: ClassVar[str]
    # device kind ("cpu", "cuda") -> checkpoint formats served there
    formats: ClassVar[dict[str, tuple[str, ...]]]
    honours: ClassVar[tuple[str, ...]] = tuple(o for o in OPTIONS if o not in (*PARALLEL, *CHOICES))
    unhonoured_why: ClassVar[str] = ""  # why the options it does not apply have no equivalent in it
    # greedy output compared with generate's token for token (the same weights and kernels), else recorded by text
    exact: ClassVar[bool] = False
    install: ClassVar[str] = ""
    # runs from an environment of its own (vLLM: .venv-vllm): its version is its serve units' business (their config
    # holds engine_version), not every unit's identity (pipeline.plan.identity_versions), so setting it up later
    # does not recompute a run's quantization and measurements
    own_environment: ClassVar[bool] = False
    # an extra: [validate.serve] engines = "all" skips it, with the reason recorded, where it is not installed
    optional: ClassVar[bool] = False
    work: ClassVar[str | None] = None  # the module that serves, by dotted path (pipeline.base.registry.load_work)
    # what the serve measurement (pipeline/serve/measure.py), the validate stage, `compress check`, report.md's
    # Serving and techniques tables (pipeline/results/serve_table.py) and the cards (pipeline/results/card.py) ask
    label: ClassVar[str] = ""  # how report.md and the cards name it ("vLLM"); "": its name
    reference: ClassVar[bool] = False  # the engine the others' served throughput is compared with ("x transformers")
    batches: ClassVar[bool] = True  # serves concurrent requests together (continuous batching), not one at a time
    prompt_logprobs: ClassVar[bool] = False  # returns prompt log-probabilities: perplexity is scored through it
    # answers lm-eval's local-completions log-likelihood requests (token-id prompts, echo + logprobs): [validate.tasks]
    # engines may score the tasks through it
    scores_tasks: ClassVar[bool] = False
    # fields added to each greedy request whose output is compared with generate's
    equality_request: ClassVar[dict[str, object]] = {}
    report_note: ClassVar[str] = ""  # report.md's Serving section: the paragraph that explains its rows

    def display(self) -> str:
        return self.label or self.name

    def serve_args(self, cfg) -> list[str]:
        """`compress serve` arguments the [validate.serve] config (pipeline/serve/config.py) asks of it, beyond
        the options it honours."""
        return []

    def config_facts(self, cfg) -> dict:
        """Facts from the [validate.serve] config that its serve record states (vLLM: whether it compiled)."""
        return {}

    def log_facts(self, log: Path, folder: Path) -> dict:
        """Facts its server's log states about what it ran, added last to its serve record."""
        return {}

    def check_note(self, cfg) -> str:
        """What `compress check`'s serve line adds for it under this [validate.serve] config."""
        return ""

    def missing(self) -> str | None:
        """Why it cannot start on this machine (not installed), or None."""
        return None

    def version(self) -> dict[str, str]:
        return {}

    def refuses(self, fmt: str, device: str) -> str | None:
        """Why it cannot serve a checkpoint of this format on this device here, or None."""
        kind = device_kind(device)
        if fmt not in self.formats.get(kind, ()):
            served = self.formats.get(kind, ())
            return (f"does not serve {describe(fmt)} on {kind.upper() if kind == 'cpu' else 'CUDA'}"
                    + (f" (it serves {', '.join(describe(f) for f in served)})" if served else ""))
        return self.missing()

    def refuses_needs(self, needs: tuple[str, ...], device: str) -> str | None:
        """Why it cannot serve a checkpoint that needs these (QuantMethod.serve_needs: "wna16", "fp8_kv") on this
        device, or None."""
        return None

    def refuses_architecture(self, model_class: str | None) -> str | None:
        """Why it cannot serve a model of this class (config.json's `architectures`), or None (by default every
        class transformers builds)."""
        return None

    def refuses_model(self, config: dict, device: str, fmt: str = UNQUANTIZED, needs: tuple[str, ...] = ()
                      ) -> str | None:
        """Why it cannot serve a model of this config.json (its shapes, its experts) on this device here, as a
        checkpoint of this format with these needs (QuantMethod.serve_needs), or None."""
        return None

    def unhonoured(self, opts: ServeOptions) -> list[str]:
        """The options the user set that this engine does not apply (refused by `compress serve`, never dropped)."""
        return [o for o in OPTIONS if o in opts.explicit and o not in self.honours]

    def refuses_start(self, folder, opts: ServeOptions) -> str | None:
        """Why its serve would refuse this folder with these options before starting anything (exit 2), or None:
        what `--engine auto` passes over (vLLM: a non-loopback host, a checkpoint its CPU build cannot run here)."""
        return None

    def serve(self, exp, sock: socket.socket, opts: ServeOptions) -> int:
        """Serve the export on the bound socket until SIGTERM; the exit code. By default its work module's
        `serve(exp, sock, opts)` (pipeline/serve/work/<name>.py, which imports the server and model libraries)."""
        if self.work is None:
            raise NotImplementedError
        return load_work(self.work).serve(exp, sock, opts)


def describe(fmt: str) -> str:
    return {"gguf": "a .gguf file", UNQUANTIZED: "unquantized checkpoints"}.get(fmt, f"{fmt} checkpoints")


_PREFIX = re.compile(r"^\((?:\w+) pid=\d+\)\s*")  # vLLM's "(APIServer pid=12) " before each line of its processes
# vLLM's log-record head: "ERROR 12-05 02:26:47 [multiproc_executor.py:953] " (a worker's traceback comes through it)
_RECORD = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\]\s*")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception)\b.*")


def error_line(lines: list[str], limit: int = 500) -> str:
    """The first exception a server's log shows ("ValueError: ...", with the reason a pydantic ValidationError gives
    on its next lines, or the reasons a message ending in a colon lists), else its first line of our own
    "error: ...", else its last line: what a refusal quotes. A worker process's exception counts where vLLM logs it
    (the engine's own "RuntimeError: Engine core initialization failed" that follows says only that it failed)."""
    plain = [_RECORD.sub("", _PREFIX.sub("", ln)).strip() for ln in lines]
    plain = [ln for ln in plain if ln]
    for i, ln in enumerate(plain):
        if _EXCEPTION.match(ln):
            if "validation error" in ln and i + 1 < len(plain):
                ln += " " + plain[i + 1]
            elif ln.endswith(":"):  # "... Reasons:" and one reason a line
                more = []
                for nxt in plain[i + 1:i + 6]:
                    if _EXCEPTION.match(nxt) or nxt.startswith(("Traceback", "File ", "[")):
                        break
                    more.append(nxt)
                ln += " " + "; ".join(more)
            return ln[:limit]
    ours = [ln for ln in plain if ln.startswith("error:")]
    return (ours[0] if ours else plain[-1] if plain else "(no output)")[:limit]
