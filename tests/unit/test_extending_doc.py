"""docs/extending.md names the files each extension touches: every file it names exists, and every templated one
(`pipeline/quant/methods/<name>.py`) has an existing example on its line that fits the template."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "extending.md"
# a backticked repository path: a top folder of ours, then a file with an extension
PATH = re.compile(r"`((?:pipeline|tests|docs|scripts|benchmarks|recipes)/[^`\s]*\.(?:py|md|toml))`")


def _template(path: str) -> re.Pattern:
    return re.compile("^" + re.escape(path).replace(re.escape("<name>"), r"[a-z0-9_]+") + "$")


def test_every_file_the_extending_doc_names_exists():
    text = DOC.read_text()
    sections = [s for s in re.split(r"^## ", text, flags=re.M)[1:]]
    assert [s.splitlines()[0] for s in sections] == ["A quantization method", "A serving engine", "A measurement",
                                                     "A gate"]
    named = 0
    for line in text.splitlines():
        paths = PATH.findall(line)
        concrete = [p for p in paths if "<" not in p]
        for p in concrete:
            assert (ROOT / p).is_file(), f"docs/extending.md names {p}, which does not exist"
            named += 1
        for p in (p for p in paths if "<name>" in p):
            examples = [c for c in concrete if _template(p).match(c)]
            assert examples, f"docs/extending.md: {p} has no existing example on its line: {line!r}"
    assert named >= 20


def test_each_extension_lists_its_registry_and_its_test():
    text = DOC.read_text()
    method, engine, measure, gate = re.split(r"^## ", text, flags=re.M)[1:]
    assert "`pipeline/quant/registry.py`" in method and "`pipeline/quant/work/<name>.py`" in method
    assert "`pipeline/serve/engines/__init__.py`" in engine and "`pipeline/serve/work/<name>.py`" in engine
    assert "`pipeline/base/worker.py`" in measure and "`pipeline/stages/kinds.py`" in measure
    assert "`pipeline/eval/config.py`" in gate and "`pipeline/results/gates.py`" in gate
    for section in (method, engine, measure, gate):
        assert "tests/unit/" in section and "`docs/recipe.md`" in section
