"""`dflash-export serve`: a real server process on 127.0.0.1 (ephemeral port, torch made
unimportable in it) driven by the official openai client and by raw HTTP; plus the pieces
under it (slots sharing sessions, prompt reuse, streamed text) tested directly."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import itertools
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner
from runtime_cases import CASES, artifact, prompts
from test_runtime_cli import char_tokenizer
from tokenizers import Tokenizer

from dflash_export.cli import cli
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.controller import controller_for
from dflash_export.runtime.errors import DFlashError, InternalError
from dflash_export.runtime.loop import Generation, generate, stream
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.sampling import Sampling
from dflash_export.runtime.settings import load_settings
from dflash_export.serve.app import ServeOptions, create_app
from dflash_export.runtime.loop import Request
from dflash_export.serve.engine import Engine
from dflash_export.serve.jobs import Job
from dflash_export.serve.text import Text, TextStream

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
NO_TORCH = "import sys\nfor m in ('torch', 'onnx', 'onnxscript', 'transformers'): sys.modules[m] = None\n"


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """The qwen3 test pair (real acceptance), with a character tokenizer and a chat template."""
    return chat_art(tmp_path_factory.mktemp("serve") / "tiny-chat")


def chat_art(d: Path) -> Path:
    """`art` written into `d` (a new folder)."""
    shutil.copytree(artifact(CASES["qwen3"])[2], d)
    char_tokenizer(d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    m = M.load_manifest(d, verify=False)
    m.tokenizer = True
    M.write_manifest(d, m)
    return d


@pytest.fixture(scope="module")
def offline(art):
    """What `dflash-export generate` produces: the loop on a fresh backend (1 thread, as the server),
    speculation auto (a sampled row's draws depend on which of its rounds drafted)."""
    backend = OrtBackend(art, threads=1)
    costs = load_settings(art, "ort:cpu").costs

    def run(ids, n, temperature=0.0, seed=0, **kw):
        kw["sampling"] = Sampling(temperature, seed=seed)
        if kw.get("draft", True):
            kw.setdefault("control", controller_for("auto", costs, backend.manifest.block_size))
        return generate(backend, ids, n, **kw)
    return run


@pytest.fixture(scope="module")
def tok(art):
    return Tokenizer.from_file(str(art / "tokenizer.json"))


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


class Server:
    """`dflash-export serve ... --port 0` in its own process, torch blocked; stopped by its pid."""

    def __init__(self, art: Path, log: Path, *args, prelude: str = ""):
        code = NO_TORCH + prelude + "from dflash_export.cli import cli\ncli(sys.argv[1:])\n"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", str(art), "--port", "0", *map(str, args)],
            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=os.environ | {"PYTHONPATH": ""})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 180  # generous: the machine may be shared and loaded
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise AssertionError(f"server not ready in 180 s: {log.read_text()}")
            if line is None:
                raise AssertionError(f"server exited: {log.read_text()}")
            if m := re.search(r"ready at http://127\.0\.0\.1:(\d+)", line):
                self.port, self.ready_line = int(m.group(1)), line
                break
        self.url = f"http://127.0.0.1:{self.port}"
        self.pid = self.proc.pid

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def raw(self, method: str, path: str, body=None, headers: dict | None = None):
        """(status, headers, parsed JSON or raw text) over a fresh connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        try:
            return r.status, dict(r.getheaders()), json.loads(data)
        except ValueError:
            return r.status, dict(r.getheaders()), data.decode(errors="replace")

    def metric(self, name: str) -> float:
        text = self.raw("GET", "/metrics")[2]
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def until(self, ok, what: str, timeout: float = 60):
        """Poll `ok()` until it holds (bounded)."""
        deadline = time.monotonic() + timeout
        while not ok():
            assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
            time.sleep(0.02)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def running(art: Path, log: Path, *args, prelude: str = ""):
    """A module fixture's body: the server, then Ctrl-C must end it cleanly (exit 0, no traceback).
    `prelude`: Python run in the server process before the CLI (the TensorRT double's install)."""
    s = Server(art, log, *args, prelude=prelude)
    yield s
    try:
        assert s.stop(signal.SIGINT) == 0, s.log.read_text()
        assert "Traceback" not in s.log.read_text()
    finally:
        s.kill()


@pytest.fixture(scope="module")
def server(art, tmp_path_factory):
    yield from running(art, tmp_path_factory.mktemp("log") / "serve.log", "--slots", 2, "--max-queue", 8)


def replica_ok(headers: dict, pid: int, slot: str = r"\d+") -> bool:
    value = {k.lower(): v for k, v in headers.items()}.get("x-dflash-replica", "")
    return re.fullmatch(rf"{re.escape(socket.gethostname())}/{pid}/{slot}", value) is not None


# -- the server through the openai client ---------------------------------------------------------


def test_completions_equal_generate(server, offline, tok):
    client = server.client()
    spec = ("drafts", "draft_tokens", "accepted_tokens")
    for text in ("def f(x):", "Hello, world", "0"):
        ids = tok.encode(text).ids
        want = offline(ids, 40)
        before = [server.metric(f"dflash:spec_decode_num_{m}_total") for m in spec]
        r = client.completions.create(model="tiny-chat", prompt=text, max_tokens=40, temperature=0)
        after = [server.metric(f"dflash:spec_decode_num_{m}_total") for m in spec]
        c = r.choices[0]
        assert c.text == decode(tok, want.tokens) and c.model_extra["token_ids"] == want.tokens
        assert c.finish_reason == ("stop" if want.stopped else "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want.tokens))
        t = r.model_extra["timings"]
        assert t["rounds"] == len(want.acceptance_lengths) and t["mean_acceptance_length"] == pytest.approx(want.tau)
        assert t["draft_n"] == 7 * t["rounds"] and t["draft_n_accepted"] == len(want.tokens) - 1 - t["rounds"]
        assert [b - a for a, b in zip(before, after)] == [t["rounds"], t["draft_n"], t["draft_n_accepted"]]
        # the same as token ids, streamed: chunks add up to the same text and tokens
        chunks = list(client.completions.create(model="tiny-chat", prompt=ids, max_tokens=40, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
        assert [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]] == want.tokens
        assert chunks[-1].usage.completion_tokens == len(want.tokens) and chunks[-2].choices[0].finish_reason == c.finish_reason
        assert chunks[-1].choices == [] and all(ch.usage is None for ch in chunks[:-1])  # OpenAI's usage chunk
        # plain decoding on request: the same tokens, no drafts
        r = client.completions.create(model="tiny-chat", prompt=text, max_tokens=40, temperature=0,
                                      extra_body={"speculative": False})
        assert r.choices[0].model_extra["token_ids"] == want.tokens
        assert r.model_extra["timings"]["draft_n"] == 0 and r.model_extra["timings"]["rounds"] == len(want.tokens) - 1
    raw = client.completions.with_raw_response.create(model="tiny-chat", prompt="x", max_tokens=2, temperature=0)
    assert replica_ok(dict(raw.headers), server.pid)
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]


def decode_ids(client, prompt: str, n: int, seed: int) -> list[int]:
    """A seeded sampled completion's token ids (speculation as the server decides)."""
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=n, temperature=1.0, seed=seed)
    return r.choices[0].model_extra["token_ids"]


def test_sampling_is_seeded_and_stop_strings_never_leak(server, offline, tok):
    """temperature > 0 with a seed draws what the loop draws; a stop string found across chunk
    boundaries ends the text before it, streamed or not; token ids and usage end with the token
    that completes it, though its round accepted more (as vLLM). `speculative: "always"`: every
    round drafts (rounds of several tokens, whatever the controller would choose)."""
    client = server.client()
    ids = tok.encode("abc").ids
    want = offline(ids, 120, temperature=1.0, seed=0, control=None)
    full = decode(tok, want.tokens)
    always = {"speculative": "always"}
    assert offline(ids, 120, temperature=1.0, seed=0).tokens == decode_ids(client, "abc", 120, seed=0)
    r = client.completions.create(model="tiny-chat", prompt="abc", max_tokens=120, temperature=1.0, seed=0,
                                  extra_body=always)
    assert r.choices[0].model_extra["token_ids"] == want.tokens and r.choices[0].text == full
    ends = set(itertools.accumulate(want.acceptance_lengths, initial=1))  # token counts at round ends

    def kept(stop):  # the tokens up to the one that completes the stop string
        return next(n for n in range(len(want.tokens) + 1) if stop in decode(tok, want.tokens[:n]))

    at = next(i for i in range(8, len(full) - 3) if full.find(full[i:i + 3]) == i and "<" not in full[:i + 3]
              and kept(full[i:i + 3]) not in ends)  # the round goes on past the stop string
    stop = full[at:at + 3]
    n = kept(stop)
    for streaming in (False, True):
        kw = dict(model="tiny-chat", prompt="abc", max_tokens=120, temperature=1.0, seed=0, stop=[stop, "never!"],
                  extra_body=always)
        if streaming:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            usage, chunks = chunks[-1].usage, chunks[:-1]
            pieces = [ch.choices[0].text for ch in chunks]
            assert len([p for p in pieces if p]) > 2  # really streamed in pieces
            text, finish = "".join(pieces), chunks[-1].choices[0].finish_reason
            token_ids = [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]]
            assert not any(stop[:2] in p for p in pieces)
        else:
            r = client.completions.create(**kw)
            c, usage = r.choices[0], r.usage
            text, finish, token_ids = c.text, c.finish_reason, c.model_extra["token_ids"]
        assert text == full[:at] and finish == "stop"
        assert token_ids == want.tokens[:n] and usage.completion_tokens == n, (streaming, n, len(token_ids))


