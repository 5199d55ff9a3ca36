"""transformers' continuous-batching manager behind compress's own FastAPI app (pipeline/serve/app.py,
pipeline/serve/engine.py), in this process: every option applied, every route but /health behind the key, the
SIGTERM drain of pipeline/serve/drain.py (socket kept open, 503 to new requests). The serving is
pipeline/serve/work/transformers.py."""
from __future__ import annotations

import logging
from importlib.metadata import version

from pipeline.serve.engines.base import UNQUANTIZED, Engine

log = logging.getLogger("compress.serve")
HF_FORMATS = (UNQUANTIZED, "gptq", "awq", "bitsandbytes", "torchao", "compressed-tensors", "compressed-tensors-fp8")


class Transformers(Engine):
    name = "transformers"
    formats = {"cpu": HF_FORMATS, "cuda": HF_FORMATS}
    exact = True  # the same weights and kernels as generate: token for token
    reference = True  # report.md's "x transformers": the other engines' throughput over this one's
    work = "pipeline.serve.work.transformers"

    def version(self) -> dict[str, str]:
        return {"transformers": version("transformers")}


ENGINES = (Transformers,)
