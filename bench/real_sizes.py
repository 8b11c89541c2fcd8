"""Real model sizes on CPU: the Qwen3-0.6B shape with random weights, end to end.

    OMP_WAIT_POLICY=PASSIVE nice -n 10 .venv/bin/python bench/real_sizes.py --work /tmp/real06b

Builds a random-weight target with the exact shape of Qwen3-0.6B (28 layers, hidden 1024,
16 heads / 8 KV heads, head_dim 128, intermediate 3072, vocab 151936, tied embeddings) in
the Hugging Face layout and a 1-layer z-lab drafter with five taps spread over the layers,
exports it twice with `--max-context 4096` (full draft vocabulary, and `--draft-vocab N`
with the documented fallback choice: the weights are random, so no data means anything),
calibrates the reduced one as `bench --calibrate` does (threads per graph, prefill chunk;
runtime.json), then measures each configuration in a child process of its own (so its
peak RSS is its own): per-call costs (plain step, draft, 16-token verify) from the bench
loop on random 32-token prompts, peak RSS with the breakdown after each session (anonymous
memory vs file pages mapped from the artifact), the time to first token of a 512-token
prompt, and, interleaved in one process, the plain step with the tied head packed from
the table (now) vs folded first (before). Prints one JSON object. Not part of the test
suite (minutes, ~3 GB of RAM per child and ~5 GB of disk); the drafter is untrained, so
only the per-call costs and memory matter.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import make_checkpoint as write_checkpoint
from common import mem, run_child

SHAPE = dict(vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, inter=3072)


def make_checkpoint(work: Path) -> None:
    """Qwen3-0.6B's config (tied, its eos/bos ids) with random weights, and a 1-layer drafter tapping 5 layers."""
    from dflash_export.models.draft_config import default_target_layer_ids

    s = SHAPE
    write_checkpoint(work, s["vocab"], s["hidden"], s["layers"], s["inter"], heads=s["heads"], kv_heads=s["kv_heads"], tie=True,
          config={"max_position_embeddings": 40960, "eos_token_id": 151645, "bos_token_id": 151643},
          drafter={"mask_token_id": 151669 % s["vocab"], "target_layer_ids": default_target_layer_ids(s["layers"], 5),
                   "intermediate_size": None})


def do_export(work: Path, name: str, draft_vocab: int | None) -> dict:
    from dflash_export.export.artifact import export_artifact

    t0 = time.perf_counter()
    export_artifact(work / "target", work / "draft", work / name, max_context=4096, force=True, progress=False,
                    draft_vocab=draft_vocab)
    files = sum(p.stat().st_size for p in (work / name).iterdir())
    return {"export_s": round(time.perf_counter() - t0, 1), "export_peak_rss_mb": mem()["VmHWM"],
            "artifact_mb": round(files / 2**20)}


def open_backend(work: Path, name: str, threads: str, variant: str, drafter: bool = True):
    """threads "cal": runtime.json's per-graph counts and prefill chunk; else one count for
    every graph. variant fold: the tied head constant-folded as before (a transposed copy)."""
    from dflash_export.runtime import manifest as M
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.ort.sessions import Sessions
    from dflash_export.runtime.settings import RunOptions, resolve

    m = M.load_manifest(work / name)
    kw = resolve(work / name, m, RunOptions(threads=None if threads == "cal" else int(threads))).ort_kwargs()
    kw |= {"low_memory": {"low_memory": True}, "keep_mapped": {"release_mapped": False}}.get(variant, {})
    if variant == "fold":
        orig = Sessions._session

        def folded(self, graph):
            self.tied_head_graphs = set()
            return orig(self, graph)

        Sessions._session = folded
    return OrtBackend(work / name, drafter=drafter, **kw)


def do_calibrate(work: Path, name: str, prompts: int, new_tokens: int) -> dict:
    import numpy as np

    from dflash_export.runtime.calibrate import calibrate
    from dflash_export.runtime.calibrate import thread_candidates
    from dflash_export.runtime.settings import RunOptions

    from dflash_export.runtime import manifest as M

    rng, vocab = np.random.default_rng(1), M.load_manifest(work / name).vocab_size
    ps = [rng.integers(0, vocab - 2, 32).tolist() for _ in range(prompts)]
    t0 = time.perf_counter()
    out = calibrate(work / name, RunOptions(spin=False), thread_candidates(), ps, new_tokens, 1,
                    log=lambda msg: print(msg, file=sys.stderr, flush=True))
    return {"calibrate_s": round(time.perf_counter() - t0), **{k: out[k] for k in ("threads", "graph_threads", "prefill_chunk")}}


