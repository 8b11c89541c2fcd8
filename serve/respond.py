"""One API request's generations and its response: `respond(...)`, for both endpoints.

A request becomes one Job per choice: each prompt (completions take several) times `n`
samples, sample i seeded `seed + i`. They queue and run like any other requests (a batched
server runs them as rows of the same rounds), and their events, tagged with the choice
index, make one response: a JSON body once all have ended, or Server-Sent Events as rounds
arrive (choices interleaved, each chunk naming its `index`). An error or a shutdown's cancel
in any choice ends the whole response. With `logprobs` the loop records the target's own
log-probabilities (runtime/logprobs.py), shaped here by serve/logprobs.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.logprobs import Logprobs
from .jobs import Job, Params, QueueFull, Unavailable, replica
from .logprobs import merge
from .requests import ERROR_TYPES, REPLICA, ApiError, Common, build_params
from .text import TextStream

INTERNAL = "internal_error"  # the code of every 500: a bug (runtime.errors.InternalError or anything unforeseen)
CANCELLED = "the server is shutting down: the generation was cancelled; retry"


@dataclasses.dataclass
class Want:
    """What the response carries beside the text: log-probabilities (`k` alternatives per token,
    None: none) in the chat or completions shape, the prompt echoed, no generated tokens."""

    k: int | None = None
    echo: bool = False
    discard: bool = False  # max_tokens 0 with echo: the prompt only (one token is generated and dropped)


async def respond(engine, request: Request, body: Common, prompts: list[list[int]], max_tokens: int | None,
                  chat: bool, default_max: int, want: Want, max_param: str = "max_tokens"):
    n = 1 if body.n is None else body.n
    params = [build_params(engine, body, ids, 1 if want.discard else max_tokens, default_max, max_param)
              for ids in prompts]
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    jobs = []
    for p in params:
        for i in range(n):
            c = len(jobs)
            q = dataclasses.replace(p, sampling=dataclasses.replace(p.sampling, seed=(p.sampling.seed + i) % 2**64))
            lp = Logprobs(want.k, want.echo) if want.k is not None else None
            jobs.append(Job(q, emit=lambda ev, c=c: loop.call_soon_threadsafe(events.put_nowait, (c, ev)),
                            text=TextStream(engine.text.decode, q.stop), logprobs=lp))
    for i, job in enumerate(jobs):
        try:
            engine.submit(job)
        except (QueueFull, Unavailable) as e:
            for j in jobs[:i]:
                engine.cancel(j)
            if isinstance(e, Unavailable):
                raise ApiError(503, str(e), code="shutting_down") from None
            more = f" (this request needs {len(jobs)} rows: {len(prompts)} prompts x n {n})" if len(jobs) > 1 else ""
            raise ApiError(429, str(e) + more, code="queue_full", headers={"retry-after": "1"}) from None
    watcher = asyncio.create_task(_watch_disconnect(request, engine, jobs))

    def cancel_all():
        watcher.cancel()
        for j in jobs:
            engine.cancel(j)

    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    created, name = int(time.time()), engine.model
    try:
        first = await events.get()  # the first event (headers wait for it)
    except BaseException:
        cancel_all()
        raise
    if first[1][0] == "error" or first[1][:2] == ("end", "cancelled"):
        cancel_all()
        _raise(first[1])
    headers = {REPLICA: replica(jobs[first[0]].slot)}
    pieces = engine.text.pieces
    prompt_text = [engine.text.decode(j.params.prompt) if want.echo else "" for j in jobs]
    obj = "chat.completion" if chat else "text_completion"

    def usage(ends: dict) -> dict:
        gens = [ends[c][2] for c in sorted(ends)]
        out = [0 if want.discard else len(g.tokens) for g in gens]
        prompt = sum(g.prompt_len for g in gens[::n])  # each prompt once, whatever n
        cached = sum(g.reused for g in gens[::n])
        request.state.dflash_tokens = (prompt, sum(out))  # the access log's
        return {"prompt_tokens": prompt, "completion_tokens": sum(out), "total_tokens": prompt + sum(out),
                "prompt_tokens_details": {"cached_tokens": cached}}

    if not body.stream:
        texts, ends, ev = [[] for _ in jobs], {}, first
        try:
            while True:
                c, e = ev
                if e[0] == "error" or e[:2] == ("end", "cancelled"):  # only a shutdown cancels (a client is gone)
                    _raise(e)
                if e[0] == "round":
                    texts[c].append(e[2])
                else:
                    ends[c] = e
                    if len(ends) == len(jobs):
                        break
                ev = await events.get()
        finally:
            cancel_all()
        choices = []
        for c, job in enumerate(jobs):
            _, finish, g, tail = ends[c]
            toks, text = ([], "") if want.discard else (g.tokens, "".join(texts[c]) + tail)
            choice = {"index": c, "finish_reason": "length" if want.discard else _finish(finish), "logprobs": None,
                      "token_ids": toks}
            lp = job.logprobs
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                if lp is not None:
                    choice["logprobs"] = {"content": pieces.chat(lp.tokens[: len(toks)], toks, []), "refusal": None}
            else:
                choice["text"] = prompt_text[c] + text
                if lp is not None:
                    head = pieces.legacy(lp.prompt, job.params.prompt, [], 0)[0] if want.echo else None
                    choice["logprobs"] = merge(head, pieces.legacy(lp.tokens[: len(toks)], toks, [],
                                                                   len(prompt_text[c]))[0])
            choices.append(choice)
        out = {"id": rid, "object": obj, "created": created, "model": name, "choices": choices,
               "usage": usage(ends), "timings": _timings(engine, ends[0][2], jobs[0].params)}
        return JSONResponse(out, headers=headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    usage_null = {"usage": None} if include_usage else {}  # as OpenAI: null on all but the usage chunk
    obj += ".chunk" if chat else ""
    sent = [0] * len(jobs)  # tokens of each choice sent so far
    echoed: set[int] = set()  # choices whose prompt was sent
    offset = [len(t) for t in prompt_text]  # the legacy text_offset of each choice's next token

    def chunk(c: int, delta: str | None, token_ids: list[int], finish: str | None, logprobs=None, **extra) -> str:
        if chat:
            d = {} if delta is None else {"content": delta}
            ch = {"index": c, "delta": d, "finish_reason": finish, "logprobs": logprobs, "token_ids": token_ids}
        else:
            ch = {"index": c, "text": delta or "", "finish_reason": finish, "logprobs": logprobs, "token_ids": token_ids}
        obj_ = {"id": rid, "object": obj, "created": created, "model": name, "choices": [ch], **usage_null, **extra}
        return f"data: {json.dumps(obj_)}\n\n"

    def round_chunk(c: int, new: list[int], delta: str) -> str | None:
        job, lp, head = jobs[c], jobs[c].logprobs, None
        if want.discard:
            new, delta = [], ""
        if want.echo and c not in echoed:  # the prompt first, once
            echoed.add(c)
            delta = prompt_text[c] + delta
            if lp is not None and not chat:
                head = pieces.legacy(lp.prompt, job.params.prompt, [], 0)[0]
        elif not new and not delta:
            return None
        logprobs = None
        if lp is not None:
            entries, before = lp.tokens[sent[c] : sent[c] + len(new)], job.text.tokens[: sent[c]]
            if chat:
                logprobs = {"content": pieces.chat(entries, new, before), "refusal": None}
            else:
                body_, offset[c] = pieces.legacy(entries, new, before, offset[c])
                logprobs = merge(head, body_)
        sent[c] += len(new)
        return chunk(c, delta, new, None, logprobs)

    async def sse():
        ev, ends = first, {}
        try:
            if chat:
                for c in range(len(jobs)):
                    role = {"id": rid, "object": obj, "created": created, "model": name,
                            "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None, "logprobs": None}], **usage_null}
                    yield f"data: {json.dumps(role)}\n\n"
            while True:
                c, e = ev
                if e[0] == "error" or e[1] == "cancelled":  # the status is sent: an error event (openai raises it)
                    err = {"message": e[1], "type": "server_error", "param": None, "code": INTERNAL} if e[0] == "error" \
                        else {"message": CANCELLED, "type": ERROR_TYPES[503], "param": None, "code": "shutting_down"}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    break
                if e[0] == "round":
                    out = round_chunk(c, e[1], e[2])
                    if out is not None:
                        yield out
                else:
                    ends[c] = e
                    _, finish, g, tail = e
                    if want.echo and c not in echoed:
                        yield round_chunk(c, [], "")
                    yield chunk(c, None if want.discard else tail or None, [],
                                "length" if want.discard else _finish(finish), timings=_timings(engine, g, jobs[c].params))
                    if len(ends) == len(jobs):
                        if include_usage:
                            u = {"id": rid, "object": obj, "created": created, "model": name, "choices": [],
                                 "usage": usage(ends)}
                            yield f"data: {json.dumps(u)}\n\n"
                        else:
                            usage(ends)
                        break
                ev = await events.get()
            yield "data: [DONE]\n\n"
        finally:
            cancel_all()

    return StreamingResponse(sse(), media_type="text/event-stream", headers=headers | {"cache-control": "no-cache"})


def _raise(e: tuple):
    if e[0] == "error":
        raise ApiError(500, e[1], code=INTERNAL)
    raise ApiError(503, CANCELLED, code="shutting_down")


async def _watch_disconnect(request: Request, engine, jobs: list[Job]) -> None:
    """Cancel the jobs when the client goes away (the body is already read: only disconnects arrive)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            for j in jobs:
                engine.cancel(j)
            return


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _timings(engine, g, p: Params) -> dict:
    """llama.cpp's keys (+ rounds, mean_acceptance_length, cache_n)."""
    rounds = len(g.acceptance_lengths)
    k = engine.manifest.block_size if p.speculative else 1
    drafted = [a for a, d in zip(g.acceptance_lengths, g.drafted) if d] if p.speculative else []
    predicted_ms = g.decode_s * 1e3
    return {"cache_n": g.reused, "prompt_n": g.prompt_len - g.reused, "prompt_ms": g.prefill_s * 1e3,
            "predicted_n": len(g.tokens), "predicted_ms": predicted_ms,
            "predicted_per_second": g.tokens_per_second,
            "draft_n": len(drafted) * (k - 1), "draft_n_accepted": sum(a - 1 for a in drafted),
            "rounds": rounds, "plain_rounds": rounds - len(drafted) if p.speculative else rounds,
            "mean_acceptance_length": g.tau, "speculative": p.speculative}
