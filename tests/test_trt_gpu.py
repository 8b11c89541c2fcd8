"""TensorRT end to end: build engines, run them, compare tokens with ONNX Runtime.

These need `tensorrt`, cuda-python and an NVIDIA GPU. Where any is missing they are
collected and reported as skipped with the reason (never silently passed). They have not
been run in development: no machine there had TensorRT or a GPU.
"""

import json

import numpy as np
import pytest
from click.testing import CliRunner


def _missing() -> str | None:
    from importlib.util import find_spec

    if find_spec("tensorrt") is None:
        return 'the Python package tensorrt is not installed (pip install "dflash-export[trt]")'
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return "cuda-python (>= 12.6) is not installed"
    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0 or count < 1:
        return "no NVIDIA GPU is visible to CUDA"
    return None


MISSING = _missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(MISSING is not None, reason=f"needs TensorRT + NVIDIA GPU: {MISSING}")]

K, MAX_CONTEXT, MAX_PROMPT = 4, 96, 24
PROMPTS = [[5, 17, 3, 42, 8], [1] * 13, list(range(2, 26))]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from tiny_exports import export_tiny_pair

    from dflash_export.cli import cli

    root = tmp_path_factory.mktemp("trt-gpu")
    export_tiny_pair(root, K, MAX_CONTEXT)
    r = CliRunner().invoke(cli, ["build", str(root / "out"), "--max-prompt", str(MAX_PROMPT),
                                 "--timing-cache", str(root / "timing.cache"), "--no-progress"])
    assert r.exit_code == 0, r.output
    return root / "out", root / "timing.cache"


def test_engines_recorded_and_hashed(built):
    import tensorrt as trt

    from dflash_export.runtime.manifest import load_manifest

    out, cache = built
    m = load_manifest(out)  # verifies every hash, the engines' included
    e = m.engines
    assert e["tensorrt"] == trt.__version__ and e["precision"] == "fp32" and e["max_prompt"] == MAX_PROMPT
    assert set(e["files"]) == {"target", "draft_context", "draft_block"}
    assert all(rel in m.files for rel in e["files"].values())
    assert [p["name"] for p in e["profiles"]["target"]] == ["verify", "prefill"]
    assert cache.is_file() and cache.stat().st_size > 0


def _tokens(backend, prompt, draft=True, n=40):
    from dflash_export.runtime.loop import generate

    return generate(backend, prompt, n, draft=draft).tokens


def test_trt_tokens_match_ort(built):
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.trt.backend import TensorRTBackend

    out, _ = built
    ref = OrtBackend(out, "cpu")
    trt_b = TensorRTBackend(out)
    try:
        for p in PROMPTS:
            want = _tokens(ref, p, draft=False)
            assert _tokens(trt_b, p, draft=False) == want  # plain greedy decoding on TensorRT
            assert _tokens(trt_b, p, draft=True) == want  # speculative: lossless at temperature 0
            assert _tokens(ref, p, draft=True) == want
    finally:
        trt_b.close()


def test_trt_short_verifies_score_fewer_drafts(built):
    """draft_block's head over the drafts a verify uses (draft_index, profiled over 1..K-1): random
    short verifies on the engines score fewer drafts and stay lossless (tests/test_draft_head.py)."""
    from test_draft_head import lossless_short, spy

    from dflash_export.runtime.trt.backend import TensorRTBackend

    out, _ = built
    be = spy(TensorRTBackend(out))
    try:
        lossless_short(be, be, 61)
    finally:
        be.close()


def test_refuses_other_tensorrt_or_gpu(built):
    from dflash_export.runtime.manifest import load_manifest
    from dflash_export.runtime.errors import DFlashError
    from dflash_export.runtime.trt.backend import TensorRTBackend

    out, _ = built
    m = load_manifest(out)
    m.engines = dict(m.engines, tensorrt="9.9.9")
    with pytest.raises(DFlashError, match="built with TensorRT 9.9.9"):
        TensorRTBackend(out, manifest=m)
    m.engines = dict(load_manifest(out).engines, compute_capability="1.0")
    with pytest.raises(DFlashError, match="compute capability 1.0"):
        TensorRTBackend(out, manifest=m)


def test_ort_tensorrt_provider_matches_cpu(built, tmp_path, monkeypatch):
    import onnxruntime as ort

    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"this onnxruntime {ort.__version__} has no TensorrtExecutionProvider (install onnxruntime-gpu)")
    from dflash_export.runtime.ort.backend import OrtBackend

    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "ort-trt"))
    out, _ = built
    cpu, gpu = OrtBackend(out, "cpu"), OrtBackend(out, "tensorrt")
    for p in PROMPTS[:2]:
        assert _tokens(gpu, p) == _tokens(cpu, p)
    assert any((tmp_path / "ort-trt").rglob("*")), "the provider's engine cache should be outside OUT"
    assert not any(p.suffix == ".engine" for p in out.iterdir())


def test_manifest_json_lists_profiles(built):
    out, _ = built
    raw = json.loads((out / "manifest.json").read_text())
    verify = raw["engines"]["profiles"]["target"][0]["shapes"]["input_ids"]
    assert np.array(verify).tolist() == [[1, K], [1, K], [1, K]]


