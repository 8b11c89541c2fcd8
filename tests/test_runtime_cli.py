"""`dflash-export generate` and `bench`: outputs, a torch-free run, and every bad input as one line."""

from __future__ import annotations

import json
import os
import shutil
import string
import subprocess
import sys

import pytest
from click.testing import CliRunner
from runtime_cases import CASES, artifact

from dflash_export.cli import cli
from dflash_export.runtime import manifest as M
from dflash_export.runtime.controller import controller_for
from dflash_export.runtime.loop import generate
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import load_settings
from dflash_export.runtime.sampling import Sampling


def char_tokenizer(path):
    """A character-level tokenizer.json for the tiny 101-token vocabulary (99 chars, mask, eos)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(string.printable[:99])} | {"<mask>": 99, "<eos>": 100}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<mask>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path))


@pytest.fixture(scope="module")
def out():
    return artifact(CASES["qwen2"])[2]


@pytest.fixture(scope="module")
def with_tok(out, tmp_path_factory):
    """The same artifact with a tokenizer added (and the manifest re-hashed, as export does)."""
    d = tmp_path_factory.mktemp("tok") / "out"
    shutil.copytree(out, d)
    char_tokenizer(d / "tokenizer.json")
    m = M.load_manifest(d, verify=False)
    m.tokenizer = True
    M.write_manifest(d, m)
    return d


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_generate_json_matches_the_loop(out):
    r = run("generate", out, "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "30", "--json", "--speculation", "always")
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    g = generate(OrtBackend(out), [5, 6, 7, 8, 9], 30)
    assert j["tokens"] == g.tokens and j["acceptance_lengths"] == g.acceptance_lengths
    assert j["tau"] == pytest.approx(g.tau) and j["tokens_per_second"] > 0 and "text" not in j
    r = run("generate", out, "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "30", "--json", "--no-draft")
    assert json.loads(r.stdout)["tokens"] == g.tokens


def test_generate_sampling_is_seeded(out):
    args = ["generate", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "20", "--temperature", "0.8",
            "--top-k", "30", "--top-p", "0.9", "--json"]
    a, b, c = (json.loads(run(*args, "--seed", s).stdout)["tokens"] for s in ("1", "1", "2"))
    assert a == b and a != c
    be = OrtBackend(out)  # as generate runs it: speculation auto (a sampled row's draws follow its own rounds)
    g = generate(be, [1, 2, 3], 20, sampling=Sampling(0.8, top_k=30, top_p=0.9, seed=1),
                 control=controller_for("auto", load_settings(out, "ort:cpu").costs, be.manifest.block_size))
    assert a == g.tokens


def test_generate_text_and_stream(with_tok):
    r = run("generate", with_tok, "--prompt", "def f(x):", "--max-new-tokens", "12", "--json")
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    ids = [string.printable.index(c) for c in "def f(x):"]
    assert j["tokens"] == generate(OrtBackend(with_tok), ids, 12).tokens
    assert isinstance(j["text"], str) and j["prompt_tokens"] == len(ids)
    r = run("generate", with_tok, "--prompt", "def f(x):", "--max-new-tokens", "12", "--stream")
    assert r.exit_code == 0 and r.stdout.strip() == j["text"].strip()
    r = run("generate", with_tok, "--prompt-ids", "3,4", "--max-new-tokens", "5", "--stop-ids", "")
    assert r.exit_code == 0 and "tau" in r.stderr


def test_generate_without_torch(out):
    """The edge path: generate in a process where importing torch (or onnx) fails."""
    code = (
        "import sys\n"
        "for m in ('torch', 'onnx', 'onnxscript', 'transformers'): sys.modules[m] = None\n"
        "from dflash_export.cli import cli\n"
        f"cli(['generate', {str(out)!r}, '--prompt-ids', '5,6,7,8,9', '--max-new-tokens', '30', '--json'])\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | {"PYTHONPATH": ""})
    assert p.returncode == 0, p.stderr
    with_torch = json.loads(run("generate", out, "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "30", "--json").stdout)
    assert json.loads(p.stdout)["tokens"] == with_torch["tokens"]
    # and nothing under runtime/ imports torch, onnx, models/ or export/: out of runtime/ only the
    # top level's errors and lazy (below every layer)
    import ast
    from pathlib import Path

    top = Path(__file__).parents[1]
    for f in (top / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                assert n.split(".")[0] not in ("torch", "onnx") and not n.startswith(("models", "export")), (f, n)
            if isinstance(node, ast.ImportFrom) and node.level:
                base = f.parent.joinpath(*[".."] * (node.level - 1)).resolve()
                if base == top:
                    assert node.module in ("errors", "lazy"), (f, "relative import out of runtime/", node.module)
                else:
                    assert top / "runtime" in [base, *base.parents], (f, "relative import out of runtime/")


def test_bench_json_and_plot(out, tmp_path):
    png = tmp_path / "b.png"
    r = run("bench", out, "--max-new-tokens", "24", "--json", "--plot", png, "--warmup", "0")
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    assert "random token prompts" in j["prompt_source"]
    assert j["lossless"] is True
    assert sum(j["acceptance_histogram"].values()) > 0 and j["tau"] >= 1
    for k in ("speedup", "ideal_speedup", "loop_efficiency", "peak_rss_mb"):
        assert j[k] > 0
    assert j["loop_efficiency"] == pytest.approx(j["speedup"] / j["ideal_speedup"])
    assert j["speculation"] == "auto" and j["auto_policy"][0]["rows"] == 1  # what auto does with the costs
    assert set(j["time_split_s"]["speculative"]) == {"prefill", "draft", "verify", "host", "total"}
    assert png.stat().st_size > 1000
    prompts = tmp_path / "p.txt"
    prompts.write_text("1,2,3\n4,5,6,7\n")
    r = run("bench", out, "--prompts", prompts, "--max-new-tokens", "8", "--warmup", "0")
    assert r.exit_code == 0 and "2 prompts from" in r.stdout and "loop efficiency" in r.stdout
    assert "auto (default costs): 1 row(s): verify 2/4/8/16 pays above" in r.stdout, r.stdout
    assert f"threads {j['threads']}," in r.stdout and "thread sweep: fastest at" in r.stdout


def test_bench_says_which_thread_count_ran_when_the_sweep_prefers_another(out, capsys):
    """The settings line's count and the sweep's fastest may differ (noise, or a stale calibration):
    the sweep's line then says which count the run used, never a bare second "best"."""
    from dflash_export.cli.run import echo_bench

    r = run("bench", out, "--max-new-tokens", "8", "--json", "--warmup", "0", "--off-domain", "0")
    j = json.loads(r.stdout)
    j.update(threads=2, best_threads=1)
    echo_bench(j, "prompts", 101, 0.0)
    text = capsys.readouterr().out
    assert "threads 2," in text and "thread sweep: fastest at 1 (the run above used 2" in text, text


