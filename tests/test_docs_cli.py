"""Every `dflash-export ...` command the README and the guides show parses against the CLI.

The commands are read from fenced code blocks and from inline code spans of README.md,
docs/*.md and demo/RESULTS.md; each one's subcommand must exist and every option it names
must be an option of that subcommand, checked on click's own command objects (no command
runs, nothing heavy is imported). So a renamed option or command fails here, not in a
user's terminal. The Python examples run (on a small export standing in for `art` / `OUT`),
so an example that drifts from the code fails here too.
"""

from __future__ import annotations

import re
import shutil
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


# -- defaults: an options table's "default" column and "(default X)" against click's defaults --

TABLE = re.compile(r"^\|(.*)\|\s*$")
OPTION = re.compile(r"`(--[a-z][\w-]*)")
NUMBER = re.compile(r"-?\d+(\.\d+)?")


def _all_commands(group: click.Group = cli):
    for sub in group.commands.values():
        yield from _all_commands(sub) if isinstance(sub, click.Group) else [sub]


def _owner(options: list[str]) -> click.Command | None:
    """The command that has every option of a table (None: no single command has them)."""
    return next((c for c in _all_commands() if set(options) <= _options(c)), None)


def _option(command: click.Command, name: str) -> click.Option:
    return next(p for p in command.params if isinstance(p, click.Option) and name in p.opts + p.secondary_opts)


def _default(command: click.Command, name: str):
    """Option `name`'s default; None where it has none (click >= 8.3 says so with its UNSET sentinel) and for
    a flag, whose default is not being given (`--no-access-log` sets False where its default is True)."""
    o = _option(command, name)
    d = o.default
    flag = o.is_flag and not o.secondary_opts
    return None if d is None or repr(d) == "Sentinel.UNSET" or (flag and d != o.flag_value) else d


def _same(doc: str, command: click.Command, name: str) -> bool:
    """A documented default names the option's: equal as numbers, else as words (a unit after it allowed).
    An option without a default (resolved at run time) has no number in the docs, except the one its help declares."""
    default, word = _default(command, name), (doc.split() or [""])[0]
    if default is None or default is False:
        return not NUMBER.fullmatch(word) or f"[default: {word}]" in (_option(command, name).help or "")
    try:
        return float(word) == float(default)
    except (TypeError, ValueError):
        return word == str(default)


def _tables(text: str) -> list[list[tuple[list[str], list[str]]]]:
    """Each table whose second column is `default`: its rows' (option names, documented defaults)."""
    tables, col = [], None
    for line in text.splitlines():
        if not TABLE.match(line):
            col = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if col is None:
            col = 1 if len(cells) > 2 and cells[1].lower() == "default" else -1
            tables.append([])
            continue
        if col < 0 or set(cells[0]) <= set("-: "):
            continue
        names = OPTION.findall(cells[0])
        values = [v.replace("`", "").strip() for v in cells[col].split(",")] if cells[col] else [""] * len(names)
        if names and len(values) == len(names):
            tables[-1].append((names, values))
    return [t for t in tables if t]


def _default_cases():
    for doc in (d for d in DOCS if d.exists()):
        text = doc.read_text()
        for table in _tables(text):
            command = _owner([n for names, _ in table for n in names])
            for names, values in table:
                yield pytest.param(command, names, values, id=f"{doc.relative_to(ROOT)}: {' '.join(names)}")
        for m in re.finditer(r"^\| `(--[\w-]+)[^|]*\|[^|]*\(default:? ([^)]+)\)", text, re.M):  # "| `--x N` | ... (default 8) |"
            yield pytest.param(_owner([m.group(1)]), [m.group(1)], [m.group(2).replace("`", "")],
                               id=f"{doc.relative_to(ROOT)}: {m.group(1)}")


DEFAULT_CASES = list(_default_cases())


@pytest.mark.parametrize("command, names, values", DEFAULT_CASES)
def test_doc_defaults_match_the_options(command, names, values):
    """Each documented default is the option's own: its value where click has one, no number where it is resolved at run time."""
    assert command is not None, f"no command has all of {names}"
    for name, doc in zip(names, values):
        assert _same(doc, command, name), \
            f"{command.name} {name}: the docs say default {doc!r}, the option's is {_default(command, name)!r}"