def test_trt_hybrid_tokens_match_ort(tmp_path):
    """A hybrid (Gated DeltaNet) artifact on real engines, the states committed on the host
    (runtime/hybrid.py): tokens == ONNX Runtime CPU's, plain and speculative, one prompt
    prefilled in two 64-position chunks. Only ever run here against the double of the real
    bindings (tests/trt_double.py, test_hybrid_runtime.py); this is the check on real TensorRT."""
    import shutil

    from test_hybrid_runtime import PATTERNS
    from runtime_cases import artifact

    from dflash_export.cli import cli
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.trt.backend import TensorRTBackend

    _, _, out = artifact(PATTERNS["full-first-vl"])
    eng = tmp_path / "out"
    shutil.copytree(out, eng)  # the build writes engines into the directory: not into the shared cache
    r = CliRunner().invoke(cli, ["build", str(eng), "--timing-cache", str(tmp_path / "tc"), "--no-progress"])
    assert r.exit_code == 0, r.output
    ref, trt_b = OrtBackend(out, "cpu"), TensorRTBackend(eng)
    long = np.random.default_rng(4).integers(0, ref.manifest.vocab_size - 2, 70).tolist()
    try:
        for p in PROMPTS + [long]:
            want = _tokens(ref, p, draft=False, n=24)
            assert _tokens(trt_b, p, draft=False, n=24) == want
            assert _tokens(trt_b, p, draft=True, n=24) == want
    finally:
        trt_b.close()


def test_trt_batched_rows_match_ort(tmp_path):
    """Engines built with --max-batch 3: every row of the batched loop (rows joining and leaving)
    equals ONNX Runtime's batch-1 greedy output, speculative and plain."""
    from tiny_exports import export_tiny_pair

    from dflash_export.cli import cli
    from dflash_export.runtime.loop import Request, generate_batch
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.trt.backend import TensorRTBackend

    export_tiny_pair(tmp_path, K, MAX_CONTEXT)
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["build", str(out), "--max-prompt", str(MAX_PROMPT), "--max-batch", "3",
                                 "--timing-cache", str(tmp_path / "tc"), "--no-progress"])
    assert r.exit_code == 0, r.output
    ref, be = OrtBackend(out, "cpu"), TensorRTBackend(out, max_batch=3)
    prompts, budgets = [*PROMPTS, [9, 4, 11], list(range(30, 41))], [40, 12, 33, 5, 20]
    want = [_tokens(ref, p, draft=False, n=n) for p, n in zip(prompts, budgets)]
    try:
        for draft in (True, False):
            gens, _ = generate_batch(be, [Request(p, n, stop_token_ids=()) for p, n in zip(prompts, budgets)], draft=draft)
            assert [g.tokens for g in gens] == want
    finally:
        be.close()


def test_trt_batched_server_matches_ort(tmp_path):
    """`serve --backend trt --max-batch 3` on real engines: concurrent requests (greedy, streamed,
    chunked prefill, a seeded sampled one) each equal ONNX Runtime's batch-1 output alone
    (tests/test_serve_trt.py runs the same check on the TensorRT double). Needs the serve extra."""
    pytest.importorskip("openai", reason="the serve test's client (the dev extra)")
    pytest.importorskip("fastapi", reason="the serve extra")
    from test_serve import chat_art, running
    from test_serve_trt import MC, MP, ROWS, requests_equal_ort_batch1

    from dflash_export.cli import cli

    out = chat_art(tmp_path / "tiny-chat")
    r = CliRunner().invoke(cli, ["build", str(out), "--max-context", str(MC), "--max-prompt", str(MP), "--max-batch",
                                 str(ROWS), "--timing-cache", str(tmp_path / "tc"), "--no-progress"])
    assert r.exit_code == 0, r.output
    server = running(out, tmp_path / "serve.log", "--backend", "trt", "--max-batch", ROWS, "--max-queue", 8,
                     "--speculation", "always")
    s = next(server)
    try:
        assert "tensorrt" in s.ready_line, s.ready_line
        requests_equal_ort_batch1(s, out)
    finally:
        next(server, None)  # Ctrl-C: a clean exit, then stopped by its pid


def test_trt_dflash2_rows_match_ort(tmp_path):
    """A DFlash 2 export (tests/test_dflash2_export.py's two-layer drafter, no context ring) built with
    --max-batch 3: every row's greedy tokens equal ONNX Runtime's plain greedy output, batch 1 and 3,
    and drafts from the engine's walk get accepted; a sampled row (host walk over the engine's
    candidates and scores) runs to its budget."""
    import shutil

    pytest.importorskip("dflash.model", reason="the official z-lab package `dflash` 0.1.0 is not installed")
    from test_dflash2_export import _exported

    from dflash_export.cli import cli
    from dflash_export.runtime.loop import Request, generate_batch
    from dflash_export.runtime.sampling import Sampling
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.trt.backend import TensorRTBackend

    out = tmp_path / "out"
    shutil.copytree(_exported("mixed-b6-noncausal") / "out", out)
    r = CliRunner().invoke(cli, ["build", str(out), "--max-context", "64", "--max-prompt", "16", "--max-batch", "3",
                                 "--timing-cache", str(tmp_path / "tc"), "--no-progress"])
    assert r.exit_code == 0, r.output
    ref = OrtBackend(out, "cpu")
    prompts = [[5, 17, 3, 42, 8], [1] * 13, [9, 4, 11]]
    want = [_tokens(ref, p, draft=False, n=20) for p in prompts]
    sampled = Request([6, 2, 9, 1], 20, Sampling(0.8, seed=7), stop_token_ids=())
    for batch in (1, 3):
        be = TensorRTBackend(out, max_batch=batch)
        try:
            gens, _ = generate_batch(be, [Request(p, 20) for p in prompts] + [sampled], batch=batch)
        finally:
            be.close()
        assert [g.tokens for g in gens[:3]] == want, batch
        assert sum(a - 1 for g in gens[:3] for a in g.acceptance_lengths) > 0 and len(gens[3].tokens) == 20
