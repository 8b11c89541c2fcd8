"""The build and the TensorRT backend run against a stand-in for tensorrt/cuda-python.

tests/trt_fake.py replaces TensorRT with ONNX Runtime on CPU and device memory with host
memory; the build runs through the real Polygraphy loaders against it. This checks OUR code
(profiles declared and respected call by call, 256-byte aligned addresses, KV offsets and
copies, manifest record, timing cache reuse, refusals) end to end against the ORT backend's
tokens. It says nothing about TensorRT itself: that is tests/test_trt_gpu.py, which needs a GPU.
"""

import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from runtime_cases import TRT_CASES, artifact

import trt_fake
from dflash_export.cli import cli
from dflash_export.runtime.manifest import load_manifest
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.loop import generate

K, MC, MP = 4, 64, 16  # MC: the engines' max context (build --max-context), below the export's
PROMPTS = [[5, 17, 3, 42, 8], list(range(2, 22)), [7]]  # the second is longer than MP: chunked prefill


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A copy of the cached tiny export (the build writes engines into it)."""
    case = TRT_CASES["fp32-k4"]
    assert case.block == K and case.max_context > MC
    root = tmp_path_factory.mktemp("trt-fake")
    shutil.copytree(artifact(case)[2], root / "out")
    return root


@pytest.fixture
def built(exported, monkeypatch):
    trt = trt_fake.install(monkeypatch)
    out, cache = exported / "out", exported / "timing.cache"
    r = CliRunner().invoke(cli, ["build", str(out), "--max-context", str(MC), "--max-prompt", str(MP), "--timing-cache",
                                 str(cache)])
    assert r.exit_code == 0, r.output
    return trt, out, cache


def test_build_records_engines(built, exported):
    trt, out, cache = built
    m = load_manifest(out)  # the engines are hashed: verify_files accepts the directory
    e = m.engines
    assert e["tensorrt"] == trt.__version__ and e["compute_capability"] == "9.0" and e["gpu"] == "Fake GPU (numpy)"
    assert (e["precision"], e["max_context"], e["max_prompt"]) == ("fp32", MC, MP)
    assert sorted(m.files) == sorted(set(m.files) | {"engines/target.engine", "engines/draft_context.engine",
                                                     "engines/draft_block.engine"})
    assert len(trt.builds) == 3 and trt.builds[0]["workspace"] == 4 << 30
    assert all(b["flags"] == [] and b["network_flags"] == 0 for b in trt.builds)  # 11.x: no flags to set
    assert trt.builds[0]["profiles"] == [p["shapes"] for p in e["profiles"]["target"]]  # what was declared is recorded
    assert not list(exported.glob(".*partial*"))  # no staging left behind
    first = cache.read_bytes()
    assert first == b"+++"  # one entry per engine, merged back into the file by Polygraphy
    r = CliRunner().invoke(cli, ["build", str(out), "--max-context", str(MC), "--max-prompt", str(MP), "--timing-cache",
                                 str(cache), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert cache.read_bytes() == first + b"+++"  # the second build started from the first one's cache
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r = CliRunner().invoke(cli, ["build", str(out), "--precision", "fp16"])
    assert r.exit_code == 2 and "re-export with `dflash-export export --dtype fp16`" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # refused before anything was written


def test_tensorrt_10x_build_sets_strongly_typed(exported, monkeypatch, tmp_path):
    trt = trt_fake.install(monkeypatch)
    monkeypatch.setattr(trt, "__version__", "10.13.3.9")  # on 10.x the flag is what makes the build strongly typed
    out = tmp_path / "out"
    shutil.copytree(exported / "out", out)
    r = CliRunner().invoke(cli, ["build", str(out), "--max-prompt", str(MP), "--timing-cache", str(tmp_path / "tc"),
                                 "--no-progress"])
    assert r.exit_code == 0, r.output
    assert [b["network_flags"] for b in trt.builds] == [1 << trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED] * 3
    monkeypatch.setattr(trt, "__version__", "10.11.0.33")  # below the supported range: refused before any work
    r = CliRunner().invoke(cli, ["build", str(out), "--no-progress"])
    assert r.exit_code == 2 and "TensorRT 10.11.0.33 is not supported" in r.output and len(trt.builds) == 3


def test_failed_build_writes_nothing(exported, monkeypatch):
    trt = trt_fake.install(monkeypatch)
    out = exported / "out"
    before = {p: p.read_bytes() for p in exported.rglob("*") if p.is_file()}
    real = trt.OnnxParser.parse_from_file

    def reject_block(self, path):  # the parser takes the first two graphs, refuses the third
        if path.endswith("draft_block.onnx"):
            self.num_errors = 1
            return False
        return real(self, path)

    monkeypatch.setattr(trt.OnnxParser, "parse_from_file", reject_block)
    r = CliRunner().invoke(cli, ["build", str(out), "--max-prompt", str(MP), "--timing-cache",
                                 str(exported / "timing.cache"), "--no-progress"])
    assert r.exit_code == 2, r.output
    (err,) = [line for line in r.output.splitlines() if line.startswith("error: ")]  # Polygraphy logs the parser's errors too
    assert err.startswith("error: TensorRT could not build an engine for draft_block.onnx: Could not parse ONNX")
    after = {p: p.read_bytes() for p in exported.rglob("*") if p.is_file()}
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert changed <= {exported / "timing.cache", exported / "timing.cache.lock"}  # Polygraphy's lock file; OUT untouched: no engines, same manifest, no staging left


def test_tokens_match_ort_backend(built):
    from dflash_export.runtime.ort import OrtBackend
    from dflash_export.runtime.trt_backend import TensorRTBackend

    _, out, _ = built
    ref = OrtBackend(out, "cpu")
    b = TensorRTBackend(out)
    assert b.max_chunk == MP and b.max_len == MC
    for p in PROMPTS:
        want = generate(ref, p, 30, draft=False).tokens
        assert generate(b, p, 30, draft=False).tokens == want
        got = generate(b, p, MC - len(p), draft=True)  # to the very end of the context
        assert got.tokens == generate(ref, p, MC - len(p), draft=False).tokens
        assert got.tokens[:30] == want
    b.close()


def test_refusals(built):
    from dflash_export.runtime.trt_backend import TensorRTBackend

    _, out, _ = built
    m = load_manifest(out)
    m.engines = dict(m.engines, tensorrt="10.13.0")
    with pytest.raises(DFlashError, match=r"built with TensorRT 10\.13\.0 but this process has TensorRT 11\.5\.0\+fake"):
        TensorRTBackend(out, manifest=m)
    m.engines = dict(load_manifest(out).engines, compute_capability="8.6", gpu="RTX 3090")
    with pytest.raises(DFlashError, match=r"8\.6 \(RTX 3090\) but this GPU is 9\.0"):
        TensorRTBackend(out, manifest=m)
    b = TensorRTBackend(out)
    with pytest.raises(DFlashError, match="exceeds the engines' --max-prompt 16"):
        b.target(np.arange(MP + 1))
    b.target_len = MC - 2
    with pytest.raises(DFlashError, match="exceeds the engines' max context 64"):
        b.target(np.arange(K))
    b.close()


def test_generate_and_bench_with_backend_trt(built):
    import json

    _, out, _ = built
    args = ["generate", str(out), "--prompt-ids", "5,17,3,42,8", "--max-new-tokens", "20", "--json"]
    trt_run = CliRunner().invoke(cli, args + ["--backend", "trt"])
    ort_run = CliRunner().invoke(cli, args + ["--backend", "ort"])
    assert trt_run.exit_code == 0 and ort_run.exit_code == 0, trt_run.output + ort_run.output
    got, want = json.loads(trt_run.output), json.loads(ort_run.output)
    assert got["tokens"] == want["tokens"] and got["provider"].startswith("tensorrt 11.5.0+fake")
    b = CliRunner().invoke(cli, ["bench", str(out), "--backend", "trt", "--max-new-tokens", "8", "--warmup", "0", "--json"])
    assert b.exit_code == 0, b.output
