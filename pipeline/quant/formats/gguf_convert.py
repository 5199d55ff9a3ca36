"""llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, its `conversion/` package and its `gguf-py`), taken
pinned out of the llama-cpp-python 0.3.36 sdist (the version the gguf-kquants extra builds) without building
llama.cpp: the sdist is fetched from the package index (with `pip download --no-deps --no-binary :all:` where the
index has no JSON file list), its sha256 checked, and only the converter's files are extracted into a cache.
method = "gguf" converts every architecture our port (pipeline/quant/formats/gguf_export.py: llama, qwen2) does not
handle through it.

    python -m pipeline.quant.formats.gguf_convert fetch [--sdist PATH]   # scripts/setup.sh runs this (idempotent)
    converter_dir()                   # the cached converter, or None when not fetched
    supported(hf_architecture)        # read from the converter's own TEXT_MODEL_MAP, with `ast` (no torch)
    run_converter(base_dir, out_file, "q8_0")   # a child process of this Python

The converter runs with the sdist's own gguf-py (it puts it on sys.path itself): the installed gguf 0.19 lacks
architectures the conversion package names (`gguf.MODEL_ARCH.DFLASH`: AttributeError at import). It needs torch,
numpy and sentencepiece (imported even for a tokenizer.json-only model). Torch-free at import: `compress check`
reads the architecture tables here.

The cache is ~/.cache/compress/llama.cpp-converter/<version>, or $COMPRESS_GGUF_CONVERTER_DIR/<version>.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from functools import cache
from pathlib import Path

from pipeline.base.fileio import sha256_file
from pipeline.model.architecture import model_class

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
# what is extracted (under _ROOT): the script, its model classes, the gguf package it imports, the licence
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "LICENSE")
SETUP_LINE = ".venv/bin/python -m pipeline.quant.formats.gguf_convert fetch  (scripts/setup.sh runs it)"
CONVERTER = f"llama.cpp's converter (llama-cpp-python {VERSION})"
# the converter's --outtype for each GGUF type it writes itself; others are made from its float output by
# llama.cpp's quantizer (llama_model_quantize)
OUTTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}
_STAMP = ".complete"  # written last: the sdist's sha256 and the tree's digest


def cache_dir() -> Path:
    env = os.environ.get("COMPRESS_GGUF_CONVERTER_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "compress" / "llama.cpp-converter") / VERSION


def converter_dir() -> Path | None:
    """The fetched converter (the folder holding convert_hf_to_gguf.py), or None when it is not set up."""
    d = cache_dir()
    return d if (d / _STAMP).is_file() and (d / "convert_hf_to_gguf.py").is_file() else None


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != _STAMP and "__pycache__" not in p.parts:
            h.update(f"{p.relative_to(root).as_posix()}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def verify(root: Path) -> None:
    """RuntimeError when the extracted files no longer hash to what the fetch recorded (edited after it)."""
    want = (root / _STAMP).read_text().split()
    if len(want) != 2 or want[0] != SDIST_SHA256 or _tree_digest(root) != want[1]:
        raise RuntimeError(f"{root}: the converter's files changed after the fetch; delete the folder and rerun: "
                           f"{SETUP_LINE}")


def _index_url() -> str:
    """The package index pip would ask first: $PIP_INDEX_URL, else pip's configured index-url, else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                         text=True)
    return got.stdout.strip() if got.returncode == 0 and got.stdout.strip() else "https://pypi.org/simple"


def _from_index(folder: Path) -> Path:
    """The sdist straight from the index's file list (PEP 691 JSON): `pip download` of an sdist first builds an
    isolated environment to read its metadata (40 s here, for a file that is then only unpacked)."""
    page = f"{_index_url().rstrip('/')}/{PACKAGE}/"
    req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    url = next(f["url"] for f in files if f["filename"] == SDIST)
    path = folder / SDIST
    with urllib.request.urlopen(urllib.parse.urljoin(page, url), timeout=300) as r, open(path, "wb") as out:
        shutil.copyfileobj(r, out, 1 << 20)
    return path


