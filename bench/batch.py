"""Batched decoding on CPU: aggregate tokens/s of a batch of rows vs batch 1, in one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch.py --work /tmp/batch --part 06b
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch.py --work /tmp/batch --part demo
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch.py --work /tmp/batch --part batch1 --old /path/to/old/checkout
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch.py --work /tmp/batch --part calls --old /path/to/old/checkout --threads 1

Parts (each prints one JSON object per measurement):
- 06b: the Qwen3-0.6B shape (random weights; bench/real_sizes.py's checkpoint), exported once
  at --max-context 1280 with each attention flavour (fp32) and int4 (the standard export
  quantized, accuracy level 4; --exports picks): rounds of the batched loop at --batch rows vs 1 row, every
  row holding 300 or 1000 positions (zeros: the cost does not depend on them): plain steps, and
  speculative rounds with the verify length fixed at 6 (random weights accept nothing, so
  this is the cost of a batched round) at 300. Per-call medians show which call dominates.
  Prefill is left out: a joining row prefills alone at every batch size.
- demo: the shipped demo pair (exported with --attention) through the loop, speculative and plain, --batch rows vs 1
  (its held-out prompts, repeated to 2 x batch requests), then batch 1 through the batch
  backend (one row at a time) vs the one-row backend.
- batch1: batch 1 through this version vs the version in --old (a checkout of it; each
  exports the demo pair with its own exporter), alternating child processes.
- calls: target graph calls of this version's export vs --old's (a 4-layer checkpoint of the
  0.6B layer shape, small vocabulary), 1 or --batch rows, 300 / 1000 past, 1 or 6 new tokens.
Every ratio is measured within one process, runs interleaved (N, 1, N, 1, ...); the load
(`uptime`) is printed first, as the numbers depend on it. The demo part reports best of
--repeats: "decode" rates count the rounds only (tokens after each request's first over the
rounds' wall time), "aggregate" ones the whole run with prefills; aggregate and per-request
tokens/s, tau, mean occupancy, and the mean draft / verify ms per round at each batch size.
"""

from __future__ import annotations

import argparse
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
    from dflash_export.cmd_batch import batch_report, run_batch

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
    t0 = clock()
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
    return 1e3 * (t3 - t0)


def part_06b(work: Path, threads: int, repeats: int, batch: int, exports: list[str]) -> None:
    """Qwen3-0.6B shape: rounds of the batched loop at `batch` rows vs 1 row, interleaved, fastest
    of `repeats` x 4 rounds (on a shared machine the fastest is the round nothing else preempted);
    every row holds 300 or 1000 positions (`fill`). Exports (once, reused): standard attention
    in fp32, int4 of it, ort attention in fp32. The ratio is the aggregate decode rate: batch x (1-row round) / (batch round)."""
    import gc
    import statistics


    from real_sizes import make_checkpoint

    from dflash_export.export.artifact import export_artifact
    from dflash_export.export.quantize import QuantOptions, quantize_artifact
    from dflash_export.runtime import ort_rows
    from dflash_export.runtime.ort import OrtBackend

    if not (work / "target" / "config.json").is_file():
        make_checkpoint(work)
    scatter = []
    real = ort_rows.scatter

    def timed_scatter(*a, **k):  # batching's own host work in a call: the new positions written per row
        t = time.perf_counter()
        real(*a, **k)
        scatter.append(time.perf_counter() - t)

    ort_rows.scatter = timed_scatter
    for name in exports:
        out = work / f"out-{name}"
        if not (out / "manifest.json").is_file():
            if name == "int4":
                quantize_artifact(work / "out-standard", out, QuantOptions(scheme="int4", draft=True, lm_head=True,
                                                                           accuracy_level=4), force=True, progress=False)
            else:
                export_artifact(work / "target", work / "draft", out, max_context=1280, attention=name, force=True,
                                progress=False)
        backends = {batch: OrtBackend(out, threads=threads, max_batch=batch), 1: OrtBackend(out, threads=threads)}
        for b, be in backends.items():
            fill(be, b, 1000)
        for ctx, verify in ((300, 1), (1000, 1), (300, 6)):
            ms = {b: [] for b in backends}
            split = {b: {} for b in backends}
            scatter.clear()
            for b, be in backends.items():  # warm-up
                round_ms(be, b, ctx, verify, {})
            for _ in range(repeats * 4):
                for b, be in backends.items():
                    ms[b].append(round_ms(be, b, ctx, verify, split[b]))
            med = {b: min(v) for b, v in ms.items()}
            calls = {f"batch_{b}": {k: round(min(v), 2) for k, v in split[b].items() if verify > 1 or k == "target"}
                     for b in backends}
            print(json.dumps({"model": "qwen3-0.6b-shape", "export": name, "threads": threads, "context": ctx,
                              "mode": "plain" if verify == 1 else f"speculative, verify {verify}",
                              "round_ms": {f"batch_{b}": round(v, 2) for b, v in med.items()}, "calls_ms": calls,
                              "round_ms_median": {f"batch_{b}": round(statistics.median(v), 2) for b, v in ms.items()},
                              "scatter_ms_per_call": round(1e3 * min(scatter), 3) if scatter else 0,
                              "aggregate_ratio": round(batch * med[1] / med[batch], 3)}), flush=True)
        for be in backends.values():
            be.close()
        del backends, be
        gc.collect()


