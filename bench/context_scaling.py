"""Per-call time of the ORT runtime at a short and a long cached context.

The cache is bound in place (runtime/ort/backend.py), so a step at context 2048 should cost a
128-context step plus only the extra attention. Measures the three calls the loop makes
(1-token target step, K-token verify, drafter block) after P cached positions, with the
measurements `bench --calibrate` makes (runtime/calibrate.py). `--attention standard,ort` exports
the same model in both attention flavours (export --attention) and measures them
interleaved, reporting each one's context cost (step at the longest context minus step at
the shortest) and the ort / standard ratio of those costs (--model h1024: a target of hidden
size 1024, where the ort flavour's step at 2048 positions costs about 1.2x its step at 128).

`--dirs A,B,...` measures existing exports instead (e.g. the same pair exported by two
versions of the exporter); every report also gives each target graph's node count, as
exported and after ONNX Runtime's own optimizations (ORT_ENABLE_ALL, what a session runs).

    python bench/context_scaling.py [--contexts 128,2048] [--repeats 30] [--passes 6] [--threads 1]
        [--model small|wide|h1024] [--attention standard|ort|standard,ort] [--dirs A,B] [--profile] [--json]
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np
from common import bench_model, machine, parser

from dflash_export.runtime import contract as C
from dflash_export.runtime.calibrate import graph_ms, step_ms_by_context
from dflash_export.runtime.ort.backend import OrtBackend


def time_calls(be: OrtBackend, P: int, repeats: int) -> dict[str, float]:
    """Median ms of each call the loop makes at a cached context of P positions, measured as
    `bench --calibrate` measures them (runtime/calibrate.py): the 1-token step after P positions
    (step_ms_by_context), and a round's verify and drafter block after a P-token prompt
    (graph_ms: one position committed per repeat, so the context grows by `repeats` at most)."""
    prompt = np.random.default_rng(P).integers(0, be.manifest.vocab_size - 2, P).tolist()
    step = step_ms_by_context(be, [P], repeats)[str(P)]
    calls = graph_ms(be, prompt, repeats)
    return {"step": step, "verify": calls[C.TARGET], "draft": calls[C.DRAFT_BLOCK]}


def node_counts(out: Path) -> dict[str, int]:
    """Nodes of the target graph as exported and as ONNX Runtime runs it (ORT_ENABLE_ALL)."""
    import tempfile

    import onnx
    import onnxruntime as ort

    from dflash_export.runtime import contract as C

    path = out / C.GRAPH_FILES[C.TARGET]
    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.log_severity_level, opts.optimized_model_filepath = 3, f"{tmp}/t.onnx"
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "t.data")
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        optimized = len(onnx.load(f"{tmp}/t.onnx", load_external_data=False).graph.node)
    return {"exported": len(onnx.load(str(path), load_external_data=False).graph.node), "ort_optimized": optimized}


def op_profile(out: Path, P: int, threads: int, runs: int = 30) -> dict[str, float]:
    """Kernel ms per 1-token target step at context P by ONNX op type (ORT profiler), through
    the runtime's own binding (either flavour): less exposed to scheduling noise than wall time."""
    import collections

    import numpy as np
    import onnxruntime as ort

    from dflash_export.runtime import contract as C

    class Profiling(ort.SessionOptions):
        def __init__(self):
            super().__init__()
            self.enable_profiling, self.profile_file_prefix = True, f"/tmp/dflash-context-{P}"

    plain, ort.SessionOptions = ort.SessionOptions, Profiling  # OrtBackend builds its sessions with these
    try:
        be = OrtBackend(out, threads=threads)
    finally:
        ort.SessionOptions = plain
    be.reset()
    be.target_len = be.context_len = P
    for _ in range(runs + 3):  # 3 warm-up steps, dropped below
        be.target(np.array([5], np.int64))
        be.commit(0)
    per_op = collections.Counter()
    for g, sess in be.sessions.items():
        path = Path(sess.end_profiling())
        if g == C.TARGET:
            events = json.loads(path.read_text())
            starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
            for e in events:  # the kernels of the timed steps (after the 3 warm-up runs)
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= starts[3]:
                    per_op[e["args"]["op_name"]] += e["dur"]
        path.unlink()
    be.close()
    ms = {k: v / runs / 1e3 for k, v in per_op.most_common()}
    return {"kernel_ms": sum(ms.values()), **dict(list(ms.items())[:6])}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--contexts", default="128,2048")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="ORT intra-op threads")
    ap.add_argument("--model", default="small", help="bench/common.py BENCH_MODELS: small | wide")
    ap.add_argument("--attention", default="standard", help="export flavour(s), comma-separated: standard, ort")
    ap.add_argument("--dirs", default=None, help="comma-separated export directories to measure instead of --model")
    ap.add_argument("--profile", action="store_true", help="also print each flavour's kernel ms per step by op type")
    a = ap.parse_args()
    if a.dirs:
        outs = {d: Path(d) for d in a.dirs.split(",")}
        flavours = list(outs)
    else:
        flavours = a.attention.split(",")
        outs = {f: bench_model(a.model, f)[2] for f in flavours}
    bes = {f: OrtBackend(out, threads=a.threads) for f, out in outs.items()}
    m = next(iter(bes.values())).manifest
    contexts = [int(c) for c in a.contexts.split(",")]
    ptrs = {f: [b.ctypes.data for b in be.kv + be.ctx] for f, be in bes.items()}
    rows: dict = {f: {} for f in flavours}
    for rnd in range(a.passes):  # interleaved passes; keep the least disturbed (fastest) median per cell
        for P in contexts:
            for f, be in bes.items():
                r = time_calls(be, P, a.repeats)
                rows[f][P] = {k: min(v, rows[f].get(P, {}).get(k, v)) for k, v in r.items()}
    assert ptrs == {f: [b.ctypes.data for b in be.kv + be.ctx] for f, be in bes.items()}, "cache buffers moved"
    lo, hi = contexts[0], contexts[-1]
    report = {
        "model": f"{m.architecture} {m.target_layers} layers, hidden {m.hidden_size}, heads {m.hidden_size // m.target_head_dim}"
                 f"/{m.target_kv_heads}, vocab {m.vocab_size}, {m.draft_layers}-layer drafter, block {m.block_size}",
        "provider": next(iter(bes.values())).provider,
        "threads": a.threads,
        "machine": machine(),
        "target_nodes": {f: node_counts(out) for f, out in outs.items()},
        "ms": rows,
        "ratio": {f: {k: r[hi][k] / r[lo][k] for k in r[lo]} for f, r in rows.items()},
        "context_cost_ms": {f: {k: r[hi][k] - r[lo][k] for k in r[lo]} for f, r in rows.items()},
    }
    if {"standard", "ort"} <= set(flavours):
        c = report["context_cost_ms"]
        report["ort_vs_standard_context_cost"] = {k: c["ort"][k] / c["standard"][k] for k in c["ort"]}
    if a.profile:
        report["op_ms"] = {f: {P: op_profile(out, P, a.threads) for P in contexts} for f, out in outs.items()}
    if a.json:
        print(json.dumps(report))
        return
    print(report["model"], "|", report["provider"], f"| {a.threads} thread(s) | load {report['machine']['load'][0]:.1f}")
    for f, n in report["target_nodes"].items():
        print(f"[{f}] target nodes: {n['exported']} exported, {n['ort_optimized']} after ORT's optimizations")
    for f in flavours:
        print(f"[{f}] {'context':>8} " + " ".join(f"{k + ' ms':>10}" for k in rows[f][lo]))
        for P, r in rows[f].items():
            print(f"[{f}] {P:>8} " + " ".join(f"{v:>10.2f}" for v in r.values()))
        print(f"[{f}] {hi} vs {lo}: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["ratio"][f].items())
              + "; context cost " + ", ".join(f"{k} {v:.2f} ms" for k, v in report["context_cost_ms"][f].items()))
    if "ort_vs_standard_context_cost" in report:
        print("context cost, ort / standard: " + ", ".join(f"{k} {v:.2f}" for k, v in report["ort_vs_standard_context_cost"].items()))
    for f, by_p in report.get("op_ms", {}).items():
        for P, ms in by_p.items():
            print(f"[{f}] step at {P}: kernel ms by op: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))


if __name__ == "__main__":
    main()
