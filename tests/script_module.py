"""A script of scripts/ as a module for the tests (scripts/ is not a package); registered in sys.modules before it
runs, as dataclasses in it need."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def script_module(name: str):
    """scripts/<name>.py, imported once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def arch_matrix():
    return script_module("arch_matrix")
