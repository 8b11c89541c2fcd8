"""What even rows buy and cost (export/even_rows.py): each quantized artifact given against a copy
of it with the padding taken out of target.onnx (the configuration before; same weights).

  lossless: speculative == plain greedy on --prompts random prompts x --tokens, and how many of
            8 positions' logits differ alone vs in one verify block (export/check_invariance.py)
  cost:     a 1-token step, an 8-position verify and a 63-token prefill through the target, 40
            steps a round, --rounds interleaved rounds; at 1 thread the CPU time of the calling
            thread (ONNX Runtime runs the graph on it; a loaded machine moves it far less than
            wall time), at more threads wall time; the median of the per-round padded / unpadded
            step ratios

    python bench/even_rows.py DIR [DIR ...] [--rounds 10] [--prompts 5] [--tokens 40] [--threads 1]
        [--no-lossless]
    python bench/even_rows.py --make WORK [--shapes qwen3-0.6b:4,qwen3-8b-layer] [--formats int4,int8]
        [--level 4] ...

--make builds (once, under WORK) random-weight targets of SHAPES with a 1-layer drafter, exports
them and quantizes each format (`--quantize X --quantize-lm-head --quantize-embedding`, block
128, accuracy level --level), then measures those. Needs ~1-2 GB of RAM per build.
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


def cost(d: Path, prompt: np.ndarray, threads: int, steps: int = 40) -> tuple[float, float, float]:
    be = OrtBackend(d, threads=threads, drafter=False, verify=False)
    clock = time.thread_time if threads == 1 else time.perf_counter  # 1 thread: ONNX Runtime runs the graph on this one

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


SHAPES = {  # bench/common.make_checkpoint keywords: Qwen3-0.6B's widths at 4 of its 28 layers; one Qwen3-8B layer
    "qwen3-0.6b:4": dict(vocab=151936, hidden=1024, layers=4, inter=3072, heads=16, kv_heads=8, tie=True),
    "qwen3-8b-layer": dict(vocab=8192, hidden=4096, layers=1, inter=12288, heads=32, kv_heads=8),
}


def made(work: Path, shape: str, formats: list[str], level: int) -> list[Path]:
    """WORK/shape/<format>-L<level> for each format, built once (random weights, export, quantize)."""
    from common import make_checkpoint

    from dflash_export.export.artifact import export_artifact
    from dflash_export.export.quantize import QuantOptions, quantize_artifact

    base = work / shape
    if not (base / "float" / "manifest.json").is_file():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        make_checkpoint(base, **SHAPES[shape])
        export_artifact(base / "target", base / "draft", base / "float", max_context=512, progress=False, force=True)
    out = []
    for f in formats:
        d = base / f"{f}-L{level}"
        if not (d / "manifest.json").is_file():
            quantize_artifact(base / "float", d, QuantOptions(f, 128, True, lm_head=True, embedding=True,
                                                               accuracy_level=level), force=True, progress=False)
        out.append(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="*", type=Path)
    ap.add_argument("--make", type=Path, metavar="WORK", help="build and measure SHAPES under WORK")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--level", type=int, default=4, help="MatMulNBits accuracy level of the --make artifacts")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-lossless", action="store_true")
    a = ap.parse_args()
    dirs = list(a.dirs)
    if a.make is not None:
        for shape in a.shapes.split(","):
            dirs += made(a.make, shape, a.formats.split(","), a.level)
    if not dirs:
        ap.error("give artifact directories or --make WORK")
    prompt = np.random.default_rng(0).integers(0, 4000, 64)
    unit = "ms CPU" if a.threads == 1 else "ms wall"
    for d in dirs:
        name = f"{d.parent.name}/{d.name}"
        u = unpadded(d)
        if not a.no_lossless:
            print(f"{name} padded:   {lossless(d, a.prompts, a.tokens)}", flush=True)
            print(f"{name} unpadded: {lossless(u, a.prompts, a.tokens)}", flush=True)
        res = {d: [], u: []}
        for r in range(a.rounds):
            for x in (d, u) if r % 2 == 0 else (u, d):
                res[x].append(cost(x, prompt, a.threads))
        p, q = np.array(res[d]), np.array(res[u])
        ratio = p[:, 0] / q[:, 0]
        print(f"{name}, {a.threads} thread(s), load {os.getloadavg()[0]:.1f}: step {p[:, 0].min():.2f} / "
              f"{q[:, 0].min():.2f} padded / unpadded (best), median ratio per round {np.median(ratio):.2f} "
              f"({ratio.min():.2f}-{ratio.max():.2f}); verify 8 {p[:, 1].min():.2f} / {q[:, 1].min():.2f}; prefill 63 "
              f"{p[:, 2].min():.1f} / {q[:, 2].min():.1f} ({unit})", flush=True)
        shutil.rmtree(u, ignore_errors=True)


if __name__ == "__main__":
    main()
