"""Where a speculative round's time goes (ONNX Runtime, CPU): graph calls vs host code.

For each export directory given, on the same prompts (interleaved, fastest of --passes kept):
per round, the wall ms of draft_context, draft_block and the verify call as the loop sees
them, and the loop's host time (acceptance, bookkeeping); the round part by part, wall and
this thread's CPU time (each call's session run, the Python around it, the loop's own code:
in wall time the round's, in CPU time also the generator's between rounds; the CPU figures leave
out the time other jobs held the core). Then (unless --parts-only):
the Python side of each call
(binding; the graph run replaced by nothing), each call timed alone vs right after the other
graph (cache interference, CPU time), and from ORT's profiler in a separate pass the median call's
model_run and kernel ms (their difference includes the profiler's own per-node cost).

    python bench/round_profile.py DIR [DIR ...] [--prompts 3] [--max-new-tokens 64] [--threads 1]
        [--verify THETA,MIN_LEN] [--passes 5] [--spin | --no-spin] [--head-lengths 4,8,16] [--parts-only]

--head-lengths: also draft_block's ms for rounds whose longest verify is each length (its head
scoring length - 1 drafts, where the export takes draft_index; an older export scores all K - 1
whatever is asked), every directory and length interleaved in one loop.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import statistics
import time
from pathlib import Path

from common import ROOT

from dflash_export.runtime import manifest as M
from dflash_export.runtime.loop import Generation, generate, stream
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import VerifyPolicy, device_key, resolve

CALLS = ("draft_context", "draft_block", "target")


def load(d: Path, threads: int, profile: bool = False, policy: VerifyPolicy | None = None,
         spin: bool | None = None) -> tuple[OrtBackend, object]:
    """The backend as `bench` builds it (runtime.json's verify policy unless `policy`, its spin
    unless `spin`), optionally profiling."""
    import onnxruntime as ort

    m = M.load_manifest(d)
    s = resolve(d, m, device_key("ort"), threads=threads, spin=spin)
    plain = ort.SessionOptions
    if profile:
        class Profiling(ort.SessionOptions):
            def __init__(self):
                super().__init__()
                self.enable_profiling, self.profile_file_prefix = True, f"/tmp/dflash-rounds-{os.getpid()}"

        ort.SessionOptions = Profiling
    try:
        be = OrtBackend(d, **s.ort_kwargs())
    finally:
        ort.SessionOptions = plain
    return be, policy or s.verify


def timed(be: OrtBackend) -> dict[str, list[tuple[int, int]]]:
    """Wrap the backend's three calls, and each graph's session run inside them, with the wall
    clock and this thread's CPU clock ((wall ns, CPU ns) per call, by name; "run:" + graph for the
    runs). At 1 thread ONNX Runtime runs every kernel on the calling thread, so CPU time is what
    the call cost, less the time other jobs held the core; a call's Python is the call less its run."""
    if hasattr(be, "clocks"):  # wrapped by an earlier pass
        return be.clocks
    ts = be.clocks = {c: [] for c in (*CALLS, *(f"run:{c}" for c in CALLS))}
    wall, cpu = time.perf_counter_ns, time.thread_time_ns

    def clocked(fn, name):
        def wrapper(*a, **k):
            w, c = wall(), cpu()
            r = fn(*a, **k)
            ts[name].append((wall() - w, cpu() - c))
            return r
        return wrapper

    for name in CALLS:  # the loop calls the rows forms (draft_block_rows, ...): wrap those
        setattr(be, f"{name}_rows", clocked(getattr(be, f"{name}_rows"), name))

    class Run:  # a session whose run is clocked
        def __init__(self, sess, name):
            self.run_with_iobinding = clocked(sess.run_with_iobinding, f"run:{name}")

    be.sessions = {g: Run(s, g) for g, s in be.sessions.items()}
    return ts


