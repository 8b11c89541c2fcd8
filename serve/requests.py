"""What a request may say: OpenAI's error body, the request models, and their validation.

Kept apart from app.py (the routes) so that the rules a client meets read in one
place: every failure here is an ApiError that the app turns into OpenAI's error body, and
`Guard` (API key, body size, the replica header) runs before any route.
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import sys
import time
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..runtime import contract as C
from ..runtime.sampling import Sampling
from .engine import Engine, Params, replica

REPLICA = "x-dflash-replica"  # every response names the process and slot that answered it
OPEN_PATHS = ("/health", "/health/ready", "/metrics")  # no API key needed (as vLLM: /v1 and the rest need it)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}
CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
         413: "request_too_large", 429: "rate_limited", 500: "internal_error", 503: "unavailable"}  # when none given


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code or CODES.get(status, "error")}}
    return JSONResponse(body, status_code=status, headers=headers)


# -- request bodies ---------------------------------------------------------------------------

Float = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None


class Common(BaseModel):
    """The fields both endpoints read; unknown fields are ignored (as OpenAI clients send many).
    Every optional field may be null, meaning not given (OpenAI's API and LangChain send nulls)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict | None = None
    # extension: false: plain decoding; true: drafting allowed (the server's controller decides); "always": draft every round
    speculative: bool | Literal["always"] | None = None
    cache_prompt: bool | None = None  # extension (llama.cpp): false: no reuse of the slot's cached prefix


class CompletionRequest(Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    tools: list | None = None  # refused when not empty: no tool calling here
    functions: list | None = None
    response_format: dict | None = None  # refused unless {"type": "text"}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


# -- the app --------------------------------------------------------------------------------------


async def parse_body(request: Request, model: type[BaseModel]):
    """The JSON body as `model` (whatever the Content-Type says, as curl -d sends form), or a 400."""
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, a 5000-digit integer, deep nesting
        raise ApiError(400, f"the body is not valid JSON ({e.__class__.__name__}: {str(e)[:120]})",
                       code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object (got {type(obj).__name__})", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        where = ".".join(loc) or "body"
        raise ApiError(400, f"{where}: {err.get('msg', 'invalid')}", param=loc[0] if loc else None,
                       code="invalid_value") from None


def check_model(engine: Engine, name: str | None) -> None:
    if name is not None and name != engine.model:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {engine.model!r}",
                       param="model", code="model_not_found")


def check_ids(engine: Engine, ids: list[int], what: str) -> None:
    v = engine.manifest.vocab_size
    bad = [t for t in ids if not 0 <= t < v]
    if bad:
        raise ApiError(400, f"{what}: token ids {bad[:5]} are outside the vocabulary [0, {v})", param=what)


def check_common(engine: Engine, body: Common) -> None:
    check_model(engine, body.model)
    if body.n is not None and body.n < 1:
        raise ApiError(400, f"n must be >= 1 (got {body.n})", param="n")
    best_of = getattr(body, "best_of", None)
    if best_of not in (None, 1, body.n or 1):
        raise ApiError(400, f"best_of {best_of} is not supported by this server (it returns every sample: ask for n "
                            f"{best_of} and rank them yourself, or set best_of to n)", param="best_of", code="unsupported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported by this server (use 0 or omit it)", param=name,
                           code="unsupported")
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias", code="unsupported")


def check_logprobs(engine: Engine, k: int | None, cap: int, param: str) -> int | None:
    """How many alternatives per token (None: no log-probabilities), or a 400."""
    if k is None:
        return None
    if not 0 <= k <= cap:
        raise ApiError(400, f"{param} must be between 0 and {cap} (got {k})", param=param)
    if not C.ragged(engine.manifest):
        raise ApiError(400, "log-probabilities need an export made by this version of dflash-export (its target "
                            "graph takes logits_index); re-export the model", param=param, code="unsupported")
    return k


def render_chat(engine: Engine, messages: list[Message], add_generation_prompt: bool) -> str:
    plain = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise ApiError(400, f"messages.{i}.content: only text parts are supported", param="messages")
            d["content"] = "\n".join(p.text for p in m.content)
        d.setdefault("content", "")
        plain.append(d)
    try:
        return engine.text.render(plain, add_generation_prompt)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


def build_params(engine: Engine, body: Common, ids: list[int], max_tokens: int | None, default_max: int,
            max_param: str = "max_tokens") -> Params:
    """Validated generation parameters, or a 400 naming the field and the allowed range."""
    if not ids:
        raise ApiError(400, "the prompt is empty (0 tokens); give at least one token", param="prompt")
    limit = engine.max_len
    if len(ids) >= limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens but the exported context holds {limit} "
                            f"(prompt + at least 1 new token); shorten the prompt", param="prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(default_max, limit - len(ids))
    elif max_tokens < 1:
        raise ApiError(400, f"{max_param} must be >= 1 (got {max_tokens}; 0 only with echo)", param=max_param)
    elif len(ids) + max_tokens > limit:
        raise ApiError(400, f"prompt ({len(ids)} tokens) + {max_param} ({max_tokens}) = {len(ids) + max_tokens} "
                            f"exceeds the exported context of {limit} tokens; lower {max_param} to at most "
                            f"{limit - len(ids)}", param=max_param, code="context_length_exceeded")
    t = 1.0 if body.temperature is None else body.temperature
    if not 0 <= t <= 2:
        raise ApiError(400, f"temperature must be in [0, 2] (got {t})", param="temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1] (got {top_p})", param="top_p")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    if top_k < 0:
        raise ApiError(400, f"top_k must be >= 0, or -1 to disable (got {top_k})", param="top_k")
    if body.seed is not None and not -(2**63) <= body.seed < 2**64:
        raise ApiError(400, f"seed must fit in 64 bits (got {body.seed})", param="seed")
    seed = secrets.randbits(63) if body.seed is None else body.seed % 2**64
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 16 or any(len(s) > 256 for s in stop):
        raise ApiError(400, "stop: at most 16 strings of at most 256 characters", param="stop")
    stop_ids = list(body.stop_token_ids or [])
    check_ids(engine, stop_ids, "stop_token_ids")
    speculative = True if body.speculative is None else body.speculative
    if speculative and not engine.has_drafter:
        raise ApiError(400, "this server was started without the drafter (--no-draft); send speculative: false",
                       param="speculative")
    if not all(map(math.isfinite, (t, top_p))):  # belt and braces: pydantic already refused NaN/inf
        raise ApiError(400, "sampling values must be finite")
    return Params(ids, max_tokens, Sampling(t, top_k, top_p, seed), tuple(stop_ids), tuple(stop), speculative,
                  body.cache_prompt is not False)


# -- the HTTP guard: what every request meets before a route --------------------------------

class Guard:
    """Pure ASGI middleware: replica header on every response, API key, body size limit (413),
    and the access log: one line per request on stderr when it ends (method, path, status,
    prompt and completion tokens, seconds; `ServeOptions.access_log`)."""

    def __init__(self, app, options):  # options: app.ServeOptions (api_key, max_body_bytes, access_log)
        self.app, self.options = app, options
        self.key = options.api_key.encode() if options.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not getattr(self.options, "access_log", False):
            return await self.guard(scope, receive, send, {})
        seen, t0 = {}, time.perf_counter()
        scope.setdefault("state", {})  # where the route leaves its token counts
        try:
            await self.guard(scope, receive, send, seen)
        finally:
            tokens = scope.get("state", {}).get("dflash_tokens")
            used = f" prompt_tokens={tokens[0]} completion_tokens={tokens[1]}" if tokens else ""
            client = (scope.get("client") or ("-",))[0]
            print(f"dflash-export serve: {client} \"{scope.get('method')} {scope.get('path')}\" "
                  f"{seen.get('status', '-')}{used} {time.perf_counter() - t0:.3f}s", file=sys.stderr, flush=True)

    async def guard(self, scope, receive, send, seen: dict):
        async def send_with_replica(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                headers = list(message.get("headers", []))
                if not any(k.lower() == REPLICA.encode() for k, _ in headers):
                    headers.append((REPLICA.encode(), replica().encode()))
                message = {**message, "headers": headers}
            await send(message)

        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.key is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token.strip(), self.key):  # constant time
                resp = error_response(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                      code="invalid_api_key", headers={"www-authenticate": "Bearer"})
                return await resp(scope, receive, send_with_replica)
        limit = self.options.max_body_bytes
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = -1
        if declared < 0:
            return await error_response(400, "invalid Content-Length header")(scope, receive, send_with_replica)
        if declared > limit:
            return await error_response(413, f"the body has {declared} bytes; the limit is {limit}",
                                        code="request_too_large")(scope, receive, send_with_replica)
        if scope.get("method") != "POST":
            return await self.app(scope, receive, send_with_replica)
        body, more = bytearray(), True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > limit:
                return await error_response(413, f"the body is over the limit of {limit} bytes",
                                            code="request_too_large")(scope, receive, send_with_replica)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send_with_replica)