def test_chat_and_prompt_reuse(server, offline, tok):
    client = server.client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = "<system>Be brief.\n<user>Hi there\n<assistant>"
    ids = tok.encode(rendered, add_special_tokens=False).ids
    assert server.raw("POST", "/tokenize", {"messages": msgs})[2]["tokens"] == ids
    want = offline(ids, 30)
    r = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=30, temperature=0)
    reply = r.choices[0].message.content
    assert reply == decode(tok, want.tokens) and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=msgs, max_completion_tokens=30,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == len(want.tokens)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reply
    # turn 2 starts with turn 1: a slot still holds it, only the new part is prefilled
    msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    ids2 = tok.encode(f"<system>Be brief.\n<user>Hi there\n<assistant>{reply}\n<user>More\n<assistant>",
                      add_special_tokens=False).ids
    r2 = client.chat.completions.create(model="tiny-chat", messages=msgs2, max_tokens=30, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(ids) and r2.model_extra["timings"]["prompt_n"] == len(ids2) - cached
    assert r2.choices[0].model_extra["token_ids"] == offline(ids2, 30).tokens
    r3 = client.chat.completions.create(model="tiny-chat", messages=msgs2, max_tokens=30, temperature=0,
                                        extra_body={"cache_prompt": False})
    assert r3.usage.prompt_tokens_details.cached_tokens == 0 and r3.choices[0].message.content == r2.choices[0].message.content


def test_load_48_requests_concurrency_8_over_2_slots(server, offline):
    ps = prompts(48, 101, seed=5)
    n = [12 + i % 20 for i in range(48)]
    client = server.client()
    before = server.metric("dflash:request_success_total")

    def one(i):  # every other one streamed
        r = client.completions.with_raw_response.create(model="tiny-chat", prompt=ps[i], max_tokens=n[i], temperature=0,
                                                        stream=i % 2 == 1)
        if i % 2 == 0:
            return r.parse().choices[0].model_extra["token_ids"], dict(r.headers)
        return [t for ch in r.parse() for t in ch.choices[0].model_extra["token_ids"]], dict(r.headers)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(48)))
    for i, (tokens, headers) in enumerate(results):
        assert tokens == offline(ps[i], n[i]).tokens, i
        assert replica_ok(headers, server.pid, "[01]")
    assert {h["x-dflash-replica"][-1] for _, h in results} == {"0", "1"}  # both slots served
    # a slot is freed just after its last event is sent: poll (bounded)
    server.until(lambda: server.raw("GET", "/health")[2]["slots_idle"] == 2, "both slots free")
    assert server.raw("GET", "/health")[2]["requests_waiting"] == 0
    assert server.metric("dflash:request_success_total") - before == 48
    assert server.metric("dflash:num_requests_running") == 0


