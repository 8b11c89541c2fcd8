"""One API request's generations and its response, for both endpoints: `respond(engine, request, plan)`.

A validated request (serve/validate.py Plan) is one Job per choice: each prompt (completions
take several) times `n` samples, sample j seeded `seed + j`. `fan_out` submits them: they queue
and run like any other requests (a batched server runs them as rows of the same rounds), and
their events, tagged with the choice index, make one response: `body`, a JSON body once all
have ended, or `sse`, Server-Sent Events as rounds arrive (choices interleaved, each chunk
naming its `index`). An error or a shutdown's cancel in any choice ends the whole response.
With `logprobs` the loop records the target's own log-probabilities (runtime/logprobs.py),
shaped here by serve/logprobs.py.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .jobs import Job, QueueFull, Unavailable, replica
from .formats import assemble
from .logprobs import merge
from .requests import ERROR_TYPES, REPLICA, ApiError
from .text import TextStream
from .validate import Plan

INTERNAL = "internal_error"  # the code of every 500: a bug (runtime.errors.InternalError or anything unforeseen)
CANCELLED = "the server is shutting down: the generation was cancelled; retry"


@dataclass
class Response:
    """What the body and the stream share: the plan, its jobs and events, the response's names."""

    engine: object
    request: Request
    plan: Plan
    jobs: list[Job]
    events: asyncio.Queue
    cancel: object  # () -> None: cancel every job and the disconnect watch
    first: tuple  # the first event (the headers wait for it)
    rid: str
    created: int
    prompt_text: list[str]  # each choice's prompt text when echoed, else ""

    @property
    def object(self) -> str:
        return "chat.completion" if self.plan.chat else "text_completion"

    def usage(self, ends: dict) -> dict:
        gens = [ends[c][2] for c in sorted(ends)]
        out = [0 if self.plan.want.discard else len(g.tokens) for g in gens]
        n = self.plan.n
        prompt = sum(g.prompt_len for g in gens[::n])  # each prompt once, whatever n
        cached = sum(g.reused for g in gens[::n])
        self.request.state.dflash_tokens = (prompt, sum(out))  # the access log's
        return {"prompt_tokens": prompt, "completion_tokens": sum(out), "total_tokens": prompt + sum(out),
                "prompt_tokens_details": {"cached_tokens": cached}}


async def respond(engine, request: Request, plan: Plan):
    r = await fan_out(engine, request, plan)
    headers = {REPLICA: replica(r.jobs[r.first[0]].slot)}
    if not plan.stream:
        return JSONResponse(await body(r), headers=headers)
    return StreamingResponse(sse(r), media_type="text/event-stream", headers=headers | {"cache-control": "no-cache"})


async def fan_out(engine, request: Request, plan: Plan) -> Response:
    """Submit a job per choice (all or none: a full queue refuses the whole request, 429) and
    wait for the first event; a disconnected client cancels them all."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    jobs = [Job(q, emit=lambda ev, c=c: loop.call_soon_threadsafe(events.put_nowait, (c, ev)),
                text=TextStream(engine.text, plan.stop, plan.shape is not None and plan.shape.fmt.specials),
                cache_prompt=plan.cache_prompt)
            for c, q in enumerate(plan.requests)]
    for i, job in enumerate(jobs):
        try:
            engine.submit(job)
        except (QueueFull, Unavailable) as e:
            for j in jobs[:i]:
                engine.cancel(j)
            if isinstance(e, Unavailable):
                raise ApiError(503, str(e), code="shutting_down") from None
            more = f" (this request needs {len(jobs)} rows: prompts x n {plan.n})" if len(jobs) > 1 else ""
            raise ApiError(429, str(e) + more, code="queue_full", headers={"retry-after": "1"}) from None
    watcher = asyncio.create_task(_watch_disconnect(request, engine, jobs))

    def cancel_all():
        watcher.cancel()
        for j in jobs:
            engine.cancel(j)

    try:
        first = await events.get()
    except BaseException:
        cancel_all()
        raise
    if first[1][0] == "error" or first[1][:2] == ("end", "cancelled"):
        cancel_all()
        _raise(first[1])
    prompt_text = [engine.text.decode(j.request.prompt) if plan.want.echo else "" for j in jobs]
    return Response(engine, request, plan, jobs, events, cancel_all, first,
                    ("chatcmpl-" if plan.chat else "cmpl-") + secrets.token_hex(12), int(time.time()), prompt_text)


async def body(r: Response) -> dict:
    """The whole response once every choice has ended."""
    plan, jobs, pieces = r.plan, r.jobs, r.engine.text.pieces
    want, chat = plan.want, plan.chat
    texts, ends, ev = [[] for _ in jobs], {}, r.first
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
            ev = await r.events.get()
    finally:
        r.cancel()
    choices = []
    for c, job in enumerate(jobs):
        _, finish, g, tail = ends[c]
        toks, text = ([], "") if want.discard else (g.tokens, "".join(texts[c]) + tail)
        choice = {"index": c, "finish_reason": "length" if want.discard else _finish(finish), "logprobs": None,
                  "token_ids": toks}
        lp = job.logprobs
        if chat:
            choice["message"], calls = message(plan, text)
            if calls and finish != "length":
                choice["finish_reason"] = "tool_calls"
            if lp is not None:
                choice["logprobs"] = {"content": pieces.chat(lp.tokens[: len(toks)], toks, []), "refusal": None}
        else:
            choice["text"] = r.prompt_text[c] + text
            if lp is not None:
                head = pieces.legacy(lp.prompt, job.request.prompt, [], 0)[0] if want.echo else None
                choice["logprobs"] = merge(head, pieces.legacy(lp.tokens[: len(toks)], toks, [],
                                                               len(r.prompt_text[c]))[0])
        choices.append(choice)
    return {"id": r.rid, "object": r.object, "created": r.created, "model": r.engine.model, "choices": choices,
            "usage": r.usage(ends), "timings": _timings(r.engine, ends[0][2], jobs[0].request)}


def message(plan: Plan, text: str) -> tuple[dict, bool]:
    """The assistant's message of a whole completion: its reasoning, content and tool calls (serve/formats.py)."""
    parser = plan.shape.parser() if plan.shape is not None else None
    if parser is None:
        return {"role": "assistant", "content": text}, False
    reasoning, content, calls = assemble(parser.push(text) + parser.finish())
    calls = calls if plan.shape.parallel else calls[:1]
    msg = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [{k: v for k, v in c.openai(i).items() if k != "index"} for i, c in enumerate(calls)]
    return msg, bool(calls)


