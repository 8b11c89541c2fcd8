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

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..runtime.errors import DFlashError
from . import validate
from .engine import Engine, load_engine
from .options import ServeOptions
from .requests import (  # REPLICA: serve/ray.py's
    REPLICA, ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, Guard, error_response,
    parse_body,
)
from .respond import INTERNAL, respond
from .validate import check_ids, check_model


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
            self.engine = load_engine(options)
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
    app = FastAPI(title="dflash-export serve", lifespan=_lifespan(holder, options), docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi(app, holder.engine)
    app.state.holder, app.state.options = holder, options
    app.add_middleware(Guard, options=options)
    _error_handlers(app)
    _status_routes(app, holder)
    _token_routes(app, holder)
    _generation_routes(app, holder, options)
    return app


def _lifespan(holder: Holder, options: ServeOptions):
    """Start: load the engine in a background thread (unless given); stop: drain, then close it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if holder.engine is None and holder.error is None:
            threading.Thread(target=holder.load, args=(options,), name="dflash-load", daemon=True).start()
        yield
        holder.draining = True
        if holder.engine is not None:
            await asyncio.to_thread(holder.engine.close)

    return lifespan


def _error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body: ours, the router's (404, 405) and a bug's (500, one line on stderr)."""

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


def _status_routes(app: FastAPI, holder: Holder) -> None:
    """/health, /metrics, /v1/models: what the server is and how it is doing."""

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


def _token_routes(app: FastAPI, holder: Holder) -> None:
    """/tokenize, /tokenizer_info, /detokenize: the model's tokenizer over HTTP."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        engine = holder.get()
        body = await parse_body(request, TokenizeRequest, engine.max_len)
        check_model(engine, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt (a string) or messages (a list of chat messages)",
                           param="prompt")
        if body.prompt is not None:
            ids = await validate.encode(engine, body.prompt, body.add_special_tokens is not False, "prompt")
        else:
            text = await validate.render_chat(engine, body.messages, body.add_generation_prompt is not False)
            ids = await validate.encode(engine, text, False, "messages")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info():  # vLLM's: what lm-eval's remote tokenizer reads (it then tokenizes with /tokenize)
        engine = holder.get()
        return {**engine.text.special, "chat_template": engine.text.template_source, "model_max_length": engine.max_len,
                "tokenizer_class": "PreTrainedTokenizerFast"}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        engine = holder.get()
        body = await parse_body(request, DetokenizeRequest, engine.max_len)
        check_model(engine, body.model)
        check_ids(engine, body.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(engine.text.decode, body.tokens)}


def _generation_routes(app: FastAPI, holder: Holder, options: ServeOptions) -> None:
    """/v1/completions, /v1/chat/completions: parse, validate into a plan (serve/validate.py), respond."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        engine = holder.get()
        body = await parse_body(request, CompletionRequest, engine.max_len)
        plan = await validate.completion(validate.Server(engine, options), body)
        return await respond(engine, request, plan)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        engine = holder.get()
        body = await parse_body(request, ChatRequest, engine.max_len)
        plan = await validate.chat(validate.Server(engine, options), body)
        return await respond(engine, request, plan)


BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest, "/tokenize": TokenizeRequest,
          "/detokenize": DetokenizeRequest}


def _openapi(app: FastAPI, engine: Engine | None) -> dict:
    """GET /openapi.json: the routes, with the request bodies the routes parse themselves (parse_body,
    so that every refusal is OpenAI's error body rather than FastAPI's 422) described by their models;
    once the model is loaded, with this server's own bounds (vocabulary, context, rows + queue)."""
    if app.openapi_schema is not None and app.openapi_schema.get("x-loaded") == (engine is not None):
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=__version__, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in BODIES.values()], ref_template="#/components/schemas/{model}")
    if engine is not None:
        _bounds(defs["$defs"], vocab=engine.manifest.vocab_size, context=engine.max_len, room=engine.room)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    for path, model in BODIES.items():
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = schema | {"x-loaded": engine is not None}
    return app.openapi_schema


def _bounds(defs: dict, vocab: int, context: int, room: int) -> None:
    """The loaded model's bounds into the bodies' schemas: token ids below the vocabulary, new tokens
    within the context, choices within what the server holds at once."""
    def walk(node, field=None):
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0 and field in ("prompt", "tokens",
                                                                                         "stop_token_ids"):
                node["maximum"] = vocab - 1
            if node.get("type") == "integer" and field in ("max_tokens", "max_completion_tokens"):
                node["maximum"] = context - 1
            if node.get("type") == "integer" and field == "n":
                node["maximum"] = min(node.get("maximum", room), room)
            for k, v in node.items():
                walk(v, k if k not in ("anyOf", "items", "properties") else field)
        elif isinstance(node, list):
            for v in node:
                walk(v, field)

    for model in defs.values():
        for name, prop in model.get("properties", {}).items():
            walk(prop, name)


def _model_card(engine: Engine) -> dict:
    return {"id": engine.model, "object": "model", "created": 0, "owned_by": "dflash-export",
            "max_model_len": engine.max_len}