def test_disconnect_cancels_the_generation(server, offline, tok):
    ids = tok.encode("zz").ids
    n = 240
    assert len(offline(ids, n, draft=False).tokens) == n  # runs the whole way unless cancelled
    cancelled = server.metric('dflash:request_success_total{finished_reason="cancelled"')
    generated = server.metric("dflash:generation_tokens_total")
    body = json.dumps({"prompt": "zz", "max_tokens": n, "temperature": 0, "stream": True, "speculative": False})
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    s.settimeout(10)
    got = b""
    while b"data: " not in got:  # headers and the first event may arrive in separate reads
        chunk = s.recv(4096)
        assert chunk, f"the server closed the stream before any event: {got!r}"
        got += chunk
    s.close()
    server.until(lambda: server.metric('dflash:request_success_total{finished_reason="cancelled"') > cancelled,
                 "the generation cancelled")
    assert server.metric("dflash:generation_tokens_total") - generated < n
    server.until(lambda: server.raw("GET", "/health")[2]["slots_idle"] == 2, "both slots free")


BAD = [  # (method, path, body, headers, status, words in the message)
    ("POST", "/v1/completions", "{not json", {}, 400, "not valid JSON"),
    ("POST", "/v1/completions", "[1, 2]", {}, 400, "JSON object"),
    ("POST", "/v1/completions", b'{"prompt": "\xff"}', {}, 400, "not valid JSON"),
    ("POST", "/v1/completions", "[" * 100000 + "]" * 100000, {}, 400, "not valid JSON"),
    ("POST", "/v1/completions", '{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}", {}, 400, "not valid JSON"),
    ("POST", "/v1/completions", {"max_tokens": 5}, {}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": 12}, {}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": "5"}, {}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": True}, {}, 400, "max_tokens"),
    ("POST", "/v1/completions", '{"prompt": "a", "temperature": NaN}', {}, 400, "finite"),
    ("POST", "/v1/completions", '{"prompt": "a", "top_p": Infinity}', {}, 400, "finite"),
    ("POST", "/v1/completions", {"prompt": "a", "temperature": 5}, {}, 400, "[0, 2]"),
    ("POST", "/v1/completions", {"prompt": "a", "temperature": -1}, {}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "a", "top_p": 0}, {}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "a", "top_k": -5}, {}, 400, "top_k"),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 0}, {}, 400, ">= 1"),
    ("POST", "/v1/completions", {"prompt": "a", "seed": 2**70}, {}, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": ""}, {}, 400, "empty"),
    ("POST", "/v1/completions", {"prompt": []}, {}, 400, "empty"),
    ("POST", "/v1/completions", {"prompt": [5, 101, -1]}, {}, 400, "[101, -1] are outside the vocabulary [0, 101)"),
    ("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 300}, {}, 400, "(3 tokens) + max_tokens (300) = 303 exceeds the exported context of 256"),
    ("POST", "/v1/completions", {"prompt": "a" * 300}, {}, 400, "300 tokens"),
    ("POST", "/v1/completions", {"prompt": "a", "n": 0}, {}, 400, "n must be >= 1"),
    ("POST", "/v1/completions", {"prompt": "a", "logprobs": 6}, {}, 400, "logprobs must be between 0 and 5"),
    ("POST", "/v1/completions", {"prompt": "a", "stop_token_ids": [500]}, {}, 400, "outside the vocabulary"),
    ("POST", "/v1/completions", {"prompt": ["a", ""]}, {}, 400, "empty"),
    ("POST", "/v1/completions", {"prompt": "a", "model": "gpt-4"}, {}, 404, "does not exist"),
    ("POST", "/v1/completions", "x" * (5 << 20), {}, 413, "limit"),
    ("POST", "/v1/chat/completions", {"messages": []}, {}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, {}, 400, "role"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, 400, "text parts"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     {}, 400, "top_logprobs must be between 0 and 20"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, {}, 400,
     "max_completion_tokens must be >= 1"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500}, {}, 400,
     "lower max_completion_tokens to at most"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "tools": [{"type": "function", "function": {"name": "f"}}]}, {}, 400,
     "writes no tool calls this server can read"),  # this template renders no tools (tests/test_serve_tools.py's does)
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "yaml"}}, {}, 400, "type must be"),
    ("POST", "/v1/completions", {"prompt": "a", "stream": "yes"}, {}, 400, "stream"),
    ("POST", "/v1/completions", {"prompt": "a", "stream_options": {"include_usage": 1}}, {}, 400, "include_usage"),
    ("POST", "/detokenize", {"tokens": [1, 999]}, {}, 400, "outside the vocabulary"),
    ("POST", "/detokenize", {"tokens": [1] * 257}, {}, 400, "more than the exported context of 256"),
    # what a field accepts, rather than pydantic's name of one of its forms
    ("POST", "/v1/completions", {"prompt": "a", "speculative": "never"}, {}, 400, 'expected true, false or "always"'),
    ("POST", "/v1/completions", {"prompt": [1.0, 2.0]}, {}, 400, "a list of token ids (integers)"),
    ("POST", "/v1/completions", {"prompt": "a", "n": 2, "best_of": 1}, {}, 400, "best_of must be at least n"),
    # every list and string is bounded
    ("POST", "/v1/completions", {"prompt": "a", "stop": ["x"] * 17}, {}, 400, "at most 16 strings"),
    ("POST", "/v1/completions", {"prompt": "a", "stop": "x" * 257}, {}, 400, "at most 256 characters"),
    ("POST", "/v1/completions", {"prompt": "a", "stop_token_ids": [1] * 65}, {}, 400, "at most 64"),
    ("POST", "/v1/completions", {"prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}}, {}, 400, "at most 300"),
    ("POST", "/v1/completions", {"prompt": ["a"] * 65}, {}, 400, "1 to 64 strings"),
    ("POST", "/v1/completions", {"prompt": [5] * 257}, {}, 400, "more than the exported context"),
    ("POST", "/v1/completions", {"prompt": "a" * 5000}, {}, 400, "characters; this server reads at most"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 1025}, {}, 400, "at most 1024"),
    # a request that can never fit this server (2 slots + --max-queue 8) is a 400 saying so, not a 429
    ("POST", "/v1/completions", {"prompt": "a", "n": 11}, {}, 400, "holds at most 10 at once"),
    ("POST", "/tokenize", {}, {}, 400, "exactly one"),
    ("GET", "/v1/completions", None, {}, 405, "not allowed"),
    ("GET", "/v1/nothing", None, {}, 404, "no route"),
    ("GET", "/v1/models/other", None, {}, 404, "does not exist"),
    ("DELETE", "/health", None, {}, 405, "not allowed"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    assert len(BAD) >= 20
    for method, path, body, headers, status, words in BAD:
        got, h, j = server.raw(method, path, body, headers)
        assert got == status and isinstance(j, dict), (path, body if len(str(body)) < 200 else "...", got, j)
        e = j["error"]
        assert set(e) == {"message", "type", "param", "code"} and words in e["message"] and e["code"], (body, e)
        assert "Traceback" not in e["message"] and replica_ok(h, server.pid, "-")
        assert server.raw("GET", "/health")[0] == 200
    # unknown fields are ignored; curl's default form content type is read as JSON
    got, _, j = server.raw("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2, "temperature": 0, "frequency_penalty": 0,
                                                       "whatever": {"x": 1}}, {"Content-Type": "application/x-www-form-urlencoded"})
    assert got == 200 and j["usage"]["completion_tokens"] == 2
    # null is "not given" for every optional field (as OpenAI reads it; LangChain sends nulls)
    nulls = dict.fromkeys(("n", "stream", "stream_options", "seed", "stop", "stop_token_ids", "top_p", "top_k", "logprobs",
                           "presence_penalty", "frequency_penalty", "logit_bias", "speculative", "cache_prompt"))
    got, _, j = server.raw("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2, "temperature": 0, "echo": None,
                                                       "suffix": None, "best_of": None, **nulls})
    assert got == 200 and j["usage"]["completion_tokens"] == 2 and j["timings"]["speculative"], j
    got, _, j = server.raw("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x", "name": None}], "max_tokens": None, "max_completion_tokens": 2,
        "temperature": 0, "tools": None, "tool_choice": None, "response_format": {"type": "text"},
        "add_generation_prompt": None, "top_logprobs": None, **nulls})
    assert got == 200 and j["usage"]["completion_tokens"] == 2, j