def test_bench_reports_tau_when_sampling(out):
    """--temperature: the speculative rounds sample (rejection sampling); tau is theirs and the
    greedy-only token comparison is not made."""
    r = run("bench", out, "--max-new-tokens", "16", "--json", "--warmup", "0", "--threads", "1", "--temperature", "0.8")
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    assert j["temperature"] == 0.8 and j["lossless"] is None and j["tau"] >= 1
    assert sum(j["acceptance_histogram"].values()) > 0
    r = run("bench", out, "--temperature", "-1")
    assert r.exit_code != 0 and "temperature must be >= 0" in r.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--provider", "tpu"], "unknown provider 'tpu'; available: cpu"),
        (["--prompt", "hello"], "no tokenizer.json"),
        (["--prompt-ids", ""], "the prompt is empty"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", "1,5000"], "outside the vocabulary"),
        (["--prompt-ids", ",".join(["1"] * 300)], "exceeds the exported max context"),
        (["--max-new-tokens", "1000"], "exceeds the exported max context"),
        (["--temperature", "-0.5"], "temperature must be >= 0"),
        (["--top-p", "0"], "top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--top-k", "-1"], "top-k must be >= 0"),
        ([], "give exactly one of --prompt"),
        (["--stream", "--json"], "exclusive"),
    ],
)
def test_generate_bad_input_is_one_line(out, args, message):
    if not any(a.startswith("--prompt") for a in args) and args != []:
        args = ["--prompt-ids", "1,2"] + args
    r = run("generate", out, *args)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_the_run_options_are_one_record():
    """generate, bench, serve and demo take the run's options from one record, RunOptions: the same
    names, defaults and help in every command; bad values are refused when the record is made."""
    import dataclasses

    from dflash_export.runtime.errors import DFlashError
    from dflash_export.runtime.settings import RunOptions

    fields = dataclasses.fields(RunOptions)
    for cmd in ("generate", "bench", "serve", "demo"):
        params = {p.name: p for p in cli.commands[cmd].params}
        for f in fields:
            if cmd == "demo" and f.name in ("backend", "provider"):  # the demo runs ONNX Runtime on CPU
                assert f.name not in params
                continue
            assert params[f.name].default == f.default and params[f.name].help == f.metadata["option"]["help"], (cmd, f.name)
    for bad, message in (({"threads": 0}, "--threads must be >= 1"), ({"verify": "some"}, "--verify must be one of"),
                         ({"backend": "tpu"}, "--backend must be one of"), ({"speculation": "x"}, "--speculation")):
        with pytest.raises(DFlashError, match=message):
            RunOptions(**bad)
    r = run("generate", "nowhere", "--prompt-ids", "1", "--threads", "0")
    assert r.exit_code == 2 and r.stderr == "error: --threads must be >= 1 (got 0)\n", r.stderr


