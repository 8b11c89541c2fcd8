"""Per-call time of the ORT runtime at a short and a long cached context.

The cache is bound in place (runtime/ort.py), so a step at context 2048 should cost a
128-context step plus only the extra attention: the goal is <= 1.3x. Measures the three
calls the loop makes (1-token target step, K-token verify, drafter block) with the cache
filled to P positions; every call is rolled back (commit(0)), so P stays put.

    python bench/context_scaling.py [--contexts 128,2048] [--repeats 30] [--passes 6] [--threads 1] [--model small|wide] [--profile] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))
from common import bench_model  # noqa: E402

from dflash_export.runtime.ort import OrtBackend  # noqa: E402


def time_calls(be: OrtBackend, P: int, repeats: int) -> dict[str, float]:
    """Median ms of each call with P valid positions in both caches."""
    import numpy as np

    K = be.manifest.block_size
    be.reset()
    be.target_len = be.context_len = P  # the buffers are preallocated: any prefix is valid memory
    one, block = np.array([5], np.int64), np.arange(5, 5 + K, dtype=np.int64)
    calls = {
        "step": lambda: (be.target(one), be.commit(0)),
        "verify": lambda: (be.target(block), be.commit(0)),
        "draft": lambda: be.draft_block(5),
    }
    out = {}
    for name, call in calls.items():
        for _ in range(3):
            call()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts) * 1e3
    return out


def op_profile(out: Path, P: int, threads: int, runs: int = 20) -> dict[str, float]:
    """Share of kernel time per ONNX op type in a 1-token target step at context P (ORT profiler)."""
    import collections

    import numpy as np
    import onnxruntime as ort

    from dflash_export.runtime import contract as C

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.enable_profiling = threads, True
    opts.profile_file_prefix = f"/tmp/dflash-context-{P}"
    sess = ort.InferenceSession(str(out / C.GRAPH_FILES[C.TARGET]), opts, providers=["CPUExecutionProvider"])
    feed = {C.INPUT_IDS: np.array([[5]]), C.POSITION_IDS: np.array([[P]])}
    for i in sess.get_inputs()[2:]:
        feed[i.name] = np.zeros((1, P, *i.shape[2:]), np.float32)
    for _ in range(runs):
        sess.run(None, feed)
    path = sess.end_profiling()
    per_op = collections.Counter()
    for e in json.loads(Path(path).read_text()):
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    Path(path).unlink()
    total = sum(per_op.values())
    return {k: v / total for k, v in per_op.most_common(8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,2048")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="ORT intra-op threads")
    ap.add_argument("--model", default="small", help="bench/common.py BENCH_MODELS: small | wide")
    ap.add_argument("--profile", action="store_true", help="also print the op-type time shares of a step")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    _, _, out = bench_model(a.model)
    be = OrtBackend(out, threads=a.threads)
    m = be.manifest
    contexts = [int(c) for c in a.contexts.split(",")]
    ptrs = [b.ctypes.data for b in be.kv + be.ctx]
    rows = {}
    for rnd in range(a.passes):  # interleaved passes; keep the least disturbed (fastest) median per cell
        for P in contexts:
            r = time_calls(be, P, a.repeats)
            rows[P] = {k: min(v, rows.get(P, {}).get(k, v)) for k, v in r.items()}
    assert ptrs == [b.ctypes.data for b in be.kv + be.ctx], "cache buffers moved"
    lo, hi = contexts[0], contexts[-1]
    report = {
        "model": f"{m.architecture} {m.target_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}, "
                 f"{m.draft_layers}-layer drafter, block {m.block_size}",
        "provider": be.provider,
        "threads": a.threads,
        "ms": rows,
        "ratio": {k: rows[hi][k] / rows[lo][k] for k in rows[lo]},
    }
    if a.profile:
        report["op_share"] = {P: op_profile(out, P, a.threads) for P in contexts}
    if a.json:
        print(json.dumps(report))
        return
    print(report["model"], "|", report["provider"], f"| {a.threads} thread(s)")
    print(f"{'context':>8} " + " ".join(f"{k + ' ms':>10}" for k in rows[lo]))
    for P, r in rows.items():
        print(f"{P:>8} " + " ".join(f"{v:>10.2f}" for v in r.values()))
    print(f"{hi} vs {lo}: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["ratio"].items()))
    for P, share in report.get("op_share", {}).items():
        print(f"step at {P}: kernel time by op: " + ", ".join(f"{k} {v:.0%}" for k, v in share.items()))


if __name__ == "__main__":
    main()
