"""Hybrid targets at the Qwen3.5-4B width: per-call costs and the cost of rollback.

The 4B model (32 layers, ~17 GB in fp32) does not fit this machine, so the target keeps
its real width and layer mix at reduced depth: hidden 2560, 16 query / 4 KV heads of 256
(gated, partial rotary), Gated DeltaNet with 16 key / 32 value heads of 128 and a conv of
4, MLP 9216, layers [linear, linear, linear, full] (one of the 8 repeats of the real
pattern). The vocabulary is cut to 32000 (the real LM head, 248320 rows, would add verify
time but no rollback time: the ratio reported here is the conservative one). A 1-layer
drafter of the same width, block 16. Random weights; exported once and cached.

Measured through the ORT runtime (runtime/ort/backend.py, 1 thread by default) with P positions of
context: a 1-token step (target + commit), the 16-token verify (target call alone), the
drafter block, and the rollback = `commit(n)` of n < 16 verified positions (the host update
of every linear layer's conv window and recurrent state, runtime/hybrid.py).

Scaled to the real 32 layers (8 repeats of the pattern): the commit scales exactly (24 linear
layers instead of 3, each committed alone), so rollback_32 = 8 x commit. The verify's layers
scale too, its LM head does not. The drafter block runs the same head over K-1 = 15 rows (plus
a layer), so the verify's head over 16 rows costs at most draft x 16/15 (a matmul linear in
its rows): verify_32 >= 8 x (verify - draft x 16/15) and rollback_32 / verify_32 <= commit /
(verify - draft x 16/15): the bound printed. The load average
before and after is printed with the figures (the machine is shared).

    python bench/hybrid.py [--context 256] [--repeats 10] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from common import cached_export

LIN, FULL = "linear_attention", "full_attention"
SHAPE = dict(vocab=32000, hidden=2560, heads=16, kv_heads=4, head_dim=256, intermediate=9216,
             layer_types=[LIN, LIN, LIN, FULL], linear=dict(linear_num_key_heads=16, linear_num_value_heads=32,
                                                            linear_key_head_dim=128, linear_value_head_dim=128))
BLOCK, MAX_CONTEXT = 16, 1024


def pair() -> Path:
    def build(t: Path, d: Path) -> None:
        from dflash_export.models.tiny import make_drafter, make_target

        s = SHAPE
        make_target(t, "qwen35", vocab=s["vocab"], hidden=s["hidden"], layers=len(s["layer_types"]), heads=s["heads"],
                    kv_heads=s["kv_heads"], head_dim=s["head_dim"], intermediate=s["intermediate"],
                    layer_types=s["layer_types"], linear=s["linear"], tie=True, std=0.02)
        make_drafter(d, t, layers=1, block_size=BLOCK)

    return cached_export("qwen35-4b-width", SHAPE, build, MAX_CONTEXT) / "out"


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import numpy as np

    from dflash_export.runtime import contract as C
    from dflash_export.runtime.ort.backend import OrtBackend

    out = pair()
    be = OrtBackend(out, threads=a.threads)
    m, K, P = be.manifest, be.manifest.block_size, a.context
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, m.vocab_size, P)
    for i in range(0, P, be.max_chunk):  # a real context: K/V and states of P positions
        ids = prompt[i : i + be.max_chunk]
        be.target(ids)
        be.commit(len(ids))
        be.draft_context(len(ids))
    block = rng.integers(0, m.vocab_size, K)

    def step():
        be.target(block[:1])
        be.commit(1)
        be.target_len -= 1  # keep the context at P (K/V by length; states drift, harmless for timing)

    def rollback(n):
        def run():
            be._pending = K  # the verify's outputs are still in the scratch buffers
            be.commit(n)
            be.target_len -= n
        return run

    res = {"context": P, "threads": a.threads, "block": K, "layer_types": m.target_layer_types,
           "load_before": [round(x, 2) for x in os.getloadavg()]}
    res["step_ms"] = median_ms(step, a.repeats)
    res["draft_ms"] = median_ms(lambda: be.draft_block(5), a.repeats)
    res["verify_ms"] = median_ms(lambda: (be.target(block), setattr(be, "_pending", 0)), a.repeats)
    be.target(block)
    for n in (1, K // 2, K):
        res[f"commit_{n}_ms"] = median_ms(rollback(n), a.repeats * 3)
    worst = max(res[f"commit_{n}_ms"] for n in (1, K // 2, K))
    res["rollback_over_verify"] = worst / res["verify_ms"]
    reps = 32 // len(m.target_layer_types)  # repeats of the pattern in the real model
    res["scaled_layers"] = reps * len(m.target_layer_types)
    res["scaled_rollback_ms"] = reps * worst
    layers_ms = res["verify_ms"] - res["draft_ms"] * K / (K - 1)  # the verify less an upper bound on its LM head
    res["scaled_verify_min_ms"] = reps * layers_ms if layers_ms > 0 else None
    res["scaled_rollback_over_verify_max"] = worst / layers_ms if layers_ms > 0 else None
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    st = be.states
    res["state_mb"] = st.nbytes(C.LINEAR_STATE) / 2**20
    res["scratch_mb"] = st.nbytes(C.LINEAR_NEW) / 2**20
    res["linear_layers"] = len(st.layers)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"Qwen3.5-4B width, layers {m.target_layer_types}, vocab {m.vocab_size}, context {P}, "
          f"ORT {a.threads} thread(s), median of {a.repeats}:")
    for k in ("step_ms", "draft_ms", "verify_ms", *(f"commit_{n}_ms" for n in (1, K // 2, K))):
        print(f"  {k:<16} {res[k]:9.2f} ms")
    print(f"  rollback (worst commit) / verify = {res['rollback_over_verify']:.4f} (goal <= 0.15)")
    if res["scaled_rollback_over_verify_max"] is None:
        print("  scaled to 32 layers: no bound (the drafter block took longer than the verify)")
    else:
        print(f"  scaled to {res['scaled_layers']} layers: rollback {res['scaled_rollback_ms']:.1f} ms, verify >= "
              f"{res['scaled_verify_min_ms']:.0f} ms, rollback / verify <= {res['scaled_rollback_over_verify_max']:.4f}")
    print(f"  load average before {res['load_before']}, after {res['load_after']}")
    print(f"  committed states {res['state_mb']:.1f} MiB, per-call scratch {res['scratch_mb']:.1f} MiB "
          f"for {res['linear_layers']} linear layers")


if __name__ == "__main__":
    main()
