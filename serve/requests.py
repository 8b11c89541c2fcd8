"""What a request may say: OpenAI's error body, the request models, and their validation.

Kept apart from app.py (the routes) so that the rules a client meets read in one
place: every failure here is an ApiError that the app turns into OpenAI's error body, and
`Guard` (API key, body size, the replica header) runs before any route.
"""

from __future__ import annotations

import hmac
import json
import sys
import time
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .jobs import replica

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
# Every list and string a request may send is bounded here, so that a hostile size is refused by
# the parse, before anything costs; the context bounds the rest (serve/validate.py).

MAX_CHOICES = 64  # prompts x n per request (each a row or slot of its own, queued like separate requests)
MAX_STOP, MAX_STOP_CHARS = 16, 256  # stop strings
MAX_STOP_IDS = 64  # stop_token_ids
MAX_MESSAGES = 1024  # chat messages
MAX_PARTS = 64  # content parts of one message
MAX_TOOLS = 128  # tools of one request (OpenAI's bound)
MAX_LIST = 1 << 16  # any other list or object (token ids: the context bounds them further)



def ranged(kind, **schema):
    """`kind` with the range serve/validate.py enforces (its messages name the field and the range),
    stated in the OpenAPI schema for clients and for the tests generated from it; not checked here."""
    return Annotated[kind, Field(allow_inf_nan=False, json_schema_extra=schema) if kind is float
                     else Field(json_schema_extra=schema)]


Float = Annotated[float, Field(allow_inf_nan=False)]
TokenId = ranged(int, minimum=0)
Ids = Annotated[list[TokenId], Field(max_length=MAX_LIST)]
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

# what a field whose value may take several forms accepts (pydantic's own message names one form)
ACCEPTS = {
    "prompt": (f"a string, a list of token ids (integers), or a list of 1 to {MAX_CHOICES} strings or of 1 to "
               f"{MAX_CHOICES} lists of token ids"),
    "stop": f"a string or a list of at most {MAX_STOP} strings, each at most {MAX_STOP_CHARS} characters",
    "speculative": 'true, false or "always"',
    "content": f"a string or a list of at most {MAX_PARTS} parts {{\"type\": \"text\", \"text\": ...}}",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None


class Common(BaseModel):
    """The fields both endpoints read; unknown fields are ignored (as OpenAI clients send many).
    Every optional field may be null, meaning not given (OpenAI's API and LangChain send nulls)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: ranged(int, minimum=0) | None = None
    temperature: ranged(float, minimum=0, maximum=2) | None = None
    top_p: ranged(float, exclusiveMinimum=0, maximum=1) | None = None
    top_k: ranged(int, minimum=-1) | None = None
    seed: ranged(int, minimum=-(2**63), maximum=2**64 - 1) | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_IDS)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: ranged(int, minimum=1, maximum=MAX_CHOICES) | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: Annotated[dict, Field(max_length=300)] | None = None  # OpenAI's bound (refused when not empty)
    # extension: false: plain decoding; true: drafting allowed (the server's mode decides; a server without
    # the drafter decodes plainly); "always": draft every round
    speculative: bool | Literal["always"] | None = None
    cache_prompt: bool | None = None  # extension (llama.cpp): false: no reuse of the slot's cached prefix


class CompletionRequest(Common):
    prompt: (str | Ids | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]
             | Annotated[list[Ids], Field(min_length=1, max_length=MAX_CHOICES)])
    logprobs: ranged(int, minimum=0, maximum=5) | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: ranged(int, minimum=1) | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] | None = None


class ChatRequest(Common):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: ranged(int, minimum=1) | None = None
    logprobs: bool | None = None
    top_logprobs: ranged(int, minimum=0, maximum=20) | None = None
    add_generation_prompt: bool | None = None
    tools: Annotated[list, Field(max_length=MAX_TOOLS)] | None = None  # checked by serve/tools.py
    tool_choice: Literal["auto", "none", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list, Field(max_length=MAX_LIST)] | None = None  # refused: the deprecated form of tools
    response_format: dict | None = None  # text, json_object, json_schema (serve/tools.py)
    chat_template_kwargs: Annotated[dict, Field(max_length=64)] | None = None  # to the template, e.g. enable_thinking
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # to the template (gpt-oss's)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: Ids


# -- the app --------------------------------------------------------------------------------------


def max_values(context: int) -> int:
    """The most JSON values (counted by commas) a valid request to a server of this context holds:
    MAX_CHOICES prompts of token ids filling the context, MAX_MESSAGES chat messages of a few
    fields each, and room for the rest."""
    return MAX_CHOICES * context + 16 * MAX_MESSAGES + 4096


async def parse_body(request: Request, model: type[BaseModel], context: int):
    """The JSON body as `model` (whatever the Content-Type says, as curl -d sends form), or a 400.
    A body with more values than any valid request needs is refused before it is parsed: parsing
    holds the event loop (and the GIL) for as long as the list is long."""
    raw = await request.body()
    limit = max_values(context)
    if raw.count(b",") > limit:
        raise ApiError(413, f"the body holds more than {limit} JSON values; no valid request to this server needs "
                            f"that many (at most {MAX_CHOICES} prompts of its context of {context} tokens, "
                            f"{MAX_MESSAGES} messages)", code="request_too_large")
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
        where, message = explain(e.errors()[0])
        raise ApiError(400, f"{where}: {message}", param=where.split(".")[0] if where != "body" else None,
                       code="invalid_value") from None


def explain(err: dict) -> tuple[str, str]:
    """(where, what is wrong) of a pydantic error, in the request's terms: the field's path without
    pydantic's union branch names (`prompt.str`), and for a field that takes several forms, what
    it accepts and what it got."""
    loc = err.get("loc", ())
    path = []
    for x in loc:
        if isinstance(x, int) or (x in ACCEPTS or x.isidentifier()) and not _branch(x):
            path.append(str(x))
        else:
            break  # a union branch name: the rest is inside that branch
    field = next((p for p in reversed(path) if p in ACCEPTS), None)
    if field is not None and err.get("type") != "missing":
        where = ".".join(path[: len(path) - path[::-1].index(field)])
        got = _short(err.get("input"))
        return where, f"expected {ACCEPTS[field]} (got {got})"
    return ".".join(path) or "body", err.get("msg", "invalid")


def _branch(name: str) -> bool:
    return name in ("str", "int", "bool", "float", "dict", "list") or any(c in name for c in "[]'()-")


def _short(x) -> str:
    """A value as JSON, cut short (a hostile input may be megabytes)."""
    if isinstance(x, (list, dict)) and len(x) > 4:
        x = list(x)[:4] + ["..."]
    try:
        text = json.dumps(x)
    except (TypeError, ValueError):
        return type(x).__name__
    return text if len(text) <= 60 else text[:57] + "..."


# -- the HTTP guard: what every request meets before a route --------------------------------

class Guard:
    """Pure ASGI middleware: replica header on every response, API key, body size limit (413),
    and the access log: one line per request on stderr when it ends (method, path, status,
    prompt and completion tokens, seconds; `ServeOptions.access_log`)."""

    def __init__(self, app, options):  # options: serve/options.py ServeOptions (api_key, max_body_bytes, access_log)
        self.app, self.options = app, options
        self.key = options.api_key.encode() if options.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.options.access_log:
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
