import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One torch thread per test process: steady timings on a 2-core machine."""
    import torch

    torch.set_num_threads(1)
    yield


def pytest_xdist_make_scheduler(config, log):
    """-n auto --dist loadfile (pyproject.toml): a module per worker, but for tests/schedule.py's SPLIT modules."""
    if config.getvalue("dist") == "loadfile":
        from tests.schedule import scheduler

        return scheduler(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
    if hasattr(config, "workerinput"):  # an xdist worker: its collection order is the controller's queue
        from tests.schedule import order

        order(items)