def test_default_checker_refuses_drift():
    """The check finds the tables, and rejects a wrong value and a number for a default resolved at run time."""
    assert len(DEFAULT_CASES) > 15
    serve = _owner(["--port", "--threads", "--slots"])
    assert _same("8000", serve, "--port") and not _same("8080", serve, "--port") and _same("10 s", serve, "--shutdown-timeout")
    assert not _same("1", serve, "--threads") and _same("calibrated", serve, "--threads")
    assert _same("1", serve, "--replicas") and not _same("2", serve, "--replicas")  # its help: [default: 1]
    table = "| flag | default | meaning |\n|---|---|---|\n| `--a`, `--b` | `1`, x | y |\n"
    assert _tables(table) == [[(["--a", "--b"], ["1", "x"])]]


# -- the examples run: every Python block of the README and the guides, on a small export --

LANG = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def _python_blocks(doc: Path) -> list[str]:
    return [body for lang, body in LANG.findall(doc.read_text()) if lang.strip() == "python"]


PYTHON_DOCS = [d for d in DOCS if d.exists() and _python_blocks(d)]


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    """A small cached export with a tokenizer (character-level), standing in for the guides' `art` / `OUT`."""
    from test_files import tokenized_copy

    return tokenized_copy(tmp_path_factory.mktemp("docs") / "art")


def test_python_examples_are_found():
    """The README's example is among them (a reader that finds nothing runs nothing)."""
    assert ROOT / "README.md" in PYTHON_DOCS and sum(len(_python_blocks(d)) for d in PYTHON_DOCS) >= 5


SERVER = "127.0.0.1:8000"


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    """`serve` of the tools test's pair under the demo's model name, on a free port; stopped by its pid."""
    from test_serve import running
    from test_serve_tools import art

    d = art.__wrapped__(tmp_path_factory)
    yield from running(d, tmp_path_factory.mktemp("log") / "serve.log", "--tool-format", "qwen3",
                       "--model-name", "dflash-demo")


