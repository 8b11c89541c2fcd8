"""Every default the README, the guides and `--help` state for an option is the code's default.

A stated default is read from three places: a table whose header has a `default` column (the
row's options against that cell), prose that names an option and then its default
("`--max-context N` ... (default 2048)", "`--speculation auto` (the default)"), and the options'
own help strings ("[default: 128 ...]"). Its first literal (a number or a code span) is compared
with the click option's default. Where the option's default is None, the value is resolved in
code; RESOLVED names the function that resolves it, and every number the statement gives must
be one that function returns for a released shape. A stated number for a None default with no
resolver here fails: the test cannot check it, so it must learn how.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from dflash_export.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "demo" / "RESULTS.md"])
OPT = r"--[a-z][a-z0-9-]+"
NUMBER = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?(?![\w.])")


@dataclass
class Stated:
    where: str  # file:line, or "help of CMD OPT"
    option: str
    text: str  # the words that state the default, from the first one on


def _unset(default: object) -> bool:
    return default is None or type(default).__name__ == "Sentinel"


def _options() -> dict[str, list[tuple[str, click.Option]]]:
    """Option name -> [(command, option)] over every command that has it."""
    out: dict[str, list[tuple[str, click.Option]]] = {}
    for name, command in cli.commands.items():
        for p in command.params:
            if isinstance(p, click.Option):
                for opt in p.opts + p.secondary_opts:
                    out.setdefault(opt, []).append((name, p))
    return out


OPTIONS = _options()


def _released_block_sizes() -> set[int]:
    """default_block_size over released shapes: (hidden, expert width or None)."""
    from dflash_export.export.quant_options import default_block_size

    shapes = [(1024, None), (2048, None), (4096, None), (5120, None),  # Qwen3 0.6B/1.7B, 8B, 14B/32B
              (2048, 768), (4096, 1536), (2880, 2880)]  # Qwen3-30B-A3B, Qwen3-235B-A22B, gpt-oss
    return {default_block_size(s, h, e) for s in ("int4", "int8") for h, e in shapes}


def _serve_max_batch() -> set[int]:
    """serve without --max-batch: DEFAULT_BATCH rows where the export and memory allow, else 1
    (the docs may also name the TensorRT build's own default, `build --max-batch`)."""
    from dflash_export.cli.serve import DEFAULT_BATCH

    return {DEFAULT_BATCH, 1}


def _ray_replicas() -> set[int]:
    """serve --ray without --replicas or --autoscale."""
    from dflash_export.serve.options import RayOptions

    return {RayOptions(use_ray=True).deploy()["replicas"]}


def _ray_headroom() -> set[int]:
    """serve --ray without --max-ongoing: rows + queue + HEADROOM (the stated number is the headroom)."""
    from dflash_export.serve.ray import HEADROOM

    return {HEADROOM}


def _moe_path() -> set[str]:
    """export without --moe: the contrib op where ONNX Runtime runs it, else standard ops."""
    from dflash_export.export.moe import choose_path

    return {choose_path(None, dtype, act) for dtype in ("fp32", "fp16") for act in ("swiglu", "gelu")}


# options whose click default is None, resolved in code -> the values the code resolves them to
RESOLVED = {
    "--quant-block-size": _released_block_sizes,
    "--max-batch": _serve_max_batch,
    "--replicas": _ray_replicas,
    "--moe": _moe_path,
    "--max-ongoing": _ray_headroom,
}


def _choices(opt: str) -> set[str]:
    return {c for _, p in OPTIONS.get(opt, []) if isinstance(p.type, click.Choice) for c in p.type.choices}


def _literal(text: str) -> str | None:
    """The first value a statement gives: a code span or a number; None for words only."""
    m = re.match(r"\s*(?:`([^`]+)`|(\d+(?:\.\d+)?)(?![%\w]))", text)
    if not m:
        return None
    return (m.group(1) or m.group(2)).strip()


def _equal(literal: str, default: object) -> bool:
    if isinstance(default, bool) or _unset(default):
        return False
    if isinstance(default, (int, float)):
        try:
            return float(literal) == float(default)
        except ValueError:
            return False
    return literal == str(default)


def _tables(lines: list[str], name: str) -> list[Stated]:
    found, column = [], None
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:
            heads = [c.lower() for c in cells]
            column = heads.index("default") if "default" in heads else -1
            continue
        opts = re.findall(rf"`({OPT})", cells[0])
        if column < 0:  # "| `--max-context N` | ... (default 2048) ... |": one option, its default in the prose
            m = re.search(r"\(default:?\s+([^)]*)", " | ".join(cells[1:]))
            if len(opts) == 1 and m:
                found.append(Stated(f"{name}:{i + 1}", opts[0], m.group(1)))
            continue
        if set(cells[0]) <= set("-: ") or len(cells) <= column or not cells[column]:
            continue
        values = [cells[column]]
        if len(opts) > 1:  # "`--a`, `--b` | 30, 600": one value each, or one for all
            parts = [v.strip() for v in cells[column].split(",")]
            values = parts if len(parts) == len(opts) else values * len(opts)
        for opt, value in zip(opts, values * len(opts)):
            if value.lower() == "none" or value in _choices(opt):  # a bare value in a default column: HeadOnly, none
                value = f"`{value}`"
            found.append(Stated(f"{name}:{i + 1}", opt, value))
    return found


# "`--opt ARGS` ... default X", within one clause and with no other option between
PROSE = re.compile(rf"`({OPT})((?: [^`]*)?)`((?:[^`.|\n]|\n(?!\n)|`[^`]*`)*?)\(?\b(?:the )?default\b(:?(?:[^.;|\n]|\n(?!\n))*)",
                   re.I)


# "... defaults to `--threads 1`": the value shown is the stated default
DEFAULTS_TO = re.compile(rf"\bdefaults? (?:to|is) `({OPT}) ([^`\s]+)`", re.I)


def _prose(text: str, name: str) -> list[Stated]:
    found = [Stated(f"{name}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1), f"`{m.group(2)}`")
             for m in DEFAULTS_TO.finditer(text)]
    for m in PROSE.finditer(text):
        opt, args, between, after = m.groups()
        if re.search(OPT, between) or len(between) > 100:
            continue
        line = text.count("\n", 0, m.start()) + 1
        if after.startswith(")") and args.strip():  # "`--speculation auto` (the default)": the value shown
            found.append(Stated(f"{name}:{line}", opt, f"`{args.split()[0]}`"))
        elif not after.startswith(")"):
            found.append(Stated(f"{name}:{line}", opt, after.lstrip(": ")))
    return found


def _helps() -> list[Stated]:
    found = []
    for name, command in cli.commands.items():
        for p in command.params:
            if isinstance(p, click.Option) and p.help:
                for m in re.finditer(r"[\[(]default:?\s+([^\])]*)", p.help):
                    found.append(Stated(f"help of {name} {p.opts[-1]}", p.opts[-1], m.group(1)))
    return found


def stated() -> list[Stated]:
    out = _helps()
    for doc in DOCS:
        text, name = doc.read_text(), doc.relative_to(ROOT).as_posix()
        text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group().count("\n"), text, flags=re.S | re.M)  # not code
        out += _tables(text.splitlines(), name) + _prose(text, name)
    return [s for s in out if s.option in OPTIONS]


def mismatch(s: Stated) -> str | None:
    """Why the statement disagrees with the code, or None."""
    owners = OPTIONS[s.option]
    literal = _literal(s.text)
    if s.option in RESOLVED:
        allowed = RESOLVED[s.option]() | {p.default for _, p in owners if not _unset(p.default)}  # other commands'
        numbers = {int(float(n)) for n in NUMBER.findall(s.text)} if all(isinstance(a, int) for a in allowed) else set()
        if numbers - allowed or (literal is not None and literal not in {str(a) for a in allowed}):
            return f"states {sorted(numbers) or literal!r}; the code resolves it to one of {sorted(allowed)}"
        return None
    if literal is None:
        return None  # words ("the drafter's", "calibrated"): nothing to compare
    defaults = [p.default for _, p in owners if not _unset(p.default)]
    if literal.lower() == "none":
        return None if len(defaults) < len(owners) else f"states none; the code's default is {defaults}"
    if any(_equal(literal, d) for d in defaults):
        return None
    if not defaults:
        return f"states {literal!r}; the option's default is None and this test has no resolver for it (RESOLVED)"
    return f"states {literal!r}; the code's default is " + ", ".join(f"{c}: {p.default!r}" for c, p in owners)


def test_the_reader_finds_defaults():
    """The extraction itself: it must see the statements this test exists for."""
    found = {(s.option, _literal(s.text)) for s in stated()}
    for expected in [("--max-context", "2048"), ("--host", "127.0.0.1"), ("--quant-block-size", "128"),
                     ("--speculation", "auto"), ("--upscale-delay", "30"), ("--downscale-delay", "600")]:
        assert expected in found, f"no statement of {expected} found: the reader is broken"


def test_a_wrong_default_is_caught():
    wrong = [Stated("x", "--max-context", "4096"), Stated("x", "--quant-block-size", "128, MoE targets 32"),
             Stated("x", "--host", "`0.0.0.0`"), Stated("x", "--threads", "4"), Stated("x", "--port", "`none`"),
             *_tables(["| flag | default |", "|---|---|", "| `--proxy` | EveryNode |"], "x")]
    assert all(mismatch(s) for s in wrong), [mismatch(s) for s in wrong]
    said = _prose("so `demo` now defaults to `--threads 1`.", "x") + _prose("`--max-context N` (default 4096)", "x")
    assert [(s.option, _literal(s.text)) for s in said] == [("--threads", "1"), ("--max-context", "4096")]
    assert all(mismatch(s) for s in said)
    assert mismatch(Stated("x", "--quant-block-size", "128, halved until it divides ...: 64 for gpt-oss")) is None


@pytest.mark.parametrize("s", stated(), ids=lambda s: f"{s.where} {s.option}")
def test_stated_default_is_the_codes(s: Stated):
    problem = mismatch(s)
    assert problem is None, f"{s.where}: {s.option} {problem} (text: {s.text[:100]!r})"
