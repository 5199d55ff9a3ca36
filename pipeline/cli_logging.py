"""One logging setup for the CLI and its worker processes: stage-tagged lines on stderr, quiet libraries."""
from __future__ import annotations

import logging
import os
import warnings


def setup_logging(verbose: bool = False) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        force=True)
    for noisy in ("transformers", "gptqmodel", "torchao", "accelerate", "datasets", "huggingface_hub", "urllib3",
                  "httpx", "filelock", "matplotlib", "PIL", "bitsandbytes", "torch.utils._pytree", "optimum", "tokenicer", "logbar", "torch"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.ERROR)
    if not verbose:
        warnings.filterwarnings("ignore")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
