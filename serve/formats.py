"""How a model family writes its reasoning and its tool calls, and the parser that takes them
back out of the generated text: `detect(template, architecture)` -> a `Format`, and
`Format.parser(thinking)` -> an `OutputParser` whose events make the response's
`reasoning_content`, `content` and `tool_calls`.

The families (chosen from the chat template's own markers, else the architecture; `serve
--tool-format` overrides):

    qwen3        <think>...</think>, then text and <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                 (Qwen3, Qwen3.5/3.6, Hermes-style templates)
    qwen3_coder  the same thinking, calls as <tool_call><function=NAME><parameter=P>VALUE</parameter>
                 </function></tool_call> (Qwen3-Coder, Qwen3-Coder-Next)
    harmony      gpt-oss: messages <|channel|>analysis|commentary|final[ to=functions.NAME]<|message|>...
                 ended by <|end|>, <|call|> or <|return|> (openai-harmony's format)
    llama3_json  Llama 3.1/3.2/3.3: the whole answer is {"name": ..., "parameters": {...}} (several: `;`)
    none         no reasoning, no calls: the text is the content

One parser serves the body and the stream: the body is the stream's events joined, so a
streamed response assembles to the same message. Markers split across rounds are held back
until they are whole; a call is sent once its closing marker arrives (whole, with its id,
name and arguments), which is how llama-server sends them too.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

FORMATS = ("auto", "qwen3", "qwen3_coder", "harmony", "llama3_json", "none")
THINK = ("<think>", "</think>")
CALL = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class Format:
    name: str
    think: tuple[str, str] | None = None  # reasoning between these markers (qwen3 families)
    specials: bool = False  # the parser reads special tokens (harmony's markers are special tokens)

    def parser(self, thinking: bool = False, tools: bool = True) -> OutputParser:
        """A parser for one completion; `thinking`: the prompt left a think block open (the output
        starts inside it); `tools`: parse calls (false: tool_choice none, no tools)."""
        if self.name == "harmony":
            return HarmonyParser(tools)
        return MarkerParser(self, thinking, tools)

    def thinking(self, prompt: str) -> bool:
        """Whether the rendered prompt ends inside an open think block (Qwen3.5's templates open it)."""
        return self.think is not None and prompt.rfind(self.think[0]) > prompt.rfind(self.think[1])


def detect(template: str | None, architecture: str = "", given: str = "auto") -> Format:
    """The format of this model: `given` unless auto, else from its chat template's markers, else its
    architecture. Reasoning markers come with any template that writes `</think>`."""
    t, arch = template or "", architecture.lower()
    name = given
    if name == "auto":
        if "<|channel|>" in t or "gptoss" in arch.replace("_", "").replace("-", ""):
            name = "harmony"
        elif "<function=" in t and "<parameter=" in t:
            name = "qwen3_coder"
        elif CALL[0] in t:
            name = "qwen3"
        elif "<|python_tag|>" in t or ("llama" in arch and "tools" in t):
            name = "llama3_json"
        else:
            name = "none"
    if name not in FORMATS[1:]:
        raise ValueError(f"unknown tool format {given!r}; choose one of {', '.join(FORMATS)}")
    think = THINK if name in ("qwen3", "qwen3_coder") or THINK[1] in t else None
    return Format(name, None if name in ("harmony", "llama3_json") else think, specials=name == "harmony")


@dataclass
class Call:
    name: str
    arguments: str  # a JSON object as text
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def openai(self, index: int) -> dict:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class OutputParser:
    """Text in (as it is generated), events out: ("reasoning", text), ("content", text), ("call", Call)."""

    def push(self, text: str) -> list[tuple]:
        raise NotImplementedError

    def finish(self) -> list[tuple]:
        raise NotImplementedError


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of one of `markers`."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class MarkerParser(OutputParser):
    """qwen3, qwen3_coder, llama3_json and none: reasoning between think markers, calls between call
    markers (llama3_json: the whole answer when it starts with `{`), the rest is content."""

    def __init__(self, fmt: Format, thinking: bool, tools: bool):
        self.fmt, self.tools = fmt, tools
        self.mode = "reasoning" if thinking else "content"
        self.buf = ""
        self.space = ""  # whitespace held back in content (dropped after the last call, kept before text)
        self.started = False  # any content or call seen (a think block opens only at the start)
        self.json_answer = fmt.name == "llama3_json" and tools  # decided on the first characters
        self.calls = 0
        self.reasoned = False  # a think block ended: the whitespace after it is not content

    def push(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while self.buf:
            before = (self.mode, len(self.buf))
            getattr(self, "_" + self.mode)(out)
            if (self.mode, len(self.buf)) == before:
                break  # waiting for more text
        return out

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        if self.mode == "reasoning":
            out.append(("reasoning", self.buf))
        elif self.mode == "call":
            call = self._parse(self.buf[len(CALL[0]):] if self.buf.startswith(CALL[0]) else self.buf)
            out.extend([("call", call)] if call else self._text(self.buf))
        elif self.mode == "json":
            calls = _llama_calls(self.buf)
            out.extend([("call", c) for c in calls] if calls else self._text(self.buf))
        else:
            out.extend(self._text(self.buf))
        self.buf = ""
        if self.space and not self.calls:
            out.append(("content", self.space))
        return [e for e in out if e[0] == "call" or e[1]]

    # -- the modes: each takes what it can of self.buf --------------------------------------------

    def _reasoning(self, out: list) -> None:
        end = self.fmt.think[1]
        i = self.buf.find(end)
        if i >= 0:
            out.append(("reasoning", self.buf[:i]))
            self.buf, self.mode, self.reasoned = self.buf[i + len(end):], "content", True
            return
        keep = _held(self.buf, (end,))
        out.append(("reasoning", self.buf[: len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]

    def _content(self, out: list) -> None:
        if not self.started:
            lead = self.buf.lstrip()
            if not lead:
                return
            if self.reasoned:
                self.buf = lead
            if self.json_answer and lead[0] == "{":
                self.mode, self.buf = "json", lead
                return
            if self.fmt.think and (lead.startswith(self.fmt.think[0]) or self.fmt.think[0].startswith(lead)):
                if len(lead) < len(self.fmt.think[0]):
                    return  # maybe the start of <think>
                self.mode, self.buf = "reasoning", lead[len(self.fmt.think[0]):]
                return
            self.json_answer = False
        markers = (CALL[0],) if self.tools and self.fmt.name in ("qwen3", "qwen3_coder") else ()
        i = min((j for j in (self.buf.find(m) for m in markers) if j >= 0), default=-1)
        if i >= 0:
            out.extend(self._text(self.buf[:i]))
            self.buf, self.mode, self.started = self.buf[i:], "call", True
            return
        keep = _held(self.buf, markers)
        out.extend(self._text(self.buf[: len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]

    def _call(self, out: list) -> None:
        i = self.buf.find(CALL[1])
        if i < 0:
            return
        body, self.buf, self.mode = self.buf[len(CALL[0]): i], self.buf[i + len(CALL[1]):], "content"
        call = self._parse(body)
        if call is None:
            out.extend(self._text(CALL[0] + body + CALL[1]))
        else:
            self.calls += 1
            self.space = ""
            out.append(("call", call))

    def _json(self, out: list) -> None:
        return  # llama3_json: the whole answer, decided at the end

    def _text(self, text: str) -> list[tuple]:
        """Content, with whitespace held back until text follows it (the whitespace around calls is not content)."""
        if not text:
            return []
        self.started = True
        if not text.strip():
            self.space += text
            return []
        text, self.space = self.space + text, ""
        stripped = text.rstrip()
        self.space = text[len(stripped):]
        return [("content", stripped)]

    def _parse(self, body: str) -> Call | None:
        return _xml_call(body) if self.fmt.name == "qwen3_coder" else _json_call(body)


def _json_call(body: str) -> Call | None:
    """{"name": ..., "arguments": {...}} (Hermes; "parameters" as Llama writes it) -> a Call."""
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _llama_calls(text: str) -> list[Call]:
    """Llama 3.1's answer as calls: one JSON object, or several separated by `;`; [] when it is not that."""
    calls = []
    for part in text.strip().split(";") if text.strip().startswith("{") else []:
        if part.strip():
            c = _json_call(part)
            if c is None:
                return []
            calls.append(c)
    return calls


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_call(body: str) -> Call | None:
    """Qwen3-Coder's <function=NAME><parameter=P>VALUE</parameter></function> -> a Call; a value that
    reads as JSON (a number, an object, true) is that value, anything else a string."""
    m = _FUNCTION.search(body)
    if m is None:
        return None
    args = {}
    for p in _PARAMETER.finditer(m.group(2)):
        value = p.group(2)
        try:
            args[p.group(1).strip()] = json.loads(value)
        except ValueError:
            args[p.group(1).strip()] = value
    return Call(m.group(1).strip(), json.dumps(args, ensure_ascii=False))


# -- harmony (gpt-oss) ------------------------------------------------------------------------------

H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>")


class HarmonyParser(OutputParser):
    """gpt-oss's messages: a header (`<|channel|>NAME[ to=functions.F][ <|constrain|>json]`) up to
    `<|message|>`, then a body up to <|end|> / <|call|> / <|return|>; the next message may begin with
    `<|start|>assistant`. analysis -> reasoning, final (and commentary without a recipient) ->
    content, commentary to=functions.F -> a call of F whose arguments are the body."""

    def __init__(self, tools: bool):
        self.tools = tools
        self.buf, self.header, self.in_body = "", "", False

    def push(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while True:
            if not self.in_body:
                i = self.buf.find(H_MESSAGE)
                if i < 0:
                    return out
                self.header, self.buf, self.in_body = self.buf[:i], self.buf[i + len(H_MESSAGE):], True
                continue
            ends = [(j, m) for m in H_ENDS if (j := self.buf.find(m)) >= 0]
            if ends:
                j, m = min(ends)
                out.extend(self._body(self.buf[:j], final=True))
                self.buf, self.in_body = self.buf[j + len(m):], False
                continue
            if self._kind()[0] != "call":  # reasoning and content stream as they come
                keep = _held(self.buf, H_ENDS)
                out.extend(self._body(self.buf[: len(self.buf) - keep], final=False))
                self.buf = self.buf[len(self.buf) - keep:]
            return out

    def finish(self) -> list[tuple]:
        out = self._body(self.buf, final=True) if self.in_body else []
        if not self.in_body and self.buf and H_CHANNEL not in self.buf and H_START not in self.buf:
            out = [("content", self.buf)]  # text the model wrote outside any harmony message: the answer as it is
        self.buf = ""
        return [e for e in out if e[0] == "call" or e[1]]

    def _kind(self) -> tuple[str, str]:
        """What the current message is: ("reasoning" | "content" | "call", the function's name)."""
        h = self.header.replace(H_START, " ")
        m = re.search(r"to=functions\.([^\s<]+)", h)
        if m and self.tools:
            return "call", m.group(1)
        return ("reasoning" if "analysis" in h else "content"), ""

    def _body(self, text: str, final: bool) -> list[tuple]:
        kind, name = self._kind()
        if kind != "call":
            return [(kind, text)] if text else []
        if not final:
            return []
        try:
            args = json.loads(text.strip() or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return [("content", text)]
        return [("call", Call(name, json.dumps(args, ensure_ascii=False)))]


def assemble(events: list[tuple]) -> tuple[str | None, str | None, list[Call]]:
    """(reasoning, content, calls) of a whole completion's events."""
    reasoning = "".join(e[1] for e in events if e[0] == "reasoning")
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = [e[1] for e in events if e[0] == "call"]
    return reasoning or None, content, calls
