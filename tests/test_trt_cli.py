"""`dflash-export build` where TensorRT is missing: one line, exit 2, nothing written."""

import sys

import pytest
from click.testing import CliRunner

from dflash_export.cli import cli


@pytest.fixture
def no_tensorrt(monkeypatch):
    """Make `import tensorrt` / cuda-python fail even on a machine that has them."""
    for name in ("tensorrt", "cuda", "cuda.bindings", "cuda.cudart"):
        monkeypatch.setitem(sys.modules, name, None)


def snapshot(root):
    return sorted((p.relative_to(root).as_posix(), p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
                  for p in root.rglob("*"))


@pytest.mark.parametrize("extra", [[], ["--precision", "fp16", "--max-context", "64", "--workspace", "2"]])
def test_build_without_tensorrt_fails_fast(tmp_path, no_tensorrt, extra):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("{}")  # contents never read: the check comes first
    (out / "target.onnx").write_bytes(b"\0" * 16)
    before = snapshot(tmp_path)
    r = CliRunner().invoke(cli, ["build", str(out), *extra])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "tensorrt" in lines[0] and "cuda-python" in lines[0]
    assert 'pip install "dflash-export[trt]"' in lines[0] and "pypi.nvidia.com" in lines[0]
    assert snapshot(tmp_path) == before  # nothing written, in OUT or beside it


def test_build_without_tensorrt_on_missing_dir(tmp_path, no_tensorrt):
    r = CliRunner().invoke(cli, ["build", str(tmp_path / "nowhere")])
    assert r.exit_code == 2 and "tensorrt" in r.output and "Traceback" not in r.output
    assert list(tmp_path.iterdir()) == []


def test_build_help_lists_options():
    r = CliRunner().invoke(cli, ["build", "--help"])
    assert r.exit_code == 0
    for opt in ("--precision", "--max-context", "--max-prompt", "--timing-cache", "--workspace", "--dry-run"):
        assert opt in r.output
