"""The OpenAI fields evaluation tools need, through a real server (tests/test_serve.py's Server:
torch blocked, ephemeral port, stopped by its pid) and the official openai client:
`logprobs` / `echo` / token-id prompts / several prompts / `max_tokens: 0` on completions,
`logprobs` + `top_logprobs` on chat, streamed and not; `n > 1` with seeds seed + i; `best_of`;
the caps; the latency histograms; the access log; a `code` on every error body.

Every log-probability is compared with the loop run offline on the same artifact
(runtime/logprobs.py, itself held to transformers and to plain decoding in
tests/test_logprobs.py); a greedy speculative request's with its `speculative: false` twin.
"""

from __future__ import annotations

import json
import re
import signal
from types import SimpleNamespace

import openai
import pytest
from runtime_cases import prompts
from test_serve import Server, running, art, decode, tok  # noqa: F401 (fixtures)

from dflash_export.runtime.controller import controller_for
from dflash_export.runtime.logprobs import Logprobs
from dflash_export.runtime.sampling import Sampling
from dflash_export.runtime.loop import Request, generate_batch
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import load_settings
from dflash_export.serve.requests import ApiError
from dflash_export.serve.validate import check_logprobs


@pytest.fixture(scope="module")
def server(art, tmp_path_factory):
    yield from running(art, tmp_path_factory.mktemp("log") / "serve.log", "--max-batch", 3)


@pytest.fixture(scope="module")
def loop(art):
    """The loop offline: (tokens, Logprobs) of one request, speculation auto as the server runs it
    (a sampled row's draws depend on which of its rounds drafted)."""
    be = OrtBackend(art, threads=1)
    costs = load_settings(art, "ort:cpu").costs

    def run(prompt, n, k=5, echo=False, draft=True, temperature=0.0, seed=0):
        lp, kw = Logprobs(k, echo), dict(sampling=Sampling(temperature, seed=seed))
        control = controller_for("auto", costs, be.manifest.block_size) if draft else None
        (g,), _ = generate_batch(be, [Request(list(prompt), n, logprobs=lp, **kw)], draft=draft, control=control)
        return g.tokens, lp
    return run