def test_health_metrics_and_tokenize(server, tok):
    got, h, j = server.raw("GET", "/health")
    assert got == 200 and j["slots"] == 2 and replica_ok(h, server.pid, "-")
    text = server.raw("GET", "/metrics")[2]
    for name in ("dflash:spec_decode_num_drafts_total", "dflash:spec_decode_num_draft_tokens_total",
                 "dflash:spec_decode_num_accepted_tokens_total", 'dflash:spec_decode_num_accepted_tokens_per_pos_total{',
                 "dflash:num_requests_running", "dflash:num_requests_waiting", "dflash:prompt_tokens_total",
                 "dflash:generation_tokens_total", "dflash:time_to_first_token_seconds_bucket",
                 "dflash:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    assert server.metric("dflash:spec_decode_num_accepted_tokens_total") <= server.metric(
        "dflash:spec_decode_num_draft_tokens_total")
    ids = server.raw("POST", "/tokenize", {"prompt": "def f"})[2]
    assert ids["tokens"] == tok.encode("def f").ids and ids["max_model_len"] == 256
    assert server.raw("POST", "/detokenize", {"tokens": ids["tokens"]})[2]["prompt"] == "def f"


def test_api_key_queue_full_no_template_and_graceful_shutdown(art, tmp_path, offline, tok):
    plain = tmp_path / "tiny-chat"  # the same model without a chat template
    shutil.copytree(art, plain)
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    M.write_manifest(plain, M.load_manifest(plain, verify=False))  # the file hashes again
    s = Server(plain, tmp_path / "serve.log", "--slots", 1, "--max-queue", 0, "--api-key", "s3cret", "--no-draft")
    try:
        assert s.raw("GET", "/health")[0] == 200  # open, as /metrics
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model="tiny-chat", prompt="a", max_tokens=2)
        got, h, j = s.raw("POST", "/v1/completions", {"prompt": "a"})
        assert got == 401 and j["error"]["code"] == "invalid_api_key" and replica_ok(h, s.pid, "-")
        client = s.client("s3cret")
        assert client.completions.create(model="tiny-chat", prompt="a", max_tokens=2, temperature=0,
                                         extra_body={"speculative": False}).usage.completion_tokens == 2
        # an unmodified client (no `speculative`) decodes plainly; only "always" needs the drafter, and is
        # refused naming the flag the server was started with
        r = client.completions.create(model="tiny-chat", prompt="zz", max_tokens=12, temperature=0)
        assert r.choices[0].model_extra["token_ids"] == offline(tok.encode("zz").ids, 12, draft=False).tokens
        assert r.model_extra["timings"]["speculative"] is False
        with pytest.raises(openai.BadRequestError, match="started with --no-draft"):
            client.completions.create(model="tiny-chat", prompt="a", max_tokens=2, extra_body={"speculative": "always"})
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"speculative": False})
        # one slot, no queue: of 4 requests sent at once (each ~250 rounds), one runs and the others get 429
        ids = tok.encode("zz").ids
        want = offline(ids, 240, draft=False)

        def one(_):
            try:
                return client.completions.create(model="tiny-chat", prompt="zz", max_tokens=240, temperature=0,
                                                 extra_body={"speculative": False}).choices[0].model_extra["token_ids"]
            except openai.RateLimitError as e:
                assert "retry later" in str(e) and e.response.headers["retry-after"] == "1"
                return "429"

        with ThreadPoolExecutor(4) as pool:
            outcomes = list(pool.map(one, range(4)))
        assert "429" in outcomes and all(o == "429" or o == want.tokens for o in outcomes), outcomes
        assert outcomes.count("429") < 4
        # SIGTERM while a stream runs: it still ends properly (within --shutdown-timeout), the process exits 0
        stream = client.completions.create(model="tiny-chat", prompt="zz", max_tokens=240, temperature=0, stream=True,
                                           extra_body={"speculative": False})
        first = next(iter(stream))
        s.proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        tokens = first.choices[0].model_extra["token_ids"] + [t for c in rest for t in c.choices[0].model_extra["token_ids"]]
        assert tokens == want.tokens and rest[-1].choices[0].finish_reason == "length"
        assert s.proc.wait(60) == 0, s.log.read_text()
        assert "stopped" in s.log.read_text() and "Traceback" not in s.log.read_text()
    finally:
        s.kill()


