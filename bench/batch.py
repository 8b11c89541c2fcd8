"""Batched decoding on CPU: aggregate tokens/s of a batch of rows vs batch 1, in one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch.py --work /tmp/batch --part 06b
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch.py --work /tmp/batch --part demo
    .venv/bin/python bench/batch.py --work /tmp/batch1 --part batch1 --old 6ae8fb2   # under 5 minutes

Parts (each prints one JSON object per measurement):
- 06b: the Qwen3-0.6B shape (random weights; bench/real_sizes.py's checkpoint), exported once at
  --max-context 1280 per attention flavour (fp32) and int4 (the standard export quantized, accuracy
  level 4; --exports picks): rounds of the batched loop at --batch rows vs 1 row, every row holding
  300 or 1000 positions (zeros: the cost does not depend on them): plain steps, and speculative
  rounds with the verify length fixed at 6 (random weights accept nothing: the cost of a batched
  round) at 300. Per-call medians show which call dominates; a joining row prefills alone.
- demo: the shipped demo pair (exported with --attention) through the loop, speculative and plain,
  --batch rows vs 1 (its held-out prompts, repeated to 2 x batch requests), then batch 1 through the
  batch backend (one row at a time) vs the one-row backend.
- batch1: batch 1 through this version vs the version in --old (a checkout folder, or a git
  revision extracted into --work; 6ae8fb2 is main just before the batched loop replaced the
  batch-1 loop): each side exports the demo pair with its own exporter and runs `generate` in a
  warm child process (1 thread, OMP_WAIT_POLICY=PASSIVE); many short runs alternate ABBA for
  --seconds, the same prompts in both runs of a pair, tokens checked identical; medians,
  the load before and after, all runs: a JSON report (--report, default WORK/batch1.json).
Every ratio is measured within one process, runs interleaved (N, 1, N, 1, ...); the load
(`uptime`) is printed first, as the numbers depend on it. The demo part reports best of
--repeats: "decode" rates count the rounds only (tokens after each request's first over the
rounds' wall time), "aggregate" ones the whole run with prefills; aggregate and per-request
tokens/s, tau, mean occupancy, and the mean draft / verify ms per round at each batch size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def per_round_ms(gens) -> dict:
    """Mean draft and verify wall time per round, ms (rows of one round share its calls)."""
    rounds = [r for g in gens for r in g.round_s]
    n = max(len(rounds), 1)
    return {"draft": round(1e3 * sum(r[0] for r in rounds) / n, 2), "verify": round(1e3 * sum(r[1] for r in rounds) / n, 2)}


def compare(backends: dict, prompts: list, new_tokens: int, draft: bool, verify, repeats: int) -> dict:
    """Interleaved runs of the same requests at each batch size; the best aggregate rate of each."""
    from dflash_export.runtime.measure import batch_report, run_batch

    best = {}
    for b, be in backends.items():  # warm-up
        run_batch(be, prompts[:b], min(new_tokens, 4), b, draft=draft, verify=verify)
    for _ in range(repeats):
        for b, be in backends.items():
            gens, stats = run_batch(be, prompts, new_tokens, b, draft=draft, verify=verify, stop_token_ids=())
            r = batch_report(gens, stats) | {"per_round_ms": per_round_ms(gens)}
            if b not in best or r["decode_tokens_per_second"] > best[b]["decode_tokens_per_second"]:
                best[b] = r
    top, one = max(backends), 1
    keep = ("aggregate_tokens_per_second", "decode_tokens_per_second", "per_request_tokens_per_second", "tau",
            "mean_occupancy", "per_round_ms")
    out = {f"batch_{b}": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k in keep}
           for b, r in best.items()}
    for key in ("aggregate", "decode"):
        out[f"{key}_ratio"] = round(best[top][f"{key}_tokens_per_second"] / best[one][f"{key}_tokens_per_second"], 3)
    return out


def fill(be, rows: int, ctx: int) -> None:
    """Rows 0..rows-1 of `be` hold `ctx` positions in both caches, all 0.01: a round's cost does
    not depend on the values (dense kernels), and at the 0.6B shape a real prefill of 5 rows x
    1000 tokens would take most of the run on a shared 2-core machine. Every page is written:
    caches left as np.zeros would be read from the kernel's shared zero page (cache-hot, too
    fast) and fault on their first write (too slow)."""
    for a in (*be._flat.values(), *(x for x in (*be.kv, *getattr(be, "ctx", ())) if x is not None)):
        a.fill(0.01)
    be.set_width(rows)
    be.lengths[:rows] = ctx
    be.ctx_lengths[:rows] = ctx


def round_ms(be, rows: int, ctx: int, verify: int, split: dict) -> float:
    """One round of the batched loop over `rows` rows at context `ctx`, as it runs with random
    weights (nothing accepted: each row keeps 1 position): verify 1 = a plain decoding step,
    else draft_block + a `verify`-position target call + draft_context. The lengths are put back
    after it, so every round sees the same context. Wall ms; per-call ms added to `split`."""
    import numpy as np

    clock, r = time.perf_counter, list(range(rows))
    be.lengths[:rows] = ctx
    be.ctx_lengths[:rows] = ctx
    t0, c0 = clock(), time.process_time()
    ids = np.ones((rows, verify), np.int64)
    if verify > 1:
        drafts, _ = be.draft_block_rows(r, np.ones(rows, np.int64))
        ids[:, 1:] = drafts[:, : verify - 1]
    t1 = clock()
    be.target_rows(r, ids, np.full(rows, verify), None)
    be.commit_rows(r, [1] * rows)
    t2 = clock()
    if verify > 1:
        be.draft_context_rows(r, np.ones(rows, np.int64))
    t3 = clock()
    for k, v in (("draft_block", t1 - t0), ("target", t2 - t1), ("draft_context", t3 - t2)):
        split.setdefault(k, []).append(1e3 * v)
    split.setdefault("cpu", []).append(1e3 * (time.process_time() - c0))
    return 1e3 * (t3 - t0)


def mixed_verify(out: Path, threads: int, batch: int, ctx: int, repeats: int) -> list[dict]:
    """A drafted round's verify on an `ort` flavour export, the backend's call against one call
    per row, interleaved, fastest of 4 x `repeats`; target calls only, every row at `ctx`
    positions. Two rounds: half the rows verifying their anchor alone (plain rows) and the rest
    6 positions, and every row 6. The backend's call: all rows in one (exports whose graph takes
    each row's count, Manifest.row_counts), else the one-position rows together and each other
    row alone."""
    import numpy as np

    from dflash_export.runtime.ort.backend import OrtBackend

    be = OrtBackend(out, threads=threads, max_batch=batch, drafter=False)
    if not be.in_place:
        return []
    fill(be, batch, ctx)
    rows, half, reports = list(range(batch)), batch // 2, []
    ids = np.ones((batch, 6), np.int64)
    for counts in (np.array([1] * half + [6] * (batch - half)), np.full(batch, 6)):
        def backend_call():
            be.target_rows(rows, ids, counts, None)

        def each():  # one call per row, each at its own count
            for r in rows:
                c = int(counts[r])
                be._target_call([r], ids[r : r + 1, :c], [c], np.zeros((1, 6), np.int64), False, r * 6)

        ms: dict = {"backend": [], "one_row_per_call": []}
        for i in range(4 * repeats + 1):
            for key, f in (("backend", backend_call), ("one_row_per_call", each)):
                be.lengths[:batch] = ctx
                t = time.perf_counter()
                f()
                if i:
                    ms[key].append(1e3 * (time.perf_counter() - t))
                be.commit_rows(rows, [1] * batch)
        best = {k: round(min(v), 2) for k, v in ms.items()}
        reports.append({"context": ctx, "rows_verify": counts.tolist(), "one_call": not be.verify_per_row,
                        "verify_ms": best, "one_row_per_call_over_backend": round(best["one_row_per_call"] / best["backend"], 3)})
    be.close()
    return reports


def op_split(out: Path, threads: int, batch: int, ctx: int, steps: int) -> dict:
    """ONNX Runtime's profiler over plain target steps at `batch` rows and at 1 row, alternating
    (`steps` each after 2 untimed), every row at `ctx` positions: kernel ms per step by op type,
    the LM head (the node reading lm_head.weight) apart. Profiled steps are slower than plain
    ones (the profiler's per-node cost): read the split, and the wall ms of the rounds above."""
    import collections

    import numpy as np
    import onnxruntime as ort
    from common import head_nodes

    from dflash_export.runtime.ort import backend as ob

    class Profiling(ort.SessionOptions):
        def __init__(self):
            super().__init__()
            self.enable_profiling, self.profile_file_prefix = True, f"/tmp/dflash-batch-ops-{os.getpid()}"

    real, ob.ort.SessionOptions = ob.ort.SessionOptions, Profiling
    try:
        bes = {b: ob.OrtBackend(out, threads=threads, max_batch=b, drafter=False) for b in (batch, 1)}
    finally:
        ob.ort.SessionOptions = real
    heads, split = head_nodes(out), {}
    for b, be in bes.items():
        fill(be, b, ctx)
    for _ in range(steps + 2):
        for b, be in bes.items():
            be.lengths[:b] = ctx
            be.target_rows(list(range(b)), np.ones((b, 1), np.int64), np.ones(b, np.int64), None)
            be.commit_rows(list(range(b)), [1] * b)
    for b, be in bes.items():
        path = Path(be.sessions["target"].end_profiling())
        events = json.loads(path.read_text())
        path.unlink()
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[2:]
        ms: dict = collections.defaultdict(float)
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and any(a <= e["ts"] <= z for a, z in spans):
                op = e["args"]["op_name"]
                ms[f"LM head ({op})" if e["name"].removesuffix("_kernel_time") in heads else op] += e["dur"] / 1e3 / len(spans)
        split[f"batch_{b}"] = {op: round(v, 2) for op, v in sorted(ms.items(), key=lambda kv: -kv[1])[:8]}
        be.close()
    return split


def part_06b(work: Path, threads: int, repeats: int, batch: int, exports: list[str], spin: bool = False,
             contexts: tuple[int, ...] = (300, 1000), modes: tuple[str, ...] = ("plain", "speculative"),
             cores: list[int] | None = None, profile: int = 0) -> None:
    """Qwen3-0.6B shape: rounds of the batched loop at `batch` rows vs 1 row, interleaved, fastest
    of `repeats` x 4 rounds (on a shared machine the fastest is the round nothing else preempted);
    every row holds 300 or 1000 positions (`fill`). Exports (once, reused): standard attention
    in fp32, int4 of it, ort attention in fp32 and int4 of it (int4-ort). The ratio is the aggregate decode rate: batch x (1-row round) / (batch round)."""
    import gc
    import statistics


    from common import uptime
    from real_sizes import make_checkpoint

    from dflash_export.export.artifact import export_artifact
    from dflash_export.export.quantize import QuantOptions, quantize_artifact
    from dflash_export.runtime.ort import backend as ort_backend  # the module whose calls use scatter
    from dflash_export.runtime.ort.backend import OrtBackend

    if not (work / "target" / "config.json").is_file():
        t0 = time.perf_counter()
        make_checkpoint(work)
        print(json.dumps({"made": "checkpoint", "seconds": round(time.perf_counter() - t0)}), flush=True)
    scatter = []
    real = ort_backend.scatter

    def timed_scatter(*a, **k):  # batching's own host work in a call: the new positions written per row
        t = time.perf_counter()
        real(*a, **k)
        scatter.append(time.perf_counter() - t)

    ort_backend.scatter = timed_scatter
    def made(name: str) -> Path:  # int4: the standard export quantized; int4-ort: the ort one
        out = work / f"out-{name}"
        if not (out / "manifest.json").is_file():
            base = made("standard" if name == "int4" else name.removeprefix("int4-")) if name.startswith("int4") else None
            t0 = time.perf_counter()
            if base is not None:
                quantize_artifact(base, out, QuantOptions(scheme="int4", draft=True, lm_head=True, accuracy_level=4),
                                  force=True, progress=False)
            else:
                export_artifact(work / "target", work / "draft", out, max_context=1280, attention=name, force=True,
                                progress=False)
            print(json.dumps({"made": name, "seconds": round(time.perf_counter() - t0)}), flush=True)
        return out

    outs = {name: made(name) for name in exports}  # exported first (all cores), measured after pinning
    if cores:
        os.sched_setaffinity(0, cores)
    print(json.dumps({"measuring_on_cpus": sorted(os.sched_getaffinity(0)), "uptime": uptime()}), flush=True)
    cases = [(c, 1) for c in contexts if "plain" in modes] + [(c, 6) for c in contexts[:1] if {"speculative", "mixed"} & set(modes)]
    for name, out in outs.items():
        backends = {batch: OrtBackend(out, threads=threads, max_batch=batch, spin=spin),
                    1: OrtBackend(out, threads=threads, spin=spin)}
        for b, be in backends.items():
            fill(be, b, 1000)
        for ctx, verify in cases:
            ms = {b: [] for b in backends}
            split = {b: {} for b in backends}
            scatter.clear()
            for b, be in backends.items():  # warm-up
                round_ms(be, b, ctx, verify, {})
            for _ in range(repeats * 4):
                for b, be in backends.items():
                    ms[b].append(round_ms(be, b, ctx, verify, split[b]))
            med = {b: min(v) for b, v in ms.items()}
            calls = {f"batch_{b}": {k: round(min(v), 2) for k, v in split[b].items() if k != "cpu" and (verify > 1 or k == "target")}
                     for b in backends}
            cpu = {b: min(split[b]["cpu"]) for b in backends}
            print(json.dumps({"model": "qwen3-0.6b-shape", "export": name, "threads": threads, "spin": spin, "context": ctx,
                              "mode": "plain" if verify == 1 else f"speculative, verify {verify}",
                              "round_ms": {f"batch_{b}": round(v, 2) for b, v in med.items()}, "calls_ms": calls,
                              "round_ms_median": {f"batch_{b}": round(statistics.median(v), 2) for b, v in ms.items()},
                              "scatter_ms_per_call": round(1e3 * min(scatter), 3) if scatter else 0,
                              "aggregate_ratio": round(batch * med[1] / med[batch], 3),
                              "cpu_ms": {f"batch_{b}": round(v, 2) for b, v in cpu.items()},
                              "aggregate_ratio_cpu_time": round(batch * cpu[1] / cpu[batch], 3), "uptime": uptime()}), flush=True)
            if verify > 1 and "mixed" in modes:
                for r in mixed_verify(out, threads, batch, ctx, repeats):
                    print(json.dumps({"export": name, "mode": "mixed verify", **r, "uptime": uptime()}), flush=True)
            if profile and verify == 1:
                print(json.dumps({"export": name, "context": ctx, "mode": "plain", "kernel_ms_per_step_by_op":
                                  op_split(out, threads, batch, ctx, profile)}), flush=True)
        for be in backends.values():
            be.close()
        del backends, be
        gc.collect()


def part_demo(work: Path, threads: int, repeats: int, batch: int, attention: str = "standard") -> None:
    from dflash_export.runtime.measure import batch_report, run_batch
    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.serve.text import load_tokenizer

    out = work / ("demo-out" if attention == "standard" else f"demo-out-{attention}")
    if not (out / "manifest.json").is_file():
        export_artifact(ROOT / "demo/pair/target", ROOT / "demo/pair/draft", out, attention=attention, force=True, progress=False)
    tok = load_tokenizer(out)
    ps = [tok.encode(json.loads(x)["prompt"]).ids for x in (ROOT / "demo/prompts.jsonl").read_text().splitlines()
          if x.strip()][: 2 * batch]
    backends = {batch: OrtBackend(out, threads=threads, max_batch=batch), 1: OrtBackend(out, threads=threads)}
    for draft in (True, False):
        r = compare(backends, ps, 64, draft, None, repeats)
        print(json.dumps({"model": "demo pair", "attention": attention, "mode": "speculative" if draft else "plain",
                          "requests": len(ps), **r}), flush=True)
    # batch 1 through the batched code: one row at a time on the batch-N backend (its position-major
    # caches at width 1) against the one-row backend, interleaved
    rates = {"batch_backend": [], "one_row_backend": []}
    for _ in range(2 * repeats):
        for key, be in (("batch_backend", backends[batch]), ("one_row_backend", backends[1])):
            gens, stats = run_batch(be, ps, 64, 1, stop_token_ids=())
            rates[key].append(batch_report(gens, stats)["decode_tokens_per_second"])
    print(json.dumps({"model": "demo pair", "mode": "speculative, batch 1", "decode_tokens_per_second": rates,
                      "batch_backend_over_one_row": round(max(rates["batch_backend"]) / max(rates["one_row_backend"]), 3)}),
          flush=True)


WORKER = """
import hashlib, json, os, sys, time
sys.path.insert(0, {pkg!r})
import dflash_export.runtime.loop as loop_module
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.loop import generate
from dflash_export.serve.text import load_tokenizer
from pathlib import Path
out, pair = Path({out!r}), Path({pair!r})
if not (out / "manifest.json").is_file():
    from dflash_export.export.artifact import export_artifact
    export_artifact(pair / "target", pair / "draft", out, force=True, progress=False)
tok = load_tokenizer(out)
ps = [tok.encode(json.loads(x)["prompt"]).ids for x in Path({prompts!r}).read_text().splitlines() if x.strip()]
be = OrtBackend(out, threads=1)
for p in ps[:2]:
    generate(be, p, 16, stop_token_ids=())
print(json.dumps({{"ready": os.path.realpath(loop_module.__file__)}}), flush=True)
for line in sys.stdin:
    first, count, new = map(int, line.split())
    generate(be, ps[first % len(ps)], 4, stop_token_ids=())  # untimed: this process's caches warm again after the other's run
    toks, decode, digest = 0, 0.0, hashlib.sha256()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(first, first + count):
        g = generate(be, ps[i % len(ps)], new, stop_token_ids=())
        toks += len(g.tokens)
        decode += g.decode_s
        digest.update(json.dumps(g.tokens).encode())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({{"decode_tps": (toks - count) / decode, "e2e_tps": toks / wall, "cpu_tps": toks / cpu,
                      "tokens": digest.hexdigest()[:16]}}), flush=True)
"""


def checkout(old: str, work: Path) -> Path:
    """`old` as a folder: itself if it is one, else a git revision of this repository extracted into `work`."""
    if Path(old).is_dir():
        return Path(old).resolve()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{old}^{{commit}}"], capture_output=True,
                         text=True)
    if rev.returncode != 0:
        raise SystemExit(f"--old {old}: neither a folder nor a git revision of {ROOT}")
    sha = rev.stdout.strip()
    dest = work / f"old-{sha[:12]}"
    if not (dest / "runtime" / "loop.py").is_file():
        tmp = work / f".old-{sha[:12]}.{os.getpid()}"
        tmp.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        tmp.rename(dest)
    return dest


