"""One MoE layer's experts on ONNX Runtime's CPU kernels: com.microsoft::QMoE at a few bit widths,
block sizes and accuracy levels, for 1 and for 8 tokens (a verify of 8), beside the same top-k
experts of one token as MatMulNBits nodes (what the experts' bytes cost without QMoE's routing).

Random codes and routing (Qwen3-30B-A3B's layer shape by default: 128 experts of width 768,
hidden 2048, top 8), so 8 tokens reach about 51 distinct experts; real routing repeats experts
more. Median ms of 20 calls after 3 warm-up calls, one process, sessions built one after another.

    python bench/qmoe_kernel.py --threads 1 [--experts 128 --hidden 2048 --width 768 --top-k 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnxruntime as ort
from common import machine
from onnx import TensorProto, helper, numpy_helper

CASES = ((4, 32, 4), (4, 32, 0), (4, 64, 4), (4, 128, 4), (8, 32, 4), (8, 128, 4))  # bits, block, level


def _model(nodes, inits, inputs, out, width):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", w]) for n, w in inputs],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["T", width])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def qmoe(e: int, h: int, i: int, k: int, bits: int, block: int, level: int) -> bytes:
    """One QMoE node, swiglu with gate/up interleaved (fc1 [E, 2I, H]), fc2 [E, H, I], symmetric codes."""
    rng, inits, names = np.random.default_rng(0), [], []
    for name, n, kk in (("fc1", 2 * i, h), ("fc2", h, i)):
        codes = rng.integers(0, 256, (e, n, kk * bits // 8), dtype=np.uint8)
        scales = rng.random((e, n, kk // block), dtype=np.float32) * 0.01 + 0.001
        inits += [numpy_helper.from_array(codes, f"{name}_q"), numpy_helper.from_array(scales, f"{name}_s")]
        names += [f"{name}_q", f"{name}_s"]
    node = helper.make_node("QMoE", ["x", "router", names[0], names[1], "", names[2], names[3]], ["y"],
                            domain="com.microsoft", k=k, activation_type="swiglu", swiglu_fusion=1,
                            expert_weight_bits=bits, block_size=block, weights_prepacked=0,
                            normalize_routing_weights=1, accuracy_level=level)
    return _model([node], inits, (("x", h), ("router", e)), "y", h)


def matmulnbits(h: int, i: int, k: int, bits: int, block: int, level: int) -> bytes:
    """k experts of one token as MatMulNBits: [T, H] -> [T, 2I] -> first I columns -> [T, H], summed."""
    rng, inits, nodes = np.random.default_rng(0), [], []
    for j in range(k):
        for name, kk, n in ((f"up{j}", h, 2 * i), (f"down{j}", i, h)):
            codes = rng.integers(0, 256, (n, kk // block, block * bits // 8), dtype=np.uint8)
            inits += [numpy_helper.from_array(codes, f"{name}_q"),
                      numpy_helper.from_array(rng.random((n * (kk // block),), dtype=np.float32) * 0.01, f"{name}_s")]
        attrs = dict(domain="com.microsoft", bits=bits, block_size=block, accuracy_level=level)
        nodes += [helper.make_node("MatMulNBits", ["x", f"up{j}_q", f"up{j}_s"], [f"a{j}"], K=h, N=2 * i, **attrs),
                  helper.make_node("Slice", [f"a{j}", "zero", "width", "minus1"], [f"g{j}"]),
                  helper.make_node("MatMulNBits", [f"g{j}", f"down{j}_q", f"down{j}_s"], [f"y{j}"], K=i, N=h, **attrs)]
    nodes.append(helper.make_node("Sum", [f"y{j}" for j in range(k)], ["y"]))
    inits += [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("zero", 0), ("width", i), ("minus1", -1))]
    return _model(nodes, inits, (("x", h),), "y", h)


def median_ms(model: bytes, feeds: dict, threads: int, calls: int = 20) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    for _ in range(3):
        s.run(None, feeds)
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        s.run(None, feeds)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rng, rows = np.random.default_rng(1), []
    for bits, block, level in CASES:
        row = dict(bits=bits, block=block, accuracy_level=level)
        m = qmoe(a.experts, a.hidden, a.width, a.top_k, bits, block, level)
        for t in (1, 8):
            feeds = {"x": rng.standard_normal((t, a.hidden), dtype=np.float32),
                     "router": rng.standard_normal((t, a.experts), dtype=np.float32)}
            row[f"qmoe_ms_{t}"] = median_ms(m, feeds, a.threads)
        x = {"x": rng.standard_normal((1, a.hidden), dtype=np.float32)}
        row["matmulnbits_ms_1"] = median_ms(matmulnbits(a.hidden, a.width, a.top_k, bits, block, level), x, a.threads)
        rows.append(row)
        if not a.json:
            print(f"{bits}-bit block {block:>3} level {level}: QMoE 1 token {row['qmoe_ms_1']:.2f} ms, 8 tokens "
                  f"{row['qmoe_ms_8']:.2f} ms; {a.top_k} experts as MatMulNBits, 1 token {row['matmulnbits_ms_1']:.2f} ms",
                  flush=True)
    meta = dict(threads=a.threads, experts=a.experts, hidden=a.hidden, width=a.width, top_k=a.top_k,
                machine=machine())
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows}))


if __name__ == "__main__":
    main()
