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
  float32 and float16 caches, and int8 caches where ONNX Runtime's kernel takes them
  (k_quant_type / v_quant_type, 1.32: per tensor and per channel scales); beside them the
  same decode attention in standard ops (MatMul with the key transposed, Softmax, MatMul;
  grouped query heads, the two query heads of a KV head one 2-row product) over exactly the
  valid positions, and the memory floor: numpy summing the float32 K/V the rows attend to.
Every figure is the fastest of interleaved repeats; the load (`uptime`) is printed first.
--clock cpu times process CPU time instead of wall time: with 1 thread on a shared machine
it leaves out the time other processes took the core.
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
CLOCK = [time.perf_counter]  # --clock cpu: time.process_time


def session(model, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def fastest(run, repeats: int, calls: int = 10) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        t = CLOCK[0]()
        for _ in range(calls):
            run()
        best = min(best, (CLOCK[0]() - t) / calls * 1e3)
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


CACHES = {"float32": (TP.FLOAT, np.float32, None), "float16": (TP.FLOAT16, np.float16, None),
          "int8 per tensor": (TP.INT8, np.int8, "PER_TENSOR"), "int8 per channel": (TP.INT8, np.int8, "PER_CHANNEL")}


def gqa_layers(max_len: int, cache: str):
    """28 chained GroupQueryAttention nodes over caches of `cache` (float16: every tensor
    float16; int8: float32 activations, the cache dequantized by the kernel with constant scales)."""
    ct, _, quant = CACHES[cache]
    t = TP.FLOAT16 if cache == "float16" else TP.FLOAT
    ins = [h.make_tensor_value_info("q0", t, ["B", 1, H * D]), h.make_tensor_value_info("k", t, ["B", 1, HKV * D]),
           h.make_tensor_value_info("v", t, ["B", 1, HKV * D]), h.make_tensor_value_info("seqlens_k", TP.INT32, ["B"]),
           h.make_tensor_value_info("total", TP.INT32, [])]
    nodes, outs, inits, attrs, scales = [], [h.make_tensor_value_info(f"q{LAYERS}", t, ["B", 1, H * D])], [], {}, []
    if quant:  # inputs 12 and 13: k_scale, v_scale
        shape = [1] if quant == "PER_TENSOR" else [1, HKV, 1, D]
        inits = [numpy_helper.from_array(np.full(shape, 0.02, np.float32), n) for n in ("ks", "vs")]
        attrs, scales = dict(k_quant_type=quant, v_quant_type=quant, kv_cache_bit_width=8), [""] * 5 + ["ks", "vs"]
    for i in range(LAYERS):
        nodes.append(h.make_node("GroupQueryAttention", [f"q{i}", "k", "v", f"pk{i}", f"pv{i}", "seqlens_k", "total", *scales],
                                 [f"q{i + 1}", f"ok{i}", f"ov{i}"], domain="com.microsoft", num_heads=H, kv_num_heads=HKV,
                                 **attrs))
        ins += [h.make_tensor_value_info(f"p{e}{i}", ct, ["B", HKV, max_len, D]) for e in "kv"]
        outs += [h.make_tensor_value_info(f"o{e}{i}", ct, ["B", HKV, max_len, D]) for e in "kv"]
    return h.make_model(h.make_graph(nodes, "gqa", ins, outs, inits), ir_version=10,
                        opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])


def gqa_binding(s, B: int, ctx: int, max_len: int, cache: str) -> tuple:
    """An IO binding of B rows at ctx positions; the arrays it points into are returned with it."""
    act = np.float16 if cache == "float16" else np.float32
    dtype = CACHES[cache][1]
    rng, io = np.random.default_rng(0), s.io_binding()
    keep = {"q0": rng.standard_normal((B, 1, H * D)).astype(act), "k": rng.standard_normal((B, 1, HKV * D)).astype(act),
            "v": rng.standard_normal((B, 1, HKV * D)).astype(act), "seqlens_k": np.full(B, ctx, np.int32),
            "total": np.array(ctx + 1, np.int32), "out": np.empty((B, 1, H * D), act)}
    for name in ("q0", "k", "v", "seqlens_k", "total"):
        io.bind_cpu_input(name, keep[name])
    io.bind_output(f"q{LAYERS}", "cpu", 0, act, list(keep["out"].shape), keep["out"].ctypes.data)
    for i in range(LAYERS):
        for e in "kv":
            a = keep[f"{e}{i}"] = np.full((B, HKV, max_len, D), 1, dtype)  # every page written
            io.bind_input(f"p{e}{i}", "cpu", 0, dtype, list(a.shape), a.ctypes.data)
            io.bind_output(f"o{e}{i}", "cpu", 0, dtype, list(a.shape), a.ctypes.data)
    return io, keep


