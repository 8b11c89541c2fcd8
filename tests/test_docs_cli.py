"""Every `dflash-export ...` command the README and the guides show parses against the CLI.

The commands are read from fenced code blocks and from inline code spans of README.md,
docs/*.md and demo/RESULTS.md; each one's subcommand must exist and every option it names
must be an option of that subcommand, checked on click's own command objects (no command
runs, nothing heavy is imported). So a renamed option or command fails here, not in a
user's terminal.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from dflash_export.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "demo" / "RESULTS.md"])
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LEAD = re.compile(r"\$|\w+=\S*|nice|-n|\d+|time|exec")  # what may precede the program: a prompt, env, nice


def _lines(text: str) -> list[str]:
    """Command lines of fenced blocks (backslash continuations joined) and inline spans."""
    out = []
    for block in FENCE.findall(text):
        out += block.replace("\\\n", " ").splitlines()
    prose = FENCE.sub("", text)
    out += [span for span in INLINE.findall(prose) if re.search(r"(^|[\s/])dflash-export\s", span)]
    return out


def _commands(text: str) -> list[list[str]]:
    """Each `dflash-export` invocation as its words after the program name."""
    found = []
    for line in _lines(text):
        for part in re.split(r"\s(?:&&|\|\||;|\|)\s", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # an unbalanced quote in prose: the words up to it
                words = part.split("#")[0].split()
            for i, w in enumerate(words):
                if w.endswith("dflash-export") and "/" not in w.replace(".venv/bin/", ""):
                    rest = words[i + 1:]
                    logged = rest[:1] and rest[0].endswith(":")  # output such as "dflash-export serve: ready"
                    if all(LEAD.fullmatch(v) for v in words[:i]) and not logged:
                        found.append(rest)
                    break
    return found


def _options(command: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for p in command.params:
        if isinstance(p, click.Option):
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def _check(words: list[str]) -> str | None:
    """None if `dflash-export WORDS` parses against the CLI, else what is wrong."""
    command: click.Command = cli
    path = ["dflash-export"]
    rest = list(words)
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        sub = command.commands.get(name)
        if sub is None:
            return f"`{' '.join(path)}` has no subcommand {name!r}"
        command, path = sub, path + [name]
    known = _options(command)
    for w in rest:
        w = w.strip("[]()")
        if not w.startswith("-") or w in ("-", "--") or re.fullmatch(r"-\d.*", w):
            continue
        name = w.split("=", 1)[0]
        if name not in known:
            return f"`{' '.join(path)}` has no option {name}"
    return None


def _cases():
    for doc in DOCS:
        if doc.exists():
            for words in _commands(doc.read_text()):
                yield pytest.param(words, id=f"{doc.relative_to(ROOT)}: {' '.join(words)[:60]}")


CASES = list(_cases())


def test_docs_show_commands():
    """The extraction finds the README's pipeline (a parser that finds nothing checks nothing)."""
    readme = {tuple(w[:1]) for w in _commands((ROOT / "README.md").read_text())}
    for sub in ("export", "check", "info", "generate", "bench", "build", "serve", "demo"):
        assert (sub,) in readme, f"README shows no `dflash-export {sub}` command"
    assert len(CASES) > 40


@pytest.mark.parametrize("words", CASES)
def test_doc_command_parses(words):
    problem = _check(words)
    assert problem is None, f"{problem}: dflash-export {' '.join(words)}"


def test_checker_refuses_drift():
    """The checker itself rejects an unknown subcommand and an unknown option."""
    assert _check(["export", "--target", "T", "--out", "O"]) is None
    assert "no subcommand" in _check(["exprot", "--out", "O"])
    assert "no option --frobnicate" in _check(["generate", "OUT", "--frobnicate", "3"])
    assert _check(["generate", "OUT", "--no-draft", "--temperature=0.8"]) is None
    assert "no option --out" in _check(["info", "OUT", "--out", "x"])


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", doc.read_text()), re.M):
        slugs.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return slugs


def test_doc_links_resolve():
    """Every relative link of the README and the guides names a file (and heading) that exists."""
    broken = []
    for doc in DOCS:
        if not doc.exists():
            continue
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
