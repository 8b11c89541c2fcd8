"""Where a batched int4 decoding step's time goes at 300 and 1000 positions, 1 row vs 4, and
what an int8 KV cache would change (CPU, the `ort` attention flavour).

    .venv/bin/python bench/batch_split.py --work /tmp/batch            # 1 thread, CPU time: ~2 minutes
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch_split.py --work /tmp/batch --threads 2 --clock wall

It reuses bench/batch.py's Qwen3-0.6B-shape int4-ort export in --work (made there if missing:
~6 minutes) and writes a sibling, out-int4-ort-kv8: the same weights, the target graph's
caches int8 (GroupQueryAttention's k_quant_type / v_quant_type PER_TENSOR, 8 bits; ONNX
Runtime 1.32's CPU kernel dequantizes them itself). Its scale is a constant, not calibrated:
the outputs are meaningless, the cost is not (dense kernels), so this measures what an int8
cache would buy before anyone builds one. `export --kv-cache int8` builds it now (calibrated
per-channel scales): bench/kv_cache.py measures that export. For each (cache, rows), interleaved, plain steps with
every row at the context (bench/batch.py's `fill`): the step, the session run inside it (the
rest is host work: bindings, bookkeeping), fastest of --repeats. --clock cpu (process time)
is the sound measure with 1 thread on a shared machine: other processes' time is not counted.
The aggregate ratio is 4 x (1-row step) / (4-row step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
KV_NAMES = ("past_key", "past_value", "present_key", "present_value")


def int8_copy(src: Path, dst: Path, scale: float = 0.02) -> Path:
    """dst: src with the target graph's caches int8 (hard links for the weights, the manifest's
    sha256 of target.onnx updated)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if (dst / "manifest.json").is_file() and (dst / "manifest.json").stat().st_mtime >= (src / "manifest.json").stat().st_mtime:
        return dst  # made from this export already
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("target.onnx", "manifest.json") and not (dst / f.name).exists():
            os.link(f, dst / f.name)
    m = onnx.load(str(src / "target.onnx"), load_external_data=False)
    g = m.graph
    for x in (*g.input, *g.output):
        if x.name.startswith(KV_NAMES):
            x.type.tensor_type.elem_type = TensorProto.INT8
    g.initializer.extend(numpy_helper.from_array(np.array([scale], np.float32), n) for n in ("kv8_k_scale", "kv8_v_scale"))
    for n in g.node:
        if n.op_type == "GroupQueryAttention":  # inputs 12, 13: k_scale, v_scale
            ins = [*n.input, *[""] * (12 - len(n.input)), "kv8_k_scale", "kv8_v_scale"]
            del n.input[:]
            n.input.extend(ins)
            n.attribute.extend([helper.make_attribute("k_quant_type", "PER_TENSOR"),
                                helper.make_attribute("v_quant_type", "PER_TENSOR"),
                                helper.make_attribute("kv_cache_bit_width", 8)])
    onnx.save(m, str(dst / "target.onnx"))
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["files"]["target.onnx"] = hashlib.sha256((dst / "target.onnx").read_bytes()).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def int8_caches() -> None:
    """Let the runtime allocate and bind int8 caches (it knows float caches only): the
    contract's dtype of a cache tensor is int8 while this is on, and the memory check is off."""
    from dflash_export.runtime import contract as C, shared as S
    from dflash_export.runtime.ort import backend as ob

    S.ONNX_TYPE["int8"], S.STORAGE["int8"] = 3, np.int8
    real = C.dtype
    C.dtype = lambda t, m: "int8" if getattr(m, "_kv8", False) and str(t.name).startswith(KV_NAMES) else real(t, m)
    ob.check_cache_memory = lambda *a, **k: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="bench/batch.py's --work (its out-int4-ort export)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--contexts", default="1000,300")
    a = ap.parse_args()
    print(json.dumps({"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": a.threads, "clock": a.clock}),
          flush=True)
    src = a.work / "out-int4-ort"
    if not (src / "manifest.json").is_file():
        subprocess.run([sys.executable, str(Path(__file__).with_name("batch.py")), "--work", str(a.work), "--part", "06b",
                        "--exports", "int4-ort", "--contexts", "300", "--modes", "plain", "--repeats", "1"], check=True)
    kv8 = int8_copy(src, a.work / "out-int4-ort-kv8")
    int8_caches()
    from batch import fill

    from dflash_export.runtime import manifest as M
    from dflash_export.runtime.ort.backend import OrtBackend

    real_load = M.load_manifest

    def load(root, *args, **kw):  # mark the int8 export's manifest for the contract's dtype
        m = real_load(root, *args, **kw)
        m._kv8 = Path(root).resolve() == kv8.resolve()
        return m

    M.load_manifest = load
    bes = {(cache, b): OrtBackend(d, threads=a.threads, max_batch=b, drafter=False)
           for cache, d in (("fp32", src), ("int8", kv8)) for b in (4, 1)}
    run_s: list[float] = []
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    for be in bes.values():
        fill(be, be.max_batch, 1000)
        s = be.sessions["target"]
        real_run = s.run_with_iobinding

        def timed(io, *x, _run=real_run, **k):
            t = clock()
            _run(io, *x, **k)
            run_s.append(clock() - t)

        s.run_with_iobinding = timed
    for ctx in (int(c) for c in a.contexts.split(",")):
        ms: dict = {k: [] for k in bes}
        for i in range(a.repeats + 1):
            for (cache, b), be in bes.items():
                be.lengths[:b] = ctx
                run_s.clear()
                t = clock()
                be.target_rows(list(range(b)), np.ones((b, 1), np.int64), np.ones(b, np.int64), None)
                be.commit_rows(list(range(b)), [1] * b)
                if i:
                    ms[cache, b].append((1e3 * (clock() - t), 1e3 * sum(run_s)))
        best = {k: min(v) for k, v in ms.items()}
        print(json.dumps({"context": ctx, "step_ms": {f"{c}_rows_{b}": round(v[0], 2) for (c, b), v in best.items()},
                          "host_ms": {f"{c}_rows_{b}": round(v[0] - v[1], 2) for (c, b), v in best.items()},
                          "aggregate_ratio": {c: round(4 * best[c, 1][0] / best[c, 4][0], 3) for c in ("fp32", "int8")},
                          "loadavg": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
