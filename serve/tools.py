"""What a chat request asks of the answer's form, checked: tools and tool_choice, the tool turns
of the conversation, response_format, chat_template_kwargs. `shape(...)` returns a `Shape`: how the
response parses the text (serve/formats.py) and the grammar its tokens must follow, if any
(serve/grammar.py); every refusal is a 400 naming the field.

tool_choice: auto (the default with tools): the model may call; none: the tools are not shown to
it and nothing is parsed as a call; required / a named function: a call is enforced by
constrained decoding (one, or one or more with parallel_tool_calls). response_format json_object /
json_schema: the answer is enforced the same way (json_schema's `strict` or not).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

from .formats import Format
from .grammar import GrammarError, grammar
from .requests import ApiError

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function's name


@dataclass
class Shape:
    """How the response reads the generated text, and what constrains it."""

    fmt: Format
    thinking: bool = False  # the prompt opened a think block: the output starts in the reasoning
    calls: bool = False  # parse tool calls (tools given and tool_choice not none)
    parallel: bool = True  # false: the first call only
    grammar: str | None = None  # compiled (serve/grammar.py), or None: unconstrained

    def parser(self):
        return self.fmt.parser(self.thinking, self.calls)


def check_tools(tools: list | None) -> list[dict]:
    """The request's tools as the template's `tools` (OpenAI's {"type": "function", "function": {...}})."""
    out, seen = [], set()
    for i, t in enumerate(tools or []):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ApiError(400, f'{where}: expected {{"type": "function", "function": {{"name": ..., "parameters": '
                                f'{{...}}}}}} (only function tools are supported)', param="tools")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ApiError(400, f"{where}.function.name: expected 1 to 64 letters, digits, '_', '.' or '-' (got "
                                f"{json.dumps(name)[:70]})", param="tools")
        if name in seen:
            raise ApiError(400, f"{where}.function.name: {name!r} is given twice; tool names must be unique",
                           param="tools")
        seen.add(name)
        params = f.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ApiError(400, f'{where}.function.parameters: expected a JSON schema of an object ({{"type": '
                                f'"object", "properties": {{...}}}})', param="tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ApiError(400, f"{where}.function.description: expected a string", param="tools")
        out.append({"type": "function", "function": {k: v for k, v in f.items() if v is not None}})
    return out


def check_choice(choice, tools: list[dict]) -> tuple[str, str | None]:
    """(auto | none | required | named, the named function's name)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ApiError(400, f'tool_choice: expected "auto", "none", "required" or {{"type": "function", '
                                f'"function": {{"name": ...}}}} (got {choice!r})', param="tool_choice")
        if choice == "required" and not tools:
            raise ApiError(400, 'tool_choice "required" needs tools; give tools or leave tool_choice out',
                           param="tool_choice")
        return choice, None
    name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, 'tool_choice: expected {"type": "function", "function": {"name": ...}}',
                       param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools ("
                            f"{', '.join(names) if names else 'none given'})", param="tool_choice")
    return "named", name


def check_turns(messages: list[dict]) -> list[dict]:
    """The conversation's tool turns, for the template: an assistant's tool_calls well formed (their
    arguments as objects, as templates iterate them), every tool message answering a call made before it."""
    calls: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m.get("role") == "assistant" and m.get("tool_calls"):
            tc = m["tool_calls"]
            if not isinstance(tc, list):
                raise ApiError(400, f"messages.{i}.tool_calls: expected a list of calls", param="messages")
            fixed = []
            for j, c in enumerate(tc):
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(c.get("id"), str):
                    raise ApiError(400, f'messages.{i}.tool_calls.{j}: expected {{"id": ..., "type": "function", '
                                        f'"function": {{"name": ..., "arguments": "{{...}}"}}}}', param="messages")
                args = f.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args or "{}")
                    except ValueError:
                        args = None
                if not isinstance(args, dict):
                    raise ApiError(400, f"messages.{i}.tool_calls.{j}.function.arguments: expected a JSON object "
                                        "(as text)", param="messages")
                calls[c["id"]] = f["name"]
                fixed.append({**c, "type": "function", "function": {**f, "arguments": args}})
            messages[i] = {**m, "tool_calls": fixed}
        elif m.get("role") == "tool":
            cid = m.get("tool_call_id")
            if cid not in calls:
                raise ApiError(400, f"messages.{i}: a tool message must answer a call made before it: its tool_call_id "
                                    f"{json.dumps(cid)[:70]} matches no earlier assistant tool_calls id "
                                    f"({', '.join(calls) or 'none made'})", param="messages")
            m.setdefault("name", calls[cid])
    return messages


def check_format(response_format: dict | None) -> dict | None:
    """The answer's JSON schema (json_object: any object), or None (text)."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = response_format.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, 'response_format json_schema: expected {"type": "json_schema", "json_schema": '
                                '{"name": ..., "schema": {...}, "strict": true}}', param="response_format")
        return schema
    raise ApiError(400, f'response_format: type must be "text", "json_object" or "json_schema" (got '
                        f"{json.dumps(kind)[:60]})", param="response_format")


async def shape(engine, fmt: Format, prompt: str, tools: list[dict], choice: tuple[str, str | None],
                parallel: bool, answer: dict | None) -> Shape:
    """The Shape of a chat request, its grammar compiled off the event loop (a 400 naming what the
    engine could not compile)."""
    kind, name = choice
    calls = bool(tools) and kind != "none"
    s = Shape(fmt, fmt.thinking(prompt), calls, parallel)
    if calls and fmt.name == "none":
        raise ApiError(400, "this model's chat template writes no tool calls this server can read; start the server "
                            "with --tool-format (qwen3, qwen3_coder, harmony, llama3_json) or a --chat-template "
                            "that renders tools", param="tools", code="unsupported")
    if not calls and answer is None:
        return s
    forced = kind in ("required", "named")
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name] if calls else None
    if forced:
        answer = None
    lark = grammar(fmt, s.thinking, fns, parallel, answer)  # auto without an answer: compiled to check the schemas
    try:
        compiled = await asyncio.to_thread(engine.grammars.compile, lark)
    except GrammarError as e:
        param = "response_format" if answer is not None and not tools else "tools"
        raise ApiError(400, f"{param}: the schema cannot be enforced: {e}", param=param, code="invalid_schema") \
            from None
    if forced or answer is not None:
        s.grammar = compiled
    return s