def _download(folder: Path) -> Path:
    """The sdist from the index (its sha256 is checked by the caller); `pip download` where the index does not
    answer in JSON (a file:// or HTML-only mirror), which pip's own configuration then reaches."""
    try:
        return _from_index(folder)
    except Exception as e:  # any failure of the shortcut: pip's own way, which reports its own error
        print(f"gguf_convert: {SDIST} not read from the index's JSON ({type(e).__name__}: {e}); pip download",
              file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"{PACKAGE}=={VERSION}", "-d", str(folder)], check=True)
    return folder / SDIST


def fetch(sdist: Path | None = None) -> Path:
    """Download the sdist (unless `sdist` is given), check its sha256, extract the converter's files into the cache
    (a temporary folder renamed into place). Idempotent: nothing is downloaded when the cache is complete."""
    dest = cache_dir()
    if converter_dir() is not None:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        path = sdist if sdist is not None else _download(Path(tmp))
        got = sha256_file(path)
        if got != SDIST_SHA256:
            raise RuntimeError(f"{path}: sha256 {got} is not the pinned {SDIST_SHA256}")
        part = Path(tmp) / "converter"
        with tarfile.open(path, "r:gz") as tar:
            for m in tar.getmembers():
                rel = m.name[len(_ROOT):] if m.name.startswith(_ROOT) else None
                if not (m.isfile() and rel and rel.startswith(_MEMBERS)) or ".." in Path(rel).parts:
                    continue
                target = part / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                target.write_bytes(src.read())
        (part / _STAMP).write_text(f"{SDIST_SHA256} {_tree_digest(part)}\n")
        if dest.exists():
            shutil.rmtree(dest)  # an incomplete earlier extraction (no stamp)
        part.replace(dest)
    return dest


# ---------------------------------------------------------------- what it converts (read with ast: no torch)