def _close(a, b, tol=1e-5):
    return all((x is None and y is None) or abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def test_completion_logprobs_equal_the_loop_and_plain_decoding(server, loop, tok):
    c = server.client()
    for p in prompts(3, 101, seed=21):
        spec = c.completions.create(model="tiny-chat", prompt=p, max_tokens=24, temperature=0, logprobs=5)
        plain = c.completions.create(model="tiny-chat", prompt=p, max_tokens=24, temperature=0, logprobs=5,
                                     extra_body={"speculative": False})
        tokens, lp = loop(p, 24)
        ch, lpo = spec.choices[0], spec.choices[0].logprobs
        assert ch.token_ids == tokens == plain.choices[0].token_ids
        assert _close(lpo.token_logprobs, [e.logprob for e in lp.tokens], 1e-6)
        assert _close(lpo.token_logprobs, plain.choices[0].logprobs.token_logprobs)
        assert len(lpo.tokens) == len(tokens) and "".join(lpo.tokens) == ch.text
        assert lpo.text_offset == [len("".join(lpo.tokens[:i])) for i in range(len(tokens))]
        for v, top in zip(lpo.token_logprobs, lpo.top_logprobs):
            assert 5 <= len(top) <= 6 and v == max(top.values())  # greedy: lm-eval's is_greedy, exact
        assert spec.timings["mean_acceptance_length"] > 1  # it really ran speculatively


def test_echo_token_prompts_and_max_tokens_0_as_lm_eval_sends_them(server, loop, tok):
    """lm-eval's local-completions loglikelihood: token-id prompts (several per request), echo,
    max_tokens 1, logprobs 1, temperature 0; it sums token_logprobs[ctxlen:-1]. And max_tokens 0."""
    ps = [p * 2 for p in prompts(3, 101, seed=5)]
    r = server.raw("POST", "/v1/completions", {"model": "tiny-chat", "prompt": ps, "echo": True, "max_tokens": 1,
                                                "logprobs": 1, "temperature": 0, "seed": 1234})
    assert r[0] == 200, r
    choices = sorted(r[2]["choices"], key=lambda ch: ch["index"])
    assert [ch["index"] for ch in choices] == [0, 1, 2]
    for p, ch in zip(ps, choices):
        tokens, lp = loop(p, 1, k=1, echo=True)
        lo = ch["logprobs"]
        assert len(lo["token_logprobs"]) == len(p) + 1 and lo["token_logprobs"][0] is None and lo["top_logprobs"][0] is None
        assert _close(lo["token_logprobs"], [None] + [e.logprob for e in lp.prompt[1:]] + [lp.tokens[0].logprob], 1e-6)
        assert ch["text"] == decode(tok, p) + decode(tok, tokens) and lo["text_offset"][len(p)] == len(decode(tok, p))
        for v, top in zip(lo["token_logprobs"][1:], lo["top_logprobs"][1:]):
            assert (v == max(top.values())) == (len(top) == 1)  # lm-eval's is_greedy
    assert r[2]["usage"]["prompt_tokens"] == sum(map(len, ps))
    r0 = server.client().completions.create(model="tiny-chat", prompt=ps[0], echo=True, max_tokens=0, logprobs=0)
    ch = r0.choices[0]
    assert ch.text == decode(tok, ps[0]) and ch.token_ids == [] and r0.usage.completion_tokens == 0
    assert ch.logprobs.token_logprobs[1:] == lo_prompt(choices[0]) and ch.finish_reason == "length"
    echo_only = server.client().completions.create(model="tiny-chat", prompt="abc", echo=True, max_tokens=3)
    assert echo_only.choices[0].text.startswith("abc") and echo_only.choices[0].logprobs is None


def lo_prompt(ch):
    return ch["logprobs"]["token_logprobs"][1:-1]


def test_streamed_logprobs_equal_the_response(server):
    c = server.client()
    p = prompts(1, 101, seed=8)[0]
    whole = c.completions.create(model="tiny-chat", prompt=p, max_tokens=30, temperature=0, logprobs=2, echo=True)
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for ev in c.completions.create(model="tiny-chat", prompt=p, max_tokens=30, temperature=0, logprobs=2, echo=True,
                                   stream=True):
        ch = ev.choices[0]
        text += ch.text
        if ch.logprobs is not None:
            for k in got:
                got[k] += getattr(ch.logprobs, k)
    w = whole.choices[0]
    assert text == w.text and got["tokens"] == w.logprobs.tokens and got["text_offset"] == w.logprobs.text_offset
    assert got["token_logprobs"] == w.logprobs.token_logprobs and got["top_logprobs"] == w.logprobs.top_logprobs


def test_chat_logprobs_streamed_and_not(server, loop, tok):
    c = server.client()
    msgs = [{"role": "user", "content": "hello there"}]
    r = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=20, temperature=0, logprobs=True,
                                  top_logprobs=3)
    ids = server.raw("POST", "/tokenize", {"messages": msgs})[2]["tokens"]
    tokens, lp = loop(ids, 20, k=3)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == decode(tok, tokens) == "".join(e.token for e in content)
    assert _close([e.logprob for e in content], [e.logprob for e in lp.tokens], 1e-6)
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob for e in content)
    assert all(e.bytes == list(e.token.encode()) for e in content)
    streamed = []
    for ev in c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=20, temperature=0, logprobs=True,
                                        top_logprobs=3, stream=True):
        if ev.choices and ev.choices[0].logprobs is not None:
            streamed += ev.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=5, temperature=0, logprobs=True)
    assert plain.choices[0].logprobs.content[0].top_logprobs == []


