"""The two kernels a batched int4 decoding step spends its time in, alone on ONNX Runtime's CPU
provider: how their cost grows with the rows of a batch (docs/batching.md, "where the time goes").

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/batch_kernels.py --threads 1

- matmulnbits: one com.microsoft.MatMulNBits node (4-bit, Qwen3-0.6B's 1024 x 3072 and 3072 x
  1024 products), M = 1 .. 64 rows of activations at each accuracy level; ms per call and the
  multiple of M = 1. The weights stay in cache between calls, so this is the kernel's compute,
  not the memory traffic that bounds a whole model's 1-row step.
- attention: 28 chained com.microsoft.GroupQueryAttention layers (16 heads, 8 KV heads of 128;
  one [B, 8, --max, 128] buffer per layer bound as past and present, as the `ort` flavour
  binds its caches), one new token per row, every row at 300 and 1000 positions; 1 row vs 4,
  float32 and float16 caches.
Every figure is the fastest of interleaved repeats; the load (`uptime`) is printed first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h, numpy_helper

H, HKV, D, LAYERS = 16, 8, 128, 28


def session(model, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def fastest(run, repeats: int, calls: int = 10) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - t) / calls * 1e3)
    return best


def matmulnbits(K: int, N: int, block: int, level: int, threads: int) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, (N, K // block, block // 2), dtype=np.uint8)
    scales = (rng.random(N * (K // block), dtype=np.float32) * 0.01).astype(np.float32)
    node = h.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=K, N=N, bits=4,
                       block_size=block, accuracy_level=level)
    g = h.make_graph([node], "mm", [h.make_tensor_value_info("A", TP.FLOAT, ["M", K])],
                     [h.make_tensor_value_info("Y", TP.FLOAT, ["M", N])],
                     [numpy_helper.from_array(q, "B"), numpy_helper.from_array(scales, "S")])
    return session(h.make_model(g, opset_imports=[h.make_opsetid("", 20), h.make_opsetid("com.microsoft", 1)]), threads)


def part_matmulnbits(threads: int, block: int, rounds: int) -> None:
    rows = (1, 2, 4, 8, 16, 24, 64)
    for K, N in ((1024, 3072), (3072, 1024)):
        sessions = {level: matmulnbits(K, N, block, level, threads) for level in (0, 1, 4)}
        inputs = {M: np.random.default_rng(M).random((M, K), dtype=np.float32) for M in rows}
        ms = {(lv, M): float("inf") for lv in sessions for M in rows}
        for _ in range(rounds):  # interleaved: a busy stretch of the machine hits every cell
            for lv, s in sessions.items():
                for M in rows:
                    ms[lv, M] = min(ms[lv, M], fastest(lambda: s.run(None, {"A": inputs[M]}), 1))
        for lv in sessions:
            print(json.dumps({"kernel": "MatMulNBits", "K": K, "N": N, "block": block, "accuracy_level": lv,
                              "ms": {M: round(ms[lv, M], 3) for M in rows},
                              "over_M1": {M: round(ms[lv, M] / ms[lv, 1], 2) for M in rows}}), flush=True)


def gqa_layers(max_len: int, fp16: bool):
    t = TP.FLOAT16 if fp16 else TP.FLOAT
    ins = [h.make_tensor_value_info("q0", t, ["B", 1, H * D]), h.make_tensor_value_info("k", t, ["B", 1, HKV * D]),
           h.make_tensor_value_info("v", t, ["B", 1, HKV * D]), h.make_tensor_value_info("seqlens_k", TP.INT32, ["B"]),
           h.make_tensor_value_info("total", TP.INT32, [])]
    nodes, outs = [], [h.make_tensor_value_info(f"q{LAYERS}", t, ["B", 1, H * D])]
    for i in range(LAYERS):
        nodes.append(h.make_node("GroupQueryAttention", [f"q{i}", "k", "v", f"pk{i}", f"pv{i}", "seqlens_k", "total"],
                                 [f"q{i + 1}", f"ok{i}", f"ov{i}"], domain="com.microsoft", num_heads=H, kv_num_heads=HKV))
        ins += [h.make_tensor_value_info(f"p{e}{i}", t, ["B", HKV, max_len, D]) for e in "kv"]
        outs += [h.make_tensor_value_info(f"o{e}{i}", t, ["B", HKV, max_len, D]) for e in "kv"]
    return h.make_model(h.make_graph(nodes, "gqa", ins, outs), ir_version=10,
                        opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])


def gqa_binding(s, B: int, ctx: int, max_len: int, dtype) -> tuple:
    """An IO binding of B rows at ctx positions; the arrays it points into are returned with it."""
    rng, io = np.random.default_rng(0), s.io_binding()
    keep = {"q0": rng.standard_normal((B, 1, H * D)).astype(dtype), "k": rng.standard_normal((B, 1, HKV * D)).astype(dtype),
            "v": rng.standard_normal((B, 1, HKV * D)).astype(dtype), "seqlens_k": np.full(B, ctx, np.int32),
            "total": np.array(ctx + 1, np.int32), "out": np.empty((B, 1, H * D), dtype)}
    for name in ("q0", "k", "v", "seqlens_k", "total"):
        io.bind_cpu_input(name, keep[name])
    io.bind_output(f"q{LAYERS}", "cpu", 0, dtype, list(keep["out"].shape), keep["out"].ctypes.data)
    for i in range(LAYERS):
        for e in "kv":
            a = keep[f"{e}{i}"] = np.full((B, HKV, max_len, D), 0.01, dtype)  # every page written
            io.bind_input(f"p{e}{i}", "cpu", 0, dtype, list(a.shape), a.ctypes.data)
            io.bind_output(f"o{e}{i}", "cpu", 0, dtype, list(a.shape), a.ctypes.data)
    return io, keep


def part_attention(threads: int, max_len: int, rounds: int) -> None:
    for fp16 in (False, True):
        s, dtype = session(gqa_layers(max_len, fp16), threads), np.float16 if fp16 else np.float32
        for ctx in (300, 1000):
            binds = {B: gqa_binding(s, B, ctx, max_len, dtype) for B in (1, 4)}
            ms = {B: float("inf") for B in binds}
            for _ in range(rounds):
                for B, (io, _) in binds.items():
                    ms[B] = min(ms[B], fastest(lambda: s.run_with_iobinding(io), 1, 3))
            print(json.dumps({"kernel": "GroupQueryAttention x 28 layers", "cache": "float16" if fp16 else "float32",
                              "max": max_len, "context": ctx, "ms": {f"rows_{B}": round(v, 2) for B, v in ms.items()},
                              "rows_4_over_rows_1": round(ms[4] / ms[1], 2)}), flush=True)
            del binds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block", type=int, default=32, help="MatMulNBits block size")
    ap.add_argument("--max", type=int, default=1280, help="positions of each attention buffer (export --max-context)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default="matmulnbits,attention")
    a = ap.parse_args()
    print(json.dumps({"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": a.threads,
                      "onnxruntime": ort.__version__}), flush=True)
    if "matmulnbits" in a.parts:
        part_matmulnbits(a.threads, a.block, a.rounds)
    if "attention" in a.parts:
        part_attention(a.threads, a.max, a.rounds)


if __name__ == "__main__":
    main()
