"""A closed-loop load generator for an OpenAI-compatible /v1/completions endpoint (streaming, asyncio + aiohttp).

Why not GuideLLM 0.8.1 (checked with `pip install --dry-run guidellm==0.8.1` beside this stack): it pins
click~=8.4.0 (this stack has click 8.5.1: it would be downgraded) and brings 27 more packages (sanic, uvloop, httpx,
Faker, ...); it counts prompt tokens with a tokenizer it loads by name. A load test is ~150 lines: this one uses
aiohttp (already installed), draws prompts from the perplexity corpus, asks for a fixed output length (ignore_eos) and
reads token counts from the server's usage record.

Per concurrency level: `concurrency` workers each send requests back to back until `requests` are done. Measured:
output tok/s (completion tokens / wall time), requests/s, time to first token and inter-token latency p50/p99,
errors (anything but a complete stream), 503s, and the server's peak resident memory (VmHWM of its pid).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from pipeline.data import resolve, rows

# Greedy, exactly max_tokens tokens, on every server compress serve runs: ignore_eos (compress serve's transformers
# app, vLLM) or min_tokens = max_tokens (llama-cpp-python's server, vLLM); temperature 0 and no repetition penalty
# (llama-cpp-python's server samples at 0.8 with repeat_penalty 1.1 unless told). Fields a server does not know are
# ignored by all three.
FIXED_LENGTH_GREEDY = {"ignore_eos": True, "temperature": 0.0, "repeat_penalty": 1.0}


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    completed: int
    errors: int
    rejected_503: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    requests_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    server_peak_rss_bytes: int | None
    server_processes: list[dict] | None  # each process's own peak (process_peaks): the memory per rank


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def peak_rss(processes: list[dict] | None) -> int | None:
    """VmHWM (peak resident set) of a process and its descendants added up (vLLM's server runs its engine in child
    processes), in bytes, from process_peaks' one reading of them; None if they could not be read."""
    return sum(p["peak_rss_bytes"] for p in processes or []) or None


def process_name(pid: int) -> str:
    """The name a process gives itself: its argv[0]'s base name (vLLM retitles its processes VLLM::EngineCore,
    VLLM::Worker_TP0 ...; /proc/<pid>/comm cuts those at 15 characters, dropping the rank), else its comm."""
    argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    return Path(argv0.split(" ")[0]).name if argv0 else Path(f"/proc/{pid}/comm").read_text().strip()


def process_peaks(pid: int | None) -> list[dict] | None:
    """[{"process": its name (process_name), "peak_rss_bytes": VmHWM}] for a process and each descendant, parent
    first: the memory of each rank (vLLM's CPU workers with tensor or pipeline parallelism are named VLLM::Worker_TP0,
    _TP1 ...). None if the process cannot be read."""
    if pid is None:
        return None
    out: list[dict] = []
    todo, seen = [pid], set()
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.add(p)
        try:
            name = process_name(p)
            hwm = next((int(line.split()[1]) * 1024 for line in Path(f"/proc/{p}/status").read_text().splitlines()
                        if line.startswith("VmHWM:")), 0)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            if p == pid:
                return None
            continue
        if hwm:
            out.append({"process": name, "peak_rss_bytes": hwm})
    return out


def corpus_prompts(n: int, words: int = 64, dataset: str = "wikitext2") -> list[str]:
    """n prompts of about `words` words each, from the perplexity corpus's non-empty rows, in order."""
    text = " ".join(r.strip() for r in rows(resolve(dataset)) if r.strip())
    toks = text.split()
    return [" ".join(toks[i * words:(i + 1) * words]) for i in range(n)]


async def one_request(session, url: str, body: dict, headers: dict, timeout_s: float) -> dict:
    """One streaming completion: {status, tokens, ttft, gaps, error}."""
    t0 = time.perf_counter()
    out: dict = {"status": None, "tokens": 0, "ttft": None, "gaps": [], "error": None}
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            out["status"] = resp.status
            if resp.status != 200:
                out["error"] = (await resp.text())[:200]
                return out
            last, done, chunks = None, False, 0
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    out["error"] = msg["error"].get("message")
                    return out
                if msg.get("usage"):
                    out["tokens"] = msg["usage"]["completion_tokens"]
                choice = (msg.get("choices") or [None])[0]
                if choice is not None and not (choice.get("text") == "" and choice.get("finish_reason")):
                    # a token arrived (llama-cpp-python ends its stream with an empty chunk carrying finish_reason,
                    # and sends no usage record: its tokens are counted as chunks)
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        out["ttft"] = now - t0
                    else:
                        out["gaps"].append(now - last)
                    last = now
            if not done:
                out["error"] = "the stream ended without [DONE]"
            out["tokens"] = out["tokens"] or chunks
    except TimeoutError:
        out["error"] = f"no complete answer within {timeout_s:g} s"
    except Exception as e:  # connection reset, server gone
        out["error"] = f"{type(e).__name__}: {e}"
    return out


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int, requests: int,
                    max_tokens: int, api_key: str | None = None, timeout_s: float = 120.0,
                    pid: int | None = None) -> LevelResult:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    todo = list(range(requests))
    results: list[dict] = []

    async def worker(session):
        while todo:
            i = todo.pop()
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, **FIXED_LENGTH_GREEDY}
            body["min_tokens"] = max_tokens
            results.append(await one_request(session, url, body, headers, timeout_s))

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    return LevelResult(concurrency, requests, len(ok), len(results) - len(ok),
                       sum(1 for r in results if r["status"] == 503), tokens, round(wall, 3),
                       round(tokens / wall, 2), round(len(ok) / wall, 3),
                       percentile(ttft, 50), percentile(ttft, 99), percentile(gaps, 50), percentile(gaps, 99),
                       peak_rss(processes := process_peaks(pid)), processes)


def run(base_url: str, model: str, levels: list[int], requests_per_level: int | None, max_tokens: int,
        prompt_words: int = 64, api_key: str | None = None, pid: int | None = None,
        timeout_s: float = 120.0, prompts: list[str] | None = None) -> list[dict]:
    """Every level in order; requests_per_level None: 2 x concurrency (at least 4)."""
    prompts = prompts or corpus_prompts(max(64, 2 * max(levels)), prompt_words)
    out = []
    for c in levels:
        n = requests_per_level or max(4, 2 * c)
        out.append(asdict(asyncio.run(run_level(base_url, model, prompts, c, n, max_tokens, api_key, timeout_s,
                                                pid))))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=None, help="per level (default: 2 x concurrency, at least 4)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--pid", type=int, default=None, help="the server's pid (its peak memory is read from /proc)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)

    res = run(a.url, a.model, [int(x) for x in a.concurrency.split(",")], a.requests, a.max_tokens, a.prompt_words,
              os.environ.get("COMPRESS_API_KEY"), a.pid)
    text = json.dumps(res, indent=2)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
