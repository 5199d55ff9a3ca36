"""Publish stage against the loopback Hub (tests/hubserver.py): no network, real huggingface_hub."""
from __future__ import annotations

import json
import logging
import re
import shutil
import traceback
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from pipeline.base.errors import CompressError, PublishError
from pipeline.publish.config import TOKEN_MESSAGE, PublishConfig
from pipeline.publish.hub import plan, publish_run, render_dry_run
from pipeline.publish.plan import PublishRefused
from tests.conftest_hub import FAKE_TOKEN, hub_env, hub_server  # noqa: F401  (fixtures)
from tests.publish_fixtures import EXPORTS, build_run, set_gate, write_manifest

torch.set_num_threads(1)
MODEL = "SmolLM2-135M-Instruct"
IDS = torch.tensor([[1, 5, 9, 13, 40, 2]])
WRITES = {"preupload", "lfs_batch", "lfs_upload", "lfs_verify", "commit", "create_branch"}


def repo(variant: str) -> str:
    return f"acme/{MODEL}-{variant}"


def manifest_files(run_dir, name: str) -> set[str]:
    outputs = json.loads((run_dir / "export" / name / "manifest.json").read_text())["outputs"]
    return set(outputs) - {"metrics.json"}  # run-folder metadata is never uploaded


def logits(path, **kwargs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()(IDS).logits


@pytest.fixture(scope="module")
def template_run(tmp_path_factory):
    return build_run(tmp_path_factory.mktemp("template"))


@pytest.fixture
def run_dir(template_run, tmp_path):
    dst = tmp_path / "artifacts" / template_run.name
    shutil.copytree(template_run, dst)
    return dst


@pytest.fixture
def log():
    return logging.getLogger("test.publish")


def cfg(hub, **kwargs) -> PublishConfig:
    return PublishConfig(org="acme", endpoint=hub.url, **kwargs)


def record(run_dir) -> dict | None:
    path = run_dir / "publish" / "pushed.json"
    return json.loads(path.read_text()) if path.exists() else None


def writes(hub) -> list:
    """Requests that upload, commit or create a branch (create_repo with exist_ok only probes)."""
    return [r for r in hub.requests if r.kind in WRITES]


def change_export(run_dir, name: str) -> None:
    """Change one file of an export folder, and its manifest as a re-export would."""
    folder = run_dir / "export" / name
    config = json.loads((folder / "config.json").read_text())
    config["compress_test_revision"] = config.get("compress_test_revision", 0) + 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    kind, verifier = EXPORTS[name][:2]
    write_manifest(folder, kind, verifier)


# ---------------------------------------------------------------- push and read back


def test_round_trip_download_loads_same_logits(run_dir, hub_server, log, tmp_path):
    from huggingface_hub import HfApi, snapshot_download

    section = publish_run(run_dir, cfg(hub_server), log)
    items = {i["name"]: i for i in section.items}
    assert section.status == "pushed" and set(items) == {"w8", "w4g64", "draft"}
    assert {i["status"] for i in items.values()} == {"pushed"}
    w8 = items["w8"]
    assert w8["commit_oid"] == hub_server.head(repo("w8"))
    assert hub_server.commit_titles(repo("w8"))[0] == "compress: w8 (ppl 10.100, x1.0100 baseline)"
    assert {f["path"] for f in w8["files"] if f["lfs"]} == {"model.safetensors"}
    assert record(run_dir)["complete"] and len(record(run_dir)["items"]) == 3

    snap = snapshot_download(repo("w8"), revision=w8["commit_oid"], endpoint=hub_server.url,
                             cache_dir=tmp_path / "download")
    downloaded = {p.relative_to(snap).as_posix() for p in Path(snap).rglob("*") if p.is_file()}
    assert downloaded == manifest_files(run_dir, "w8") | {".gitattributes"}
    assert torch.equal(logits(snap), logits(run_dir / "export" / "w8"))

    # the sharded, "quantized" variant: config keeps quantization_config, card metadata intact
    w4 = hub_server.files(repo("w4g64"))
    assert json.loads(w4["config.json"])["quantization_config"]["bits"] == 4
    assert {p for p in w4 if p.endswith(".safetensors")} == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    card = HfApi(endpoint=hub_server.url).model_info(repo("w4g64")).card_data
    assert card["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card["base_model_relation"] == "quantized"


def test_repush_is_up_to_date_and_creates_no_commit(run_dir, hub_server, log):
    first = publish_run(run_dir, cfg(hub_server), log)
    heads = {r: hub_server.head(r) for r in hub_server.repos}
    writes = [r for r in hub_server.requests if r.method in ("POST", "PUT")]
    second = publish_run(run_dir, cfg(hub_server), log)
    assert [i["status"] for i in second.items] == ["up to date"] * 3
    assert [i["commit_oid"] for i in second.items] == [i["commit_oid"] for i in first.items]
    assert {r: hub_server.head(r) for r in hub_server.repos} == heads
    new_writes = [r for r in hub_server.requests if r.method in ("POST", "PUT")][len(writes):]
    assert {r.kind for r in new_writes} == {"create_repo"}  # exist_ok probe only: no upload, no commit
    assert record(run_dir)["complete"]


@pytest.mark.parametrize("kind, after", [("lfs_upload", 1), ("commit", 0)])
def test_interrupted_push_claims_nothing_and_rerun_finishes(run_dir, hub_server, log, kind, after):
    config = cfg(hub_server, include=["w4g64"])  # three LFS shards
    (run_dir / "publish").mkdir()
    (run_dir / "publish" / "pushed.json").write_text('{"complete": true, "items": []}')  # an old push
    hub_server.fail_next(kind, after=after)
    with pytest.raises(PublishError, match="injected failure"):
        publish_run(run_dir, config, log)
    target = repo("w4g64")
    assert set(hub_server.files(target)) == {".gitattributes"}  # the commit is atomic: nothing landed
    assert record(run_dir) is None  # and nothing local claims a push
    stored = len(hub_server.repos[target].lfs)
    uploads = len(hub_server.requests_of("lfs_upload"))

    section = publish_run(run_dir, config, log)
    assert section.items[0]["status"] == "pushed"
    assert set(hub_server.files(target)) == manifest_files(run_dir, "w4g64") | {".gitattributes"}
    assert len(hub_server.requests_of("lfs_upload")) - uploads == 3 - stored  # only the missing shards
    assert record(run_dir)["complete"]


def test_read_back_catches_a_file_the_hub_dropped(run_dir, hub_server, log):
    hub_server.drop_on_next_commit = {"tokenizer.json"}
    with pytest.raises(PublishError, match=r"read-back .* missing or different \['tokenizer.json'\]"):
        publish_run(run_dir, cfg(hub_server, include=["w8"]), log)
    assert record(run_dir) is None
    assert publish_run(run_dir, cfg(hub_server, include=["w8"]), log).items[0]["status"] == "pushed"
    assert "tokenizer.json" in hub_server.files(repo("w8"))


def test_stale_remote_files_are_deleted(run_dir, hub_server, log):
    from huggingface_hub import HfApi

    publish_run(run_dir, cfg(hub_server, include=["w8"]), log)
    HfApi(endpoint=hub_server.url, token=FAKE_TOKEN).upload_file(
        path_or_fileobj=b"old shard", path_in_repo="old/model-00001.safetensors", repo_id=repo("w8"))
    section = publish_run(run_dir, cfg(hub_server, include=["w8"]), log)
    assert section.items[0]["status"] == "pushed"
    assert set(hub_server.files(repo("w8"))) == manifest_files(run_dir, "w8") | {".gitattributes"}


# ---------------------------------------------------------------- the gate rule


def test_failing_gate_pushes_nothing(run_dir, hub_server, log):
    set_gate(run_dir, "w4g64", passed=False)
    with pytest.raises(PublishRefused, match=r"w4g64/max_ppl_ratio .*--partial") as refused:
        publish_run(run_dir, cfg(hub_server), log)
    assert refused.value.exit_code == 6
    assert refused.value.section.failed_gates[0]["model"] == "w4g64"
    assert hub_server.requests == [] and record(run_dir) is None


def edit_report(run_dir, fn) -> None:
    path = run_dir / "report.json"
    report = json.loads(path.read_text())
    fn(report)
    path.write_text(json.dumps(report, indent=2))


def test_a_warn_only_gate_that_did_not_pass_never_blocks(run_dir, hub_server, log):
    def warn(report):
        for g in report["gates"]:
            if g["model"] == "draft":
                g.update(passed=False, severity="warn", value=0.8)
    edit_report(run_dir, warn)
    section = publish_run(run_dir, cfg(hub_server, dry_run=True), log)
    assert [i["name"] for i in section.items] == ["w4g64", "w8", "draft"] and section.skipped == {}


@pytest.mark.parametrize("status", ["running", "interrupted", "failed"])
def test_a_run_that_did_not_finish_publishes_nothing(run_dir, hub_server, log, status):
    edit_report(run_dir, lambda r: r["run"].update(status=status, error="boom" if status == "failed" else None))
    with pytest.raises(PublishRefused, match=f"did not finish \\(status {status}"):
        publish_run(run_dir, cfg(hub_server, partial=True, dry_run=True), log)
    assert hub_server.requests == []


def test_gates_not_evaluated_publishes_nothing(run_dir, hub_server, log):
    edit_report(run_dir, lambda r: r["run"].update(gates_evaluated=False))
    with pytest.raises(PublishRefused, match="did not finish"):
        publish_run(run_dir, cfg(hub_server, dry_run=True), log)


def test_a_report_from_another_run_than_the_lock_publishes_nothing(run_dir, hub_server, log):
    (run_dir / "recipe.lock.toml").write_text('[lock]\nrun_id = "a-later-run"\n')
    with pytest.raises(PublishRefused, match="do not come from the same run"):
        publish_run(run_dir, cfg(hub_server, dry_run=True), log)


def test_an_export_folder_the_report_does_not_list_is_never_planned(run_dir, hub_server, log):
    stale = run_dir / "export" / "w3-renamed-away"
    shutil.copytree(run_dir / "export" / "w8", stale)
    edit_report(run_dir, lambda r: None)
    section = publish_run(run_dir, cfg(hub_server, dry_run=True), log)
    assert "w3-renamed-away" not in {i["name"] for i in section.items} | set(section.skipped)
    with pytest.raises(PublishError, match=r"include names \['w3-renamed-away'\], not exports of this run"):
        publish_run(run_dir, cfg(hub_server, dry_run=True, include=["w3-renamed-away"]), log)


def test_an_export_rewritten_since_the_report_is_refused(run_dir, hub_server, log):
    from tests.publish_fixtures import RUN_ID

    folder = run_dir / "export" / "w8"
    (folder / "config.json").write_text("{}")
    manifest = json.loads((folder / "manifest.json").read_text())
    from pipeline.app.runner import canonical_hash, hash_outputs

    manifest["outputs"] = hash_outputs(folder)  # a consistent folder + manifest the report never saw
    manifest["outputs_hash"], manifest["run_id"] = canonical_hash(manifest["outputs"]), RUN_ID
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PublishError, match="is not the export this run's report lists"):
        publish_run(run_dir, cfg(hub_server, dry_run=True), log)
    assert hub_server.requests == []


def test_new_repos_are_private_unless_the_recipe_says_otherwise(run_dir, hub_server, log):
    assert PublishConfig(org="acme").private is True
    publish_run(run_dir, cfg(hub_server, include=["w8"]), log)
    assert hub_server.repos[repo("w8")].private


@pytest.mark.parametrize("url", ["http://hub.example.com", "http://10.0.0.5:8080"])
def test_plain_http_to_another_machine_is_refused(url, monkeypatch, run_dir, log):
    with pytest.raises(ValidationError, match="plain http to another machine"):
        PublishConfig(org="acme", endpoint=url)
    monkeypatch.setenv("HF_ENDPOINT", url)
    with pytest.raises(PublishError, match="HF_ENDPOINT .* plain http"):
        publish_run(run_dir, PublishConfig(org="acme", dry_run=True), log)


def test_a_branches_layout_survives_the_lock_round_trip():
    """The lock stores the resolved recipe; `compress push` re-validates it (revision = 'main' included)."""
    config = PublishConfig(org="acme", layout="branches", repo_id="{org}/{model}-all")
    again = PublishConfig.model_validate(config.model_dump())
    assert again.layout == "branches" and again.revision == "main"


def test_partial_pushes_passing_variants_and_draft_only_with_its_verifier(run_dir, hub_server, log):
    set_gate(run_dir, "w4g64", passed=False)
    section = publish_run(run_dir, cfg(hub_server, partial=True), log)
    assert [i["name"] for i in section.items] == ["w8"]
    assert section.skipped["w4g64"].startswith("gate failed: w4g64/max_ppl_ratio")
    assert "verifier 'w4g64' is not being pushed" in section.skipped["draft"]
    assert set(hub_server.repos) == {repo("w8")}


def test_partial_skips_a_draft_whose_own_gate_failed(run_dir, hub_server, log):
    set_gate(run_dir, "draft", passed=False)
    section = publish_run(run_dir, cfg(hub_server, partial=True, include=["w4g64", "draft"]), log)
    assert [i["name"] for i in section.items] == ["w4g64"]
    assert section.skipped["draft"].startswith("gate failed")
    assert set(hub_server.repos) == {repo("w4g64")}


def test_draft_without_its_verifier_is_an_error_unless_partial(run_dir, hub_server, log):
    with pytest.raises(PublishError, match="cannot push draft 'draft'.*include its verifier"):
        publish_run(run_dir, cfg(hub_server, include=["draft"]), log)
    assert hub_server.requests == []


# ---------------------------------------------------------------- layouts and options


def test_branches_layout_with_draft_in_its_verifiers_folder(run_dir, hub_server, log, tmp_path):
    from huggingface_hub import HfApi, snapshot_download

    config = cfg(hub_server, layout="branches", repo_id="{org}/{model}-compressed",
                 main_variant="w8", draft="folder")
    section = publish_run(run_dir, config, log)
    target = f"acme/{MODEL}-compressed"
    assert set(hub_server.repos) == {target}
    where = {i["name"]: (i["revision"], i["path_in_repo"]) for i in section.items}
    assert where == {"w8": ("main", ""), "w4g64": ("w4g64", ""), "draft": ("w4g64", "draft")}
    refs = HfApi(endpoint=hub_server.url).list_repo_refs(target)
    assert {b.name for b in refs.branches} == {"main", "w4g64"}
    assert set(hub_server.files(target, "main")) == manifest_files(run_dir, "w8") | {".gitattributes"}
    assert set(hub_server.files(target, "w4g64")) == (manifest_files(run_dir, "w4g64") | {".gitattributes"}
                                                     | {f"draft/{f}" for f in manifest_files(run_dir, "draft")})
    snap = snapshot_download(target, revision="w4g64", endpoint=hub_server.url, cache_dir=tmp_path / "dl")
    assert torch.equal(logits(snap, subfolder="draft"), logits(run_dir / "export" / "draft"))
    again = publish_run(run_dir, config, log)  # the verifier's push must not delete draft/
    assert [i["status"] for i in again.items] == ["up to date"] * 3


def test_create_pr_leaves_main_alone(run_dir, hub_server, log):
    section = publish_run(run_dir, cfg(hub_server, include=["w8"], create_pr=True), log)
    item = section.items[0]
    assert item["status"] == "pull request" and item["pr_url"].endswith("/discussions/1")
    assert set(hub_server.files(repo("w8"))) == {".gitattributes"}
    assert set(hub_server.files(repo("w8"), "refs/pr/1")) == manifest_files(run_dir, "w8") | {".gitattributes"}


def test_create_pr_rerun_reuses_its_open_pull_request(run_dir, hub_server, log, caplog):
    caplog.set_level(logging.INFO)
    config, target = cfg(hub_server, include=["w8"], create_pr=True), repo("w8")
    first = publish_run(run_dir, config, log).items[0]
    assert (first["status"], first["pr_num"]) == ("pull request", 1)
    assert first["pr_url"] == f"{hub_server.url}/{target}/discussions/1"
    assert first["commit_oid"] == hub_server.head(target, "refs/pr/1")
    main = hub_server.head(target)

    # unchanged: the open PR #1 already holds the folder; nothing is written, no PR is opened
    before = len(hub_server.requests)
    second = publish_run(run_dir, config, log)
    item = second.items[0]
    assert (item["status"], item["pr_num"], item["pr_url"]) == ("up to date", 1, first["pr_url"])
    assert item["commit_oid"] == first["commit_oid"]
    assert [r for r in hub_server.requests[before:] if r.kind in WRITES] == []
    assert len(hub_server.pull_requests(target)) == 1 and hub_server.head(target) == main
    assert "w8: up to date (open pull request #1)" in caplog.text
    assert record(run_dir)["items"][0]["pr_num"] == 1  # and the report's publish section:
    assert second.items[0]["pr_url"].endswith("/discussions/1")

    # one file changed: exactly one new commit, onto PR #1; main and the PR count untouched
    change_export(run_dir, "w8")
    commits = len(hub_server.requests_of("commit"))
    third = publish_run(run_dir, config, log).items[0]
    assert (third["status"], third["pr_num"]) == ("pull request updated", 1)
    assert len(hub_server.requests_of("commit")) == commits + 1
    assert [pr.num for pr in hub_server.pull_requests(target)] == [1]
    assert third["commit_oid"] == hub_server.head(target, "refs/pr/1") != first["commit_oid"]
    assert hub_server.repos[target].history("refs/pr/1")[1].oid == first["commit_oid"]
    assert json.loads(hub_server.files(target, "refs/pr/1")["config.json"])["compress_test_revision"] == 1
    assert hub_server.head(target) == main
    assert "w8: updated pull request #1" in caplog.text

    # and unchanged again: up to date with PR #1 at its new head
    before = len(hub_server.requests)
    fourth = publish_run(run_dir, config, log).items[0]
    assert (fourth["status"], fourth["pr_num"], fourth["commit_oid"]) == ("up to date", 1, third["commit_oid"])
    assert [r for r in hub_server.requests[before:] if r.kind in WRITES] == []


def test_create_pr_never_writes_to_a_closed_or_foreign_pull_request(run_dir, hub_server, log):
    config, target = cfg(hub_server, include=["w8"], create_pr=True), repo("w8")
    publish_run(run_dir, config, log)
    hub_server.pull_requests(target)[0].status = "closed"  # a maintainer closed PR #1
    second = publish_run(run_dir, config, log).items[0]
    assert (second["status"], second["pr_num"]) == ("pull request", 2)
    heads = {n: hub_server.head(target, f"refs/pr/{n}") for n in (1, 2)}
    hub_server.pull_requests(target)[1].author = "someone-else"  # PR #2 is not the token user's
    change_export(run_dir, "w8")
    third = publish_run(run_dir, config, log).items[0]
    assert (third["status"], third["pr_num"]) == ("pull request", 3)
    assert {n: hub_server.head(target, f"refs/pr/{n}") for n in (1, 2)} == heads
    assert [pr.num for pr in hub_server.pull_requests(target) if pr.is_open] == [2, 3]


def test_create_pr_recognises_an_unmarked_pull_request_of_an_older_push(run_dir, hub_server, log):
    from huggingface_hub import HfApi

    config, target = cfg(hub_server, include=["w8"], create_pr=True, private=False), repo("w8")
    api = HfApi(endpoint=hub_server.url, token=FAKE_TOKEN)
    api.create_repo(target)  # public, as an older push left it
    api.upload_folder(repo_id=target, folder_path=run_dir / "export" / "w8", create_pr=True,
                      ignore_patterns=["manifest.json", "metrics.json"],
                      commit_message=plan(run_dir, config).items[0].commit_message)
    before = len(hub_server.requests)
    item = publish_run(run_dir, config, log).items[0]
    assert (item["status"], item["pr_num"]) == ("up to date", 1)
    assert [r for r in hub_server.requests[before:] if r.kind in WRITES] == []
    change_export(run_dir, "w8")  # an unmarked PR only counts when it already holds the folder
    item = publish_run(run_dir, config, log).items[0]
    assert (item["status"], item["pr_num"]) == ("pull request", 2)
    assert len(hub_server.repos[target].history("refs/pr/1")) == 2  # PR #1 untouched


def test_create_pr_with_branches_layout_keeps_one_pull_request_per_folder(run_dir, hub_server, log):
    config = cfg(hub_server, layout="branches", repo_id="{org}/{model}-compressed", main_variant="w8",
                 draft="folder", create_pr=True)
    target = f"acme/{MODEL}-compressed"
    first = {i["name"]: i for i in publish_run(run_dir, config, log).items}
    assert {n: (i["status"], i["pr_num"]) for n, i in first.items()} == {
        "w4g64": ("pull request", 1), "w8": ("pull request", 2), "draft": ("pull request", 3)}
    assert [pr.base for pr in hub_server.pull_requests(target)] == ["w4g64", "main", "w4g64"]
    commits = len(hub_server.requests_of("commit"))
    again = {i["name"]: i for i in publish_run(run_dir, config, log).items}
    assert {n: (i["status"], i["pr_num"]) for n, i in again.items()} == {
        "w4g64": ("up to date", 1), "w8": ("up to date", 2), "draft": ("up to date", 3)}
    assert len(hub_server.requests_of("commit")) == commits and len(hub_server.pull_requests(target)) == 3
    change_export(run_dir, "draft")  # only the draft's PR gets a commit
    third = {i["name"]: i for i in publish_run(run_dir, config, log).items}
    assert {n: i["status"] for n, i in third.items()} == {
        "w8": "up to date", "w4g64": "up to date", "draft": "pull request updated"}
    assert third["draft"]["pr_num"] == 3 and len(hub_server.requests_of("commit")) == commits + 1


def test_private_repo_and_refusal_to_push_private_work_into_a_public_repo(run_dir, hub_server, log):
    from huggingface_hub import HfApi

    publish_run(run_dir, cfg(hub_server, include=["w8"], private=True), log)
    assert hub_server.repos[repo("w8")].private
    HfApi(endpoint=hub_server.url, token=FAKE_TOKEN).create_repo(repo("w4g64"), private=False)
    with pytest.raises(PublishError, match="is public, but \\[publish\\].private = true"):
        publish_run(run_dir, cfg(hub_server, include=["w4g64"], private=True), log)
    assert [r for r in hub_server.requests_of("commit") if "w4g64" in r.path] == []


def test_dry_run_sends_nothing_and_writes_nothing(run_dir, hub_server, log, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")  # a dry run needs no token
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    config = cfg(hub_server, dry_run=True)
    section = publish_run(run_dir, config, log)
    assert hub_server.requests == []
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert section.status == "dry-run" and len(section.items) == 3
    text = render_dry_run(plan(run_dir, config), hub_server.url)
    assert f"{hub_server.url}/{repo('w4g64')} @ main: 9 files" in text
    shard = run_dir / "export" / "w4g64" / "model-00001-of-00003.safetensors"
    assert re.search(rf"model-00001-of-00003.safetensors +\S+ KB +\({shard.stat().st_size} bytes", text)


def test_token_never_leaks(run_dir, hub_server, log, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    hub_server.echo_auth = True  # a misbehaving server puts our Authorization header in its error
    hub_server.fail_next("commit", message="rejected")
    with pytest.raises(PublishError) as failed:
        publish_run(run_dir, cfg(hub_server, include=["w8"]), log)
    shown = "".join(traceback.format_exception(failed.value))
    assert "rejected" in shown and "Bearer <token>" in shown and FAKE_TOKEN not in shown
    assert failed.value.__context__ is None and failed.value.__cause__ is None
    publish_run(run_dir, cfg(hub_server), log)
    assert all(r.authorized for r in hub_server.requests_of("commit"))  # the token was really used
    out = capsys.readouterr()
    assert FAKE_TOKEN not in out.out + out.err + caplog.text
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and FAKE_TOKEN.encode() in p.read_bytes()]
    assert leaked == []


def test_no_token_is_a_clear_error(run_dir, hub_server, log, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(PublishError, match="no Hugging Face token: set HF_TOKEN"):
        publish_run(run_dir, cfg(hub_server), log)
    assert hub_server.requests == []


# ---------------------------------------------------------------- inputs


def test_changed_export_file_is_refused_before_any_request(run_dir, hub_server, log):
    (run_dir / "export" / "w8" / "config.json").write_text("{}")
    with pytest.raises(PublishError, match=r"export 'w8' .*config.json changed since export"):
        publish_run(run_dir, cfg(hub_server), log)
    assert hub_server.requests == []


@pytest.mark.parametrize("drop, message", [
    ("run", "report.json: run: Field required"),
    ("baseline", "report.json has no perplexity for 'w4g64' (or for the baseline)"),
])
def test_missing_report_key_is_named(run_dir, hub_server, log, drop, message):
    report = json.loads((run_dir / "report.json").read_text())
    del report[drop]
    (run_dir / "report.json").write_text(json.dumps(report))
    with pytest.raises(CompressError, match=re.escape(message)):
        publish_run(run_dir, cfg(hub_server), log)
    assert hub_server.requests == []


@pytest.mark.parametrize("key", ["token", "hf_token", "auth", "api_token"])
def test_token_key_in_publish_config_is_rejected(key):
    with pytest.raises(ValidationError, match=re.escape(TOKEN_MESSAGE)) as err:
        PublishConfig(org="acme", **{key: "hf_SECRETfromArecipe123"})
    assert "hf_SECRETfromArecipe123" not in str(err.value)


@pytest.mark.parametrize("fields, message", [
    ({"layout": "branches"}, "must not contain {variant}"),
    ({"repo_id": "{org}/{model}"}, "needs {variant} in repo_id"),
    ({"repo_id": "{org}/{modle}-{variant}"}, "unknown placeholder(s) ['modle']"),
    ({"commit_message": "{variant} {loss}"}, "unknown placeholder(s) ['loss']"),
    ({"main_variant": "w8"}, "main_variant only applies to layout = 'branches'"),
    ({"layout": "branches", "repo_id": "{org}/x", "revision": "dev"}, "revision does not apply"),
    ({"endpoint": "https://user:pw@hub.example"}, "must not carry credentials"),
    ({"include": []}, "would push nothing"),
])
def test_publish_config_rules(fields, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        PublishConfig(org="acme", **fields)
