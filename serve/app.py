"""The OpenAI-compatible HTTP app (FastAPI) over the engine: `create_app(options) -> ASGI app`.

Model loading is separate from the process: the app starts answering at once (/health is
503 until the engine is loaded in a background thread), or takes an engine loaded by the
caller (`create_app(options, engine=...)`, e.g. one replica of a Ray Serve deployment).

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}` with its
status; bad input is never a 500 and never a traceback. Every response carries
`x-dflash-replica: HOST/PID/SLOT` (SLOT is `-` when no slot served it).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.errors import DFlashError
from .engine import Engine, Job, Params, QueueFull, Unavailable, load_engine, replica
from .requests import (
    ERROR_TYPES, ApiError, ChatRequest, Common, CompletionRequest, DetokenizeRequest, TokenizeRequest, build_params,
    REPLICA, Guard, check_common, check_ids, check_model, error_response, parse_body, render_chat,
)
from .text import TextStream

INTERNAL = "internal_error"  # the code of every 500: a bug (runtime.errors.InternalError or anything unforeseen)
CANCELLED = "the server is shutting down: the generation was cancelled; retry"


@dataclass
class ServeOptions:
    directory: Path
    model_name: str | None = None  # default: the directory's name
    slots: int = 1
    max_batch: int = 1  # > 1: one batched loop of this many rows (serve/batch.py) instead of slots
    max_queue: int = 16
    api_key: str | None = None
    backend: str = "ort"
    provider: str = "cpu"
    threads: int | None = None  # None: runtime.json's calibrated count, else the default (runtime/settings.py)
    spin: bool | None = None
    verify: str = "auto"
    default_max_tokens: int = 256
    max_body_bytes: int = 4 << 20
    chat_template: str | None = None  # template text overriding the artifact's
    speculative: bool = True  # False: load without the drafter, plain decoding only
    speculation: str = "auto"  # auto: the controller decides per round; always: draft every round

    @property
    def rows(self) -> int:
        """Requests generating at once: batch rows, or slots."""
        return max(self.max_batch, self.slots)

    @property
    def model(self) -> str:
        return self.model_name or Path(self.directory).resolve().name


class Holder:
    """The engine once loaded (or why it failed); `ready` is set either way."""

    def __init__(self, engine: Engine | None = None):
        self.engine, self.error = engine, None
        self.ready = threading.Event()
        self.draining = False
        if engine is not None:
            self.ready.set()

    def load(self, options: ServeOptions) -> None:
        try:
            self.engine = load_engine(
                options.directory, slots=options.slots, model=options.model, max_queue=options.max_queue,
                backend=options.backend, provider=options.provider, threads=options.threads, spin=options.spin,
                verify=options.verify, drafter=options.speculative, chat_template=options.chat_template,
                max_batch=options.max_batch, speculation=options.speculation)
        except DFlashError as e:
            self.error = str(e)
        except Exception as e:  # a load failure is reported in one line by the command
            self.error = f"loading failed: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        finally:
            self.ready.set()

    def get(self) -> Engine:
        if self.draining or (self.engine is not None and self.engine.stopping):
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.engine is None:
            raise ApiError(503, self.error or "the model is loading; retry shortly (GET /health is 200 when ready)",
                           code="loading" if self.error is None else "load_failed")
        return self.engine


def create_app(options: ServeOptions, engine: Engine | None = None) -> FastAPI:
    """The ASGI app. Without `engine`, the app loads one from `options` when it starts (lifespan)."""
    holder = Holder(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if holder.engine is None and holder.error is None:
            threading.Thread(target=holder.load, args=(options,), name="dflash-load", daemon=True).start()
        yield
        holder.draining = True
        if holder.engine is not None:
            await asyncio.to_thread(holder.engine.close)

    app = FastAPI(title="dflash-export serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.holder, app.state.options = holder, options
    app.add_middleware(Guard, options=options)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(e.status_code, msg, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"dflash-export serve: internal error on {request.url.path}: {first}", file=sys.stderr)
        return error_response(500, f"internal error: {first}", code=INTERNAL)

    @app.get("/health")
    @app.get("/health/ready")
    async def health():
        engine = holder.get()
        return {"status": "ok", "model": engine.model, "slots": len(engine.slots), "slots_idle": engine.idle_slots(),
                "requests_waiting": len(engine.waiting), "max_batch": engine.max_batch}

    @app.get("/metrics")
    async def metrics():
        engine = holder.get()
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(holder.get())]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        engine = holder.get()
        check_model(engine, name)
        return _model_card(engine)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        engine = holder.get()
        body = await parse_body(request, TokenizeRequest)
        check_model(engine, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
        if body.prompt is not None:
            ids = engine.text.encode(body.prompt, body.add_special_tokens is not False)
        else:
            ids = engine.text.encode(render_chat(engine, body.messages, body.add_generation_prompt is not False), False)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        engine = holder.get()
        body = await parse_body(request, DetokenizeRequest)
        check_model(engine, body.model)
        check_ids(engine, body.tokens, "tokens")
        return {"prompt": engine.text.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        engine = holder.get()
        body = await parse_body(request, CompletionRequest)
        check_common(engine, body)
        for name, bad in (("logprobs", body.logprobs is not None), ("echo", bool(body.echo)), ("suffix", body.suffix),
                          ("best_of", body.best_of not in (None, 1))):
            if bad:
                raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request (got {len(prompt)})", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = engine.text.encode(prompt)
        else:
            ids = list(prompt)
            check_ids(engine, ids, "prompt")
        return await _generate(engine, request, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        engine = holder.get()
        body = await parse_body(request, ChatRequest)
        check_common(engine, body)
        if body.logprobs or body.top_logprobs:
            raise ApiError(400, "logprobs is not supported by this server", param="logprobs", code="unsupported")
        if body.tools or body.functions:
            raise ApiError(400, "tool calling is not supported by this server", param="tools", code="unsupported")
        if body.response_format and body.response_format.get("type") != "text":
            raise ApiError(400, f"response_format {body.response_format.get('type')!r} is not supported by this server "
                                "(only plain text)", param="response_format", code="unsupported")
        ids = engine.text.encode(render_chat(engine, body.messages, body.add_generation_prompt is not False), False)
        if body.max_completion_tokens is not None:
            return await _generate(engine, request, body, ids, body.max_completion_tokens, chat=True,
                                   max_param="max_completion_tokens")
        return await _generate(engine, request, body, ids, body.max_tokens, chat=True)

    async def _generate(engine: Engine, request: Request, body: Common, ids: list[int], max_tokens: int | None,
                        chat: bool, max_param: str = "max_tokens"):
        params = build_params(engine, body, ids, max_tokens, options.default_max_tokens, max_param)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job = Job(params, emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                  text=TextStream(engine.text.decode, params.stop))
        try:
            engine.submit(job)
        except QueueFull as e:  # openai clients honour retry-after when they retry
            raise ApiError(429, str(e), code="queue_full", headers={"retry-after": "1"}) from None
        except Unavailable as e:
            raise ApiError(503, str(e), code="shutting_down") from None
        watcher = asyncio.create_task(_watch_disconnect(request, engine, job))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created, name = int(time.time()), engine.model
        try:
            first = await events.get()  # the first round (headers wait for it) or the end
        except BaseException:
            watcher.cancel()
            engine.cancel(job)
            raise
        if first[0] == "error":
            watcher.cancel()
            raise ApiError(500, first[1], code=INTERNAL)
        if first[0] == "end" and first[1] == "cancelled":
            watcher.cancel()
            raise ApiError(503, CANCELLED, code="shutting_down")
        headers = {REPLICA: replica(job.slot)}

        if not body.stream:
            tokens, text, ev = [], [], first
            try:
                while ev[0] == "round":
                    tokens += ev[1]
                    text.append(ev[2])
                    ev = await events.get()
            finally:
                watcher.cancel()
                engine.cancel(job)
            if ev[0] == "error":
                raise ApiError(500, ev[1], code=INTERNAL)
            if ev[1] == "cancelled":  # only a shutdown sees this: a disconnected client is gone
                raise ApiError(503, CANCELLED, code="shutting_down")
            _, finish, g, tail = ev
            text.append(tail)
            choice = {"index": 0, "finish_reason": _finish(finish), "logprobs": None, "token_ids": g.tokens}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(text)}
            else:
                choice["text"] = "".join(text)
            out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                   "model": name, "choices": [choice], "usage": _usage(g), "timings": _timings(engine, g, params)}
            return JSONResponse(out, headers=headers)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        usage_null = {"usage": None} if include_usage else {}  # as OpenAI: null on all but the usage chunk

        def chunk(delta: str | None, token_ids: list[int], finish: str | None, **extra) -> str:
            if chat:
                d = {} if delta is None else {"content": delta}
                c = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None, "token_ids": token_ids}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None, "token_ids": token_ids}
            obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                   "model": name, "choices": [c], **usage_null, **extra}
            return f"data: {json.dumps(obj)}\n\n"

        async def sse():
            ev = first
            try:
                if chat:
                    role = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None, "logprobs": None}], **usage_null}
                    yield f"data: {json.dumps(role)}\n\n"
                while ev[0] == "round":
                    yield chunk(ev[2], ev[1], None)
                    ev = await events.get()
                if ev[0] == "error" or ev[1] == "cancelled":  # the status is sent: an error event (openai raises it)
                    err = {"message": ev[1], "type": "server_error", "param": None, "code": INTERNAL} if ev[0] == "error" \
                        else {"message": CANCELLED, "type": ERROR_TYPES[503], "param": None, "code": "shutting_down"}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                else:
                    _, finish, g, tail = ev
                    yield chunk(tail or None, [], _finish(finish), timings=_timings(engine, g, params))
                    if include_usage:
                        usage = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                 "created": created, "model": name, "choices": [], "usage": _usage(g)}
                        yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                watcher.cancel()
                engine.cancel(job)

        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers | {"cache-control": "no-cache"})

    return app


async def _watch_disconnect(request: Request, engine: Engine, job: Job) -> None:
    """Cancel the job when the client goes away (the body is already read: only disconnects arrive)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            engine.cancel(job)
            return


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(g) -> dict:
    return {"prompt_tokens": g.prompt_len, "completion_tokens": len(g.tokens),
            "total_tokens": g.prompt_len + len(g.tokens), "prompt_tokens_details": {"cached_tokens": g.reused}}


def _timings(engine: Engine, g, p: Params) -> dict:
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


def _model_card(engine: Engine) -> dict:
    return {"id": engine.model, "object": "model", "created": 0, "owned_by": "dflash-export",
            "max_model_len": engine.max_len}
