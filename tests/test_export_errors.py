"""Bad input to `export`: one line `error: ...`, non-zero exit, nothing written.

Each case runs the real CLI (click's CliRunner); only the interrupt and the late failure
patch the exporter, to show that a run stopped half-way leaves no trace.
"""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from dflash_export.models.tiny import make_drafter, make_target

from dflash_export.cli import cli
from dflash_export.export import trace as export_trace
from killed import kill_after


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpts")
    small = dict(hidden=32, heads=4, kv_heads=2, intermediate=48, vocab=50)
    make_target(d / "t2", "qwen2", layers=2, **small)
    make_target(d / "t4", "qwen2", layers=4, **small)
    make_target(d / "t64", "qwen2", layers=2, **{**small, "hidden": 64})
    make_drafter(d / "d2", d / "t2", layers=1)
    make_drafter(d / "d4", d / "t4", layers=1)
    make_drafter(d / "d64", d / "t64", layers=1)
    return d


def run_export(d, target, draft, out="out", *extra):
    return CliRunner().invoke(cli, ["export", "--target", str(d / target), "--draft", str(d / draft),
                                    "--out", str(d / out), "--quiet", *extra])


def assert_error(r, *words):
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def assert_nothing_written(d, out="out"):
    assert not (d / out).exists()
    assert not [p.name for p in d.iterdir() if p.name.startswith(f".{out}.")]


def test_missing_directory(ckpts):
    r = run_export(ckpts, "nope", "d2")
    assert_error(r, "target directory", "does not exist")
    assert_nothing_written(ckpts)


def test_directory_without_config(ckpts, tmp_path):
    (ckpts / "empty").mkdir(exist_ok=True)
    assert_error(run_export(ckpts, "t2", "empty"), "no config.json")
    assert_nothing_written(ckpts)


def test_swapped_directories(ckpts):
    assert_error(run_export(ckpts, "d2", "t2"), "is a DFlash drafter (DFlashDraftModel), not a target", "pass it as --draft")
    assert_nothing_written(ckpts)


def test_drafter_for_another_hidden_size(ckpts):
    assert_error(run_export(ckpts, "t2", "d64"), "hidden_size 64", "another target")
    assert_nothing_written(ckpts)


def test_drafter_for_another_layer_count(ckpts):
    assert_error(run_export(ckpts, "t2", "d4"), "num_target_layers 4", "2 layers")
    assert_nothing_written(ckpts)


def test_unsupported_architecture(ckpts):
    bad = ckpts / "gpt2"
    shutil.copytree(ckpts / "t2", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_error(run_export(ckpts, "gpt2", "d2"), "'GPT2LMHeadModel' is not supported")
    assert_nothing_written(ckpts)


def test_bad_options(ckpts):
    assert_error(run_export(ckpts, "t2", "d2", "out", "--block-size", "1"), "block size 1")
    assert_error(run_export(ckpts, "t2", "d2", "out", "--mask-token-id", "50"), "outside the target's vocabulary")
    assert_error(run_export(ckpts, "t2", "d2", "out", "--max-context", "4"), "--max-context 4")
    assert_error(run_export(ckpts, "t2", "d2", "out", "--opset", "12"), "--opset 12 is not supported")
    assert_nothing_written(ckpts)


def test_existing_out_without_force(ckpts):
    out = ckpts / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_error(run_export(ckpts, "t2", "d2", "taken"), "not empty", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (ckpts / "file").write_text("x")
    assert_error(run_export(ckpts, "t2", "d2", "file"), "not a directory")


def test_missing_weights_fail_late_and_clean_up(ckpts):
    """The config is fine, the weights are not: the failure comes after the temp dir exists."""
    bad = ckpts / "noweights"
    bad.mkdir()
    shutil.copy(ckpts / "t2" / "config.json", bad)
    assert_error(run_export(ckpts, "noweights", "d2"), "no *.safetensors")
    assert_nothing_written(ckpts)


def test_interrupt_and_failure_leave_the_old_out_alone(ckpts, monkeypatch):
    out = ckpts / "old"
    out.mkdir()
    (out / "keep.txt").write_text("previous export")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_trace, "trace", interrupted)
    r = run_export(ckpts, "t2", "d2", "old", "--force")
    assert r.exit_code == 130 and "error: interrupted" in r.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".old.")]

    def broken(*a, **k):
        raise export_trace.DFlashError("torch.onnx.export failed for TargetGraph: boom")

    monkeypatch.setattr(export_trace, "trace", broken)
    assert_error(run_export(ckpts, "t2", "d2", "old", "--force"), "boom")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".old.")]


