"""Every refusal of a generation request, in one step, and the loop's record of what it asks.

`completion(server, body)` and `chat(server, body)` take a parsed body (serve/requests.py,
whose models already bound every list and string by size) and return a `Plan`: the loop's own
`Request` for each choice (runtime/loop.py), with what the response needs beside them; or
they raise the ApiError a client gets. Nothing after this step refuses a request: the engines
queue it (429 only when the queue is full) and the loop runs it.

The checks run cheapest first, so a hostile request costs little: the model, fields this
server does not do, the rows the request needs against the rows the server has (before any
text is tokenized), the prompt's characters against what the context can hold (before
tokenizing), then the tokenization itself off the event loop, and the lengths, sampling and
stops of what was tokenized.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, replace

from ..runtime import contract as C
from ..runtime.logprobs import Logprobs
from ..runtime.loop import Request
from ..runtime.sampling import Sampling
from .requests import MAX_CHOICES, ApiError, ChatRequest, Common, CompletionRequest, Message
from .tools import Shape, check_choice, check_format, check_tools, check_turns, shape


@dataclass
class Server:
    """What validation reads of the running server: its engine, and how it was started
    (serve/options.py ServeOptions: the default max_tokens, the flag that made it plain)."""

    engine: object
    options: object


@dataclass
class Want:
    """What the response carries beside the text: log-probabilities (`k` alternatives per token,
    None: none) in the chat or completions shape, the prompt echoed, no generated tokens."""

    k: int | None = None
    echo: bool = False
    discard: bool = False  # max_tokens 0 with echo: the prompt only (one token is generated and dropped)


@dataclass
class Plan:
    """A validated request: the loop's Request of each choice (prompt i's sample j at i * n + j,
    seeded seed + j), and what the response needs beside them."""

    requests: list[Request]
    n: int
    chat: bool
    stream: bool
    include_usage: bool
    want: Want
    stop: tuple[str, ...] = ()  # stop strings (serve/text.py TextStream finds them in the text)
    cache_prompt: bool = True  # false: no reuse of a cached prefix (llama.cpp's extension)
    shape: Shape | None = None  # chat: reasoning and tool calls out of the text, and the grammar (serve/tools.py)


def check_model(engine, name: str | None) -> None:
    if name is not None and name != engine.model:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {engine.model!r}",
                       param="model", code="model_not_found")


def check_ids(engine, ids: list[int], what: str) -> None:
    """Token ids of a prompt or of /detokenize: at most the context, each in the vocabulary."""
    if len(ids) > engine.max_len:
        raise ApiError(400, f"{what}: {len(ids)} token ids, more than the exported context of {engine.max_len}",
                       param=what.split(".")[0], code="context_length_exceeded")
    v = engine.manifest.vocab_size
    bad = [t for t in ids if not 0 <= t < v]
    if bad:
        raise ApiError(400, f"{what}: token ids {bad[:5]} are outside the vocabulary [0, {v})",
                       param=what.split(".")[0])


def check_chars(engine, chars: int, what: str) -> None:
    """Refuse text that cannot fit the context before tokenizing it: no token of this vocabulary is
    longer than `engine.text.max_token_chars` characters, so more characters than the context times
    that is more tokens than the context holds."""
    limit = engine.max_len * engine.text.max_token_chars
    if chars > limit:
        raise ApiError(400, f"{what} has {chars} characters; this server reads at most {limit} (its context of "
                            f"{engine.max_len} tokens x the longest token's {engine.text.max_token_chars} "
                            "characters); shorten it", param=what.split(".")[0], code="context_length_exceeded")


def check_logprobs(engine, k: int | None, cap: int, param: str) -> int | None:
    """How many alternatives per token (None: no log-probabilities), or a 400."""
    if k is None:
        return None
    if not 0 <= k <= cap:
        raise ApiError(400, f"{param} must be between 0 and {cap} (got {k})", param=param)
    if not C.ragged(engine.manifest):
        raise ApiError(400, "log-probabilities need an export made by this version of dflash-export (its target "
                            "graph takes logits_index); re-export the model", param=param, code="unsupported")
    return k


def _common(server: Server, body: Common, prompts: int) -> int:
    """The checks every generation request meets before anything is tokenized; returns n."""
    engine = server.engine
    check_model(engine, body.model)
    n = 1 if body.n is None else body.n
    if n < 1:
        raise ApiError(400, f"n must be >= 1 (got {n})", param="n")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of < n:
        raise ApiError(400, f"best_of must be at least n (got best_of {best_of}, n {n})", param="best_of")
    if best_of not in (None, n):
        raise ApiError(400, f"best_of {best_of} is not supported by this server (it returns every sample: ask for n "
                            f"{best_of} and rank them yourself, or set best_of to n)", param="best_of",
                       code="unsupported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported by this server (use 0 or omit it)", param=name,
                           code="unsupported")
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias", code="unsupported")
    need, room = prompts * n, engine.room
    if need > MAX_CHOICES:
        raise ApiError(400, f"{prompts} prompt(s) x n {n} = {need} choices; give 1 to {MAX_CHOICES} choices "
                            "per request",
                       param="n" if prompts == 1 else "prompt")
    if need > room:  # could never run, however idle the server: not a retryable 429
        raise ApiError(400, f"{prompts} prompt(s) x n {n} = {need} choices, each a row of its own; this server holds "
                            f"at most {room} at once ({len(engine.slots)} rows + --max-queue {engine.max_queue}); "
                            f"send at most {room} choices per request", param="n" if prompts == 1 else "prompt",
                       code="too_many_choices")
    return n


def _speculative(server: Server, given) -> bool | str:
    """The request's `speculative` on this server: not given or true, the server's mode decides
    (a server without the drafter decodes plainly); only "always" needs the drafter."""
    if not server.engine.has_drafter:
        if given == "always":
            raise ApiError(400, f"speculative: \"always\" needs the drafter, and this server decodes plainly (started "
                                f"with {server.options.plain_flag}); send speculative: true or false, or leave it out",
                           param="speculative", code="unsupported")
        return False
    return True if given is None else given


def _sampling(body: Common) -> Sampling:
    t = 1.0 if body.temperature is None else body.temperature
    if not 0 <= t <= 2:
        raise ApiError(400, f"temperature must be in [0, 2] (got {t}); 0 is greedy", param="temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1] (got {top_p}); 1 disables it", param="top_p")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    if top_k < 0:
        raise ApiError(400, f"top_k must be >= 0, or -1 to disable (got {top_k})", param="top_k")
    if body.seed is not None and not -(2**63) <= body.seed < 2**64:
        raise ApiError(400, f"seed must fit in 64 bits (got {body.seed})", param="seed")
    seed = secrets.randbits(63) if body.seed is None else body.seed % 2**64
    return Sampling(t, top_k, top_p, seed)  # below MIN_TEMPERATURE: greedy (runtime/sampling.py)


def _max_tokens(engine, ids: list[int], given: int | None, default: int, param: str) -> int:
    if not ids:
        raise ApiError(400, "the prompt is empty (0 tokens); give at least one token", param="prompt")
    limit = engine.max_len
    if len(ids) >= limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens but the exported context holds {limit} "
                            f"(prompt + at least 1 new token); shorten the prompt", param="prompt",
                       code="context_length_exceeded")
    if given is None:
        return min(default, limit - len(ids))
    if given < 1:
        raise ApiError(400, f"{param} must be >= 1 (got {given}; 0 only with echo)", param=param)
    if len(ids) + given > limit:
        raise ApiError(400, f"prompt ({len(ids)} tokens) + {param} ({given}) = {len(ids) + given} exceeds the "
                            f"exported context of {limit} tokens; lower {param} to at most {limit - len(ids)}",
                       param=param, code="context_length_exceeded")
    return given


def _stop_ids(engine, body: Common) -> tuple[int, ...]:
    """The model's eos ids and the request's stop_token_ids (checked)."""
    extra = list(body.stop_token_ids or ())
    check_ids(engine, extra, "stop_token_ids")
    return tuple(dict.fromkeys(list(engine.manifest.eos_token_ids) + extra))


def _plan(server: Server, body: Common, prompts: list[list[int]], n: int, given: int | None, param: str,
          want: Want, chat: bool, form: Shape | None = None, constraints: list | None = None) -> Plan:
    engine = server.engine
    sampling, speculative = _sampling(body), _speculative(server, body.speculative)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    stop_ids = _stop_ids(engine, body)
    requests = []
    for ids in prompts:
        max_tokens = _max_tokens(engine, ids, 1 if want.discard else given, server.options.default_max_tokens, param)
        for j in range(n):
            lp = Logprobs(want.k, want.echo) if want.k is not None else None
            c = constraints[j] if constraints else None
            requests.append(Request(ids, max_tokens, replace(sampling, seed=(sampling.seed + j) % 2**64), stop_ids,
                                    speculative=speculative, logprobs=lp, constraint=c))
    return Plan(requests, n, chat, bool(body.stream), bool(body.stream_options and body.stream_options.include_usage),
                want, stop, body.cache_prompt is not False, form)


async def encode(engine, text: str, special: bool, what: str) -> list[int]:
    """Text -> token ids, bounded by characters first and tokenized off the event loop."""
    check_chars(engine, len(text), what)
    try:
        text.encode("utf-8")  # JSON may carry an unpaired surrogate ("\ud800"), which no tokenizer takes
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{what}: the text holds an unpaired surrogate ({text[e.start]!a} at character "
                            f"{e.start}): not valid Unicode", param=what.split(".")[0]) from None
    return await asyncio.to_thread(engine.text.encode, text, special)


async def render_chat(engine, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None,
                      kwargs: dict | None = None) -> str:
    """The chat as text (its characters bounded before the template runs, the template run off the event loop);
    `tools` and `kwargs` (chat_template_kwargs) go to the template."""
    plain = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise ApiError(400, f"messages.{i}.content: only text parts are supported "
                                    "({\"type\": \"text\", \"text\": ...})", param="messages")
            d["content"] = "\n".join(p.text for p in m.content)
        d.setdefault("content", "")
        plain.append(d)
    plain = check_turns(plain)
    extra = len(json.dumps(tools)) if tools else 0
    check_chars(engine, sum(len(d["content"]) if isinstance(d["content"], str) else 0 for d in plain) + extra,
                "messages")
    try:
        return await asyncio.to_thread(engine.text.render, plain, add_generation_prompt, tools or None,
                                       **(kwargs or {}))
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


async def completion(server: Server, body: CompletionRequest) -> Plan:
    engine = server.engine
    many = isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], (str, list))
    prompts = body.prompt if many else [body.prompt]
    n = _common(server, body, len(prompts))
    if body.suffix:
        raise ApiError(400, "suffix is not supported by this server", param="suffix", code="unsupported")
    want = Want(check_logprobs(engine, body.logprobs, 5, "logprobs"), bool(body.echo),
                bool(body.echo) and body.max_tokens == 0)
    ids = []
    for i, prompt in enumerate(prompts):
        what = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            ids.append(await encode(engine, prompt, True, what))
        else:
            check_ids(engine, prompt, what)
            ids.append(list(prompt))
    return _plan(server, body, ids, n, body.max_tokens, "max_tokens", want, False)


async def chat(server: Server, body: ChatRequest) -> Plan:
    engine = server.engine
    n = _common(server, body, 1)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    want = Want(check_logprobs(engine, (body.top_logprobs or 0) if body.logprobs else None, 20, "top_logprobs"))
    if body.functions:
        raise ApiError(400, "functions is the deprecated form of tools; send tools: [{\"type\": \"function\", "
                            "\"function\": {...}}]", param="functions", code="unsupported")
    tools = check_tools(body.tools)
    choice = check_choice(body.tool_choice, tools)
    answer = check_format(body.response_format)
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    shown = tools if choice[0] != "none" else None
    text = await render_chat(engine, body.messages, body.add_generation_prompt is not False, shown, kwargs)
    form = await shape(engine, engine.text.format, text, tools, choice, body.parallel_tool_calls is not False, answer)
    ids = await encode(engine, text, False, "messages")
    given, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None
                    else (body.max_tokens, "max_tokens"))
    constraints = None
    if form.grammar is not None:  # a matcher per choice, made off the event loop (a large grammar takes a while)
        stop_ids = _stop_ids(engine, body)
        constraints = await asyncio.to_thread(lambda: [engine.grammars.constraint(form.grammar, stop_ids)
                                                       for _ in range(n)])
    return _plan(server, body, [ids], n, given, param, want, True, form, constraints)