async def sse(r: Response):
    """Server-Sent Events: a chunk per round of each choice, its end, the usage, [DONE]."""
    plan, jobs, engine, pieces = r.plan, r.jobs, r.engine, r.engine.text.pieces
    want, chat = plan.want, plan.chat
    usage_null = {"usage": None} if plan.include_usage else {}  # as OpenAI: null on all but the usage chunk
    obj = r.object + (".chunk" if chat else "")
    head = {"id": r.rid, "object": obj, "created": r.created, "model": engine.model}
    sent = [0] * len(jobs)  # tokens of each choice sent so far
    echoed: set[int] = set()  # choices whose prompt was sent
    offset = [len(t) for t in r.prompt_text]  # the legacy text_offset of each choice's next token
    parsers = [plan.shape.parser() if chat and plan.shape is not None else None for _ in jobs]
    ncalls = [0] * len(jobs)  # tool calls sent per choice

    def deltas(c: int, events: list[tuple]) -> list[dict]:
        """A choice's parsed events as chat deltas (a call whole, in one delta; parallel false: the first only)."""
        out = []
        for kind, v in events:
            if kind == "call":
                if ncalls[c] and not plan.shape.parallel:
                    continue
                out.append({"tool_calls": [v.openai(ncalls[c])]})
                ncalls[c] += 1
            else:
                out.append({"reasoning_content" if kind == "reasoning" else "content": v})
        return out

    def chunk(c: int, delta, token_ids: list[int], finish: str | None, logprobs=None, **extra) -> str:
        if chat:
            d = {} if delta is None else delta if isinstance(delta, dict) else {"content": delta}
            ch = {"index": c, "delta": d, "finish_reason": finish, "logprobs": logprobs, "token_ids": token_ids}
        else:
            ch = {"index": c, "text": delta or "", "finish_reason": finish, "logprobs": logprobs,
                  "token_ids": token_ids}
        return f"data: {json.dumps({**head, 'choices': [ch], **usage_null, **extra})}\n\n"

    def round_chunk(c: int, new: list[int], delta: str) -> str | None:
        job, lp, echo_head = jobs[c], jobs[c].logprobs, None
        if want.discard:
            new, delta = [], ""
        if want.echo and c not in echoed:  # the prompt first, once
            echoed.add(c)
            delta = r.prompt_text[c] + delta
            if lp is not None and not chat:
                echo_head = pieces.legacy(lp.prompt, job.request.prompt, [], 0)[0]
        elif not new and not delta:
            return None
        logprobs = None
        if lp is not None:
            entries, before = lp.tokens[sent[c] : sent[c] + len(new)], job.text.tokens[: sent[c]]
            if chat:
                logprobs = {"content": pieces.chat(entries, new, before), "refusal": None}
            else:
                body_, offset[c] = pieces.legacy(entries, new, before, offset[c])
                logprobs = merge(echo_head, body_)
        sent[c] += len(new)
        if parsers[c] is None:
            return chunk(c, delta, new, None, logprobs)
        ds = deltas(c, parsers[c].push(delta)) or [{}]  # the round's token ids ride on its first delta
        return "".join(chunk(c, d, new if i == 0 else [], None, logprobs if i == 0 else None) for i, d in enumerate(ds))

    ev, ends = r.first, {}
    try:
        if chat:
            for c in range(len(jobs)):
                role = {**head, "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
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
                reason = "length" if want.discard else _finish(finish)
                if parsers[c] is not None:
                    for d in deltas(c, parsers[c].push(tail) + parsers[c].finish()):
                        yield chunk(c, d, [], None)
                    tail = None
                    if ncalls[c] and reason != "length":
                        reason = "tool_calls"
                yield chunk(c, None if want.discard else tail or None, [], reason,
                            timings=_timings(engine, g, jobs[c].request))
                if len(ends) == len(jobs):
                    u = r.usage(ends)
                    if plan.include_usage:
                        yield f"data: {json.dumps({**head, 'choices': [], 'usage': u})}\n\n"
                    break
            ev = await r.events.get()
        yield "data: [DONE]\n\n"
    finally:
        r.cancel()


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


def _timings(engine, g, p) -> dict:
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