@pytest.mark.parametrize("rows", [("--slots", 1), ("--max-batch", 2)])
def test_shutdown_cancels_what_outlasts_the_bound(art, tmp_path, offline, tok, rows):
    """--shutdown-timeout 0.2 with ~2000 rounds of work in flight: the running stream ends with an error
    event, the waiting requests get 503, whatever finished is complete; exit 0, quickly, no traceback.
    Eight requests for at most two rows: on a quiet machine a tiny model can finish four within
    the bound, so there are more than that and some are still waiting when the signal comes."""
    s = Server(art, tmp_path / "serve.log", *rows, "--max-queue", 8, "--no-draft", "--shutdown-timeout", 0.2)
    try:
        want = offline(tok.encode("zz").ids, 240, draft=False).tokens
        client = s.client()

        def one(_):
            got = []
            try:
                for ch in client.completions.create(model="tiny-chat", prompt="zz", max_tokens=240, temperature=0,
                                                    stream=True, extra_body={"speculative": False}):
                    got += ch.choices[0].model_extra["token_ids"]
            except openai.APIError as e:  # the error event mid-stream, or a 503 for one still waiting
                assert "shutting down" in str(e), e
                return "cancelled", got
            return "done", got

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(8)]
            m = lambda name: s.metric(f"dflash:{name}")  # noqa: E731
            s.until(lambda: m("num_requests_running") + m("num_requests_waiting") + m("request_success_total") >= 8,
                    "8 requests in the server")
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(60) == 0, s.log.read_text()
            took = time.monotonic() - t0
            outcomes = [f.result(timeout=60) for f in futures]
        assert all(got == want for how, got in outcomes if how == "done")
        assert "cancelled" in [how for how, _ in outcomes], outcomes
        log = s.log.read_text()
        assert "Traceback" not in log and "ERROR" not in log and "stopped" in log, log
        print(f"exit {took:.2f} s after SIGTERM; outcomes {[(h, len(g)) for h, g in outcomes]}")
        assert took < 15, took
    finally:
        s.kill()


