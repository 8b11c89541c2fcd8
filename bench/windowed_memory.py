"""Sliding-window targets: the caches' memory from context 512 to 8192, measured.

A gpt-oss-shaped pair with gpt-oss's attention (64 query / 8 KV heads of 64, window 128,
sliding and full layers alternating, sinks, YaRN) at reduced width and depth (hidden 512,
4 layers, 4 experts, vocabulary 2000) and a 1-layer drafter, block 8, exported once per
context with --max-context = context + 64. Each context runs in a process of its own: load
the ONNX Runtime backend, prefill a prompt of (context - 40) tokens, decode 32 more
speculatively; then report the bytes of each cache (the sliding layers' rings, the full
layers' K/V, the drafter's context), what the sliding layers would take with one slot per
position, and the process's RSS. The rings must be the same bytes at every context.

    python bench/windowed_memory.py [--contexts 512,8192] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from common import cached_export, mem, run_child, uptime

SW, FA = "sliding_attention", "full_attention"
SHAPE = dict(vocab=2000, hidden=512, heads=64, kv_heads=8, head_dim=64, intermediate=256, window=128,
             layer_types=[SW, FA, SW, FA])
NEW = 32


def pair(context: int) -> Path:
    def build(t: Path, d: Path) -> None:
        from dflash_export.models.tiny import make_drafter, make_target

        s = SHAPE
        make_target(t, "gpt_oss", vocab=s["vocab"], hidden=s["hidden"], layers=len(s["layer_types"]), heads=s["heads"],
                    kv_heads=s["kv_heads"], head_dim=s["head_dim"], intermediate=s["intermediate"],
                    layer_types=s["layer_types"], window=s["window"], std=0.02)
        make_drafter(d, t, layers=1, block_size=8, head_dim=64, num_heads=8, num_kv_heads=8, intermediate_size=1024)

    return cached_export(f"gpt-oss-attention-{context}", {**SHAPE, "context": context}, build, context + 64) / "out"


def measure(out: str, context: int) -> dict:
    """One context, in this process: the caches' bytes by kind and the RSS after decoding to it."""
    import numpy as np

    from dflash_export.runtime import contract as C
    from dflash_export.runtime.loop import generate
    from dflash_export.runtime.ort.backend import OrtBackend

    be = OrtBackend(out, threads=2)
    m = be.manifest
    kinds = C.layer_kinds(C.TARGET, m)
    prompt = np.random.default_rng(0).integers(0, SHAPE["vocab"] - 2, context - 40).tolist()
    t0 = time.perf_counter()
    g = generate(be, prompt, NEW, stop_token_ids=())
    wall = time.perf_counter() - t0
    w = C.window(m)
    full = sum(b.nbytes for b in be.kv if b is not None)
    slot = 2 * w["kv_heads"] * w["head_dim"] * 4  # K and V of one position of one sliding layer, fp32
    return {"context": context, "max_context": m.max_context, "positions": be.target_len,
            "sliding_layers": kinds.count(C.SLIDING), "full_layers": kinds.count(C.ATTENTION),
            "ring_slots": w["ring"], "rings_bytes": sum(a.nbytes for a in be.rings.buf.values()),
            "rings_scratch_bytes": sum(a.nbytes for a in be.rings.flat.values()),
            "sliding_if_one_slot_per_position_bytes": kinds.count(C.SLIDING) * m.max_context * slot,
            "full_kv_bytes": full, "drafter_context_bytes": sum(b.nbytes for b in be.ctx),
            "tau": g.tau, "wall_s": round(wall, 2), **mem()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.child[0], int(a.child[1]))))
        return
    report = {"shape": SHAPE, "load_before": uptime(), "runs": []}
    for c in (int(x) for x in a.contexts.split(",")):
        report["runs"].append(run_child(__file__, ["--child", str(pair(c)), str(c)]))
    report["load_after"] = uptime()
    mb = lambda b: f"{b / 2**20:8.2f}"  # noqa: E731
    print(f"{'context':>8} {'rings MB':>9} {'(1 slot/pos)':>12} {'full K/V MB':>11} {'drafter MB':>10} {'RSS MB':>7}")
    for r in report["runs"]:
        print(f"{r['context']:>8} {mb(r['rings_bytes'])}  {mb(r['sliding_if_one_slot_per_position_bytes'])}   "
              f"{mb(r['full_kv_bytes'])}  {mb(r['drafter_context_bytes'])} {r['VmRSS']:>7}")
    print(report["load_before"], report["load_after"], sep="\n")
    flat = len({r["rings_bytes"] for r in report["runs"]}) == 1
    print("rings flat in the context:", flat)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(0 if flat else 1)


if __name__ == "__main__":
    main()
