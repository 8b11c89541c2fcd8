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
import sys
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import DFlashError
from .engine import Engine, load_engine
from .requests import (
    REPLICA, ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, Guard, check_common, check_ids,
    check_logprobs, check_model, error_response, parse_body, render_chat,
)  # REPLICA: serve/ray.py's
from .respond import INTERNAL, Want, respond

MAX_CHOICES = 64  # prompts x n per request (each a row or slot of its own, queued like separate requests)


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
    access_log: bool = False  # one line per request on stderr (the command turns it on; --no-access-log)

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

    @app.get("/tokenizer_info")
    async def tokenizer_info():  # vLLM's: what lm-eval's remote tokenizer reads (it then tokenizes with /tokenize)
        engine = holder.get()
        return {**engine.text.special, "chat_template": engine.text.template_source, "model_max_length": engine.max_len,
                "tokenizer_class": "PreTrainedTokenizerFast"}

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
        want = Want(check_logprobs(engine, body.logprobs, 5, "logprobs"), bool(body.echo), bool(body.echo)
                    and body.max_tokens == 0)
        if body.suffix:
            raise ApiError(400, "suffix is not supported by this server", param="suffix", code="unsupported")
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], (str, list)) \
            else [body.prompt]
        if not 1 <= len(prompts) * (body.n or 1) <= MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n {body.n or 1}: give 1 to {MAX_CHOICES} choices per request",
                           param="prompt")
        ids = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids.append(engine.text.encode(prompt))
            else:
                check_ids(engine, prompt, "prompt" if len(prompts) == 1 else f"prompt.{i}")
                ids.append(list(prompt))
        return await respond(engine, request, body, ids, body.max_tokens, False, options.default_max_tokens, want)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        engine = holder.get()
        body = await parse_body(request, ChatRequest)
        check_common(engine, body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        want = Want(check_logprobs(engine, (body.top_logprobs or 0) if body.logprobs else None, 20, "top_logprobs"))
        if body.tools or body.functions:
            raise ApiError(400, "tool calling is not supported by this server", param="tools", code="unsupported")
        if body.response_format and body.response_format.get("type") != "text":
            raise ApiError(400, f"response_format {body.response_format.get('type')!r} is not supported by this server "
                                "(only plain text)", param="response_format", code="unsupported")
        if (body.n or 1) > MAX_CHOICES:
            raise ApiError(400, f"n must be at most {MAX_CHOICES} (got {body.n})", param="n")
        ids = engine.text.encode(render_chat(engine, body.messages, body.add_generation_prompt is not False), False)
        if body.max_completion_tokens is not None:
            return await respond(engine, request, body, [ids], body.max_completion_tokens, True,
                                 options.default_max_tokens, want, "max_completion_tokens")
        return await respond(engine, request, body, [ids], body.max_tokens, True, options.default_max_tokens, want)

    return app


def _model_card(engine: Engine) -> dict:
    return {"id": engine.model, "object": "model", "created": 0, "owned_by": "dflash-export",
            "max_model_len": engine.max_len}
