"""The transformers engine's serving (pipeline/serve/engines/transformers.py): the continuous-batching engine
(pipeline/serve/engine.py) behind compress's own app (pipeline/serve/app.py), drained on SIGTERM."""
from __future__ import annotations

import os
import socket
import sys

import torch

from pipeline.serve import drain
from pipeline.serve.app import build_app
from pipeline.serve.engine import TransformersEngine
from pipeline.serve.engines.base import ServeOptions


def serve(exp, sock: socket.socket, opts: ServeOptions) -> int:
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