# -- the command's own checks -------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["serve"], "give an exported directory OUT or --demo"),
    (["serve", "/nonexistent/dir"], "not a directory"),
    (["serve", "OUT", "--slots", "0"], "--slots must be >= 1"),
    (["serve", "OUT", "--max-queue", "-1"], "--max-queue must be >= 0"),
    (["serve", "OUT", "--threads", "0"], "--threads must be >= 1"),
    (["serve", "OUT", "--slots", "2", "--backend", "trt"], "needs --backend ort"),
    (["serve", "OUT", "--api-key", "a", "--api-key-file", "f"], "not both"),
    (["serve", "OUT", "--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key: unreadable (no such file)"),
    (["serve", "OUT", "--chat-template", "/nonexistent.jinja"], "no such file"),
])
def test_serve_bad_arguments_are_one_line(art, args, message):
    r = CliRunner().invoke(cli, [str(art) if a == "OUT" else a for a in args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_serve_options_are_the_records_fields():
    """`serve`'s options are generated from ServeOptions and RayOptions: every field but the directory,
    max_body_bytes and the resolved settings is an option, with its field's default unless the field
    declares the command's own (the run's options included: ServeOptions is a RunOptions)."""
    from dflash_export.serve.options import RayOptions

    params = {p.name: p for p in cli.commands["serve"].params}
    for cls in (ServeOptions, RayOptions):
        for f in dataclasses.fields(cls):
            if f.name in ("directory", "max_body_bytes", "settings"):
                continue
            assert f.name in params, f"{cls.__name__}.{f.name} is no option of serve"
            own = (f.metadata.get("option") or {}).get("default", f.default)
            assert params[f.name].default == own, f"{f.name}: option default {params[f.name].default!r}, field {own!r}"
    assert params["max_batch"].default is None and params["access_log"].default is True  # resolved / the command's


def test_demo_bad_run_options_fail_before_the_demo_export(tmp_path, monkeypatch):
    """--threads/--verify need no artifact: refused before --demo's first export starts."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = CliRunner().invoke(cli, ["serve", "--demo", "--threads", "0"])
    assert r.exit_code == 2 and "--threads must be >= 1" in r.output and "exporting" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_port_out_of_range_is_refused_by_the_option(tmp_path, monkeypatch):
    """--port past 65535 is the option's own error (exit 2), before anything loads or binds: no traceback."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = CliRunner().invoke(cli, ["serve", "--demo", "--port", "70000"])
    assert r.exit_code == 2 and "70000 is not in the range" in r.output and "Traceback" not in r.output, r.output
    assert not list(tmp_path.iterdir())


def test_ray_without_the_ray_extra_is_one_line(art, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    r = CliRunner().invoke(cli, ["serve", str(art), "--ray"])
    assert r.exit_code == 2 and 'pip install "dflash-export[ray]"' in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_demo_without_the_export_extra_is_one_line(tmp_path):
    code = NO_TORCH + "from dflash_export.cli import cli\ncli(['serve', '--demo'])\n"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=os.environ | {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": ""})
    assert p.returncode == 2 and 'pip install "dflash-export[export]"' in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_demo_cache_from_an_older_format_is_not_served(art, tmp_path, monkeypatch):
    """A cached demo export this version cannot read is exported again, never served as is."""
    from dflash_export.demo import artifact as demo

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    pair = ROOT / "demo" / "pair"
    out = demo.demo_cache_dir(pair)
    shutil.copytree(art, out)
    assert demo.demo_artifact(pair) == out  # readable: served from the cache
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(m | {"format_version": C.FORMAT_VERSION - 1}))
    monkeypatch.setattr(demo, "installed", lambda name: False)  # no export extra: the one-line error
    with pytest.raises(DFlashError, match="needs the export extra"):
        demo.demo_artifact(pair)


# -- the pieces: slots over one set of sessions, prompt reuse, cancellation, streamed text -----------


def test_forks_share_sessions_and_interleave_losslessly(art, offline):
    a = OrtBackend(art, threads=1)
    b = a.fork()
    assert all(a.sessions[k] is b.sessions[k] for k in a.sessions)
    assert a.kv[0] is not b.kv[0] and a.kv[0].ctypes.data != b.kv[0].ctypes.data
    ps = prompts(6, 101, seed=9)
    for p, q in zip(ps[::2], ps[1::2]):  # two sequences advanced alternately, round by round
        ga, gb = Generation(), Generation()
        for _ in itertools.zip_longest(stream(a, p, 30, out=ga), stream(b, q, 30, out=gb)):
            pass
        assert ga.tokens == offline(p, 30).tokens and gb.tokens == offline(q, 30).tokens


def test_prompt_reuse_prefills_only_the_new_part(art, offline):
    backend = OrtBackend(art, threads=1)
    for p in prompts(4, 101, seed=4):
        g = generate(backend, p, 20)
        longer = p + g.tokens[:-1] + [3, 4, 5]
        reuse = min(backend.target_len, backend.context_len)
        assert reuse > len(p) // 2
        again = generate(backend, longer, 20, reuse=reuse)
        assert again.tokens == offline(longer, 20).tokens and again.reused == reuse
        with pytest.raises(InternalError, match="reuse"):
            generate(backend, [1, 2], 5, reuse=2)


def test_cancel_stops_within_one_round(art):
    backend = OrtBackend(art, threads=1)
    engine = Engine([backend, backend.fork()], Text(art), "m", max_queue=2)
    try:
        events: queue.Queue = queue.Queue()
        job = Job(Request([5, 6, 7], 200, speculative=False), emit=events.put)

        def emit(ev):
            events.put(ev)
            if ev[0] == "round":
                engine.cancel(job)

        job.emit = emit
        engine.submit(job)
        got = [events.get(timeout=30)]
        while got[-1][0] != "end":
            got.append(events.get(timeout=30))
        assert [e[0] for e in got] in (["round", "end"], ["round", "round", "end"]) and got[-1][1] == "cancelled"
        deadline = time.monotonic() + 30  # the slot is freed just after its last event
        while engine.idle_slots() != 2:
            assert time.monotonic() < deadline, "the slot was not freed"
            time.sleep(0.01)
    finally:
        engine.close()


def test_text_stream_holds_back_broken_utf8_and_stop_strings():
    tok = Tokenizer.from_file(str(ROOT / "demo/pair/target/tokenizer.json"))
    dec = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    text = "naïve café 日本語 🙂 done"
    ids = tok.encode(text).ids
    assert any(dec(ids[:k]).endswith("\ufffd") for k in range(len(ids)))  # the case is exercised
    ts = TextStream(tok)
    deltas = [ts.push([i]) for i in ids] + [ts.finish()]
    assert "".join(deltas) == dec(ids) == text and not any("\ufffd" in d for d in deltas)
    for stop in ("日本", "🙂 d", "café 日", "e"):
        ts = TextStream(tok, [stop, "not there"])
        deltas = [ts.push([i]) for i in ids] + [ts.finish()]
        assert "".join(deltas) == text[: text.index(stop)] and ts.stopped
        assert not any(stop in "".join(deltas[: i + 1]) for i in range(len(deltas)))
        whole = TextStream(tok, [stop, "not there"])  # one round of all tokens: kept up to the stop's last one
        assert whole.push(ids) == text[: text.index(stop)] and ids[: len(whole.tokens)] == whole.tokens
        assert stop in dec(whole.tokens) and stop not in dec(whole.tokens[:-1])
    ts = TextStream(tok, ["done!"])  # a stop string's prefix is held back, then released at the end
    out = "".join(ts.push([i]) for i in ids)
    assert out == text[: -len("done")] and ts.finish() == "done" and not ts.stopped


def _scope(method: str, path: str, body: bytes = b"") -> dict:
    return {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
            "headers": [(b"content-length", str(len(body)).encode())], "scheme": "http", "server": ("t", 80),
            "client": ("t", 1), "root_path": "", "http_version": "1.1", "asgi": {"version": "3.0"}}


async def _call(app, method: str, path: str, body: bytes = b"", disconnect=None):
    """One request straight into the ASGI app: (status, body as JSON or else text, headers). After the
    body, receive() blocks until the asyncio.Event `disconnect` is set, then reports the client gone."""
    sent, first = [], True

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnect is None:
            await asyncio.Event().wait()  # never: the client stays
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(_scope(method, path, body), receive, send)
    data = b"".join(m.get("body", b"") for m in sent[1:])
    try:
        return sent[0]["status"], json.loads(data), dict(sent[0]["headers"])
    except ValueError:
        return sent[0]["status"], data.decode(), dict(sent[0]["headers"])


def test_health_is_503_until_the_engine_is_loaded(art):
    """The app answers before the model is loaded (and the factory takes an engine loaded elsewhere)."""
    from dflash_export.cli.serve import _is_loopback
    from dflash_export.serve.engine import load_engine

    options = ServeOptions(art)
    status, body, headers = asyncio.run(_call(create_app(options), "GET", "/health"))  # lifespan not run: not loaded
    assert status == 503 and body["error"]["code"] == "loading" and headers[b"x-dflash-replica"].endswith(b"/-")
    engine = load_engine(ServeOptions(art, slots=2, model_name="given"))
    try:
        status, body, _ = asyncio.run(_call(create_app(options, engine=engine), "GET", "/v1/models"))
        assert status == 200 and body["data"][0]["id"] == "given"
    finally:
        engine.close()
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and not _is_loopback("0.0.0.0")


class Gated:
    """A backend whose target calls after the first wait for `gate`: a generation held mid-way."""

    def __init__(self, backend):
        self.backend, self.gate, self.calls = backend, threading.Event(), 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def target_rows(self, *args, **kwargs):  # the loop's target call (runtime/backend.py: rows)
        self.calls += 1
        if self.calls > 1:
            assert self.gate.wait(60), "the gate was never opened"
        return self.backend.target_rows(*args, **kwargs)


def test_disconnect_cancels_a_non_streamed_request(art):
    """No response is being streamed, so only the app's own watch on the connection can notice."""
    gated = Gated(OrtBackend(art, threads=1))
    engine = Engine([gated], Text(art), "m", max_queue=2)
    app = create_app(ServeOptions(art), engine=engine)
    n = 200
    body = json.dumps({"prompt": "zz", "max_tokens": n, "temperature": 0, "speculative": False}).encode()

    async def run():
        gone = asyncio.Event()
        request = asyncio.create_task(_call(app, "POST", "/v1/completions", body, disconnect=gone))
        for _ in range(6000):  # the job is in its slot, held at its first round
            if gated.calls >= 2 or request.done():
                break
            await asyncio.sleep(0.01)
        assert gated.calls >= 2 and engine.slots[0].job is not None
        job = engine.slots[0].job
        gone.set()
        for _ in range(6000):
            if job.cancelled.is_set():
                break
            await asyncio.sleep(0.01)
        assert job.cancelled.is_set(), "the disconnect did not cancel the job"
        gated.gate.set()
        return await asyncio.wait_for(request, 60)

    try:
        status, _, _ = asyncio.run(run())
        assert status == 503  # nobody reads it
        cancelled = engine.metrics.registry.get_sample_value("dflash:request_success_total",
                                                             {"model_name": "m", "finished_reason": "cancelled"})
        assert cancelled == 1
        assert gated.calls <= 3  # prefill, the held round, at most one more
        deadline = time.monotonic() + 30
        while engine.idle_slots() != 1:
            assert time.monotonic() < deadline, "the slot was not freed"
            time.sleep(0.01)
    finally:
        gated.gate.set()
        engine.close()


def test_chat_templates_are_sandboxed(tmp_path):
    char_tokenizer(tmp_path / "tokenizer.json")
    for template, words in (("{{ messages.__class__.__mro__[1].__subclasses__() }}", "refused"),
                            ("{{ raise_exception('only user turns') }}", "only user turns"),
                            ("{% for m in messages %}{{ m.content | tojson }}{% endfor %}", None)):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        text = Text(tmp_path)
        if words is None:
            assert text.render([{"role": "user", "content": "a\"b"}]) == '"a\\"b"'
        else:
            with pytest.raises(ValueError, match=words):
                text.render([{"role": "user", "content": "x"}])


class Broken:
    """A backend whose verify breaks an invariant (a bug, as the runtime's InternalError says)."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def target_rows(self, *args, **kwargs):  # the loop's target call (runtime/backend.py: rows)
        raise InternalError("commit(9) but the last target call wrote 3 positions")


def test_a_bug_is_a_500_with_code_internal_error(art):
    engine = Engine([Broken(OrtBackend(art, threads=1))], Text(art), "m", max_queue=2)
    try:
        body = json.dumps({"prompt": "z", "max_tokens": 5, "temperature": 0}).encode()
        status, got, _ = asyncio.run(asyncio.wait_for(_call(create_app(ServeOptions(art), engine=engine), "POST",
                                                            "/v1/completions", body), 60))
        assert status == 500 and got["error"]["code"] == "internal_error", got
        assert "commit(9)" in got["error"]["message"]
    finally:
        engine.close()
