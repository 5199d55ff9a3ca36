import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One OpenMP thread in every process the tests start (compress runs, worker tasks, scripts) unless the test or the
# recipe sets its own: the suite runs one xdist worker per core and one more, often beside .ci/run's background run,
# and a torch process with 2 threads on 2 busy cores spins at every barrier. Measured here, 3,000 small matmuls beside
# two busy Python loops: 6.7 s with 1 thread, 17.6 s with 2, and the loops did 25-30 % less work.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One torch thread per test process: steady timings on a 2-core machine."""
    import torch

    torch.set_num_threads(1)
    yield


def pytest_xdist_auto_num_workers(config):
    """-n auto (pyproject.toml): one worker more than the cores ($PYTEST_XDIST_AUTO_NUM_WORKERS still decides). The
    suite is CPU-bound, but its tests also wait (servers starting, clusters joining, timeouts they assert): with one
    worker a core, /proc/stat showed both cores idle 5-23 % of each minute of a CI run; with a third worker, 0-2 %
    until the last minute."""
    from pipeline.base.env import cpu_count  # torch-free: the cores this process may run on

    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return cpu_count() + 1


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
