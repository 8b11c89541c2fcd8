"""`serve --backend trt --max-batch N` over engines built with `build --max-batch N`, on the
double of the real TensorRT bindings (tests/trt_fake.py: ONNX Runtime plays the engines, host
memory the device). NOT TensorRT on a GPU: that is tests/test_trt_gpu.py's, skipped here.

The server is a real process (tests/test_serve.py's Server: torch blocked, 127.0.0.1, ephemeral
port, stopped by its pid) that installs the double before its CLI runs. Concurrent requests
(greedy, streamed or not, a seeded sampled one) share rounds of the batched loop on the engines;
every output equals ONNX Runtime's batch-1 output of that request alone."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner
from runtime_cases import prompts
from test_serve import art, running  # noqa: F401 (fixture)

import trt_bindings
import trt_fake
from dflash_export.cli import cli
from dflash_export.runtime.loop import generate
from dflash_export.runtime.manifest import load_manifest
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.sampling import Sampling

pytestmark = pytest.mark.filterwarnings("ignore:Context managers for TensorRT types are deprecated")
MC, MP, ROWS = 64, 16, 3  # the engines' max context and prompt (build --max-context/--max-prompt), batch
VERSION = trt_bindings.VERSIONS[-1]
PRELUDE = (f"sys.path.insert(0, {str(Path(__file__).parent)!r})\nimport pytest, trt_fake\n"
           f"trt_fake.install(pytest.MonkeyPatch(), {VERSION!r})\n")


@pytest.fixture(scope="module")
def engines(art, tmp_path_factory):  # noqa: F811
    """A copy of the serve tests' pair (real acceptance, a character tokenizer) with engines for 1..3 rows."""
    out = tmp_path_factory.mktemp("serve-trt") / "tiny-chat"
    shutil.copytree(art, out)
    with pytest.MonkeyPatch.context() as mp:
        trt_fake.install(mp, VERSION)
        r = CliRunner().invoke(cli, ["build", str(out), "--max-context", str(MC), "--max-prompt", str(MP), "--max-batch",
                                     str(ROWS), "--timing-cache", str(out.parent / "tc"), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert load_manifest(out).engines["max_batch"] == ROWS
    return out


@pytest.fixture(scope="module")
def trt_server(engines, tmp_path_factory):
    yield from running(engines, tmp_path_factory.mktemp("log") / "serve.log", "--backend", "trt", "--max-batch", ROWS,
                       "--max-queue", 8, "--speculation", "always", prelude=PRELUDE)


def test_batched_trt_server_equals_ort_batch1(trt_server, engines):
    assert f"tensorrt {VERSION}" in trt_server.ready_line, trt_server.ready_line
    requests_equal_ort_batch1(trt_server, engines)


def requests_equal_ort_batch1(server, out: Path) -> None:
    """Concurrent requests (greedy streamed and not, a prompt prefilled in chunks, a seeded sampled
    one) to a `--max-batch 3 --speculation always` server over `out`'s engines: each equals ONNX
    Runtime's batch-1 output of it alone, and they shared rounds. tests/test_trt_gpu.py runs it on a GPU."""
    assert f"batch {ROWS}" in server.ready_line, server.ready_line
    ref = OrtBackend(out, "cpu", threads=1)
    ps = prompts(7, 101, seed=5)
    ps[1] = list(range(3, 24))  # longer than --max-prompt: its prefill is chunked
    jobs = [(p, 8 + 4 * (i % 4), dict(temperature=0.8, seed=7) if i == 2 else {}) for i, p in enumerate(ps)]
    wants = [generate(ref, p, n, sampling=Sampling(k.get("temperature", 0), seed=k.get("seed", 0))).tokens
             for p, n, k in jobs]  # alone, batch 1, ONNX Runtime
    assert wants[0] == generate(ref, ps[0], jobs[0][1], draft=False).tokens  # greedy: the target's own output
    client = server.client()
    before = [server.metric(f"dflash:batch_rows_per_round_{m}") for m in ("count", "sum")]

    def ask(i):
        p, n, k = jobs[i]
        r = client.completions.create(model=out.name, prompt=p, max_tokens=n, temperature=k.get("temperature", 0),
                                      seed=k.get("seed"), stream=i % 2 == 1)
        if i % 2 == 0:
            return r.choices[0].model_extra["token_ids"]
        return [t for ch in r for t in ch.choices[0].model_extra["token_ids"]]

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = [f.result(timeout=300) for f in [pool.submit(ask, i) for i in range(len(jobs))]]
    for i, (g, w) in enumerate(zip(got, wants)):
        assert g == w, (i, jobs[i][2])
    rounds, rows = (server.metric(f"dflash:batch_rows_per_round_{m}") - b for m, b in zip(("count", "sum"), before))
    assert rounds > 0 and rows / rounds > 1.2, (rounds, rows)  # the requests shared rounds
    assert server.raw("GET", "/health")[2]["max_batch"] == ROWS
    print(f"{len(jobs)} concurrent requests: {rounds:.0f} rounds, mean {rows / rounds:.2f} rows per round")


def test_max_batch_beyond_the_engines_is_one_line(engines):
    r = CliRunner().invoke(cli, ["serve", str(engines), "--backend", "trt", "--max-batch", str(ROWS + 1), "--port", "0"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: --max-batch {ROWS + 1} but the TensorRT engines in ") and \
        f"built for batch 1..{ROWS}; rebuild them with `dflash-export build" in r.output and \
        f"--max-batch {ROWS + 1}`, or serve with --max-batch {ROWS}" in r.output
