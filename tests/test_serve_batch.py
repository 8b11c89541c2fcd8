"""`serve --max-batch N`: requests as rows of one batched loop. Every request's output is
its output alone (greedy, sampled with a seed, speculative or not, stop strings) whatever
else runs beside it: well-formed neighbours, hostile and oversize requests, cancelled
streams. Plus the queue (429), API key, graceful shutdown, metrics and the start-up checks.
The server runs as a real process (tests/test_serve.py's Server: torch blocked, ephemeral
port, stopped by its pid) driven by the openai client and raw HTTP."""

from __future__ import annotations

import json
import queue
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from click.testing import CliRunner
from runtime_cases import prompts
from test_serve import Server, running, art, decode, offline, replica_ok, tok  # noqa: F401 (fixtures)

from dflash_export.cli import cli
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.serve.batch import BatchEngine
from dflash_export.runtime.loop import Request
from dflash_export.serve.jobs import Job
from dflash_export.serve.text import Text


@pytest.fixture(scope="module")
def batched(art, tmp_path_factory):
    yield from running(art, tmp_path_factory.mktemp("log") / "serve.log", "--max-batch", 3, "--max-queue", 16)


def _disconnect_after_first_event(port: int, body: dict) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    s.settimeout(30)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    s.close()


def test_rows_beside_hostile_oversize_and_cancelled_requests_equal_their_run_alone(batched, offline, tok):
    ps = prompts(12, 101, seed=9)
    kinds = [dict(), dict(speculative=False), dict(temperature=1.0, seed=7)]  # per-request, inside one batch
    jobs = [(ps[i], 10 + 3 * i, kinds[i % 3]) for i in range(12)]
    wants = [offline(p, n, draft=k.get("speculative", True), temperature=k.get("temperature", 0.0),
                     seed=k.get("seed", 0)).tokens for p, n, k in jobs]
    client = batched.client()
    before = {m: batched.metric(f"dflash:{m}") for m in ("batch_rows_per_round_count", "batch_rows_per_round_sum",
                                                          "request_queue_time_seconds_count")}
    cancelled = batched.metric('dflash:request_success_total{finished_reason="cancelled"')
    huge = list(range(5, 100)) * 40  # past the exported context

    def good(i):
        p, n, k = jobs[i]
        extra = {"speculative": k["speculative"]} if "speculative" in k else {}
        r = client.completions.with_raw_response.create(
            model="tiny-chat", prompt=p, max_tokens=n, temperature=k.get("temperature", 0), seed=k.get("seed"),
            stream=i % 2 == 1, extra_body=extra)
        if i % 2 == 0:
            return r.parse().choices[0].model_extra["token_ids"], dict(r.headers)
        return [t for ch in r.parse() for t in ch.choices[0].model_extra["token_ids"]], dict(r.headers)

    def hostile(i):
        kind = i % 4
        if kind == 0:
            return batched.raw("POST", "/v1/completions", {"prompt": huge, "max_tokens": 5})[0]
        if kind == 1:
            return batched.raw("POST", "/v1/completions", '{"prompt": [1, 2, "' + "x" * 50000)[0]
        if kind == 2:
            return batched.raw("POST", "/v1/completions", {"prompt": [1, -3, 10**12], "max_tokens": 5,
                                                           "stop_token_ids": [-1], "temperature": 1e9})[0]
        _disconnect_after_first_event(batched.port, {"prompt": ps[i % 12], "max_tokens": 200, "temperature": 0,
                                                     "stream": True})
        return "cancelled"

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, i) for i in range(12)]
        bads = [pool.submit(hostile, i) for i in range(8)]
        results = [f.result(timeout=300) for f in goods]
        assert [f.result(timeout=300) for f in bads] == [400, 400, 400, "cancelled"] * 2
    for i, (tokens, headers) in enumerate(results):
        assert tokens == wants[i], (i, jobs[i][2])
        assert replica_ok(headers, batched.pid, "[012]")
    assert len({h["x-dflash-replica"][-1] for _, h in results}) > 1  # several rows served
    batched.until(lambda: batched.metric('dflash:request_success_total{finished_reason="cancelled"') >= cancelled + 2,
                  "the disconnected streams cancelled")
    batched.until(lambda: batched.raw("GET", "/health")[2]["slots_idle"] == 3, "every row free")
    h = batched.raw("GET", "/health")[2]
    assert h["max_batch"] == 3 and h["requests_waiting"] == 0
    rounds = batched.metric("dflash:batch_rows_per_round_count") - before["batch_rows_per_round_count"]
    rows = batched.metric("dflash:batch_rows_per_round_sum") - before["batch_rows_per_round_sum"]
    assert rounds > 0 and rows / rounds > 1.2, (rounds, rows)  # requests really shared rounds
    assert batched.metric("dflash:request_queue_time_seconds_count") - before["request_queue_time_seconds_count"] >= 14
    print(f"12 requests beside 8 hostile or cancelled ones: {rounds:.0f} rounds, mean {rows / rounds:.2f} rows per round")


