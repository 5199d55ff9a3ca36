"""No plug-in is special-cased by name (issue #43): 0 serving-engine-name branches outside pipeline/serve/engines/ and
0 quantization-method-name branches outside pipeline/quant/methods/ and pipeline/quant/work/. What an engine or a
method does differently it declares (pipeline/serve/engines/base.py Engine, pipeline/quant/method.py QuantMethod),
and the code asks the declaration. Read from the source with ast, over pipeline/ (benchmarks and research are
tools that compare engines by name on purpose).

Counted as an engine-name branch: a comparison (==, !=, in, not in) with a registered engine's name (a string, or a
tuple/list/set holding one), a dict literal keyed by two or more engine names (a lookup by engine), a `Literal[...]`
of two or more engine names (a choice of engines written out instead of built from the registry). Counted as a
method-name branch: a comparison with a registered method's name whose other side is a method field (`x.method`,
`x["method"]`, `x.get("method")`, a variable named `method`). "gptq", "awq" and "gguf" are also checkpoint formats,
which engines and export code compare as declared data: a comparison with `checkpoint_format` or `format` is not a
method's name.
"""
from __future__ import annotations

import ast
from pathlib import Path

from pipeline.base.codehash import PACKAGE_DIR
from pipeline.quant.registry import METHODS
from pipeline.serve import engines

ENGINE_HOME = ("serve/engines/",)
METHOD_HOME = ("quant/methods/", "quant/work/")


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _method_field(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "method"
    if isinstance(node, ast.Name):
        return node.id in ("method", "method_name")
    if isinstance(node, ast.Subscript):
        return _strings(node.slice) == {"method"}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return _strings(node.args[0]) == {"method"}
    return False


def branches(source: str, engine_names: set[str], method_names: set[str], *, engines_home: bool = False,
             methods_home: bool = False) -> list[tuple[str, int, str]]:
    """(kind, line, code) of every engine- and method-name branch in one module's source."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if not engines_home and any(_strings(s) & engine_names for s in sides):
                out.append(("engine", node.lineno, ast.unparse(node)))
            if not methods_home and any(_strings(s) & method_names for s in sides) and any(map(_method_field, sides)):
                out.append(("method", node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Dict) and not engines_home:
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if len(keys & engine_names) >= 2:
                out.append(("engine", node.lineno, "{" + ", ".join(sorted(keys & engine_names)) + ": ...}"))
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal"
              and not engines_home and len(_strings(node.slice) & engine_names) >= 2):
            out.append(("engine", node.lineno, ast.unparse(node)))
    return sorted(out, key=lambda b: b[1])


def test_the_counter_finds_what_it_counts():
    e, m = {"vllm", "llama.cpp", "transformers"}, {"gguf", "gptq"}
    src = """
if engine == "vllm": pass
x = a if _engine(s) != "transformers" else b
y = engine in ("llama.cpp", "other")
LABELS = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}
Choice = Literal["auto", "transformers", "vllm"]
if e.method == "gguf": pass
if p.get("method") in ("gptq", "awq"): pass
if method != "gptq": pass
ok = fmt == "gguf" or variant.format != "gptq" or {"transformers": version}
"""
    found = branches(src, e, m)
    assert [k for k, *_ in found] == ["engine"] * 5 + ["method"] * 3, found
    assert branches(src, e, m, engines_home=True, methods_home=True) == []


def test_no_engine_or_method_is_special_cased_by_name_outside_its_own_files():
    engine_names, method_names = set(engines.NAMES), set(METHODS.names())
    assert {"vllm", "llama.cpp", "transformers"} <= engine_names and {"gguf", "gptq", "rtn"} <= method_names
    found = []
    for path in sorted(Path(PACKAGE_DIR).rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        found += [(rel, *b) for b in branches(path.read_text(), engine_names, method_names,
                                                engines_home=rel.startswith(ENGINE_HOME),
                                                methods_home=rel.startswith(METHOD_HOME))]
    engine_branches = [f for f in found if f[1] == "engine"]
    method_branches = [f for f in found if f[1] == "method"]
    assert len(engine_branches) == 0, engine_branches
    assert len(method_branches) == 0, method_branches
