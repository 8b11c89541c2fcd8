"""The build and the TensorRT backend against a double of the REAL TensorRT bindings, 10.12 and 11.4.

tests/trt_double.py is NVIDIA's own `tensorrt` module (tests/trt_bindings.py) whose library
objects check every attribute, call, argument type and return value against the real
classes; what they do is simulated (tests/trt_fake.py: ONNX Runtime plays the engine, host
memory the device). So this proves our calls (and Polygraphy's, which run for real) exist with
these signatures on both versions, and checks OUR bookkeeping end to end against the ORT
backend's tokens: profiles declared and respected, 256-byte aligned addresses, KV offsets,
the manifest record, the timing cache, refusals. It does not prove what TensorRT builds or
computes: that is tests/test_trt_gpu.py, on a GPU.
"""

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from runtime_cases import TRT_CASES, Case, artifact

import trt_bindings
import trt_fake
from killed import kill_after
from dflash_export.cli import cli
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.loop import generate
from dflash_export.runtime.manifest import load_manifest
from dflash_export.runtime.sampling import Sampling

# Polygraphy's `with cache.serialize() as buffer`: the real 11.x bindings warn on it too
pytestmark = pytest.mark.filterwarnings("ignore:Context managers for TensorRT types are deprecated")
K, MC, MP = 4, 64, 16  # MC: the engines' max context (build --max-context), below the export's
PROMPTS = [[5, 17, 3, 42, 8], list(range(2, 22)), [7]]  # the second is longer than MP: chunked prefill
VERSIONS = trt_bindings.VERSIONS
# the hybrid case of tests/test_hybrid_runtime.py (PATTERNS["full-first-vl"]): the same cached export
HYBRID = Case("qwen35-vl", layers=2, draft_layers=2, block=4, hidden=32, seed=2, tie=True, max_context=160,
              layer_types=("full_attention", "linear_attention"), released="qwen3.6-27b-dflash.partial-config.json")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A copy of the cached tiny export (the build writes engines into it)."""
    case = TRT_CASES["fp32-k4"]
    assert case.block == K and case.max_context > MC
    root = tmp_path_factory.mktemp("trt-double")
    shutil.copytree(artifact(case)[2], root / "out")
    return root


def build(out, cache, *extra):
    return CliRunner().invoke(cli, ["build", str(out), "--max-context", str(MC), "--max-prompt", str(MP),
                                    "--timing-cache", str(cache), *extra])


@pytest.fixture(params=VERSIONS)
def built(request, exported, monkeypatch, tmp_path):
    trt = trt_fake.install(monkeypatch, request.param)
    out, cache = tmp_path / "out", tmp_path / "timing.cache"
    shutil.copytree(exported / "out", out)
    r = build(out, cache)
    assert r.exit_code == 0, r.output
    return trt, out, cache


def test_build_records_engines(built):
    trt, out, cache = built
    m = load_manifest(out)  # the engines are hashed: verify_files accepts the directory
    e = m.engines
    assert e["tensorrt"] == trt.__version__ and e["compute_capability"] == "9.0" and e["gpu"] == "Fake GPU (numpy)"
    assert (e["precision"], e["max_context"], e["max_prompt"]) == ("fp32", MC, MP)
    assert set(m.files) >= {"engines/target.engine", "engines/draft_context.engine", "engines/draft_block.engine"}
    assert len(trt_fake.builds) == 3 and trt_fake.builds[0]["workspace"] == 4 << 30
    assert all(b["flags"] == [] for b in trt_fake.builds)  # no builder flags: TF32 cleared by Polygraphy, no weak typing
    # 10.x: STRONGLY_TYPED (numbered 1 there, EXPLICIT_BATCH is 0) is what makes the build honour the types;
    # 11.x: deprecated (numbered 0, always on), not set
    flag = trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED
    want = 1 << int(flag) if trt.__version__.startswith("10.") else 0
    assert int(flag) == (1 if trt.__version__.startswith("10.") else 0)
    assert [b["network_flags"] for b in trt_fake.builds] == [want] * 3
    assert trt_fake.builds[0]["profiles"] == [p["shapes"] for p in e["profiles"]["target"]]  # declared == recorded
    assert not list(out.parent.glob(".*partial*"))  # no staging left behind
    first = cache.read_bytes()
    assert first == b"+++"  # one entry per engine, merged back into the file by Polygraphy
    r = build(out, cache, "--no-progress")
    assert r.exit_code == 0, r.output
    assert cache.read_bytes() == first + b"+++"  # the second build started from the first one's cache
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r = CliRunner().invoke(cli, ["build", str(out), "--precision", "fp16"])
    assert r.exit_code == 2 and "re-export with `dflash-export export --dtype fp16`" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # refused before anything was written


def test_version_outside_the_range_is_refused(exported, monkeypatch, tmp_path):
    trt = trt_fake.install(monkeypatch, VERSIONS[0])
    monkeypatch.setattr(trt, "__version__", "10.11.0.33")  # below the supported range: refused before any work
    r = CliRunner().invoke(cli, ["build", str(exported / "out"), "--no-progress"])
    assert r.exit_code == 2 and "TensorRT 10.11.0.33 is not supported" in r.output and trt_fake.builds == []


def test_failed_build_writes_nothing(exported, monkeypatch):
    trt_fake.install(monkeypatch)
    out = exported / "out"
    before = {p: p.read_bytes() for p in exported.rglob("*") if p.is_file()}
    real = trt_fake.SimOnnxParser.parse_from_file

    def reject_block(self, model):  # the parser takes the first two graphs, refuses the third
        if model.endswith("draft_block.onnx"):
            self.errors.append(trt_fake.SimParserError("simulated: unsupported node"))
            return False
        return real(self, model)

    monkeypatch.setattr(trt_fake.SimOnnxParser, "parse_from_file", reject_block)
    r = build(out, exported / "timing.cache", "--no-progress")
    assert r.exit_code == 2, r.output
    assert "simulated: unsupported node" in r.output  # Polygraphy logs the parser's errors (str() of the real ParserError)
    (err,) = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert err.startswith("error: TensorRT could not build an engine for draft_block.onnx: Could not parse ONNX")
    after = {p: p.read_bytes() for p in exported.rglob("*") if p.is_file()}
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert changed <= {exported / "timing.cache", exported / "timing.cache.lock"}  # OUT untouched


def test_a_killed_build_is_cleaned_by_the_next_run(exported, monkeypatch, tmp_path):
    """build killed with -9 after its first engine (in the staging folder beside OUT, no cleanup runs)
    leaves OUT as it was; the next build of OUT removes the folder and publishes its engines."""
    trt_fake.install(monkeypatch)  # here first: skips (or fails) where the bindings are missing
    out, cache = tmp_path / "out", tmp_path / "timing.cache"
    shutil.copytree(exported / "out", out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    args = ["build", str(out), "--max-context", str(MC), "--max-prompt", str(MP), "--timing-cache", str(cache),
            "--no-progress"]
    setup = "import pytest, trt_fake\ntrt_fake.install(pytest.MonkeyPatch())"
    pid = kill_after("trt_fake", "SimBuilder.build_serialized_network", args, setup, calls=2)
    left = list(tmp_path.glob(".out.*"))
    assert [p.name for p in left] == [f".out.engines-{pid}"] and [p.name for p in left[0].iterdir()] == ["target.engine"]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before and not (out / "engines").exists()
    r = build(out, cache, "--no-progress")
    assert r.exit_code == 0, r.output
    assert not list(tmp_path.glob(".out.*")) and len(load_manifest(out, verify=True).engines["profiles"]) == 3


def test_a_backend_that_fails_partway_frees_what_it_allocated(built, monkeypatch):
    """TensorRTBackend.__init__ raising after some of its device buffers and its stream exist
    (here: the 10th cudaMalloc fails) frees every one of them and destroys the stream."""
    import sys

    from dflash_export.runtime.trt.backend import TensorRTBackend

    _, out, _ = built
    cuda = sys.modules["cuda.bindings.runtime"]
    live, calls, streams = set(trt_fake._mem), [], []
    real_malloc, real_destroy = cuda.cudaMalloc, cuda.cudaStreamDestroy

    def malloc(n):
        calls.append(n)
        return (2, 0) if len(calls) == 10 else real_malloc(n)  # 2: cudaErrorMemoryAllocation

    monkeypatch.setattr(cuda, "cudaMalloc", malloc)
    monkeypatch.setattr(cuda, "cudaStreamDestroy", lambda s: (streams.append(s), real_destroy(s))[1])
    with pytest.raises(DFlashError, match="CUDA error"):
        TensorRTBackend(out)
    assert len(calls) == 10 and set(trt_fake._mem) == live and len(streams) == 1


def test_dry_run_needs_no_tensorrt(exported, monkeypatch):
    trt_fake.install(monkeypatch)
    r = CliRunner().invoke(cli, ["build", str(exported / "out"), "--dry-run", "--max-prompt", str(MP)])
    assert r.exit_code == 0 and "lint: every graph passes the TensorRT 10.12 to 11.x checks" in r.output, r.output
    assert trt_fake.builds == []


def test_tokens_match_ort_backend(built):
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.trt.backend import TensorRTBackend

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


def test_refusals(built, monkeypatch):
    from dflash_export.runtime.trt.backend import TensorRTBackend

    trt, out, _ = built
    m = load_manifest(out)
    m.engines = dict(m.engines, tensorrt="10.13.0")
    with pytest.raises(DFlashError, match=rf"built with TensorRT 10\.13\.0 but this process has TensorRT {trt.__version__}"):
        TensorRTBackend(out, manifest=m)
    m.engines = dict(load_manifest(out).engines, compute_capability="8.6", gpu="RTX 3090")
    with pytest.raises(DFlashError, match=r"8\.6 \(RTX 3090\) but this GPU is 9\.0"):
        TensorRTBackend(out, manifest=m)
    b = TensorRTBackend(out)
    with pytest.raises(DFlashError, match="exceeds the engines' --max-prompt 16"):
        b.target(np.arange(MP + 1))
    b.target_len = MC - 2
    with pytest.raises(DFlashError, match=r"exceeds the TensorRT engines' max context 64; .* rebuild them with a larger"):
        b.target(np.arange(K))
    b.reset()  # a request longer than the engines' context names the rebuild, not a re-export
    with pytest.raises(DFlashError, match=r"exceeds the TensorRT engines' max context 64; .* rebuild them with a larger"):
        generate(b, [1] * (MC - 4), 8)
    b.close()


def test_engines_that_do_not_match_are_refused_at_load(built, monkeypatch):
    """Point by point what the backend checks when it loads engines, each produced for real."""
    from dflash_export.runtime.trt.backend import TensorRTBackend

    trt, out, _ = built
    m = load_manifest(out)
    plan = (out / "engines" / "draft_block.engine").read_bytes()
    # a plan TensorRT cannot deserialize (corrupt, or another version's): deserialize_cuda_engine gives None
    for bad in (b"\x00garbage", plan.replace(trt.__version__.encode(), b"9.9.9")):
        (out / "engines" / "draft_block.engine").write_bytes(bad)
        with pytest.raises(DFlashError, match="draft_block.engine: TensorRT could not deserialize this engine"):
            TensorRTBackend(out, manifest=m)  # the manifest object given: its file hashes are not re-checked
    (out / "engines" / "draft_block.engine").write_bytes(plan)
    # the manifest's profiles are not the engine's
    e = json.loads(json.dumps(m.engines))
    e["profiles"]["target"][1]["shapes"]["input_ids"][2] = [1, MP + 1]
    m.engines = e
    with pytest.raises(DFlashError, match=r"target.engine: profile 1 of input_ids is \[\[1, 1\], \[1, 8\], \[1, 16\]\]"):
        TensorRTBackend(out, manifest=m)
    m.engines = dict(e, profiles=dict(e["profiles"], target=e["profiles"]["target"][:1]))
    with pytest.raises(DFlashError, match="target.engine has 2 optimization profiles but the manifest records 1"):
        TensorRTBackend(out, manifest=m)
    # an engine whose input is an output (another graph's engine under this name)
    with monkeypatch.context() as mp:
        mp.setattr(trt_fake.SimICudaEngine, "get_tensor_mode", lambda self, name: trt.TensorIOMode.OUTPUT)
        with pytest.raises(DFlashError, match="target.engine: input_ids is not an input of the engine"):
            TensorRTBackend(out)
    # TensorRT refuses to switch a context to the prefill profile: set_optimization_profile_async returns False
    monkeypatch.setattr(trt_fake.SimIExecutionContext, "__init__", _refusing_init)
    with pytest.raises(DFlashError, match="target.engine: TensorRT refused optimization profile 1"):
        TensorRTBackend(out)


def _refusing_init(self, engine):
    self.e, self.profile, self.shapes, self.addrs, self.refuse_profile = engine, 0, {}, {}, True


def test_generate_and_bench_with_backend_trt(built):
    trt, out, _ = built
    args = ["generate", str(out), "--prompt-ids", "5,17,3,42,8", "--max-new-tokens", "20", "--json"]
    trt_run = CliRunner().invoke(cli, args + ["--backend", "trt"])
    ort_run = CliRunner().invoke(cli, args + ["--backend", "ort"])
    assert trt_run.exit_code == 0 and ort_run.exit_code == 0, trt_run.output + ort_run.output
    got, want = json.loads(trt_run.output), json.loads(ort_run.output)
    assert got["tokens"] == want["tokens"] and got["provider"].startswith(f"tensorrt {trt.__version__}")
    b = CliRunner().invoke(cli, ["bench", str(out), "--backend", "trt", "--max-new-tokens", "8", "--warmup", "0", "--json"])
    assert b.exit_code == 0, b.output


@pytest.mark.parametrize("version", VERSIONS)
def test_hybrid_target_builds_and_runs(version, monkeypatch, tmp_path):
    """The planner's other graph kind: a hybrid (DeltaNet) target, its states bound as engine I/O.
    (tests/test_hybrid_runtime.py checks its tokens in depth on the newest version.)"""
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.trt.backend import TensorRTBackend

    trt_fake.install(monkeypatch, version)
    out = tmp_path / "out"
    shutil.copytree(artifact(HYBRID)[2], out)
    r = CliRunner().invoke(cli, ["build", str(out), "--timing-cache", str(tmp_path / "tc"), "--no-progress"])
    assert r.exit_code == 0, r.output
    shapes = trt_fake.builds[0]["profiles"][0]
    assert any(n.startswith("rec_state.") for n in shapes) and any(n.startswith("conv_state.") for n in shapes)
    be = TensorRTBackend(out)
    prompt = list(range(3, 40))
    assert generate(be, prompt, 12).tokens == generate(OrtBackend(out), prompt, 12, draft=False).tokens
    be.close()


def test_batched_rows_match_ort(exported, monkeypatch, tmp_path):
    """Engines built with --max-batch 3 run the batched loop: every row's tokens equal ONNX Runtime's
    batch-1 plain decoding of that prompt, with rows of mixed prompt lengths (one prefilled in
    chunks), rows that stop early and requests joining as rows leave (relayouts, moved rows)."""
    from dflash_export.runtime.loop import Request, generate_batch
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.trt.backend import TensorRTBackend

    trt_fake.install(monkeypatch)
    out = tmp_path / "out"
    shutil.copytree(exported / "out", out)
    r = build(out, tmp_path / "tc", "--no-progress", "--max-batch", "3")
    assert r.exit_code == 0, r.output
    assert load_manifest(out).engines["max_batch"] == 3
    ref = OrtBackend(out, "cpu")
    prompts = [*PROMPTS, [9, 4, 11], list(range(30, 41))]
    budgets = [20, 9, 25, 3, 14]
    want = [generate(ref, p, n, draft=False).tokens for p, n in zip(prompts, budgets)]
    sampled = Request([6, 2, 9, 1], 16, Sampling(0.8, seed=7), stop_token_ids=())  # rejection sampling: draft logits per row
    be = TensorRTBackend(out, max_batch=3)
    for draft in (True, False):
        reqs = [Request(p, n, stop_token_ids=()) for p, n in zip(prompts, budgets)]
        gens, stats = generate_batch(be, reqs[:2] + [sampled] + reqs[2:], draft=draft)
        assert [g.tokens for g in gens[:2] + gens[3:]] == want
        assert gens[2].tokens == generate(ref, sampled.prompt, 16, sampling=sampled.sampling, stop_token_ids=(),
                                          draft=draft).tokens  # its own seed's output, whatever else is in the batch
        assert stats.batch == 3 and stats.occupancy > 0.5
    with pytest.raises(DFlashError, match=r"--batch 4: the engines were built for batch 1\.\.3; rebuild them with "
                                          r"`dflash-export build OUT --max-batch 4`, or use --batch 3$"):
        TensorRTBackend(out, max_batch=4)
    with pytest.raises(DFlashError, match=r"no TensorRT engines; build them first with `dflash-export build OUT "
                                          r"--max-batch 2`$"):
        TensorRTBackend(exported / "out", max_batch=2)
    be.close()
    f = tmp_path / "p.txt"  # the CLI: generate --backend trt --batch 3
    f.write_text("\n".join(",".join(map(str, p)) for p in prompts) + "\n")
    r = CliRunner().invoke(cli, ["generate", str(out), "--backend", "trt", "--prompts", str(f), "--batch", "3",
                                 "--max-new-tokens", "9", "--json"])
    assert r.exit_code == 0, r.output
    got = [json.loads(x)["tokens"] for x in r.stdout.splitlines() if x.startswith("{")]
    assert got == [generate(ref, p, 9, draft=False).tokens for p in prompts]
    for cmd in (["generate", str(out), "--prompts", str(f)], ["bench", str(out)]):  # more rows than built: one line, exit 2
        r = CliRunner().invoke(cli, [*cmd, "--backend", "trt", "--batch", "4"])
        assert r.exit_code == 2 and r.output.startswith("error: --batch 4: the engines were built for batch 1..3") \
            and r.output.count("\n") == 1, r.output


def test_batched_hybrid_rows(monkeypatch, tmp_path):
    """A hybrid (Gated DeltaNet) target batched on the engines: per-row states copied to and from
    the device, a joining row's states at the buffers' start; tokens equal ONNX Runtime's batch 1."""
    from dflash_export.runtime.loop import Request, generate_batch
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.trt.backend import TensorRTBackend

    trt_fake.install(monkeypatch)
    out = tmp_path / "out"
    shutil.copytree(artifact(HYBRID)[2], out)
    r = CliRunner().invoke(cli, ["build", str(out), "--timing-cache", str(tmp_path / "tc"), "--no-progress", "--max-batch", "2"])
    assert r.exit_code == 0, r.output
    ref, be = OrtBackend(out), TensorRTBackend(out, max_batch=2)
    prompts, budgets = [list(range(3, 40)), [5, 9, 2], list(range(11, 20))], [12, 6, 9]
    gens, _ = generate_batch(be, [Request(p, n, stop_token_ids=()) for p, n in zip(prompts, budgets)])
    assert [g.tokens for g in gens] == [generate(ref, p, n, draft=False).tokens for p, n in zip(prompts, budgets)]
    be.close()