def part_demo(work: Path, threads: int, repeats: int, batch: int, attention: str = "standard") -> None:
    from dflash_export.cmd_batch import batch_report, run_batch
    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.ort import OrtBackend
    from dflash_export.serve.text import load_tokenizer

    out = work / ("demo-out" if attention == "standard" else f"demo-out-{attention}")
    if not (out / "manifest.json").is_file():
        export_artifact(ROOT / "demo/pair/target", ROOT / "demo/pair/draft", out, attention=attention, force=True,
                        progress=False)
    tok = load_tokenizer(out)
    ps = [tok.encode(json.loads(x)["prompt"]).ids for x in (ROOT / "demo/prompts.jsonl").read_text().splitlines()
          if x.strip()][: 2 * batch]
    backends = {batch: OrtBackend(out, threads=threads, max_batch=batch), 1: OrtBackend(out, threads=threads)}
    for draft in (True, False):
        r = compare(backends, ps, 64, draft, None, repeats)
        print(json.dumps({"model": "demo pair", "attention": attention, "mode": "speculative" if draft else "plain",
                          "requests": len(ps), **r}),
              flush=True)
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


CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
from dflash_export.export.artifact import export_artifact
from dflash_export.runtime.ort import OrtBackend
from dflash_export.runtime.loop import generate
from dflash_export.serve.text import load_tokenizer
from pathlib import Path
out = Path({out!r})
if not (out / "manifest.json").is_file():
    export_artifact(Path({pair!r}) / "target", Path({pair!r}) / "draft", out, force=True, progress=False)
tok = load_tokenizer(out)
ps = [tok.encode(json.loads(x)["prompt"]).ids for x in Path({prompts!r}).read_text().splitlines() if x.strip()]
be = OrtBackend(out, threads={threads})
generate(be, ps[0], 16)
toks, secs = 0, 0.0
for p in ps:
    g = generate(be, p, 64)
    toks += len(g.tokens) - 1
    secs += g.decode_s
