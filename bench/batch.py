"""Batched decoding on CPU: aggregate tokens/s of a batch of rows vs batch 1, in one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch.py --work /tmp/batch --part 06b
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch.py --work /tmp/batch --part demo
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch.py --work /tmp/batch --part batch1 --old /path/to/old/checkout

Parts (each prints one JSON object per measurement):
- 06b: the Qwen3-0.6B shape (random weights, fp32; bench/real_sizes.py's checkpoint),
  exported in both attention flavours at --max-context 1280: plain decoding at ~300 and
  ~1000 context tokens, and speculative decoding with the verify length fixed at 6 (random
  weights accept nothing, so this is the cost of a batched round), batch 4 vs batch 1.
- demo: the shipped demo pair, speculative and plain, batch 4 vs batch 1 (its held-out prompts).
- batch1: batch 1 through this version vs the version in --old (a checkout of it; each
  exports the demo pair with its own exporter), alternating child processes.
Every ratio is measured within one process, runs interleaved (N, 1, N, 1, ...), best of
--repeats; "decode" rates count the rounds only (the goals' measure: tokens after each
request's first over the rounds' wall time), "aggregate" ones the whole run with prefills; the load (`uptime`) is printed first, as the numbers depend on it. Per
measurement: aggregate and per-request tokens/s, tau, mean occupancy, and the mean
draft / verify milliseconds per round at each batch size (which call dominates).
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


def part_06b(work: Path, threads: int, repeats: int, batch: int) -> None:
    import numpy as np

    from real_sizes import make_checkpoint

    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.ort import OrtBackend
    from dflash_export.runtime.settings import VerifyPolicy

    if not (work / "target" / "config.json").is_file():
        make_checkpoint(work)
    for flavour in ("standard", "ort"):
        out = work / f"out-{flavour}"
        if not (out / "manifest.json").is_file():
            export_artifact(work / "target", work / "draft", out, max_context=1280, attention=flavour, force=True,
                            progress=False)
        backends = {batch: OrtBackend(out, threads=threads, max_batch=batch), 1: OrtBackend(out, threads=threads)}
        rng = np.random.default_rng(0)
        vocab = backends[1].manifest.vocab_size
        for ctx, new in ((300, 12), (1000, 12)):
            ps = [rng.integers(0, vocab - 2, ctx).tolist() for _ in range(batch)]
            r = compare(backends, ps, new, False, None, repeats)
            print(json.dumps({"model": "qwen3-0.6b-shape", "attention": flavour, "mode": "plain", "context": ctx, **r}),
                  flush=True)
        fixed6 = VerifyPolicy(theta=2.0, min_len=6)  # no cumulative probability reaches 2: always 6 positions
        ps = [rng.integers(0, vocab - 2, 300).tolist() for _ in range(batch)]
        r = compare(backends, ps, 18, True, fixed6, repeats)
        print(json.dumps({"model": "qwen3-0.6b-shape", "attention": flavour, "mode": "speculative, verify 6",
                          "context": 300, **r}), flush=True)
        for be in backends.values():
            be.close()


def part_demo(work: Path, threads: int, repeats: int, batch: int) -> None:
    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.ort import OrtBackend
    from dflash_export.serve.text import load_tokenizer

    out = work / "demo-out"
    if not (out / "manifest.json").is_file():
        export_artifact(ROOT / "demo/pair/target", ROOT / "demo/pair/draft", out, force=True, progress=False)
    tok = load_tokenizer(out)
    ps = [tok.encode(json.loads(x)["prompt"]).ids for x in (ROOT / "demo/prompts.jsonl").read_text().splitlines()
          if x.strip()][: 2 * batch]
    backends = {batch: OrtBackend(out, threads=threads, max_batch=batch), 1: OrtBackend(out, threads=threads)}
    for draft in (True, False):
        r = compare(backends, ps, 64, draft, None, repeats)
        print(json.dumps({"model": "demo pair", "mode": "speculative" if draft else "plain", "requests": len(ps), **r}),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--part", choices=["06b", "demo", "batch1"], required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--old", type=Path, help="part batch1: a checkout of the version to compare with")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": a.threads}), flush=True)
    if a.part == "06b":
        part_06b(a.work, a.threads, a.repeats, a.batch)
    elif a.part == "demo":
        part_demo(a.work, a.threads, a.repeats, a.batch)
    else:
        if a.old is None:
            raise SystemExit("--part batch1 needs --old CHECKOUT (the version to compare with)")
        part_batch1(a.work, a.threads, a.repeats, a.old)


if __name__ == "__main__":
    main()