def test_a_killed_export_is_cleaned_by_the_next_run(ckpts, monkeypatch):
    """export killed with -9 inside its staging (no cleanup runs) leaves the folder beside --out; the
    next export to the same --out removes it first, whatever that run does next (here it fails)."""
    args = ["export", "--target", str(ckpts / "t2"), "--draft", str(ckpts / "d2"), "--out", str(ckpts / "killed"),
            "--quiet"]
    pid = kill_after("dflash_export.export.artifact", "load_pair", args)
    assert [p.name for p in ckpts.glob(".killed.*")] == [f".killed.partial-{pid}"] and not (ckpts / "killed").exists()

    def broken(*a, **k):
        raise export_trace.DFlashError("torch.onnx.export failed for TargetGraph: boom")

    monkeypatch.setattr(export_trace, "trace", broken)
    assert_error(run_export(ckpts, "t2", "d2", "killed"), "boom")
    assert_nothing_written(ckpts, "killed")


def test_export_options_are_the_records_fields():
    """`export`'s options are ExportOptions' and QuantRequest's fields with their defaults, and export_artifact
    takes every ExportOptions field as a keyword with the same default: each named and defaulted once."""
    import dataclasses
    import inspect

    from dflash_export.export.artifact import export_artifact
    from dflash_export.export.options import ExportOptions, QuantRequest

    params = {p.name: p for p in cli.commands["export"].params}
    keywords = inspect.signature(export_artifact).parameters
    for cls in (ExportOptions, QuantRequest):
        for f in dataclasses.fields(cls):
            assert f.name in params, f"{cls.__name__}.{f.name} is no option of export"
            assert params[f.name].multiple or params[f.name].default == f.default, f.name
            if cls is ExportOptions:
                assert keywords[f.name].default == f.default, f"export_artifact's {f.name} default differs"
    assert {f.name for f in dataclasses.fields(QuantRequest)} <= {p.name for p in cli.commands["quantize"].params}


def test_help_teaches():
    for cmd in ("export", "check"):
        r = CliRunner().invoke(cli, [cmd, "--help"])
        assert r.exit_code == 0 and "Examples:" in r.output and "dflash-export " + cmd in r.output


def test_max_context_past_the_trained_positions_warns(ckpts, capsys):
    from dflash_export.export.artifact import plan

    cfg = json.loads((ckpts / "t2" / "config.json").read_text())
    plan(ckpts / "t2", ckpts / "d2", None, None, cfg["max_position_embeddings"])
    assert "warning" not in capsys.readouterr().err
    plan(ckpts / "t2", ckpts / "d2", None, None, cfg["max_position_embeddings"] + 1)
    err = capsys.readouterr().err
    assert err.startswith("warning: --max-context") and "max_position_embeddings" in err and err.count("\n") == 1


REFUSE_ALONE = """
import json, sys
from click.testing import CliRunner
from dflash_export.cli import cli
lines = []
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(cli, args)
    lines.append([r.exit_code, (r.output.strip().splitlines() or [""])[-1]])
print(json.dumps({"lines": lines, "heavy": sorted(m for m in ("torch", "onnx", "onnx_ir", "onnxruntime") if m in sys.modules)}))
"""


def test_cheap_refusals_come_before_anything_loads(ckpts):
    """An existing --out, a --quantize that is not a choice, a bad block size, --kv-cache without the
    ort flavour: refused by one line before torch, onnx or ONNX Runtime is even imported (a fresh
    process, so nothing another test imported counts)."""
    import subprocess
    import sys

    taken = ckpts / "taken-early"
    taken.mkdir(exist_ok=True)
    (taken / "keep.txt").write_text("mine")
    base = ["export", "--target", str(ckpts / "t2"), "--draft", str(ckpts / "d2"), "--quiet", "--out"]
    cases = [
        (base + [str(taken)], "exists and is not empty"),
        (base + [str(ckpts / "new"), "--quantize", "int3"], "'int3' is not one of 'int4', 'int8'"),
        (base + [str(ckpts / "new"), "--quantize", "INT4"], "'INT4' is not one of 'int4', 'int8'"),
        (base + [str(ckpts / "new"), "--quantize", "int4", "--quant-block-size", "12"], "power of two >= 16"),
        (base + [str(ckpts / "new"), "--quantize", "int4", "--dtype", "bf16"], "--dtype bf16 is not supported"),
        (base + [str(ckpts / "new"), "--kv-cache", "int8"], "needs --attention ort"),
        (base + [str(ckpts / "new"), "--kv-calibration", str(ckpts / "t2" / "config.json")], "needs --kv-cache int8"),
    ]
    p = subprocess.run([sys.executable, "-c", REFUSE_ALONE, json.dumps([a for a, _ in cases])],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    for (args, message), (code, line) in zip(cases, got["lines"]):
        assert code == 2 and message in line, (args, line)
    assert got["heavy"] == [], f"imported before refusing: {got['heavy']}"
    assert [p.name for p in taken.iterdir()] == ["keep.txt"] and not (ckpts / "new").exists()


@pytest.mark.parametrize("args", [["foo"], ["generate"], ["generate", "x", "--threads", "abc"],
                                  ["export", "--quantize", "int3"], ["bench", "x", "--no-such-flag"]])
def test_usage_errors_are_one_line(args):
    """click's usage errors (unknown command or option, missing argument, a bad value) read as every
    other error: one `error:` line naming the help to read, exit status 2."""
    r = CliRunner().invoke(cli, args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "--help`" in lines[0], r.output