def decode(be: OrtBackend, verify, prompts: list[list[int]], n: int) -> dict:
    """ms per round: each call's wall, its session run's and its Python's (wall and CPU), the loop's
    host time; tau and rate."""
    ts = timed(be)
    gs, calls, cpu = [], collections.Counter(), 0
    for p in prompts:
        g = Generation()
        for i, _ in enumerate(stream(be, p, n, draft=True, verify=verify, out=g)):
            if i == 0:  # prefill done: count the rounds' calls only
                for v in ts.values():
                    v.clear()
                c0 = time.thread_time_ns()
        cpu += time.thread_time_ns() - c0
        for c, v in ts.items():
            calls[c] += sum(w for w, _ in v)
            calls[f"{c} cpu"] += sum(u for _, u in v)
        gs.append(g)
    rounds = sum(len(g.acceptance_lengths) for g in gs)
    tokens = sum(len(g.tokens) - 1 for g in gs)
    decode_s = sum(g.decode_s for g in gs)
    ms = {k: v / rounds / 1e6 for k, v in calls.items()}
    out = {f"{c}_ms": ms[c] for c in CALLS}
    out["host_ms"] = sum(g.host_s for g in gs) / rounds * 1e3
    out["round_ms"] = decode_s / rounds * 1e3
    out["tau"] = tokens / rounds
    out["verify_len"] = statistics.mean(s for g in gs for s in g.verify_lengths)
    out["tok_s"] = tokens / decode_s
    for c in CALLS:  # the part-by-part split: graph run, and the Python binding around it
        for k in ("", " cpu"):
            out[f"parts{k}"] = out.get(f"parts{k}", {}) | {f"run {c}": ms[f"run:{c}{k}"],
                                                          f"python {c}": ms[f"{c}{k}"] - ms[f"run:{c}{k}"]}
    out["parts"]["loop host"] = out["host_ms"]
    out["parts cpu"]["loop host"] = cpu / rounds / 1e6 - sum(ms[f"{c} cpu"] for c in CALLS)
    return out


def kernels(d: Path, threads: int, prompts: list[list[int]], n: int, policy: VerifyPolicy | None,
            spin: bool | None = None) -> dict:
    """Median per call of each graph (prefill calls are a few of many): ORT's model_run ms, its
    kernels' ms, the difference (ORT's own per-call overhead, profiler included); op ms means."""
    be, verify = load(d, threads, profile=True, policy=policy, spin=spin)
    for p in prompts:
        generate(be, p, n, draft=True, verify=verify)
    out = {}
    for g, sess in be.sessions.items():
        path = Path(sess.end_profiling())
        ev = json.loads(path.read_text())
        path.unlink()
        runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "Session" and e["name"] == "model_run")
        kern, ops = [0.0] * len(runs), collections.Counter()
        starts = [r[0] for r in runs]
        for e in ev:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                kern[bisect.bisect_right(starts, e["ts"]) - 1] += e["dur"]
                ops[e["args"]["op_name"]] += e["dur"]
        run_ms = [(b - a) / 1e3 for a, b in runs]
        out[g] = {"calls": len(runs), "model_run_ms": statistics.median(run_ms),
                  "kernel_ms": statistics.median(k / 1e3 for k in kern),
                  "overhead_ms": statistics.median(r - k / 1e3 for r, k in zip(run_ms, kern)),
                  "top_ops_ms": {k: v / len(runs) / 1e3 for k, v in ops.most_common(4)}}
    be.close()
    return out


def binding_us(be: OrtBackend, reps: int = 500) -> dict:
    """Median us of each call's Python side (binding its buffers), the graph run replaced by nothing."""
    import numpy as np

    class NoRun:
        def run_with_iobinding(self, io):
            pass

    def med(fn) -> float:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6

    be.reset()
    be.target(np.arange(5, 37, dtype=np.int64))
    be.commit(32)
    be.draft_context(32)
    real, be.sessions = be.sessions, {g: NoRun() for g in be.sessions}
    try:
        one, six = np.array([5], np.int64), np.arange(5, 11, dtype=np.int64)

        def ctx4():
            be.draft_context(4)
            be.context_len = 32

        return {"target(1)": med(lambda: be.target(one)), "target(6)": med(lambda: be.target(six)),
                "draft_block": med(lambda: be.draft_block(5)), "draft_context(4)": med(ctx4)}
    finally:
        be.sessions = real


def interference(be: OrtBackend, reps: int = 200) -> dict:
    """Median ms (this thread's CPU time) of each call timed alone (repeated: its weights stay in
    cache) vs right after the call that precedes it in a round: what alternating graphs costs.
    A round runs draft_block, the verify of K, then draft_context of the kept positions."""
    import numpy as np

    be.reset()
    be.target(np.arange(5, 133, dtype=np.int64))
    be.commit(128)
    be.draft_context(128)
    k = be.manifest.block_size
    one, block_k = np.array([5], np.int64), np.arange(5, 5 + k, dtype=np.int64)

    def med(first, timed) -> float:
        ts = []
        for _ in range(reps):
            first()
            t = time.thread_time_ns()
            timed()
            ts.append(time.thread_time_ns() - t)
        return statistics.median(ts) / 1e6

    def context():  # 3 positions of the last call, then rolled back (the cache does not grow)
        be.draft_context(3)
        be.context_len -= 3

    step, verify, block = (lambda: be.target(one)), (lambda: be.target(block_k)), (lambda: be.draft_block(5))
    return {"step alone": med(step, step), "step after draft_block": med(block, step),
            f"verify{k} alone": med(verify, verify), f"verify{k} after draft_block": med(block, verify),
            "draft_block alone": med(block, block),
            f"draft_block after verify{k} + draft_context": med(lambda: (verify(), context()), block),
            "draft_context alone": med(lambda: None, context), f"draft_context after verify{k}": med(verify, context)}