def _module_ast(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _dict_literal(path: Path, name: str) -> dict:
    """The literal value of the module-level `name = {...}` (or `name: ... = {...}`) in `path`."""
    for node in _module_ast(path).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == name and node.value is not None:  # type: ignore[attr-defined]
            value = node.value  # type: ignore[attr-defined]
            if isinstance(value, ast.Call) and value.args:  # OrderedDict([...])
                return dict(ast.literal_eval(value.args[0]))
            return dict(ast.literal_eval(value))
    raise LookupError(f"{path}: no {name}")


@cache
def text_model_map(root: Path) -> dict[str, str]:
    """{HF architecture (config.json's architectures[0]): conversion module} (conversion/__init__.py TEXT_MODEL_MAP,
    what the converter's get_model_class looks up)."""
    return _dict_literal(root / "conversion" / "__init__.py", "TEXT_MODEL_MAP")


@cache
def _classes(root: Path) -> dict[str, tuple[list[str], str | None, list[str]]]:
    """Every class of the conversion package: name -> (base names, its `model_arch = gguf.MODEL_ARCH.X` member X
    or None, the HF architectures its @ModelBase.register names)."""
    out: dict[str, tuple[list[str], str | None, list[str]]] = {}
    for path in sorted((root / "conversion").glob("*.py")):
        for node in _module_ast(path).body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                     if isinstance(b, ast.Name | ast.Attribute)]
            arch = next((a for a in map(_model_arch, node.body) if a is not None), None)
            names = [a.value for d in node.decorator_list if isinstance(d, ast.Call)
                     and isinstance(d.func, ast.Attribute) and d.func.attr == "register"
                     for a in d.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            out[node.name] = (bases, arch, names)
    return out


@cache
def pre_tokenizer_hashes(root: Path) -> dict[str, str]:
    """{chkhsh: tokenizer.ggml.pre name}: the converter's own table (TextModel.get_vocab_base_pre's
    `if chkhsh == "...": res = "..."` lines in conversion/base.py, generated by convert_hf_to_gguf_update.py)."""
    table: dict[str, str] = {}
    for node in ast.walk(_module_ast(root / "conversion" / "base.py")):
        if not (isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre"):
            continue
        for stmt in ast.walk(node):
            if not isinstance(stmt, ast.If):
                continue
            test = stmt.test
            if not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "chkhsh"
                    and isinstance(test.comparators[0], ast.Constant)):
                continue
            names = [a.value.value for a in stmt.body if isinstance(a, ast.Assign)
                     and isinstance(a.targets[0], ast.Name) and a.targets[0].id == "res"
                     and isinstance(a.value, ast.Constant)]
            if names:
                table[str(test.comparators[0].value)] = str(names[0])
    if not table:
        raise LookupError(f"{root}: no chkhsh table in get_vocab_base_pre")
    return table


def _model_arch(stmt: ast.stmt) -> str | None:
    """X of a class-body statement `model_arch = gguf.MODEL_ARCH.X`."""
    if isinstance(stmt, ast.Assign):
        targets, value = stmt.targets, stmt.value
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        targets, value = [stmt.target], stmt.value
    else:
        return None
    named = any(isinstance(t, ast.Name) and t.id == "model_arch" for t in targets)
    return value.attr if named and isinstance(value, ast.Attribute) else None


@cache
def _arch_names(root: Path) -> dict[str, str]:
    """gguf-py's MODEL_ARCH_NAMES: {MODEL_ARCH member: the general.architecture string written in the file}."""
    tree = _module_ast(root / "gguf-py" / "gguf" / "constants.py")
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == "MODEL_ARCH_NAMES" and isinstance(node.value, ast.Dict):
            return {k.attr: str(v.value) for k, v in zip(node.value.keys, node.value.values, strict=True)
                    if isinstance(k, ast.Attribute) and isinstance(v, ast.Constant)}
    raise LookupError("gguf-py constants.py: no MODEL_ARCH_NAMES")


@cache
def _set_vocab_bodies(root: Path) -> dict[str, list[ast.stmt]]:
    """Every conversion class's own set_vocab body: class name -> its statements."""
    out = {}
    for path in sorted((root / "conversion").glob("*.py")):
        for node in _module_ast(path).body:
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and f.name == "set_vocab":
                        out[node.name] = f.body
    return out


def needs_sentencepiece(root: Path, hf_arch: str) -> bool:
    """Whether the converter's class for `hf_arch` reads a SentencePiece tokenizer.model unconditionally: its
    set_vocab (its own or the nearest base's) calls self._set_vocab_sentencepiece() at its top level, or raises when
    tokenizer.model is missing. Read from the source (llama's set_vocab tries SentencePiece, then falls back: not
    unconditional)."""
    bodies = _set_vocab_bodies(root)
    first = next((name for name in _lineage(root, hf_arch) if name in bodies), None)
    return first is not None and any(_reads_sentencepiece(stmt) for stmt in bodies[first])


def _lineage(root: Path, hf_arch: str):
    """The converter's class registered for `hf_arch`, then its bases, nearest first (each once)."""
    classes = _classes(root)
    todo = [name for name, (_, _, regs) in classes.items() if hf_arch in regs]
    seen: set[str] = set()
    while todo:
        name = todo.pop(0)
        if name in seen or name not in classes:
            continue
        seen.add(name)
        yield name
        todo += classes[name][0]


def _reads_sentencepiece(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        return isinstance(f, ast.Attribute) and f.attr == "_set_vocab_sentencepiece"
    if isinstance(stmt, ast.If) and any(isinstance(s, ast.Raise) for s in stmt.body):
        return "tokenizer_path" in ast.unparse(stmt.test) and "is_file" in ast.unparse(stmt.test)
    return False


def llama_cpp_arch(root: Path, hf_arch: str) -> str | None:
    """The GGUF general.architecture the converter writes for `hf_arch` (its registered class's model_arch, inherited
    through the class's bases), or None when it is set at run time (not a class attribute)."""
    classes = _classes(root)
    arch = next((classes[name][1] for name in _lineage(root, hf_arch) if classes[name][1] is not None), None)
    return _arch_names(root).get(arch) if arch is not None else None


def hf_architecture(model_type: str, config: dict | None = None) -> str | None:
    """The HF architecture the converter keys on: config.json's architectures[0] when it names one (the baseline the
    load stage wrote does), else transformers' causal-LM class for the model_type (what the load stage builds)."""
    return model_class({**(config or {}), "model_type": model_type})


def supported(root: Path, hf_arch: str) -> bool:
    return hf_arch in text_model_map(root)


# transformers 5.24's load_gguf_checkpoint (modeling_gguf_pytorch_utils.py) renames these GGUF architectures before
# it looks them up in GGUF_CONFIG_MAPPING, and then names the model type as on the right
_TRANSFORMERS_RENAMES = {"qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss", "qwen3moe": "qwen3_moe",
                         "minimax-m2": "minimax_m2"}
_TRANSFORMERS_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}


@cache
def _transformers_gguf_archs() -> frozenset[str]:
    spec = importlib.util.find_spec("transformers")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "integrations" / "ggml.py"
    return frozenset(_dict_literal(path, "GGUF_CONFIG_MAPPING")) - {"general", "tokenizer"}


def transformers_model_type(gguf_arch: str) -> str | None:
    """The model_type transformers' GGUF loader rebuilds a file of this GGUF architecture as, or None when it cannot
    read the architecture at all."""
    arch = _TRANSFORMERS_RENAMES.get(gguf_arch, gguf_arch)
    if arch not in _transformers_gguf_archs():
        return None
    return _TRANSFORMERS_MODEL_TYPES.get(arch, arch)


# ---------------------------------------------------------------- running it


# run_converter's child when the pre-tokenizer is named by us: the converter's main, with get_vocab_base_pre
# answering that name where its hash table does not know the tokenizer (its NotImplementedError)
_FORCED_PRE = """
import runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[3:]]
sys.path.insert(0, root)
sys.path.insert(1, root + "/gguf-py")
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_converter(base_dir: Path, out_file: Path, outtype: str, timeout_s: float | None = None,
                  pre: str | None = None) -> str:
    """Run convert_hf_to_gguf.py on a checkpoint folder in a child process of this Python (with the sdist's gguf-py:
    NO_LOCAL_GGUF is cleared). `pre`: the tokenizer.ggml.pre name to write where the converter's hash table does
    not know the tokenizer (gguf_export.pre_tokenizer identified it by its split pattern). Returns its log;
    RuntimeError with the log's last lines when it fails."""
    root = converter_dir()
    if root is None:
        raise RuntimeError(f"{CONVERTER} is not set up: run {SETUP_LINE}")
    verify(root)
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    args = [str(base_dir), "--outtype", outtype, "--outfile", str(out_file)]
    cmd = ([sys.executable, "-c", _FORCED_PRE, str(root), pre, *args] if pre is not None
           else [sys.executable, str(root / "convert_hf_to_gguf.py"), *args])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    log = p.stdout + p.stderr
    if p.returncode != 0 or not out_file.is_file():
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-8:]
        raise RuntimeError(f"{CONVERTER} failed on {base_dir} (exit {p.returncode}){_hint(log)}:\n"
                           + "\n".join(tail))
    return log


def _hint(log: str) -> str:
    """One sentence for the failures a user can act on."""
    if "BPE pre-tokenizer was not recognized" in log:  # first: a class that tries SentencePiece first logs that too
        return ": the converter does not know this tokenizer's BPE pre-tokenizer (its get_vocab_base_pre table)"
    if "tokenizer.model" in log and ("FileNotFoundError" in log or "Missing" in log):
        return (": this architecture's converter class reads a SentencePiece tokenizer.model, and the checkpoint's "
                "tokenizer has none (only tokenizer.json); use the model's own tokenizer")
    return ""


def main(argv: list[str]) -> int:
    if argv[:1] != ["fetch"]:
        print("usage: python -m pipeline.quant.formats.gguf_convert fetch [--sdist PATH]", file=sys.stderr)
        return 2
    sdist = Path(argv[2]) if argv[1:2] == ["--sdist"] else None
    root = fetch(sdist)
    print(f"gguf_convert: {CONVERTER} in {root} ({len(text_model_map(root))} HF architectures)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
