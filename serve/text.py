"""Text for the server: the artifact's tokenizer, its chat template, and streamed text.

Chat templates are Jinja rendered in a sandbox, as transformers renders them
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`tojson`, `strftime_now`): a template is data from a model folder, never trusted code.

`TextStream` turns the tokens of each accepted round into the text to send now. It decodes
incrementally with the tokenizers library's own streaming decoder (`DecodeStream`: each token
costs a small window, not the whole completion, and it waits while a character is an incomplete
UTF-8 sequence), searches for stop strings only where new text could complete one, and holds
back a tail that may still be the start of a stop string. At a stop string it keeps only the
tokens up to the one that completes it, so the engine can report those (token ids, usage) and
not the rest of the round.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ..runtime.errors import DFlashError
from ..runtime.files import read_json, read_text, readable
from ..runtime.lazy import lazy_import
from . import formats
from .logprobs import Pieces

jinja2 = lazy_import("jinja2")  # the serve extra, on the first chat template (runtime/lazy.py)
jinja2_sandbox = lazy_import("jinja2.sandbox")


class Text:
    """Tokenizer + chat template of an exported directory (torch-free: `tokenizers`, `jinja2`)."""

    def __init__(self, directory: Path, chat_template: str | None = None):
        self.tokenizer = load_tokenizer(directory)
        if self.tokenizer is None:
            raise DFlashError(f"{directory} has no tokenizer.json; the server needs one to turn text into tokens")
        config = read_json(Path(directory) / "tokenizer_config.json", "re-export the directory")
        config = config if isinstance(config, dict) else {}
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if chat_template is None:
            chat_template = config.get("chat_template")
            jinja = Path(directory) / "chat_template.jinja"  # transformers 5 saves it beside the config
            if chat_template is None and jinja.exists():
                chat_template = read_text(jinja, "re-export the directory")
            if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
                chat_template = named.get("default")
        self.template = _compile(chat_template) if isinstance(chat_template, str) else None
        self.template_source = chat_template if isinstance(chat_template, str) else None
        self.format = formats.detect(self.template_source)  # reasoning and tool calls (load_engine: + architecture)
        self.pieces = Pieces(self)  # token texts for logprobs, cached across requests (they never change)
        # no token is longer than this in characters, so text longer than the context times it cannot fit
        # (serve/validate.py refuses it before tokenizing); vocabulary strings are never shorter than their text
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, special: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): a long prompt tokenized in a
        # worker thread then leaves the event loop free (/health, other streams)
        return self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **kwargs) -> str:
        """The chat as the model was trained to see it (`tools`: the template's own `tools` variable;
        `kwargs`: a request's chat_template_kwargs, e.g. enable_thinking); ValueError with the
        template's message."""
        if self.template is None:
            raise ValueError("this model has no chat template (neither tokenizer_config.json nor chat_template.jinja "
                             "holds one); "
                             "use /v1/completions, or start the server with --chat-template FILE")
        try:
            return self.template.render({**{k: v for k, v in self.special.items() if v is not None}, **kwargs,
                                         "messages": messages, "add_generation_prompt": add_generation_prompt,
                                         "tools": tools})
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused these messages: {e}") from None


def load_tokenizer(directory: Path):
    """The exported directory's tokenizer.json as a `tokenizers.Tokenizer`, None without one."""
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        return None
    readable(path, "make it readable or re-export the directory")  # tokenizers' own error would not say why
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise DFlashError(f"{path}: unreadable tokenizer ({str(e).splitlines()[0] if str(e) else e}); re-export") from None


def _token_text(t) -> str | None:
    return t.get("content") if isinstance(t, dict) else t if isinstance(t, str) else None


def _compile(source: str):
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = jinja2_sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DFlashError(f"the chat template does not compile (line {e.lineno}: {e.message})") from None


class TextStream:
    """Text deltas of a completion as its tokens arrive, cut at the first stop string.
    `text`: a serve Text or a tokenizers.Tokenizer."""

    def __init__(self, text, stop: list[str] | tuple[str, ...] = (), specials: bool = False):
        self.tokenizer = getattr(text, "tokenizer", text)
        self.skip = not specials  # specials: the text keeps special tokens (harmony's markers; serve/formats.py)
        self.decoder = DecodeStream(skip_special_tokens=self.skip)
        self.stop = [s for s in stop if s]
        self.longest = max(map(len, self.stop), default=0)
        self.tokens: list[int] = []  # the completion's tokens (up to a stop string's last one)
        self.text = ""  # the completion's text so far (cut at a stop string once one is found)
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found

    def push(self, tokens: list[int]) -> str:
        """Add a round's tokens; return the text that is safe to send now."""
        if self.stopped:
            return ""
        for t in tokens:
            before = len(self.text)
            self.text += self.decoder.step(self.tokenizer, t) or ""  # None: a character not complete yet
            self.tokens.append(t)
            hit = self._hit(max(0, before - self.longest + 1)) if self.stop and len(self.text) > before else None
            if hit is not None:  # this token completes it: keep the tokens up to it (as vLLM)
                self.stopped, self.text = True, self.text[:hit]
                return self._take(hit)
        end = len(self.text)
        held = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._take(max(self.sent, end - held))

    def _hit(self, start: int) -> int | None:
        """Where the first stop string at or after `start` begins."""
        return min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=None)

    def finish(self) -> str:
        """Whatever was held back, at the end of the completion (with a trailing incomplete
        character as the whole decode shows it)."""
        if not self.stopped:
            whole = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip)
            if whole.startswith(self.text):
                self.text = whole
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out