def test_stop_strings_and_chat_in_a_batch(batched, offline, tok):
    client = batched.client()
    ids = tok.encode("abc").ids
    want = offline(ids, 120, temperature=1.0, seed=0)
    full = decode(tok, want.tokens)
    stop = full[20:23]
    at = full.find(stop)
    with ThreadPoolExecutor(3) as pool:
        fs = [pool.submit(client.completions.create, model="tiny-chat", prompt="abc", max_tokens=120,
                          temperature=1.0, seed=0, stop=[stop]) for _ in range(3)]
        chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=20, temperature=0)
        outs = [f.result(timeout=120) for f in fs]
    for r in outs:
        assert r.choices[0].text == full[:at] and r.choices[0].finish_reason == "stop"
    ids2 = tok.encode("<user>Hi\n<assistant>", add_special_tokens=False).ids
    assert chat.choices[0].model_extra["token_ids"] == offline(ids2, 20).tokens


def test_multi_turn_chat_reuses_a_parked_prefix_beside_other_rows(batched, offline, tok):
    client = batched.client()
    msgs = [{"role": "system", "content": "Reuse me."}, {"role": "user", "content": "Tell me more"}]
    ids = tok.encode("<system>Reuse me.\n<user>Tell me more\n<assistant>", add_special_tokens=False).ids
    r1 = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=24, temperature=0)
    reply = r1.choices[0].message.content
    assert r1.choices[0].model_extra["token_ids"] == offline(ids, 24).tokens
    msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again"}]
    ids2 = tok.encode(f"<system>Reuse me.\n<user>Tell me more\n<assistant>{reply}\n<user>Again\n<assistant>",
                      add_special_tokens=False).ids
    cached_before = batched.metric("dflash:prompt_tokens_cached_total")
    ps = prompts(2, 101, seed=13)  # two: at most two parks before turn 2 joins, so its entry (one of 3) stays
    with ThreadPoolExecutor(3) as pool:  # turn 2 joins while other rows run (and take other slots)
        fs = [pool.submit(client.completions.create, model="tiny-chat", prompt=p, max_tokens=30, temperature=0)
              for p in ps]
        r2 = client.chat.completions.create(model="tiny-chat", messages=msgs2, max_tokens=24, temperature=0)
        r3 = pool.submit(client.chat.completions.create, model="tiny-chat", messages=msgs2, max_tokens=24,
                         temperature=0, extra_body={"cache_prompt": False}).result(timeout=120)
        others = [f.result(timeout=120) for f in fs]
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(ids) and r2.model_extra["timings"]["prompt_n"] == len(ids2) - cached
    assert r2.choices[0].model_extra["token_ids"] == offline(ids2, 24).tokens
    assert r3.usage.prompt_tokens_details.cached_tokens == 0
    assert r3.choices[0].message.content == r2.choices[0].message.content
    for p, r in zip(ps, others):
        assert r.choices[0].model_extra["token_ids"] == offline(p, 30).tokens
    assert batched.metric("dflash:prompt_tokens_cached_total") >= cached_before + cached


def test_engine_cancel_frees_the_row_before_the_next_round(art):
    """Cancelled from inside its round event: not one more round, the row is free, and the
    neighbour's output is its output alone."""
    engine = BatchEngine(OrtBackend(art, threads=1, max_batch=2), Text(art), "m", max_queue=2)
    try:
        events, other = queue.Queue(), queue.Queue()
        job = Job(Request([5, 6, 7], 200, speculative=False), emit=events.put)
        rounds = []

        def emit(ev):  # called by the loop's thread, between two rounds
            events.put(ev)
            if ev[0] == "round":
                rounds.append(ev)
                if len(rounds) == 3:
                    engine.cancel(job)

        job.emit = emit
        engine.submit(Job(Request([9, 8, 7, 6], 60), emit=other.put))
        engine.submit(job)
        got = [events.get(timeout=60)]
        while got[-1][0] != "end":
            got.append(events.get(timeout=60))
        assert [e[0] for e in got] == ["round"] * 3 + ["end"] and got[-1][1] == "cancelled"
        assert engine.slots[1].job is None
        toks = []
        while (ev := other.get(timeout=60))[0] == "round":
            toks += ev[1]
        from dflash_export.runtime.loop import generate

        assert ev[1] == "length" and toks == generate(OrtBackend(art, threads=1), [9, 8, 7, 6], 60).tokens
    finally:
        engine.close()


