"""The build and the TensorRT backend run against a stand-in for tensorrt/cuda-python.

tests/trt_fake.py replaces TensorRT with ONNX Runtime on CPU and device memory with host
memory. This checks OUR code (profiles declared and respected call by call, 256-byte
aligned addresses, KV offsets and copies, manifest record, timing cache reuse, CUDA-graph
capture/replay bookkeeping, refusals) end to end against the ORT backend's tokens. It says
nothing about TensorRT itself: that is tests/test_trt_gpu.py, which needs a GPU.
"""

import numpy as np
import pytest
from click.testing import CliRunner

import trt_fake
from dflash_export.cli import cli
from dflash_export.runtime.contract import load_manifest
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.loop import generate

K, MC, MP = 4, 64, 16
PROMPTS = [[5, 17, 3, 42, 8], list(range(2, 22)), [7]]  # the second is longer than MP: chunked prefill


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tiny import export_tiny_pair

    root = tmp_path_factory.mktemp("trt-fake")
    export_tiny_pair(root, K, MC)
    return root


@pytest.fixture
def built(exported, monkeypatch):
    trt = trt_fake.install(monkeypatch)
    out, cache = exported / "out", exported / "timing.cache"
    r = CliRunner().invoke(cli, ["build", str(out), "--max-prompt", str(MP), "--timing-cache", str(cache)])
    assert r.exit_code == 0, r.output
    return trt, out, cache


def test_build_records_engines(built, exported):
    trt, out, cache = built
    m = load_manifest(out)  # the engines are hashed: verify_files accepts the directory
    e = m.engines
    assert e["tensorrt"] == trt.__version__ and e["compute_capability"] == "9.0" and e["gpu"] == "Fake GPU (numpy)"
    assert (e["precision"], e["strongly_typed"], e["max_context"], e["max_prompt"]) == ("fp32", True, MC, MP)
    assert sorted(m.files) == sorted(set(m.files) | {"engines/target.engine", "engines/draft_context.engine",
                                                     "engines/draft_block.engine"})
    assert [b["strongly_typed"] for b in trt.builds] == [True] * 3 and trt.builds[0]["workspace"] == 4 << 30
    assert trt.builds[0]["profiles"] == [p["shapes"] for p in e["profiles"]["target"]]  # what was declared is recorded
    assert not list(exported.glob(".*partial*"))  # no staging left behind
    first = cache.read_bytes()
    r = CliRunner().invoke(cli, ["build", str(out), "--max-prompt", str(MP), "--timing-cache", str(cache),
                                 "--precision", "fp16", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert cache.read_bytes().startswith(first)  # the second build started from the first one's cache
    assert trt.builds[-1]["flags"] == ["FP16"] and trt.builds[-1]["strongly_typed"] is False
    assert load_manifest(out).engines["precision"] == "fp16"


def test_tokens_match_ort_backend(built):
    from dflash_export.runtime.ort import OrtBackend
    from dflash_export.runtime.trt import TensorRTBackend

    _, out, _ = built
    ref = OrtBackend(out, "cpu")
    b = TensorRTBackend(out, cuda_graphs=False)
    assert b.max_chunk == MP and b.max_len == MC
    for p in PROMPTS:
        want = generate(ref, p, 30, draft=False).tokens
        assert generate(b, p, 30, draft=False).tokens == want
        got = generate(b, p, MC - len(p), draft=True)  # to the very end of the context
        assert got.tokens == generate(ref, p, MC - len(p), draft=False).tokens
        assert got.tokens[:30] == want
    b.close()


def test_cuda_graphs_capture_then_replay(built):
    from dflash_export.runtime.trt import TensorRTBackend

    _, out, _ = built
    b = TensorRTBackend(out, cuda_graphs=True)
    runs = []
    for _ in range(3):
        runs.append(generate(b, PROMPTS[0], 25).tokens)
    assert runs[0] == runs[1] == runs[2]
    assert len(b.eng["target"].graphs) > 0 and len(b.eng["draft_block"].graphs) > 0
    assert not b.eng["draft_context"].graphs  # variable C: never captured
    launched = trt_fake._Context.runs
    generate(b, PROMPTS[0], 25)
    assert trt_fake._Context.runs > launched  # replays still execute the work
    b.close()


def test_refusals(built):
    from dflash_export.runtime.trt import TensorRTBackend

    _, out, _ = built
    m = load_manifest(out)
    m.engines = dict(m.engines, tensorrt="10.0.1")
    with pytest.raises(DFlashError, match="built with TensorRT 10.0.1 but this process has TensorRT 10.99.0-fake"):
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
    assert got["tokens"] == want["tokens"] and got["provider"].startswith("tensorrt 10.99.0-fake")
    b = CliRunner().invoke(cli, ["bench", str(out), "--backend", "trt", "--max-new-tokens", "8", "--warmup", "0", "--json"])
    assert b.exit_code == 0, b.output
