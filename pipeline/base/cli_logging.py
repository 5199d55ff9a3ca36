"""One logging setup for the CLI and its worker processes: stage-tagged lines on stderr, quiet libraries.

The console speaks for compress: our logger ("compress") and anything without a library's name go to
stderr. Libraries' loggers and Python warnings (routed to logging, logger "py.warnings") stay off the
console unless --verbose: in the CLI process they are dropped below ERROR; in a worker they are written to
`library_log`, the worker's stdout, which pipeline.base.worker.run_child sends to the task's log file. Lines that
libraries print before any of this is set up are filtered where a worker's stderr is relayed
(pipeline.base.worker.HARMLESS_STDERR).
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import IO

FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"
LIBRARY_LOGGERS = ("transformers", "gptqmodel", "torchao", "accelerate", "datasets", "huggingface_hub", "urllib3",
                   "httpx", "filelock", "matplotlib", "PIL", "bitsandbytes", "optimum", "tokenicer", "logbar", "torch",
                   "torch.utils._pytree",  # torch resets its "torch" logger when imported, not this one
                   "py.warnings")


def setup_logging(verbose: bool = False, library_log: IO[str] | None = None) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format=FORMAT, datefmt=DATEFMT, force=True)
    logging.captureWarnings(True)  # warnings.warn -> logger "py.warnings", handled like a library's logger
    to_log = None
    if library_log is not None and not verbose:
        to_log = logging.StreamHandler(library_log)
        to_log.setFormatter(logging.Formatter(FORMAT, DATEFMT))
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if verbose:
            logger.setLevel(logging.DEBUG)
        elif to_log is not None:  # worker: kept, in the task's log
            logger.setLevel(logging.WARNING)
            logger.handlers = [to_log]  # torch installs its own stderr handler on import: replaced
            logger.propagate = False
        else:  # CLI process: only errors reach the console
            logger.setLevel(logging.ERROR)
    if not verbose:
        if library_log is None:
            warnings.filterwarnings("ignore")
        # transformers adds its own stderr handler when first imported; this keeps it to errors
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
