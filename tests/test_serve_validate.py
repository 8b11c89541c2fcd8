"""What a server refuses, and what it no longer refuses, in process (the ASGI app over a real engine):
plain servers answer unmodified clients; a request that can never fit is a 400, a full queue a 429;
hostile sizes are refused before they cost (/health keeps answering); the messages say what is
accepted; and, generated from the server's own OpenAPI schema, no request is a 5xx, every 4xx is
one line with a code, and the server is healthy after."""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_serve import _call, chat_art
from tokenizers import Tokenizer

from dflash_export.runtime.loop import Request
from dflash_export.runtime.sampling import MIN_TEMPERATURE, Sampling, choose
from dflash_export.serve.app import create_app
from dflash_export.serve.engine import load_engine
from dflash_export.serve.jobs import Job
from dflash_export.serve.options import ServeOptions
from dflash_export.serve.text import TextStream

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return chat_art(tmp_path_factory.mktemp("validate") / "tiny-chat")


@pytest.fixture(scope="module")
def servers(art):
    """name -> (app, engine): speculative (batch 2, queue 2), and plain by each of the two flags."""
    made = {}
    for name, o in (("spec", ServeOptions(art, max_batch=2, max_queue=2)),
                    ("no-draft", ServeOptions(art, max_batch=2, max_queue=2, no_draft=True)),
                    ("never", ServeOptions(art, max_batch=2, max_queue=2, speculation="never"))):
        engine = load_engine(o)
        made[name] = create_app(o, engine=engine), engine
    yield made
    for _, engine in made.values():
        engine.close()


async def call(app, method: str, path: str, body=None) -> tuple[int, object]:
    """One request into the ASGI app (test_serve's `_call`), a dict body sent as JSON: (status, JSON or text)."""
    raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    status, got, _ = await _call(app, method, path, raw)
    return status, got


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def one_line_error(status: int, body) -> bool:
    e = body.get("error", {}) if isinstance(body, dict) else {}
    return 400 <= status < 500 and bool(e.get("code")) and "\n" not in e.get("message", "\n")


# -- a plain server answers what an unmodified client sends ---------------------------------------


@pytest.mark.parametrize("name, flag", [("no-draft", "--no-draft"), ("never", "--speculation never")])
def test_a_plain_server_decodes_plainly_unless_always_is_asked(servers, name, flag):
    app, _ = servers[name]
    spec_app, _ = servers["spec"]
    body = {"prompt": "abc", "max_tokens": 12, "temperature": 0}
    plain = run(call(spec_app, "POST", "/v1/completions", body | {"speculative": False}))[1]["choices"][0]["token_ids"]
    for extra in ({}, {"speculative": True}, {"speculative": False}):  # not given, or allowed: the server decides
        status, got = run(call(app, "POST", "/v1/completions", body | extra))
        assert status == 200 and got["choices"][0]["token_ids"] == plain and not got["timings"]["speculative"], got
    status, got = run(call(app, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                   "max_tokens": 3}))
    assert status == 200, got
    status, got = run(call(app, "POST", "/v1/completions", body | {"speculative": "always"}))
    assert status == 400 and f"started with {flag})" in got["error"]["message"] and one_line_error(status, got), got


# -- capacity: never fits = 400 naming the limit; a full queue = 429 -------------------------------


