"""GPTQModel's device thread pool ends the process with os._exit(1) when a task raises: inside our session the
failure is kept and raised on leaving, so the variant fails with its error line (exit 4) and report.json says so."""
import pytest

from pipeline.quant import gptqmodel_driver


def test_a_worker_thread_failure_is_raised_not_an_exit():
    from gptqmodel.utils.threadx import _DeviceWorker

    original = _DeviceWorker._abort_process
    with pytest.raises(RuntimeError, match="a GPTQModel worker thread failed: TypeError: forward\\(\\) missing"):
        with gptqmodel_driver.worker_failures_raised():
            _DeviceWorker._abort_process(object(), TypeError("forward() missing 1 required positional argument"))
    assert _DeviceWorker._abort_process is original, "GPTQModel's own behaviour is restored outside the session"


def test_nothing_is_raised_when_no_worker_failed():
    with gptqmodel_driver.worker_failures_raised():
        pass
