"""transformers' continuous-batching manager behind compress's own FastAPI app (pipeline/serve/app.py,
pipeline/serve/engine.py), in this process: every option applied, every route behind the key."""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from pipeline.serve.engines.base import UNQUANTIZED, Engine, ServeOptions

log = logging.getLogger("compress.serve")
HF_FORMATS = (UNQUANTIZED, "gptq", "awq", "bitsandbytes", "torchao", "compressed-tensors")


class Transformers(Engine):
    name = "transformers"
    formats = {"cpu": HF_FORMATS, "cuda": HF_FORMATS}
    exact = True  # the same weights and kernels as generate: token for token

    def version(self) -> dict[str, str]:
        from importlib.metadata import version

        return {"transformers": version("transformers")}

    def serve(self, exp, sock: socket.socket, opts: ServeOptions) -> int:
        import torch
        import uvicorn

        from pipeline.serve.app import build_app
        from pipeline.serve.engine import TransformersEngine

        if opts.threads:
            torch.set_num_threads(opts.threads)
        eng = TransformersEngine(exp.path, max_batch=opts.slots, max_len=opts.max_model_len, device=opts.device)
        eng.start()
        app = build_app(eng, exp.path.name, slots=opts.slots, max_queue=opts.max_queue,
                        queue_timeout_s=opts.queue_timeout_s, max_tokens_limit=opts.max_tokens_limit, api_key=opts.key)
        drain_s = opts.drain_s

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                if not app.state.draining:
                    log.warning("signal %s: draining in-flight requests for up to %g s", sig, drain_s)
                app.state.draining = True
                super().handle_exit(sig, frame)

        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_s, access_log=False,
                                timeout_keep_alive=5)
        server = _Server(config)
        print(f"serving {exp.path.name} ({eng.name}) on http://{opts.host}:{opts.port}/v1  slots {opts.slots}, "
              f"queue {opts.max_queue}" + (", API key required" if opts.key else ""), file=sys.stderr, flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            # uvicorn restores the handlers it found and re-raises the signal it drained on: a no-op here makes the
            # drained exit 0 (not -15); the stop after it is bounded by its own timeout
            signal.signal(sig, lambda *_: None)
        try:
            server.run(sockets=[sock])
        finally:
            stopped = eng.stop(timeout=max(1.0, drain_s / 4))
        if not stopped:  # the generation thread did not end: leave without joining it (exit 0: the drain is done)
            sys.stderr.flush()
            os._exit(0)
        return 0


ENGINES = (Transformers,)