def test_n_samples_are_seed_plus_i_in_one_batch(server, loop):
    c = server.client()
    p = prompts(1, 101, seed=3)[0]
    r = c.completions.create(model="tiny-chat", prompt=p, max_tokens=12, temperature=1.0, seed=40, n=3)
    want = [loop(p, 12, temperature=1.0, seed=40 + i)[0] for i in range(3)]
    assert [ch.token_ids for ch in sorted(r.choices, key=lambda ch: ch.index)] == want
    assert len({tuple(w) for w in want}) > 1  # the samples differ
    streamed = {i: [] for i in range(3)}
    for ev in c.completions.create(model="tiny-chat", prompt=p, max_tokens=12, temperature=1.0, seed=40, n=3,
                                   stream=True, best_of=3):
        for ch in ev.choices:
            streamed[ch.index] += ch.token_ids or []
    assert [streamed[i] for i in range(3)] == want
    chat = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                     temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_bad_fields_are_one_line_400s_and_every_error_has_a_code(server):
    bad = [({"prompt": "a", "logprobs": 6}, "logprobs must be between 0 and 5"),
           ({"prompt": "a", "logprobs": -1}, "logprobs must be between 0 and 5"),
           ({"prompt": "a", "best_of": 2}, "best_of 2 is not supported"),
           ({"prompt": "a", "n": 3, "best_of": 2}, "best_of must be at least n"),
           ({"prompt": "a", "n": 0}, "n must be >= 1"),
           ({"prompt": "a", "n": 65}, "choices per request"),
           ({"prompt": "a", "max_tokens": 0}, "0 only with echo"),
           ({"prompt": "a", "suffix": "b"}, "suffix is not supported")]
    for body, msg in bad:
        st, _, out = server.raw("POST", "/v1/completions", body)
        assert st == 400 and msg in out["error"]["message"] and out["error"]["code"], (body, out)
        assert "\n" not in out["error"]["message"]
    chat = [({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
            ({"top_logprobs": 2}, "top_logprobs needs logprobs: true")]
    for extra, msg in chat:
        st, _, out = server.raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]} | extra)
        assert st == 400 and msg in out["error"]["message"] and out["error"]["code"], out
    others = [("GET", "/nowhere", None), ("DELETE", "/v1/completions", None), ("POST", "/v1/completions", "{bad"),
              ("POST", "/v1/completions", {"model": "other", "prompt": "a"}),
              ("POST", "/v1/completions", {"prompt": [1000]}), ("POST", "/v1/completions", {"prompt": ""})]
    for method, path, body in others:
        st, _, out = server.raw(method, path, body)
        assert st >= 400 and isinstance(out["error"]["code"], str) and out["error"]["code"], (path, out)
    r = server.raw("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2})  # no model: accepted
    assert r[0] == 200, r
    with pytest.raises(ApiError, match="re-export"):  # an export made before logits_index
        check_logprobs(SimpleNamespace(manifest=SimpleNamespace(ragged=False)), 1, 5, "logprobs")


def test_latency_histograms_and_access_log(server):
    c = server.client()
    n0, t0 = server.metric("dflash:inter_token_latency_seconds_count"), \
        server.metric("dflash:request_time_per_output_token_seconds_count")
    r = c.completions.create(model="tiny-chat", prompt="hello", max_tokens=17, temperature=0,
                             extra_body={"stop_token_ids": []})
    assert r.usage.completion_tokens == 17
    assert server.metric("dflash:inter_token_latency_seconds_count") - n0 == 16  # every token after the first
    assert server.metric("dflash:request_time_per_output_token_seconds_count") - t0 == 1
    text = server.raw("GET", "/metrics")[2]
    assert "observes t/n, n times" in text
    lines = server.log.read_text().splitlines()
    assert any(re.search(r'"POST /v1/completions" 200 prompt_tokens=5 completion_tokens=17 \d+\.\d+s$', x)
               for x in lines), lines[-5:]
    assert any('"GET /nowhere" 404' in x for x in lines)