def standard_layers(T: int):
    """28 layers of decode attention in standard ops over caches of exactly T positions: the
    two query heads of a KV head as one [2, D] x [D, T] product (the key transposed by the
    product, which ONNX Runtime fuses into FusedMatMul transB), Softmax, x V."""
    G = H // HKV
    ins = [h.make_tensor_value_info("q0", TP.FLOAT, ["B", HKV, G, D])]
    nodes = []
    for i in range(LAYERS):
        ins += [h.make_tensor_value_info(f"{e}{i}", TP.FLOAT, ["B", HKV, T, D]) for e in "kv"]
        nodes += [h.make_node("Transpose", [f"k{i}"], [f"kt{i}"], perm=[0, 1, 3, 2]),
                  h.make_node("MatMul", [f"q{i}", f"kt{i}"], [f"s{i}"]),
                  h.make_node("Softmax", [f"s{i}"], [f"p{i}"], axis=-1), h.make_node("MatMul", [f"p{i}", f"v{i}"], [f"q{i + 1}"])]
    g = h.make_graph(nodes, "std", ins, [h.make_tensor_value_info(f"q{LAYERS}", TP.FLOAT, ["B", HKV, G, D])])
    return h.make_model(g, ir_version=10, opset_imports=[h.make_opsetid("", 21)])


def standard_binding(s, B: int, ctx: int) -> tuple:
    io = s.io_binding()
    keep = {"q0": np.random.default_rng(0).standard_normal((B, HKV, H // HKV, D)).astype(np.float32)}
    keep |= {f"{e}{i}": np.full((B, HKV, ctx + 1, D), 0.01, np.float32) for i in range(LAYERS) for e in "kv"}
    for name, a in keep.items():
        io.bind_cpu_input(name, a)
    io.bind_output(f"q{LAYERS}", "cpu")
    return io, keep


def floor_ms(B: int, ctx: int, max_len: int, rounds: int) -> float:
    """numpy summing the float32 K and V the rows attend to (B rows x 28 layers x 2 x [8, ctx + 1, 128]
    of [8, max_len, 128] buffers): the memory traffic any float32 attention pays."""
    caches = np.full((LAYERS * 2 * B, HKV, max_len, D), 0.01, np.float32)
    view = caches[:, :, : ctx + 1]
    return fastest(lambda: view.sum(axis=(0, 1, 2)), rounds, 1)


def part_attention(threads: int, max_len: int, rounds: int) -> None:
    def report(kernel: str, ctx: int, ms: dict, **extra) -> None:
        print(json.dumps({"kernel": kernel, **extra, "max": max_len, "context": ctx,
                          "ms": {f"rows_{B}": round(v, 2) for B, v in ms.items()},
                          "rows_4_over_rows_1": round(ms[4] / ms[1], 2)}), flush=True)

    for cache in CACHES:
        try:
            s = session(gqa_layers(max_len, cache), threads)
            io, keep = gqa_binding(s, 1, 8, max_len, cache)  # keep: the arrays the binding points into
            s.run_with_iobinding(io)
        except Exception as e:  # an ONNX Runtime without the quantized cache
            print(json.dumps({"kernel": "GroupQueryAttention", "cache": cache, "unsupported": str(e).splitlines()[0][:200]}))
            continue
        for ctx in (300, 1000):
            binds = {B: gqa_binding(s, B, ctx, max_len, cache) for B in (1, 4)}
            ms = {B: float("inf") for B in binds}
            for _ in range(rounds):
                for B, (io, _) in binds.items():
                    ms[B] = min(ms[B], fastest(lambda: s.run_with_iobinding(io), 1, 3))
            report("GroupQueryAttention x 28 layers", ctx, ms, cache=cache)
            del binds
    for ctx in (300, 1000):
        s = session(standard_layers(ctx + 1), threads)
        binds = {B: standard_binding(s, B, ctx) for B in (1, 4)}
        ms = {B: float("inf") for B in binds}
        for _ in range(rounds):
            for B, (io, _) in binds.items():
                ms[B] = min(ms[B], fastest(lambda: s.run_with_iobinding(io), 1, 3))
        report("MatMul, Softmax, MatMul x 28 layers (standard ops, exact length)", ctx, ms, cache="float32")
        del binds, s
        report("memory floor: numpy sum of the K/V read", ctx,
               {B: floor_ms(B, ctx, max_len, rounds) for B in (1, 4)}, cache="float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block", type=int, default=32, help="MatMulNBits block size")
    ap.add_argument("--max", type=int, default=1280, help="positions of each attention buffer (export --max-context)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default="matmulnbits,attention")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time (sound with --threads 1 on a shared machine)")
    a = ap.parse_args()
    if a.clock == "cpu":
        CLOCK[0] = time.process_time
    print(json.dumps({"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": a.threads,
                      "clock": a.clock, "onnxruntime": ort.__version__}), flush=True)
    if "matmulnbits" in a.parts:
        part_matmulnbits(a.threads, a.block, a.rounds)
    if "attention" in a.parts:
        part_attention(a.threads, a.max, a.rounds)


if __name__ == "__main__":
    main()
