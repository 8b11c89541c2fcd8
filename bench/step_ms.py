"""Plain decode step time of several exports, interleaved in one process (CPU, ONNX Runtime).

A shared machine's load changes within minutes: run one after another, the exports would be
compared at different loads, so each round decodes --tokens with every export in turn and the
best and median round per export are reported.

    python bench/step_ms.py LABEL=DIR [LABEL=DIR ...] [--threads 1] [--depth 64] [--tokens 12] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np

from dflash_export.runtime.load import open_backend
from dflash_export.runtime.loop import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+", metavar="LABEL=DIR")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--depth", type=int, default=64, help="prompt tokens before decoding")
    ap.add_argument("--tokens", type=int, default=12, help="tokens decoded per round")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    dirs = dict(x.split("=", 1) for x in a.exports)
    backends = {k: open_backend(d, "ort", "cpu", threads=a.threads, drafter=False) for k, d in dirs.items()}
    prompt = np.random.default_rng(0).integers(0, min(b.manifest.vocab_size for b in backends.values()), a.depth).tolist()
    for b in backends.values():  # warm-up: shapes, pages
        generate(b, prompt, 4, draft=False, stop_token_ids=())
    ms: dict[str, list[float]] = {k: [] for k in backends}
    load = [os.getloadavg()[0]]
    for _ in range(a.rounds):
        for k, b in backends.items():
            g = generate(b, prompt, a.tokens, draft=False, stop_token_ids=())
            ms[k].append(g.decode_s / (len(g.tokens) - 1) * 1e3)
    load.append(os.getloadavg()[0])
    print(json.dumps({"threads": a.threads, "depth": a.depth, "load": [round(x, 1) for x in load],
                      "step_ms_best": {k: round(min(v), 1) for k, v in ms.items()},
                      "step_ms_median": {k: round(statistics.median(v), 1) for k, v in ms.items()}}))


if __name__ == "__main__":
    main()
