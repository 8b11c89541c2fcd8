"""draft_block time and drafter cache memory against context, with and without the context ring.

Exports one small target with two drafters of the same shape: every layer sliding (window W:
the export keeps the drafter's context as a ring of W slots) and every layer full attention
(one slot per position). Then, per drafter and per context length, fills the caches to that
length through the runtime's own calls and times draft_block calls (median of --calls,
the two drafters interleaved), and reports the drafter cache's bytes.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/draft_window.py --work /tmp/dw
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.load import open_backend
    from dflash_export.models.tiny import make_drafter, make_target

    work, contexts = Path(a.work), [int(c) for c in a.contexts.split(",")]
    max_ctx = max(contexts) + 64
    t = work / "t"
    if not (t / "config.json").exists():
        make_target(t, "qwen3", layers=4, hidden=a.hidden, heads=4, kv_heads=2, head_dim=64, intermediate=2 * a.hidden)
    arts = {}
    for name, types in (("sliding", "sliding_attention"), ("full", "full_attention")):
        d, out = work / f"d-{name}", work / f"out-{name}"
        if not (out / "manifest.json").exists():
            make_drafter(d, t, layers=2, block_size=16, layer_types=[types] * 2, sliding_window=a.window)
            export_artifact(t, d, out, max_context=max_ctx, progress=False, force=True)
        arts[name] = open_backend(out, "ort", "cpu")
    import numpy as np

    rows = []
    for n in contexts:
        times = {k: [] for k in arts}
        for be in arts.values():  # fill both caches to n positions (prefill in chunks)
            be.reset()
            ids = np.random.default_rng(0).integers(0, be.manifest.vocab_size - 2, n)
            for i in range(0, n, be.max_chunk):
                chunk = ids[i : i + be.max_chunk]
                be.target(chunk)
                be.commit(len(chunk))
                be.draft_context(len(chunk))
        for _ in range(10):  # warm-up (first calls allocate)
            for be in arts.values():
                be.draft_block(5)
        for _ in range(a.calls):  # interleaved
            for k, be in arts.items():
                t0 = time.perf_counter()
                be.draft_block(5)
                times[k].append(time.perf_counter() - t0)
        row = {"context": n}
        for k, be in arts.items():
            row[f"{k}_ms"] = round(1e3 * statistics.median(times[k]), 3)
            row[f"{k}_cache_kib"] = round(sum(c.nbytes for c in be.ctx) / 1024, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    for r in rows:
        print(f"context {r['context']:5d}: ring {r['sliding_ms']:.3f} ms ({r['sliding_ms'] / base['sliding_ms']:.2f}x), "
              f"cache {r['sliding_cache_kib']} KiB | full {r['full_ms']:.3f} ms "
              f"({r['full_ms'] / base['full_ms']:.2f}x), cache {r['full_cache_kib']} KiB")


if __name__ == "__main__":
    main()