def test_engine_refuses_a_bad_request_alone(art):
    """A request the app would have refused (ids past the vocabulary, a prompt past the context)
    handed to the engine directly fails alone, before it joins; the batch goes on."""
    engine = BatchEngine(OrtBackend(art, threads=1, max_batch=2), Text(art), "m", max_queue=4)
    try:
        good, bad, long = queue.Queue(), queue.Queue(), queue.Queue()
        engine.submit(Job(Request([9, 8, 7, 6], 40), emit=good.put))
        engine.submit(Job(Request([5, 10**6], 5), emit=bad.put))
        engine.submit(Job(Request([5] * 300, 5), emit=long.put))
        for q in (bad, long):
            ev = q.get(timeout=60)
            assert ev[0] == "error" and "generation failed" in ev[1], ev
        toks = []
        while (ev := good.get(timeout=60))[0] == "round":
            toks += ev[1]
        from dflash_export.runtime.loop import generate

        assert ev[1] == "length" and toks == generate(OrtBackend(art, threads=1), [9, 8, 7, 6], 40).tokens
    finally:
        engine.close()


def test_api_key_queue_full_and_graceful_shutdown(art, tmp_path, offline, tok):
    s = Server(art, tmp_path / "serve.log", "--max-batch", 2, "--max-queue", 0, "--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model="tiny-chat", prompt="a", max_tokens=2)
        client = s.client("s3cret")
        want = offline(tok.encode("zz").ids, 240, draft=False).tokens
        streams = [client.completions.create(model="tiny-chat", prompt="zz", max_tokens=240, temperature=0,
                                             stream=True, extra_body={"speculative": False}) for _ in range(2)]
        firsts = [next(iter(st)) for st in streams]  # both rows busy, no queue: the next request gets 429
        with pytest.raises(openai.RateLimitError, match="retry later"):
            client.completions.create(model="tiny-chat", prompt="a", max_tokens=2)
        s.proc.send_signal(signal.SIGTERM)  # in flight: both still end properly, then exit 0
        for first, st in zip(firsts, streams):
            rest = list(st)
            tokens = first.choices[0].model_extra["token_ids"] + [t for c in rest for t in c.choices[0].model_extra["token_ids"]]
            assert tokens == want and rest[-1].choices[0].finish_reason == "length"
        assert s.proc.wait(60) == 0, s.log.read_text()
        assert "stopped" in s.log.read_text() and "Traceback" not in s.log.read_text()
    finally:
        s.kill()


@pytest.mark.parametrize("args, message", [
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-batch", "2", "--slots", "2"], "not both"),
    (["--max-batch", "2", "--backend", "trt"], "has no TensorRT engines; build them for --max-batch 2 with "
                                               "`dflash-export build"),
    (["--max-batch", "2", "--provider", "cuda"], "--max-batch 2 runs on ONNX Runtime's CPU provider (its batched "
                                                 "caches are host arrays); on an NVIDIA GPU serve with --backend trt"),
])
def test_bad_batch_arguments_are_one_line(art, args, message):
    res = CliRunner().invoke(cli, ["serve", str(art), "--port", "0", *args])
    assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output, res.output


def test_a_batch_whose_caches_do_not_fit_is_refused_at_start(art, monkeypatch):
    from dflash_export.runtime import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 1 << 20)  # 1 MiB left
    res = CliRunner().invoke(cli, ["serve", str(art), "--port", "0", "--max-batch", "8"])
    assert res.exit_code != 0 and "Traceback" not in res.output, res.output
    line = res.output.strip()
    assert "\n" not in line and "--max-batch 8 x max context" in line and "lower --max-batch" in line, line


def test_default_batch_is_what_fits(art, monkeypatch):
    """No --max-batch: 4 rows where the export and memory allow, fewer when only fewer fit, 1
    for --slots or no memory at all; TensorRT: up to 4 of the rows its engines were built for."""
    from dflash_export.cli.serve import _batch_rows
    from dflash_export.runtime import manifest as M, memory

    m = M.load_manifest(art, verify=False)
    row = m.max_context * memory.cache_bytes_per_position(m)
    for free, want in ((100 * row, (4, 1)), (3.5 * row, (2, 1)), (2 * row, (1, 1))):
        monkeypatch.setattr(memory, "available_memory", lambda free=free: int(free))
        assert _batch_rows(art, m, None, None, "ort", "cpu", True) == want, free
    assert _batch_rows(art, m, None, 3, "ort", "cpu", True) == (1, 3)
    assert _batch_rows(art, m, None, None, "trt", "cpu", True) == (1, 1)  # no engines
    for built, want in ((1, (1, 1)), (3, (3, 1)), (8, (4, 1))):  # engines for 1..built rows (device memory)
        m.engines = {"max_batch": built}
        assert _batch_rows(art, m, None, None, "trt", "cpu", True) == want, built
        assert _batch_rows(art, m, built, None, "trt", "cpu", True) == (built, 1)