def test_one_name_one_meaning_across_commands():
    """--threads (ONNX Runtime's), --batch (rows decoded together), --warmup (untimed runs) and --precision
    (the engines') mean one thing in every command that shows them; train-draft's own are named for what
    they are, and still take their former names, hidden from --help."""
    import click

    shown = {}
    for name, cmd in cli.commands.items():
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                for o in getattr(p, "old", ()):
                    assert o not in cmd.get_help(click.Context(cmd, info_name=name)), (name, o)
                for o in set(p.opts) - set(getattr(p, "old", ())):
                    shown.setdefault(o, set()).add(name)
    assert shown["--threads"] == {"generate", "bench", "demo", "serve"} and shown["--batch"] == {"generate", "bench"}
    assert shown["--warmup"] == {"bench"} and shown["--precision"] == {"build"}
    train = cli.commands["train-draft"]
    ctx = train.make_context("train-draft", ["--target", "t", "--out", "o", "--data", "d", "--threads", "3", "--batch", "5",
                                             "--warmup", "0.1", "--precision", "fp32"])
    assert (ctx.params["torch_threads"], ctx.params["train_batch"], ctx.params["lr_warmup"],
            ctx.params["train_precision"]) == (3, 5, 0.1, "fp32")
    ctx = train.make_context("train-draft", ["--target", "t", "--out", "o", "--data", "d", "--torch-threads", "2"])
    assert (ctx.params["torch_threads"], ctx.params["train_batch"]) == (2, 8)


def test_bad_artifacts_are_one_line(out, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "draft_block.data").write_bytes(b"tampered")
    for cmd in ("generate", "bench"):
        r = run(cmd, bad, *(["--prompt-ids", "1,2"] if cmd == "generate" else []))
        assert r.exit_code == 2 and "does not match its sha256" in r.stderr and r.stderr.count("\n") == 1
    r = run("generate", tmp_path / "nothing", "--prompt-ids", "1")
    assert r.exit_code == 2 and r.stderr.startswith("error: ")
    r = run("bench", out, "--prompts", tmp_path / "missing.txt")
    assert r.exit_code == 2 and "no such file" in r.stderr


def test_onnxruntime_load_failure_says_what_failed(out, tmp_path):
    """The graph, the provider and ORT's own first line; the re-export hint only where it helps."""
    from dflash_export.runtime.errors import DFlashError
    from dflash_export.runtime.ort.backend import OrtBackend

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "draft_context.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(DFlashError) as e:
        OrtBackend(bad, verify=False)  # the hash check would refuse it first: this is the load itself
    msg = str(e.value)
    assert "cannot load the draft_context graph" in msg and "CPUExecutionProvider" in msg and "\n" not in msg, msg
    assert "INVALID_PROTOBUF" in msg and "re-export the directory" in msg, msg


def test_missing_onnxruntime_is_one_line(monkeypatch, tmp_path):
    """Base install without the cpu/gpu extra: a one-line hint naming both flavours, exit 2."""
    import sys

    from click.testing import CliRunner

    from dflash_export.cli import cli

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    monkeypatch.delitem(sys.modules, "dflash_export.runtime.ort.backend", raising=False)
    r = CliRunner().invoke(cli, ["generate", str(tmp_path), "--prompt-ids", "1,2"])
    assert r.exit_code == 2, r.output
    assert 'pip install "dflash-export[cpu]"' in r.output and "[gpu]" in r.output
    assert "Traceback" not in r.output


def test_internal_errors_ask_for_a_report_with_the_traceback():
    """A bug (InternalError) is not the user's: its own line, the traceback, exit 3; user errors stay one line, exit 2."""
    import click

    from dflash_export.cli import Group
    from dflash_export.runtime.errors import DFlashError, InternalError

    @click.group(cls=Group)
    def g():
        pass

    @g.command()
    def bug():
        raise InternalError("keep(9) but the target cache holds 3 positions")

    @g.command()
    def user():
        raise DFlashError("no such directory: x")

    r = CliRunner().invoke(g, ["bug"])
    assert r.exit_code == 3 and r.output.startswith("internal error (please report): keep(9) but"), r.output
    assert "Traceback (most recent call last)" in r.output and 'raise InternalError("keep(9)' in r.output
    r = CliRunner().invoke(g, ["user"])
    assert r.exit_code == 2 and r.output == "error: no such directory: x\n"