print(json.dumps({{"tokens_per_second": toks / secs}}))
"""


def old_package(old: Path, work: Path) -> Path:
    """A `dflash_export` package folder over the checkout `old` (its pyproject's package-dir map), for PYTHONPATH."""
    pkg = work / "old-pkg" / "dflash_export"
    if not pkg.is_dir():
        pkg.mkdir(parents=True)
        for f in (old / "dflash_export").iterdir():
            (pkg / f.name).symlink_to(f)
        for sub in ("models", "export", "runtime", "serve", "train", "demo"):
            if (old / sub).is_dir() and not (pkg / sub).exists():
                (pkg / sub).symlink_to(old / sub)
    return pkg.parent


def part_batch1(work: Path, threads: int, repeats: int, old: Path) -> None:
    """Batch 1: this version vs `old`, each a fresh child process per run, alternating."""
    envs = {"new": (dict(os.environ), work / "demo-out-new"),
            "old": (dict(os.environ, PYTHONPATH=str(old_package(old, work))), work / "demo-out-old")}
    rates = {k: [] for k in envs}
    for _ in range(repeats):
        for name, (env, out) in envs.items():
            code = CHILD.format(root=str(ROOT) if name == "new" else str(old_package(old, work)), out=str(out),
                                pair=str(ROOT / "demo/pair"), prompts=str(ROOT / "demo/prompts.jsonl"), threads=threads)
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            rates[name].append(json.loads(res.stdout.strip().splitlines()[-1])["tokens_per_second"])
    best = {k: max(v) for k, v in rates.items()}
    print(json.dumps({"model": "demo pair", "mode": "speculative, batch 1", "runs": rates,
                      "new_over_old": round(best["new"] / best["old"], 3)}), flush=True)


EXPORT = ("from dflash_export.export.artifact import export_artifact; from pathlib import Path; import sys; "
          "w = Path(sys.argv[1]); export_artifact(w / 'target', w / 'draft', w / sys.argv[2], max_context=1280, "
          "force=True, progress=False)")


def part_calls(work: Path, threads: int, repeats: int, old: Path, batch: int) -> None:
    """Target graph calls, this version's export vs --old's, alternating in one process: a 4-layer
    checkpoint of the Qwen3-0.6B layer shape (hidden 1024, 16 heads, 8 KV heads of 128; vocabulary
    2000, so the layers dominate), 1 or `batch` rows at 300 / 1000 past positions, 1 or 6 new tokens."""
    import numpy as np
    import onnxruntime as ort
    from common import make_checkpoint

    w = work / "calls"
    if not (w / "target" / "config.json").is_file():
        make_checkpoint(w, 2000, 1024, 4, 3072, heads=16, kv_heads=8)
    for name, env in (("new", {}), ("old", {"PYTHONPATH": str(old_package(old, work))})):
        if not (w / name / "manifest.json").is_file():
            subprocess.run([sys.executable, "-c", EXPORT, str(w), name], env={**os.environ, **env}, check=True, cwd="/")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions = {k: ort.InferenceSession(str(w / k / "target.onnx"), opts, providers=["CPUExecutionProvider"])
                for k in ("old", "new")}

    def feeds(s, rows: int, past: int, n: int) -> dict:
        f = {"input_ids": np.ones((rows, n), np.int64), "position_ids": past + np.tile(np.arange(n), (rows, 1)),
             "past_lengths": np.full(rows, past, np.int64), "logits_index": np.tile(np.arange(n), (rows, 1))}
        return {i.name: f[i.name] if i.name in f else np.full((past, rows, *i.shape[2:]), 0.01, np.float32)
                for i in s.get_inputs()}

    for past in (300, 1000):
        for rows, n in ((1, 1), (batch, 1), (1, 6), (batch, 6)):
            f = {k: feeds(s, rows, past, n) for k, s in sessions.items()}
            ms = {k: [] for k in sessions}
            for _ in range(3 * repeats):
                for k, s in sessions.items():
                    t = time.perf_counter()
                    s.run(None, f[k])
                    ms[k].append(1e3 * (time.perf_counter() - t))
            best = {k: round(min(v), 2) for k, v in ms.items()}
            print(json.dumps({"part": "calls", "past": past, "rows": rows, "new_tokens": n, "ms": best,
                              "new_over_old": round(best["new"] / best["old"], 3)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--part", choices=["06b", "demo", "batch1", "calls"], required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--exports", default="standard,int4,ort",
                    help="part 06b: which exports, comma-separated (standard, int4, or an attention flavour)")
    ap.add_argument("--attention", default="standard", help="part demo: the export's attention flavour")
    ap.add_argument("--old", type=Path, help="part batch1: a checkout of the version to compare with")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": a.threads}), flush=True)
    if a.part == "06b":
        part_06b(a.work, a.threads, a.repeats, a.batch, a.exports.split(","))
    elif a.part == "demo":
        part_demo(a.work, a.threads, a.repeats, a.batch, a.attention)
    else:
        if a.old is None:
            raise SystemExit(f"--part {a.part} needs --old CHECKOUT (the version to compare with)")
        if a.part == "calls":
            part_calls(a.work, a.threads, a.repeats, a.old, a.batch)
        else:
            part_batch1(a.work, a.threads, a.repeats, a.old)


if __name__ == "__main__":
    main()