def head_ms(bes: dict, lengths: list[int], reps: int = 300) -> dict:
    """{dir: {verify length: median ms of draft_block scoring length - 1 drafts}}, interleaved."""
    import numpy as np

    for be, _ in bes.values():
        be.reset()
        be.target(np.arange(5, 69, dtype=np.int64))
        be.commit(64)
        be.draft_context(64)
    ts = {d: {s: [] for s in lengths} for d in bes}
    for _ in range(reps):
        for d, (be, _) in bes.items():
            for s in lengths:
                t = time.perf_counter()
                be.draft_block(5, s - 1)
                ts[d][s].append(time.perf_counter() - t)
    return {d: {s: statistics.median(v) * 1e3 for s, v in by.items()} for d, by in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--verify", default=None, help="THETA,MIN_LEN for every directory instead of its runtime.json")
    ap.add_argument("--spin", action=argparse.BooleanOptionalAction, default=None,
                    help="ORT's idle workers spin (default: runtime.json's, else off)")
    ap.add_argument("--head-lengths", default=None, help="verify lengths L,... to time draft_block at (see above)")
    ap.add_argument("--parts-only", action="store_true", help="the rounds' parts alone (no binding, interference, profiler passes)")
    a = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "demo" / "pair" / "target" / "tokenizer.json"))
    lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()[: a.prompts]
    prompts = [tok.encode(json.loads(ln)["prompt"]).ids for ln in lines]
    load0 = os.getloadavg()
    policy = VerifyPolicy(float(a.verify.split(",")[0]), int(a.verify.split(",")[1])) if a.verify else None
    bes = {d: load(d, a.threads, policy=policy, spin=a.spin) for d in a.dirs}
    for be, verify in bes.values():  # warm-up
        generate(be, prompts[0], a.max_new_tokens, draft=True, verify=verify)
    best: dict = {}
    for _ in range(a.passes):  # interleaved; keep each directory's fastest pass (least disturbed)
        for d, (be, verify) in bes.items():
            r = decode(be, verify, prompts, a.max_new_tokens)
            if d not in best or r["round_ms"] < best[d]["round_ms"]:
                best[d] = r
    heads = head_ms(bes, [int(x) for x in a.head_lengths.split(",")]) if a.head_lengths else {}
    extras = not a.parts_only
    bind = {d: binding_us(be) for d, (be, _) in bes.items()} if extras else {}
    inter = {d: interference(be) for d, (be, _) in bes.items()} if extras else {}
    prof = {d: kernels(d, a.threads, prompts, a.max_new_tokens, policy, a.spin) for d in a.dirs} if extras else {}
    print(f"{a.threads} thread(s), spin {a.spin}, {a.prompts} prompts x {a.max_new_tokens} tokens, fastest of {a.passes} passes; "
          f"load {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    for d, r in best.items():
        print(f"{d}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if not isinstance(v, dict)))
        for k in ("parts", "parts cpu"):
            print(f"  round, {'wall' if k == 'parts' else 'CPU'} ms: " + ", ".join(f"{p} {v:.3f}" for p, v in r[k].items())
                  + f"; sum {sum(r[k].values()):.3f}")
        if d in heads:
            print("  draft_block ms by the round's longest verify: " + ", ".join(f"{s} {v:.3f}" for s, v in heads[d].items()))
        if not extras:
            continue
        print("  Python side per call, us: " + ", ".join(f"{k} {v:.0f}" for k, v in bind[d].items()))
        print("  call CPU ms alone vs after the call before it in a round: " + ", ".join(f"{k} {v:.2f}" for k, v in inter[d].items()))
        for g, p in prof[d].items():
            print(f"  {g}: {p['calls']} calls, median model_run {p['model_run_ms']:.3f} ms, kernels {p['kernel_ms']:.3f}, "
                  f"ORT overhead {p['overhead_ms']:.3f}; mean ms by op: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in p["top_ops_ms"].items()))


if __name__ == "__main__":
    main()
