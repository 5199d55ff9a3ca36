"""`compress run` with a [publish] table against the loopback Hub: push, read back, load, same logits;
re-publish is a no-op (also with create_pr: the open PR is found); a failing gate pushes nothing; a dry
run prints the plan and sends nothing."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest_hub import FAKE_TOKEN, hub_env, hub_server  # noqa: F401
from tests.e2e.test_tiny_recipe import RECIPE, ROOT

EXPORTS = {"gptq-w4g32", "rtn-w4g32", "draft"}
LOCAL_ONLY = {"manifest.json", "metrics.json"}  # run-folder metadata, never uploaded
WRITES = {"preupload", "lfs_batch", "lfs_upload", "lfs_verify", "commit", "create_branch"}


def compress_run(run_root: Path, *sets: str):
    args = [sys.executable, "-m", "pipeline.app.cli", "run", str(RECIPE), "--set", f"run.output_dir={json.dumps(str(run_root))}"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                          timeout=900)


def to_hub(hub) -> tuple[str, str]:
    return "publish.org=tester", f"publish.endpoint={json.dumps(hub.url)}"


@pytest.fixture
def run_dir(tiny_run, tmp_path):
    """A copy of the finished tiny run (no [publish] table yet) under tmp_path/tiny."""
    dst = tmp_path / "tiny"
    shutil.copytree(tiny_run[0], dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def export_files(run_dir: Path, name: str) -> dict[str, bytes]:
    folder = run_dir / "export" / name
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in folder.rglob("*") if p.is_file() and p.name not in LOCAL_ONLY}


def assert_no_token(run_dir: Path, *outputs: str) -> None:
    for text in outputs:
        assert FAKE_TOKEN not in text
    for f in run_dir.rglob("*"):
        if f.is_file():
            assert FAKE_TOKEN.encode() not in f.read_bytes(), f


def test_run_publishes_verifies_and_the_download_loads(run_dir, hub_server, tmp_path):
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM

    p = compress_run(tmp_path, *to_hub(hub_server))
    assert p.returncode == 0, p.stderr[-4000:]
    stages = report(run_dir)["stages"]
    assert {s["status"] for s in stages.values()} == {"skipped"}, "adding [publish] reran a stage"
    section = report(run_dir)["publish"]
    items = {i["name"]: i for i in section["items"]}
    assert section["status"] == "pushed" and set(items) == EXPORTS
    for name, item in items.items():
        assert item["status"] == "pushed" and item["repo_id"] == f"tester/tiny-llama-{name}"
        assert item["commit_oid"] == hub_server.head(item["repo_id"])
        assert hub_server.commit_titles(item["repo_id"])[0].startswith(f"compress: {name} (ppl ")
        remote = hub_server.files(item["repo_id"])
        remote.pop(".gitattributes")
        assert remote == export_files(run_dir, name), f"{name}: the Hub holds exactly the export folder"
    pushed = json.loads((run_dir / "publish" / "pushed.json").read_text())
    assert pushed["complete"] is True and [i["name"] for i in pushed["items"]] == [i["name"] for i in section["items"]]

    # read back with huggingface_hub and load: the same logits as the local export
    local = tmp_path / "dl"
    snapshot_download(items["gptq-w4g32"]["repo_id"], endpoint=hub_server.url, local_dir=local)
    cfg = json.loads((local / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "gptq"
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        a = AutoModelForCausalLM.from_pretrained(local).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(run_dir / "export" / "gptq-w4g32").eval()(ids).logits
    assert torch.equal(a, b)

    # pushing the same run again: every item up to date, no commit, and no stage rerun (the model
    # cards, which embed the recipe lock, must not change between runs of the same recipe)
    heads = {name: hub_server.head(i["repo_id"]) for name, i in items.items()}
    writes = [r for r in hub_server.requests if r.kind in WRITES]
    p2 = compress_run(tmp_path, *to_hub(hub_server))
    assert p2.returncode == 0, p2.stderr[-4000:]
    again = {i["name"]: i for i in report(run_dir)["publish"]["items"]}
    assert {i["status"] for i in again.values()} == {"up to date"}
    assert {name: i["commit_oid"] for name, i in again.items()} == heads
    assert heads == {name: hub_server.head(i["repo_id"]) for name, i in items.items()}
    assert [r for r in hub_server.requests if r.kind in WRITES] == writes, "the re-push uploaded or committed"
    for name, item in items.items():
        assert f"{name}: {item['repo_id']}@main is up to date" in p2.stderr
    assert {s["status"] for s in report(run_dir)["stages"].values()} == {"skipped"}

    # the token is nowhere: not in either run's output, not in any file of the run folder
    assert_no_token(run_dir, p.stdout, p.stderr, p2.stdout, p2.stderr)


def test_create_pr_rerun_finds_its_open_pull_requests(run_dir, hub_server, tmp_path):
    p = compress_run(tmp_path, *to_hub(hub_server), "publish.create_pr=true")
    assert p.returncode == 0, p.stderr[-4000:]
    items = {i["name"]: i for i in report(run_dir)["publish"]["items"]}
    assert set(items) == EXPORTS
    for name, item in items.items():
        assert (item["status"], item["pr_num"]) == ("pull request", 1), name
        assert item["pr_url"] == f"{hub_server.url}/{item['repo_id']}/discussions/1"
        assert item["commit_oid"] == hub_server.head(item["repo_id"], "refs/pr/1")
        assert set(hub_server.files(item["repo_id"])) == {".gitattributes"}, "main stays as it was"
        assert f"{name}: opened pull request #1 {item['pr_url']}" in p.stderr

    # the scheduled rerun of the unchanged run: every folder's open PR is found up to date
    writes = [r for r in hub_server.requests if r.kind in WRITES]
    p2 = compress_run(tmp_path, *to_hub(hub_server), "publish.create_pr=true")
    assert p2.returncode == 0, p2.stderr[-4000:]
    again = {i["name"]: i for i in report(run_dir)["publish"]["items"]}
    assert {n: (i["status"], i["pr_num"], i["pr_url"], i["commit_oid"]) for n, i in again.items()} == \
        {n: ("up to date", 1, i["pr_url"], i["commit_oid"]) for n, i in items.items()}
    assert [r for r in hub_server.requests if r.kind in WRITES] == writes, "the re-push wrote to the Hub"
    assert {n: len(hub_server.pull_requests(i["repo_id"])) for n, i in items.items()} == dict.fromkeys(EXPORTS, 1)
    for name in EXPORTS:
        assert f"{name}: up to date (open pull request #1)" in p2.stderr
    assert {s["status"] for s in report(run_dir)["stages"].values()} == {"skipped"}
    assert_no_token(run_dir, p.stdout, p.stderr, p2.stdout, p2.stderr)


def test_failing_gate_pushes_nothing_and_exits_5(run_dir, hub_server, tmp_path):
    before = {name: export_files(run_dir, name) for name in EXPORTS}
    p = compress_run(tmp_path, *to_hub(hub_server), "validate.gates.max_ppl_ratio=0.5")
    assert p.returncode == 5, p.stderr[-3000:]
    assert hub_server.requests == [], "nothing is sent to the Hub, not even a read"
    assert hub_server.repos == {}
    section = report(run_dir)["publish"]
    assert section["status"] == "refused" and "gate(s) failed" in section["reason"]
    assert section["failed_gates"] and all(not g["passed"] for g in section["failed_gates"])
    assert "refusing to publish" in p.stderr
    assert not (run_dir / "publish" / "pushed.json").exists()
    # the cards show the gates, so changing them re-exported the cards (before publishing) and nothing else
    after = {name: export_files(run_dir, name) for name in EXPORTS}
    assert {n: {k: v for k, v in f.items() if k != "README.md"} for n, f in after.items()} == \
        {n: {k: v for k, v in f.items() if k != "README.md"} for n, f in before.items()}
    assert b"Gates: SOME FAILED" in after["gptq-w4g32"]["README.md"]
    assert report(run_dir)["stages"]["export/gptq-w4g32"]["status"] == "done"
    assert_no_token(run_dir, p.stdout, p.stderr)


def test_dry_run_prints_the_plan_and_touches_nothing(run_dir, hub_server, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")  # a dry run needs no token
    before = {name: export_files(run_dir, name) for name in EXPORTS}
    p = compress_run(tmp_path, *to_hub(hub_server), "publish.dry_run=true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert hub_server.requests == [] and hub_server.repos == {}
    assert {s["status"] for s in report(run_dir)["stages"].values()} == {"skipped"}
    section = report(run_dir)["publish"]
    assert section["status"] == "dry-run" and {i["name"] for i in section["items"]} == EXPORTS
    assert "publish dry run (nothing sent)" in p.stderr and "Publish plan: 3 model(s)" in p.stderr
    for name in EXPORTS:
        files = before[name]
        assert re.search(rf"- {re.escape(name)} \((variant|draft)\) -> {re.escape(hub_server.url)}/tester/"
                         rf"tiny-llama-{re.escape(name)} @ main: {len(files)} files, ", p.stderr), name
        for rel, data in files.items():
            assert re.search(rf"\n +{re.escape(rel)} +\S+ [KMG]?B +\({len(data)} bytes, sha256 ", p.stderr), (name, rel)
    assert not (run_dir / "publish").exists()
    assert {name: export_files(run_dir, name) for name in EXPORTS} == before