@pytest.mark.parametrize("doc", PYTHON_DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_python_examples_run(doc, small_export, tmp_path, monkeypatch, capsys, request):
    """A guide's Python blocks run in order in one namespace, as a reader pastes them, from a folder
    where the directory they name (`art`, `OUT`) is the small export, and the server they talk to a
    real one (the agents' test pair as the demo: a template that renders tools); a name or keyword
    the code does not have fails here."""
    for name in ("art", "OUT"):
        shutil.copytree(small_export, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    blocks = _python_blocks(doc)
    if any(SERVER in b for b in blocks):  # a client of `serve --demo --port 8000`: a real server on a free port
        server = request.getfixturevalue("agent_server")
        blocks = [b.replace(SERVER, f"127.0.0.1:{server.port}").replace("max_tokens=64", "max_tokens=120")
                  for b in blocks]  # its tokenizer is character-level: a call takes ~80 tokens
    for i, body in enumerate(blocks):
        exec(compile(body, f"{doc.name} python block {i + 1}", "exec"), namespace)  # noqa: S102 - the docs' own code
    capsys.readouterr()


# -- the examples run: every `dflash-export` command of a fenced block, on small inputs --

# What cannot run here, and why (the first rule a command matches; the rest run).
CANNOT = [
    (lambda w: w[0] == "build" or "trt" in w or "cuda" in w or "tensorrt" in w,
     "needs an NVIDIA GPU and TensorRT (tests/test_trt_*.py check the calls against the bindings)"),
    (lambda w: any(re.fullmatch(r"[\w.-]+/[\w.-]+(@\S*)?", x) and not x.startswith(("demo/", "W/")) for x in w),
     "downloads from the Hugging Face Hub (tests/test_sources.py resolves ids against a fake Hub)"),
    (lambda w: "--ray" in w, "starts a Ray cluster (tests/test_ray.py runs one)"),
    (lambda w: "DFLASH2_DRAFT_DIR" in w, "a DFlash 2 drafter (tests/test_dflash2_export.py exports tiny ones)"),
    (lambda w: any("*" in x or "$" in x for x in w), "names files through the shell (a glob or $VAR)"),
    (lambda w: w[0] in ("demo", "train-draft"), "minutes of training or the demo pair end to end "
                                                "(tests/test_train_demo.py, tests/test_demo.py run them small)"),
    (lambda w: "..." in w or "<commit>" in " ".join(w), "a placeholder, not a command"),
    (lambda w: "--moe" in w or "Qwen3-30B-A3B" in w or "s8" in w,
     "a mixture-of-experts target (tests/test_moe.py and tests/test_moe_stream.py export tiny ones)"),
]
MODELS = {"T": "t", "TARGET_DIR": "t", "demo/pair/target": "t", "W/target": "t", "Qwen3-30B-A3B": "t",
          "D": "d", "DRAFT_DIR": "d", "demo/pair/draft": "d", "W/draft": "d", "my-draft": "d"}
INPUTS = {"demo/prompts.jsonl": "prompts.jsonl", "corpus.jsonl": "prompts.jsonl",  # small stand-ins of the guides' values
          "32768": "64", "128,2048": "8,16"}
CAPS = {"generate": ["--max-new-tokens", "4"], "bench": ["--max-new-tokens", "4", "--warmup", "0", "--off-domain", "0"],
        "check": ["--num-prompts", "1", "--max-new-tokens", "4"], "export": ["--force", "--quiet", "--max-context", "256"],
        "quantize": ["--force", "--quiet"]}


def _block_commands(doc: Path) -> list[list[str]]:
    """The `dflash-export` commands of a guide's fenced blocks, in order, each once."""
    out: list[list[str]] = []
    for _, body in LANG.findall(doc.read_text()):
        for words in _commands("```\n" + body + "```\n"):
            if words and words not in out:
                out.append(words)
    return out


def _cannot(words: list[str]) -> str | None:
    return next((why for rule, why in CANNOT if rule(words)), None)


COMMAND_DOCS = [d for d in DOCS if d.exists() and _block_commands(d)]


def test_every_block_command_runs_or_says_why_not():
    """Which commands run and which cannot here (with the reason): most of them run."""
    runs = [w for d in COMMAND_DOCS for w in _block_commands(d) if _cannot(w) is None]
    cannot = [w for d in COMMAND_DOCS for w in _block_commands(d) if _cannot(w) is not None]
    assert len(runs) > len(cannot) and {w[0] for w in runs} >= {"export", "check", "info", "generate", "bench",
                                                                     "quantize", "serve"}


@pytest.fixture(scope="module")
def small_pair(small_export, tmp_path_factory):
    """The small export's target (with its tokenizer) and drafter, for the guides' T / D."""
    from runtime_cases import CASES, artifact

    t, d, _ = artifact(CASES["qwen2"])
    root = tmp_path_factory.mktemp("pair")
    shutil.copytree(t, root / "t")
    shutil.copytree(d, root / "d")
    shutil.copyfile(small_export / "tokenizer.json", root / "t" / "tokenizer.json")
    return root


@pytest.mark.parametrize("doc", COMMAND_DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_block_commands_run(doc, small_export, small_pair, tmp_path, monkeypatch):
    """A guide's commands run in order from one folder, as a reader types them: its models are the small
    pair, the artifacts it names before exporting them a copy of the small export, exports replace
    (--force), and each command is capped to a few tokens. `serve` runs up to binding its socket."""
    from click.testing import CliRunner

    from dflash_export.cli import serve as cmd_serve

    served = []
    monkeypatch.setattr(cmd_serve, "_serve_here", lambda options, host, port, timeout: served.append(options))
    monkeypatch.setattr(cmd_serve, "demo_artifact", lambda pair=None: small_export)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("def f(x):\n1,2,3\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def f(x):"}\n{"prompt": "x = 1"}\n')
    commands = [w for w in _block_commands(doc) if _cannot(w) is None]
    for words in commands:
        args = [str(small_pair / MODELS[w]) if w in MODELS else INPUTS.get(w, w).removeprefix("/tmp/") for w in words]
        if args[0] != "export" and len(args) > 1 and not args[1].startswith("-") and not (tmp_path / args[1]).exists():
            shutil.copytree(small_export, tmp_path / args[1])  # an artifact the guide made elsewhere (or later)
        if args[0] == "check" and "--target" not in args:  # the copy's recorded sources are gone: name them
            args += ["--target", str(small_pair / "t"), "--draft", str(small_pair / "d")]
        r = CliRunner().invoke(cli, [*args, *CAPS.get(args[0], [])])
        assert r.exit_code in (0,), f"{doc.name}: dflash-export {' '.join(words)}\n{r.output[-2000:]}"