def old_package(old: Path, work: Path) -> Path:
    """A folder whose `dflash_export` is the checkout `old`'s package, for sys.path: the checkout itself
    where the package is its top level (its dflash_export/ points there), else one mapped by symlinks."""
    import hashlib

    if (old / "__init__.py").is_file():
        return old
    pkg = work / f"pkg-{hashlib.sha256(str(old).encode()).hexdigest()[:8]}" / "dflash_export"
    if not pkg.is_dir():
        pkg.mkdir(parents=True)
        for f in (old / "dflash_export").iterdir():
            (pkg / f.name).symlink_to(f)
        for sub in ("models", "export", "runtime", "serve", "train", "demo"):
            if (old / sub).is_dir() and not (pkg / sub).exists():
                (pkg / sub).symlink_to(old / sub)
    return pkg.parent


def export_key(root: Path) -> str:
    """What a checkout's export of the demo pair depends on: its exporter, models and contract."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted((root / "export").glob("*.py")) + sorted((root / "models").glob("*.py")) + [root / "runtime/contract.py"]:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


class Worker:
    """A child process that loads one checkout's ONNX Runtime backend once (1 thread) and runs
    `generate` over a slice of the demo prompts per request on its stdin; idle (blocked on
    stdin) while the other side runs, so the two never compete for a core."""

    def __init__(self, name: str, root: Path, pkg: Path, work: Path):
        out = work / f"demo-out-{name}-{export_key(root)}"
        code = WORKER.format(pkg=str(pkg), out=str(out), pair=str(ROOT / "demo/pair"),
                             prompts=str(ROOT / "demo/prompts.jsonl"))
        env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(pkg))
        self.name, self.root = name, root
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker exited ({self.proc.wait()})")
        return json.loads(line)

    def ready(self) -> str:
        loaded = self.read()["ready"]
        if not Path(loaded).is_relative_to(self.root.resolve()):  # PYTHONPATH lost to the installed package
            raise SystemExit(f"the {self.name} worker loaded {loaded}, not {self.root}")
        return loaded

    def run(self, first: int, count: int, new: int) -> dict:
        self.proc.stdin.write(f"{first} {count} {new}\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def part_batch1(work: Path, old: str, seconds: float, prompts_per_run: int, new_tokens: int, report: Path) -> None:
    """Batch 1: this checkout's `generate` vs the checkout `old`'s, each in a warm child process
    (1 thread, OMP_WAIT_POLICY=PASSIVE), many short runs alternating new/old, old/new (ABBA:
    a drift in the load hits both sides alike) for `seconds`; the same prompts in both runs of a
    pair; each run starts with an untimed 4-token generate (the caches warm again after the other
    side's run). Rates: decode (the rounds' wall time), end to end (prefill included, wall) and per CPU
    second of the worker (prefill included: what a busy machine disturbs least). Ratios: median
    over the pairs of new/old in each order (new first, old first) and their geometric mean
    (`new_over_old`, the figure to read), the median over all pairs, the ratio of the medians,
    and of the best runs."""
    import statistics

    from common import machine, uptime, write_report

    old_root = checkout(old, work)
    workers = {"new": Worker("new", ROOT, old_package(ROOT, work), work), "old": Worker("old", old_root, old_package(old_root, work), work)}
    loaded = {k: w.ready() for k, w in workers.items()}
    report_ = {"bench": "batch 1 through the batched loop vs the batch-1 loop", "model": "demo pair",
               "mode": "speculative, greedy, full-block verify", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": machine(), "load_before": uptime(), "old": str(old_root), "loaded": loaded, "threads": 1,
               "prompts_per_run": prompts_per_run, "new_tokens": new_tokens, "runs": []}
    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end or i < 4:
        order = ("new", "old") if i % 2 == 0 else ("old", "new")
        pair = {k: workers[k].run(i * prompts_per_run, prompts_per_run, new_tokens) for k in order}
        if pair["new"]["tokens"] != pair["old"]["tokens"]:
            raise SystemExit(f"run {i}: new and old decoded different tokens (greedy must be identical)")
        report_["runs"].append({k: {m: round(v, 2) for m, v in pair[k].items() if m != "tokens"} for k in ("new", "old")})
        i += 1
    for w in workers.values():
        w.stop()

    def ratios(runs: list) -> dict:
        out = {"pairs": len(runs)}
        for m in ("decode_tps", "e2e_tps", "cpu_tps"):
            per = sorted(r["new"][m] / r["old"][m] for r in runs)
            q = statistics.quantiles(per, n=4)
            # the side that runs second in a pair may be slower: the median of each order, their geometric mean
            order = [statistics.median(r["new"][m] / r["old"][m] for r in runs[j::2]) for j in (0, 1)]
            med = {k: statistics.median(r[k][m] for r in runs) for k in ("new", "old")}
            best = {k: max(r[k][m] for r in runs) for k in ("new", "old")}
            out[m] = {"new_over_old": round((order[0] * order[1]) ** 0.5, 3),
                      "new_first_then_old_first": [round(x, 3) for x in order],
                      "new_over_old_median_of_pairs": round(statistics.median(per), 3),
                      "interquartile": [round(q[0], 3), round(q[2], 3)],
                      "median_new": round(med["new"], 1), "median_old": round(med["old"], 1),
                      "new_over_old_of_medians": round(med["new"] / med["old"], 3),
                      "new_over_old_of_best": round(best["new"] / best["old"], 3)}
        return out

    write_report(report_, report, ratios)


def main() -> None:
    from common import machine, parser

    ap = parser(__doc__, json_flag=False)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--part", choices=["06b", "demo", "batch1"], required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spin", action="store_true", help="part 06b: ONNX Runtime's threads spin within a call")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--exports", default="standard,int4,ort", help="part 06b: the exports (flavours, int4), comma-separated")
    ap.add_argument("--contexts", default="300,1000", help="part 06b: positions every row holds (speculative: the first)")
    ap.add_argument("--modes", default="plain,speculative",
                    help="part 06b: plain steps, speculative rounds (verify 6), mixed (ort flavour: its verify call against one per row)")
    ap.add_argument("--cores", help="part 06b: measure pinned to these CPUs (e.g. 0,1), after the exports are made")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="part 06b: also ONNX Runtime's per-op kernel ms of STEPS plain steps at batch N and 1 per context")
    ap.add_argument("--attention", default="standard", help="part demo: the export's attention flavour")
    ap.add_argument("--old", help="part batch1: the version to compare with: a checkout folder or a git revision")
    ap.add_argument("--seconds", type=float, default=120, help="part batch1: how long to alternate runs")
    ap.add_argument("--report", type=Path, help="part batch1: the JSON report [default: WORK/batch1.json]")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"machine": machine(), "threads": 1 if a.part == "batch1" else a.threads}), flush=True)
    if a.part == "06b":
        part_06b(a.work, a.threads, a.repeats, a.batch, a.exports.split(","), a.spin,
                 tuple(int(c) for c in a.contexts.split(",")), tuple(a.modes.split(",")),
                 [int(c) for c in a.cores.split(",")] if a.cores else None, a.profile)
    elif a.part == "demo":
        part_demo(a.work, a.threads, a.repeats, a.batch, a.attention)
    else:
        if a.old is None:
            raise SystemExit("--part batch1 needs --old CHECKOUT|REVISION (the version to compare with)")
        part_batch1(a.work, a.old, a.seconds, 2, 48, a.report or a.work / "batch1.json")


if __name__ == "__main__":
    main()