def do_measure(work: Path, name: str, threads: str, variant: str, prompts: int, new_tokens: int, ttft: bool) -> dict:
    import numpy as np

    from dflash_export.runtime.calibrate import prefill_ms, ttft_prompt
    from dflash_export.runtime.measure import run_bench
    from dflash_export.runtime.ort.backend import OrtBackend

    stages = {"start": mem()}
    orig = OrtBackend._session

    def recorded(self, graph, *a, **kw):  # RSS after each session: the per-session breakdown
        s = orig(self, graph, *a, **kw)
        stages[graph] = mem()
        return s

    OrtBackend._session = recorded
    t0 = time.perf_counter()
    be = open_backend(work, name, threads, variant)
    load_s = time.perf_counter() - t0
    stages["loaded"] = mem()
    rng = np.random.default_rng(0)
    ps = [rng.integers(0, be.manifest.vocab_size - 2, 32).tolist() for _ in range(prompts)]
    report = run_bench(be, ps, new_tokens, warmup=1)
    stages["after_bench"] = mem()
    out = {}
    if ttft:
        long = ttft_prompt(be)
        out["ttft_ms"] = round(prefill_ms(be, long, [be.max_chunk])[be.max_chunk])
        out["ttft_prompt_tokens"] = len(long)
        stages["after_ttft"] = mem()
    c = report["ms_per_call"]
    return {"artifact": name, "threads": threads, "variant": variant, "load_s": round(load_s, 1),
            "session_threads": {g: s.get_session_options().intra_op_num_threads for g, s in be.sessions.items()},
            "prefill_chunk": be.max_chunk, "ms_per_call": {k: round(v, 1) for k, v in c.items()},
            "draft_over_step": round(c["draft"] / c["step"], 3), "verify_over_step": round(c["verify"] / c["step"], 3),
            "ideal_speedup_at_tau_6.5": round(6.5 * c["step"] / (c["draft"] + c["verify"]), 2),
            "lossless": report["lossless"], "draft_vocab": report.get("draft_vocab"), **out,
            "rss_mb": stages, "peak_rss_mb": mem()["VmHWM"]}


def do_step_speed(work: Path, name: str, rounds: int) -> dict:
    """Plain 1-token step, tied head packed from the table (now) vs folded first (before):
    both target sessions in one process, measured alternately."""
    from dflash_export.runtime.calibrate import step_ms_by_context

    now = open_backend(work, name, "cal", "default", drafter=False)
    before = open_backend(work, name, "cal", "fold", drafter=False)
    ms = {"now": [], "before": []}
    for _ in range(rounds):
        for label, be in (("now", now), ("before", before)):
            ms[label].append(step_ms_by_context(be, [32], repeats=20)["32"])
    med = {k: float(sorted(v)[len(v) // 2]) for k, v in ms.items()}
    return {"step_ms": {k: [round(x, 1) for x in v] for k, v in ms.items()},
            "now_over_before": round(med["now"] / med["before"], 3)}


def child(args: list[str]) -> dict:
    return run_child(__file__, args)


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-real-sizes"))
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", default="dv:cal:default,full:2:default,dv:cal:fold",
                    help="artifact:threads:variant,... (artifact full | dv; threads N or cal = runtime.json; "
                         "variant default | fold | keep_mapped | low_memory); the first also times the TTFT")
    ap.add_argument("--speed-rounds", type=int, default=3, help="alternations of the now-vs-folded step timing")
    ap.add_argument("--keep", action="store_true", help="reuse the checkpoint and exports in --work")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.step:
        kind, *rest = a.step.split(":")
        if kind == "checkpoint":
            make_checkpoint(a.work)
            out = {}
        elif kind == "export":
            out = do_export(a.work, rest[0], int(rest[1]) or None)
        elif kind == "calibrate":
            out = do_calibrate(a.work, rest[0], a.prompts, a.new_tokens)
        elif kind == "speed":
            out = do_step_speed(a.work, rest[0], a.speed_rounds)
        else:
            out = do_measure(a.work, rest[0], rest[1], rest[2], a.prompts, a.new_tokens, rest[3] == "ttft")
        print(json.dumps(out))
        return

    import shutil

    result = {"shape": SHAPE, "draft_vocab": a.draft_vocab, "prompts": a.prompts, "new_tokens": a.new_tokens,
              "load_average_start": load_average()}
    if not (a.keep and (a.work / "dv" / "manifest.json").is_file()):
        shutil.rmtree(a.work, ignore_errors=True)
        a.work.mkdir(parents=True)
        child(["--work", str(a.work), "--step", "checkpoint"])
        result["export"] = {"full": child(["--work", str(a.work), "--step", "export:full:0"]),
                            "dv": child(["--work", str(a.work), "--step", f"export:dv:{a.draft_vocab}"])}
    result["weights_mb"] = round(sum(p.stat().st_size for p in (a.work / "target").glob("*.safetensors")) / 2**20)
    common = ["--work", str(a.work), "--prompts", str(a.prompts), "--new-tokens", str(a.new_tokens)]
    result["calibration_dv"] = child([*common, "--step", "calibrate:dv"])
    runs = []
    for i, spec in enumerate(a.runs.split(",")):
        r = child([*common, "--step", f"measure:{spec}:{'ttft' if i == 0 else ''}"])
        art = sum(p.stat().st_size for p in (a.work / r["artifact"]).iterdir() if p.name != "runtime.json") / 2**20
        r["artifact_mb"] = round(art)
        r["peak_rss_over_artifact"] = round(r["peak_rss_mb"] / art, 2)
        r["load_average"] = load_average()
        runs.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    result["runs"] = runs
    result["step_speed_dv"] = child([*common, "--speed-rounds", str(a.speed_rounds), "--step", "speed:dv"])
    result["load_average_end"] = load_average()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