def test_a_request_that_can_never_fit_is_a_400_and_a_full_queue_a_429(servers, art):
    app, engine = servers["spec"]  # 2 rows + --max-queue 2
    status, got = run(call(app, "POST", "/v1/completions", {"prompt": "a", "n": 5, "max_tokens": 2}))
    assert status == 400 and "holds at most 4 at once (2 rows + --max-queue 2)" in got["error"]["message"], got
    status, got = run(call(app, "POST", "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2}))
    assert status == 400 and got["error"]["param"] == "prompt", got
    status, got = run(call(app, "POST", "/v1/completions", {"prompt": "a", "n": 4, "max_tokens": 2}))
    assert status == 200 and len(got["choices"]) == 4, got
    # rows and queue held by 4 long jobs: the next request is a retryable 429
    hold = []
    for _ in range(4):
        job = Job(Request([5, 6, 7], 200, speculative=False, stop_token_ids=()), emit=lambda ev: None)
        engine.submit(job)
        hold.append(job)
    try:
        status, got = run(call(app, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}))
        assert status == 429 and got["error"]["code"] == "queue_full", got
    finally:
        for job in hold:
            engine.cancel(job)
    wait_idle(engine)


def wait_idle(engine) -> None:
    deadline = time.monotonic() + 60
    while engine.idle_slots() != len(engine.slots) or engine.waiting:
        assert time.monotonic() < deadline, "rows were not freed"
        time.sleep(0.01)


# -- hostile sizes are refused before they cost ------------------------------------------------------

HOSTILE = [  # (path, body, status, words): each under the 4 MB body limit
    ("/v1/completions", {"prompt": "x" * 3_900_000}, 400, "characters"),
    ("/tokenize", {"prompt": "x" * 3_900_000}, 400, "characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3_900_000}]}, 400, "characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 100_000}, 413, "JSON values"),
    ("/v1/completions", b'{"prompt": "a", "stop_token_ids": [' + b"1," * 1_900_000 + b'1]}', 413, "JSON values"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {str(i): 1 for i in range(150_000)}}, 413, "JSON values"),
    ("/v1/completions", {"prompt": ["a"] * 300_000}, 413, "JSON values"),
    ("/detokenize", b'{"tokens": [' + b"1," * 1_900_000 + b"1]}", 413, "JSON values"),
    ("/v1/completions", {"prompt": [1] * 30_000}, 400, "more than the exported context"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [1] * 30_000}, 400, "at most 64"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "unpaired surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "unpaired surrogate"),
]


def test_health_answers_within_half_a_second_while_hostile_bodies_are_refused(servers):
    app, engine = servers["spec"]
    bodies = [(path, body if isinstance(body, bytes) else json.dumps(body).encode(), status, words)
              for path, body, status, words in HOSTILE]

    async def one(path, raw):
        hostile = asyncio.create_task(call(app, "POST", path, raw))
        await asyncio.sleep(0)  # the hostile request is in the app first
        t0 = time.perf_counter()
        health = await call(app, "GET", "/health")
        return time.perf_counter() - t0, health, await hostile

    async def all_at_once():  # four at once, beside a health check
        tasks = [asyncio.create_task(call(app, "POST", path, raw)) for path, raw, _, _ in bodies[:4]]
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        health = await call(app, "GET", "/health")
        return time.perf_counter() - t0, health, await asyncio.gather(*tasks)

    for path, raw, status, words in bodies:
        took, health, (got, body) = run(one(path, raw))
        assert got == status and words in body["error"]["message"] and one_line_error(got, body), (path, body)
        assert health[0] == 200 and took < 0.5, (path, took)
    took, health, outs = run(all_at_once())
    assert health[0] == 200 and took < 0.5 and [s for s, _ in outs] == [b[2] for b in bodies[:4]], (took, outs)
    wait_idle(engine)


def test_tokenizing_leaves_the_event_loop_free(tmp_path):
    """A long prompt is tokenized in a worker thread by a call that releases the GIL: the event loop
    keeps running while it works (the longest stall well under the tokenization's time)."""
    from dflash_export.serve.text import Text

    (tmp_path / "tokenizer.json").write_bytes((ROOT / "demo/pair/target/tokenizer.json").read_bytes())
    text = Text(tmp_path)
    prompt = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 1500

    async def measure():
        gaps, busy = [], True

        async def tick():
            last = time.perf_counter()
            while busy:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        ids = await asyncio.to_thread(text.encode, prompt)
        took, busy = time.perf_counter() - t0, False
        await ticker
        return ids, took, max(gaps)

    ids, took, stall = run(measure())
    assert ids == text.tokenizer.encode(prompt).ids and stall < took / 2, (took, stall)


