"""transformers' continuous-batching manager behind compress's own FastAPI app (pipeline/serve/app.py,
pipeline/serve/engine.py), in this process: every option applied, every route but /health behind the key, the
SIGTERM drain of pipeline/serve/drain.py (socket kept open, 503 to new requests)."""
from __future__ import annotations

import logging
import os
import socket
import sys
from importlib.metadata import version

from pipeline.serve import drain
from pipeline.serve.engines.base import UNQUANTIZED, Engine, ServeOptions

log = logging.getLogger("compress.serve")
HF_FORMATS = (UNQUANTIZED, "gptq", "awq", "bitsandbytes", "torchao", "compressed-tensors", "compressed-tensors-fp8")


class Transformers(Engine):
    name = "transformers"
    formats = {"cpu": HF_FORMATS, "cuda": HF_FORMATS}
    exact = True  # the same weights and kernels as generate: token for token

    def version(self) -> dict[str, str]:
        return {"transformers": version("transformers")}

    def serve(self, exp, sock: socket.socket, opts: ServeOptions) -> int:
        # late: the server and the model; `compress check` imports this engine's declarations
        import torch

        from pipeline.serve.app import build_app
        from pipeline.serve.engine import TransformersEngine

        if opts.threads:
            torch.set_num_threads(opts.threads)
        eng = TransformersEngine(exp.path, max_batch=opts.slots, max_len=opts.max_model_len, device=opts.device)
        eng.start()
        app = build_app(eng, exp.path.name, slots=opts.slots, max_queue=opts.max_queue,
                        queue_timeout_s=opts.queue_timeout_s, max_tokens_limit=opts.max_tokens_limit, api_key=opts.key)
        print(f"serving {exp.path.name} ({eng.name}) on http://{opts.host}:{opts.port}/v1  slots {opts.slots}, "
              f"queue {opts.max_queue}" + (", API key required" if opts.key else ""), file=sys.stderr, flush=True)
        try:
            drain.run(app, app.state.drain, sock, opts.drain_s)
        finally:
            stopped = eng.stop(timeout=max(1.0, opts.drain_s / 4))
        if not stopped:  # the generation thread did not end: leave without joining it (exit 0: the drain is done)
            sys.stderr.flush()
            os._exit(0)
        return 0


ENGINES = (Transformers,)
