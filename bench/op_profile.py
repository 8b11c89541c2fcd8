"""Which ONNX Runtime kernels a target's decode step and prefill spend their time in (CPU).

For each export directory: ORT's profiler (SessionOptions.enable_profiling) over --steps plain
1-token steps after a --depth-token prompt, and over one --prefill-token prompt (the runtime's
default chunk), in separate sessions. Per op type: ms per step / per prefill and the share; the
LM head (the MatMul or MatMulNBits reading lm_head.weight) is its own line, as llama.cpp's
`output` tensor is the figure to compare it with. Profiled runs are slower than plain ones (the
profiler's own per-node cost), so the shares matter more than the sums.

    python bench/op_profile.py DIR [DIR ...] [--threads 1] [--depth 64] [--steps 32] [--prefill 512] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path

import numpy as np

from dflash_export.runtime.calibrate import prefill_ms
from dflash_export.runtime.loop import generate
from dflash_export.runtime.ort import backend as ob


def profiled(d: Path, threads: int, tag: str) -> ob.OrtBackend:
    import onnxruntime as ort

    class Profiling(ort.SessionOptions):
        def __init__(self):
            super().__init__()
            self.enable_profiling, self.profile_file_prefix = True, f"/tmp/dflash-ops-{tag}-{os.getpid()}"

    real, ob.ort.SessionOptions = ob.ort.SessionOptions, Profiling
    try:
        return ob.OrtBackend(d, threads=threads, drafter=False)
    finally:
        ob.ort.SessionOptions = real


def head_nodes(d: Path) -> set[str]:
    import onnx

    g = onnx.load(str(d / "target.onnx"), load_external_data=False).graph
    return {n.name for n in g.node if any(i.startswith("lm_head.weight") for i in n.input)}


def by_op(path: Path, heads: set[str], runs: slice) -> dict[str, float]:
    """op type -> kernel ms per call over the session's runs[`runs`] (the LM head apart), from one profile file."""
    events = json.loads(path.read_text())
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[runs]
    ms: dict[str, float] = collections.defaultdict(float)
    calls = len(spans)
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        if not any(a <= e["ts"] <= b for a, b in spans):
            continue
        node = e["name"].removesuffix("_kernel_time")
        op = "LM head (" + e["args"]["op_name"] + ")" if node in heads else e["args"]["op_name"]
        ms[op] += e["dur"] / 1e3 / calls
    path.unlink()
    return dict(sorted(ms.items(), key=lambda kv: -kv[1]))


def profile(d: Path, threads: int, depth: int, steps: int, prefill: int) -> dict:
    heads = head_nodes(d)
    b = profiled(d, threads, "step")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, b.manifest.vocab_size, depth).tolist()
    g = generate(b, prompt, steps + 1, draft=False, stop_token_ids=())
    step = by_op(Path(b.sessions["target"].end_profiling()), heads, slice(-(-depth // b.max_chunk), None))  # the steps
    b.close()
    b = profiled(d, threads, "prefill")
    long = rng.integers(0, b.manifest.vocab_size, prefill).tolist()
    ms = prefill_ms(b, long, [b.max_chunk], repeats=1)[b.max_chunk]
    chunks = -(-prefill // b.max_chunk)
    pre = by_op(Path(b.sessions["target"].end_profiling()), heads, slice(-chunks, None))  # the timed prefill's calls
    pre = {op: ms * chunks for op, ms in pre.items()}  # per prefill, not per chunk
    b.close()
    return {"dir": str(d), "threads": threads, "step_ms_wall": g.decode_s / steps * 1e3, "step_ms_by_op": step,
            "prefill_tokens": prefill, "prefill_ms_wall": ms, "prefill_ms_by_op": pre}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    reports = [profile(d, a.threads, a.depth, a.steps, a.prefill) for d in a.dirs]
    if a.json:
        print(json.dumps(reports))
        return
    for r in reports:
        print(f"{r['dir']} ({r['threads']} thread(s)): step {r['step_ms_wall']:.2f} ms wall, "
              f"prefill of {r['prefill_tokens']} {r['prefill_ms_wall']:.0f} ms wall")
        for what in ("step", "prefill"):
            ops = r[f"{what}_ms_by_op"]
            total = sum(ops.values())
            print(f"  {what}: kernels {total:.2f} ms per call")
            for op, ms in list(ops.items())[:8]:
                print(f"    {op:32s} {ms:9.2f} ms  {ms / total:6.1%}")


if __name__ == "__main__":
    main()