# -- a temperature below the floor is greedy ------------------------------------------------------


def test_a_vanishing_temperature_is_greedy(servers):
    assert Sampling(5e-324).greedy and Sampling(MIN_TEMPERATURE / 2).greedy and not Sampling(MIN_TEMPERATURE).greedy
    logits = np.random.default_rng(0).normal(size=(3, 50)) * 100
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warnings: logits / T is never computed
        assert choose(logits, np.full(3, 0.5), Sampling(5e-324)).tolist() == logits.argmax(-1).tolist()
    app, _ = servers["spec"]
    body = {"prompt": "abc", "max_tokens": 16}
    greedy = run(call(app, "POST", "/v1/completions", body | {"temperature": 0}))[1]["choices"][0]
    tiny = run(call(app, "POST", "/v1/completions", body | {"temperature": 5e-324, "seed": 3}))[1]["choices"][0]
    assert tiny["token_ids"] == greedy["token_ids"] and tiny["finish_reason"] == greedy["finish_reason"]


# -- streamed text: the tokenizers library's incremental decoder -------------------------------------


def test_text_stream_equals_the_whole_decode_in_any_rounds():
    tok = Tokenizer.from_file(str(ROOT / "demo/pair/target/tokenizer.json"))
    rng = np.random.default_rng(5)
    text = "naïve café 日本語 🙂 done; ünïcödé ≠ ascii\n\tend"
    for ids in (tok.encode(text).ids, rng.integers(0, tok.get_vocab_size(), 300).tolist()):
        whole = tok.decode(ids, skip_special_tokens=True)
        ts, out, i = TextStream(tok), [], 0
        while i < len(ids):
            k = int(rng.integers(1, 8))
            out.append(ts.push(ids[i : i + k]))
            i += k
        assert "".join(out) + ts.finish() == whole


# -- generated from the server's own OpenAPI schema -------------------------------------------------


def test_openapi_schema_describes_the_bodies(servers):
    app, _ = servers["spec"]
    status, schema = run(call(app, "GET", "/openapi.json"))
    assert status == 200
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    stop = schema["components"]["schemas"]["CompletionRequest"]["properties"]["stop_token_ids"]
    assert any(s.get("maxItems") == 64 for s in stop["anyOf"])


def integral(x):
    """JSON Schema's "integer" admits 10.0, which schemathesis sends; the server reads JSON integers
    strictly (10.0 is refused, in one line): most such bodies are made integers, so that the valid
    ones reach generation."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return int(x)
    if isinstance(x, list):
        return [integral(v) for v in x]
    if isinstance(x, dict):
        return {k: integral(v) for k, v in x.items()}
    return x


def test_property_no_5xx_every_4xx_one_line_with_a_code_and_healthy_after(servers):
    """schemathesis generates bodies from /openapi.json (valid ones and ones that break the schema)
    and sends them into the app: bounded examples, no deadline, the rows free again after."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    app, engine = servers["spec"]
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    seen = []

    def check(response, case):
        status = response.status_code
        seen.append(status)
        assert status < 500, (case.path, case.body, response.text[:300])
        if status >= 400:
            assert one_line_error(status, response.json()), (case.path, case.body, response.text[:300])

    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        op = schema[path]["POST"]
        for mode in ("positive", "negative"):
            strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

            @settings(max_examples=12, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def test(case):
                case.body = integral(case.body)
                given = case.body.get("max_tokens") if isinstance(case.body, dict) else None
                if type(given) is int and given > 8:  # short generations: the test is about the answers
                    case.body = {**case.body, "max_tokens": 8}
                check(case.call(), case)

            test()
    assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen), seen
    wait_idle(engine)
    assert run(call(app, "GET", "/health"))[0] == 200
