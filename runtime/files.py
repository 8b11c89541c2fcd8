"""Reading the user's files: every file the tool opens goes through these few functions.

A file that cannot be read (missing, a directory, not readable by this user, not UTF-8 where
text is expected) is the user's to fix, so it becomes one DFlashError line naming the file,
what is wrong and `fix`, never a traceback. Libraries that open paths themselves (ONNX Runtime,
tokenizers, safetensors) get a path only after `readable` has opened it: their own errors
would be a traceback or a message that does not name the cause.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import DFlashError


def why(e: OSError | UnicodeDecodeError) -> str:
    """What is wrong with a file, in words."""
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text, byte {e.object[e.start]:#04x} at offset {e.start}: a binary file?"
    if isinstance(e, IsADirectoryError):
        return "a directory, not a file"
    if isinstance(e, FileNotFoundError):
        return "no such file"
    if isinstance(e, PermissionError):
        return "permission denied: not readable by this user"
    return e.strerror or str(e)


def unreadable(path: str | Path, e: OSError | UnicodeDecodeError, fix: str = "", what: str = "") -> DFlashError:
    """The one-line error for `path`; `what` names where it came from (e.g. "--prompts ")."""
    return DFlashError(f"{what}{path}: unreadable ({why(e)})" + (f"; {fix}" if fix else ""))


def read_bytes(path: str | Path, fix: str = "", what: str = "") -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise unreadable(path, e, fix, what) from None


def read_text(path: str | Path, fix: str = "", what: str = "") -> str:
    """A UTF-8 text file's content."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise unreadable(path, e, fix, what) from None


def read_json(path: str | Path, fix: str, what: str = ""):
    """A JSON file's content ({} when there is none); one line naming it and `fix` when unreadable."""
    path = Path(path)
    if not path.exists():
        return {}
    text = read_text(path, fix, what)
    try:
        return json.loads(text)
    except ValueError as e:
        raise DFlashError(f"{what}{path}: unreadable, invalid JSON ({e}); {fix}") from None


def readable(path: str | Path, fix: str = "", what: str = "") -> Path:
    """`path`, once opened for reading here: for a library that opens it itself."""
    try:
        with open(path, "rb") as f:
            f.read(1)  # a directory opens on some systems and fails on read
    except OSError as e:
        raise unreadable(path, e, fix, what) from None
    return Path(path)


def prompt_lines(path: str | Path, what: str = "--prompts ") -> list[str]:
    """A file of prompts: its non-empty lines, or each line's "prompt" string of a *.jsonl file."""
    path = Path(path)
    lines = [ln for ln in read_text(path, "give a UTF-8 text file, one prompt a line", what).splitlines() if ln.strip()]
    if not lines:
        raise DFlashError(f"{what}{path}: no prompts in it (one per line)")
    if path.suffix == ".jsonl":  # {"prompt": "..."} per line, as demo/prompts.jsonl
        try:
            lines = [json.loads(ln)["prompt"] for ln in lines]
        except (ValueError, KeyError, TypeError):
            lines = [None]
        if not all(isinstance(ln, str) for ln in lines):
            raise DFlashError(f"{what}{path}: each JSONL line needs a \"prompt\" string")
    return lines
