"""OpenAI conformance of `compress serve` (transformers engine, tiny random model, a real subprocess on 127.0.0.1):
the official `openai` client for chat with stop strings (streamed and not), completions with logprobs + echo
against the model's own log-softmax, batched token-id prompts, the 400s (n=3, tools, role "wizard", a lone
surrogate) and 413 (a body over the cap), a /metrics scrape; and lm-eval 0.4.13's `local-completions` model
(LocalCompletionsAPI: token-id batches, echo, logprobs=1, max_tokens=1) scoring log-likelihoods equal to the
in-process ones within 1e-4."""
from __future__ import annotations

import urllib.request

import pytest

from pipeline.serve.openai_schema import MAX_BODY_BYTES
from tests.serve_helpers import Server, post, tiny_export

pytestmark = pytest.mark.slow  # one server subprocess (torch + transformers, ~5 s) for the module
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("serve-openai") / "tiny")


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    s = Server(folder, "--slots", "2", "--max-queue", "8", log=tmp_path_factory.mktemp("log") / "server.log")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(folder):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _logprobs(model, ids: list[int]):
    """(log p(ids[i] | ids[:i]) for i >= 1, the argmax there, its log p), in-process."""
    import torch

    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    best = lp.max(-1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), best.indices.tolist(), best.values.tolist()


def test_chat_stop_strings_streamed_and_not(client):
    messages = [{"role": "user", "content": "t5 t6 t7"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    stop = full.split()[1]  # the second word: the text ends before its first occurrence
    want = full[:full.index(stop)]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == want and out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stop=stop,
                                                 stream=True, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want and stop not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completions_logprobs_echo_and_token_id_batches(client, model):
    prompts = [[1, 5, 9, 33, 7], [1, 8, 8, 100]]
    out = client.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=1, max_tokens=1)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.prompt_tokens == 9
    for ids, choice in zip(prompts, sorted(out.choices, key=lambda c: c.index)):
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        full = ids + [argmax_next(model, ids)]
        ref, argmax, best = _logprobs(model, full)
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref)) < 1e-4
        for top, chosen, am, b in zip(lp.top_logprobs[1:], full[1:], argmax, best):  # top-1 and the chosen token
            assert top[f"t{am}"] == pytest.approx(b, abs=1e-4) and len(top) == (1 if chosen == am else 2)
        single = client.completions.create(model="tiny", prompt=ids, max_tokens=1)
        assert choice.text.endswith(single.choices[0].text)  # echo: prompt text + the same completion


def argmax_next(model, ids: list[int]) -> int:
    import torch

    with torch.no_grad():
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())


@pytest.mark.parametrize("kwargs,needle", [
    ({"n": 3}, "n: only n=1"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools: tools are not served"),
    ({"messages": [{"role": "wizard", "content": "t5"}]}, "messages.0.role"),
], ids=["n", "tools", "role"])
def test_refusals_name_the_field(client, kwargs, needle):
    args = {"model": "tiny", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400 and needle in e.value.message


def test_surrogate_oversized_body_and_metrics(server, client):
    status, out = post(server.url + "/v1/completions", b'{"model": "tiny", "prompt": "hi \\ud800 there"}')
    assert status == 400 and out["error"]["message"].startswith("prompt: not valid Unicode")
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="t5 " * (MAX_BODY_BYTES // 3 + 10), max_tokens=1)
    assert e.value.status_code == 413
    assert server.proc.poll() is None and server.health()["status"] == "ok"
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in ("compress_serve_requests_total{route=\"/v1/completions\",status=\"413\"}",
                 "compress_serve_time_to_first_token_seconds_bucket", "compress_serve_inter_token_latency_seconds_sum",
                 "compress_serve_generation_tokens_total", "compress_serve_prompt_tokens_total",
                 "compress_serve_queue_waiting", "compress_serve_rejected_total"):
        assert name in text, name


def test_lm_eval_local_completions_loglikelihood_equals_in_process(server, folder, model):
    pytest.importorskip("tenacity")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", tokenizer=str(folder),
                             tokenizer_backend="huggingface", batch_size=2, max_length=128, max_retries=1)
    pairs = [("t5 t6 t7 t8", " t9 t10"), ("t40 t41", " t42")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    served = lm.loglikelihood(reqs, disable_tqdm=True)
    for (ctx, cont), (ll, greedy) in zip(pairs, served):
        c_ids, x_ids = lm.tok_encode(ctx), lm.tok_encode(cont)
        lps, argmax, _ = _logprobs(model, c_ids + x_ids)
        tail = len(x_ids)
        assert abs(ll - sum(lps[-tail:])) < 1e-4
        assert greedy == (argmax[-tail:] == (c_ids + x_ids)[-tail:])


def test_logprobs_stay_exact_while_the_manager_generates_beside_them(server, folder, model):
    """The scoring forward and the manager's generation steps share the model: scored side by side they corrupted
    each other (lm-eval at 4 clients flipped 83 of 200 real task items; research/tasks_served.py). Long generations
    keep the manager busy while echo+logprobs requests are scored; every value must still equal the in-process one."""
    import threading

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    done = threading.Event()

    def generate(i):  # one slot kept generating until every prompt is scored
        while not done.is_set():
            post(server.url + "/v1/completions", {"model": "tiny", "prompt": f"t{i} " * 30, "max_tokens": 64,
                                                  "min_tokens": 64}, timeout=120)

    prompts = [tok(f"t{3 * i} t{i + 7} " * (4 + i % 5))["input_ids"] for i in range(24)]
    results = {}

    def score(i):
        results[i] = post(server.url + "/v1/completions", {"model": "tiny", "prompt": [prompts[i]], "max_tokens": 1,
                                                           "logprobs": 1, "echo": True}, timeout=120)

    busy = threading.Thread(target=generate, args=(1,))
    busy.start()
    for i in range(len(prompts)):  # one scoring request at a time in the other slot, beside the generation
        score(i)
    done.set()
    busy.join(180)
    for i, ids in enumerate(prompts):
        status, body = results[i]
        assert status == 200, body
        served = body["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
        expected, _, _ = _logprobs(model, ids)
        assert max(abs(a - b) for a, b in zip(served, expected)) < 1e-4, i
