"""What even rows buy and cost (export/even_rows.py): each quantized artifact given against a copy
of it with the padding taken out of target.onnx (the configuration before; same weights).

  lossless: speculative == plain greedy on --prompts random prompts x --tokens, and how many of
            8 positions' logits differ alone vs in one verify block (export/check_invariance.py)
  cost:     a 1-token step, an 8-position verify and a 63-token prefill, CPU time of the calling
            thread at 1 thread (a loaded machine moves it far less than wall time), --rounds
            interleaved rounds; the median of the per-round padded / unpadded step ratios

    python bench/even_rows.py DIR [DIR ...] [--rounds 10] [--prompts 5] [--tokens 40] [--no-lossless]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np
import onnx

from dflash_export.export.check_invariance import row_invariance
from dflash_export.export.even_rows import PREFIX
from dflash_export.runtime.loop import generate
from dflash_export.runtime.manifest import load_manifest
from dflash_export.runtime.ort.backend import OrtBackend


def unpadded(src: Path) -> Path:
    """src's copy (data files hard-linked) whose target.onnx has the even-rows nodes taken out."""
    dst = src.parent / f"{src.name}-unpadded"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    for f in os.listdir(src):
        if f != "target.onnx" and (src / f).is_file():
            os.link(src / f, dst / f)
    m = onnx.load(str(src / "target.onnx"), load_external_data=False)
    was = {}  # padded tensor -> the tensor it stands for
    for n in m.graph.node:
        if n.name.endswith("/pad"):
            was[n.output[0]] = n.input[0]
        elif n.name.endswith("/unpad"):
            was[n.input[0]] = n.output[0]
    keep = [n for n in m.graph.node if not n.name.startswith(PREFIX)]
    for n in keep:
        n.input[:] = [was.get(x, x) for x in n.input]
        n.output[:] = [was.get(x, x) for x in n.output]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    inits = [t for t in m.graph.initializer if not t.name.startswith(PREFIX)]
    del m.graph.initializer[:]
    m.graph.initializer.extend(inits)
    onnx.save_model(m, str(dst / "target.onnx"))
    return dst


def lossless(d: Path, n: int, tokens: int) -> str:
    m = load_manifest(d, verify=False)
    inv = row_invariance(d, m)["block"]
    be = OrtBackend(d, threads=1, verify=False)
    rng = np.random.default_rng(0)
    same = 0
    for _ in range(n):
        p = rng.integers(0, m.vocab_size - 2, int(rng.integers(3, 30))).tolist()
        same += generate(be, p, tokens, stop_token_ids=()).tokens == generate(be, p, tokens, draft=False,
                                                                              stop_token_ids=()).tokens
    be.close()
    return f"speculative == plain {same}/{n}, rows differing alone vs in a verify {inv['rows_differing']}/{inv['rows']}"


def cost(d: Path, prompt: np.ndarray, steps: int = 40) -> tuple[float, float, float]:
    be = OrtBackend(d, threads=1, drafter=False, verify=False)
    clock = time.thread_time  # threads=1: ONNX Runtime runs the graph on this thread

    def timed(f) -> float:
        t0 = clock()
        f()
        return (clock() - t0) * 1e3

    be.reset()
    be.target(prompt)
    be.commit(len(prompt))
    for _ in range(3):
        be.target(prompt[-1:])
    step = float(np.median([timed(lambda: be.target(prompt[-1:])) for _ in range(steps)]))
    verify = float(np.median([timed(lambda: be.target(prompt[:8])) for _ in range(6)]))
    prefill = []
    for _ in range(2):
        be.reset()
        prefill.append(timed(lambda: be.target(prompt[:63])))
    be.close()
    return step, verify, min(prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--no-lossless", action="store_true")
    a = ap.parse_args()
    prompt = np.random.default_rng(0).integers(0, 4000, 64)
    for d in a.dirs:
        u = unpadded(d)
        if not a.no_lossless:
            print(f"{d.name} padded:   {lossless(d, a.prompts, a.tokens)}", flush=True)
            print(f"{d.name} unpadded: {lossless(u, a.prompts, a.tokens)}", flush=True)
        res = {d: [], u: []}
        for r in range(a.rounds):
            for x in (d, u) if r % 2 == 0 else (u, d):
                res[x].append(cost(x, prompt))
        p, q = np.array(res[d]), np.array(res[u])
        ratio = p[:, 0] / q[:, 0]
        print(f"{d.name}, 1 thread, load {os.getloadavg()[0]:.1f}: step {p[:, 0].min():.2f} / {q[:, 0].min():.2f} ms "
              f"padded / unpadded (best), median ratio per round {np.median(ratio):.2f} ({ratio.min():.2f}-"
              f"{ratio.max():.2f}); verify 8 {p[:, 1].min():.2f} / {q[:, 1].min():.2f}; prefill 63 "
              f"{p[:, 2].min():.1f} / {q[:, 2].min():.1f} (ms CPU)", flush=True)
        shutil.rmtree(u, ignore_errors=True)


if __name__ == "__main__":
    main()
