"""One MoE layer at Qwen3-30B-A3B's expert shape: ONNX Runtime's MoE op against expert-grouped execution.

    OMP_WAIT_POLICY=PASSIVE nice -n 19 python bench/moe_grouped.py [--threads 2 --repeats 7]

128 experts, hidden 2048, width 768, top 8, float32, random weights and router logits. For a
call of T tokens (a verify of T positions) it times, interleaved, median ms:
- "op": com.microsoft::MoE (what `export --moe op` writes), the weights fed as inputs;
- "grouped": each selected expert's weights read once, its tokens in one GEMM per projection
  (torch matmuls on the same threads);
- "gathered": the standard-op path (`export --moe standard`): the k experts' weights gathered
  per token, batched MatMuls (reads k*T expert matrices).
With the distinct experts a call touches (its weight bytes). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone

import numpy as np
import onnxruntime as ort
import torch
from common import uptime
from onnx import TensorProto, helper

E, H, I, K = 128, 2048, 768, 8  # Qwen3-30B-A3B's experts, hidden, expert width, experts per token


def op_session(threads: int) -> ort.InferenceSession:
    f = TensorProto.FLOAT
    node = helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=K,
                            activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1)
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", f, ["T", H]),
                                              helper.make_tensor_value_info("logits", f, ["T", E]),
                                              helper.make_tensor_value_info("fc1", f, [E, 2 * I, H]),
                                              helper.make_tensor_value_info("fc2", f, [E, H, I])],
                              [helper.make_tensor_value_info("y", f, ["T", H])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = torch.softmax(logits, -1).topk(K, -1)
    return w / w.sum(-1, keepdim=True), ids


def swiglu(h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(h[..., 0::2]) * h[..., 1::2]  # interleaved gate / up rows


def grouped(x, logits, fc1, fc2) -> torch.Tensor:
    w, ids = route(logits)
    y = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = swiglu(x[tok] @ fc1[e].T) @ fc2[e].T
        y.index_add_(0, tok, h * w[tok, slot, None])
    return y


def gathered(x, logits, fc1, fc2) -> torch.Tensor:
    w, ids = route(logits)
    h = torch.matmul(fc1[ids], x[:, None, :, None])[..., 0]  # T k 2I
    y = torch.matmul(fc2[ids], swiglu(h)[..., None])[..., 0]  # T k H
    return (y * w[..., None]).sum(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", default="1,2,4,8,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": platform.machine(),
              "cpus": os.cpu_count(), "threads": args.threads, "onnxruntime": ort.__version__,
              "shape": {"experts": E, "hidden": H, "width": I, "top_k": K}, "load_before": uptime()}
    g = torch.Generator().manual_seed(0)
    fc1 = torch.randn(E, 2 * I, H, generator=g) * 0.02
    fc2 = torch.randn(E, H, I, generator=g) * 0.02
    sess = op_session(args.threads)
    feeds = {"fc1": fc1.numpy(), "fc2": fc2.numpy()}
    expert_mb = (2 * I * H + H * I) * 4 / 2**20
    rows = {}
    with torch.inference_mode():
        for t in [int(x) for x in args.tokens.split(",")]:
            x, logits = torch.randn(t, H, generator=g), torch.randn(t, E, generator=g)
            ways = {"op": lambda: sess.run(None, {"x": x.numpy(), "logits": logits.numpy(), **feeds})[0],
                    "grouped": lambda: grouped(x, logits, fc1, fc2).numpy(),
                    "gathered": lambda: gathered(x, logits, fc1, fc2).numpy()}
            outs = {k: f() for k, f in ways.items()}  # warm-up, and the three agree
            err = max(float(np.abs(outs[k] - outs["op"]).max()) for k in outs)
            times = {k: [] for k in ways}
            for _ in range(args.repeats):
                for k, f in ways.items():
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
            distinct = int(route(logits)[1].unique().numel())
            ms = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
            rows[t] = {"distinct_experts": distinct, "expert_mb_read_grouped": round(distinct * expert_mb, 1),
                       "ms": ms, "grouped_over_op": ms["grouped"] / ms["op"], "gathered_over_op": ms["gathered"] / ms["op"],
                       "max_abs_diff_vs_op": err}
            print(json.dumps({t: rows[t]}), flush=True)
    report["by_tokens"] = rows
    report["load_after"] = uptime()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
