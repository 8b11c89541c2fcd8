"""What a draft call whose LM head scores only the drafts a verify uses would change for `auto`.

    OMP_WAIT_POLICY=PASSIVE nice -n 5 python bench/moe_draft_head.py --policy POLICY.json

POLICY.json: bench/moe_policy.py's output (its last line: the report, with the measured costs). The exported draft_block
scores all K-1 draft positions against the vocabulary (151936 x 2048 at Qwen3-30B-A3B's
shape) though a verify of s positions uses s-1 of them. This measures that head alone (one
MatMul [n, H] x [H, V] in ONNX Runtime, fp32, random weights of the shape, the threads of
the policy run) at n = 1..K-1, and replays the policy's profiles (bench/moe_policy.py:
accepts nothing, the demo histogram, the demo recorded rounds; one controller over the
requests) with the draft cost as measured and with the draft cost a head over s-1 positions
would give (draft - head(K-1) + head(s-1)), the controller choosing its lengths from each.
An estimate of what slicing the head would buy, not a graph that does it. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from common import uptime
from moe_policy import profiles, replay
from onnx import TensorProto, helper, numpy_helper

from dflash_export.runtime.controller import Controller, Costs


class HeadPerLength(Costs):
    """The measured costs with a draft call that pays the head for the s-1 drafts a verify of s uses."""

    head: list[float] = []  # ms of the head over n = 1..K-1 positions

    def spec_ms(self, r: int, s: int) -> float:
        n = max(2, min(s, len(self.head) + 1))  # the verify's length: n - 1 drafts scored
        cut = self.head[-1] - self.head[n - 2]
        return super().spec_ms(r, s) - cut


def head_ms(hidden: int, vocab: int, positions: int, threads: int, repeats: int) -> list[float]:
    """Median ms of [n, hidden] x [hidden, vocab] in ONNX Runtime for n = 1..positions."""
    w = np.random.default_rng(0).standard_normal((hidden, vocab), dtype=np.float32) * 0.02
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", vocab])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    del w
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    del model
    out = []
    x = np.random.default_rng(1).standard_normal((positions, hidden), dtype=np.float32)
    for n in range(1, positions + 1):
        sess.run(None, {"x": x[:n]})
        t = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run(None, {"x": x[:n]})
            t.append(time.perf_counter() - t0)
        out.append(1e3 * float(np.median(t)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    pol = json.loads(args.policy.read_text().strip().splitlines()[-1])
    c, k, threads = pol["costs_ms"], pol["target"]["block"], pol["threads"]
    report = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load_before": uptime(),
              "policy": str(args.policy), "policy_date": pol["date"], "threads": threads}
    head = head_ms(args.hidden, pol["target"]["vocab"], k - 1, threads, args.repeats)
    report["head_ms_by_positions"] = head
    report["draft_ms"] = c["draft"]
    as_is = Costs([1], [c["step"]], [c["verify_by_length"]], [c["draft"]], [c["context"]], "calibrated")
    sliced = HeadPerLength([1], [c["step"]], [c["verify_by_length"]], [c["draft"]], [c["context"]], "calibrated")
    sliced.head = head
    report["draft_ms_by_verify_length"] = {s: round(sliced.spec_ms(1, s) - as_is.verify_ms(1, s) - c["context"], 1)
                                              for s in (2, 4, 8, k)}
    streams = {"accepts nothing (8 requests)": [lambda t: 1] * 8, **profiles(128, 24)}
    out = {}
    for name, reqs in streams.items():
        row = {}
        for label, costs in (("draft as exported", as_is), ("head over the drafts used", sliced)):
            res = {}
            for mode in ("auto", "never"):
                ctl = Controller(costs, k)
                res[mode] = [replay(a, 128, mode, costs, k, ctl) for a in reqs]
            rate = {mode: sum(x[0] for x in v) / sum(x[1] for x in v) for mode, v in res.items()}
            row[label] = {"auto_over_plain": round(rate["auto"] / rate["never"], 3),
                          "mean_verify_len": round(float(np.mean([x[2] for x in res["auto"] if x[2]] or [0])), 1)}
        out[name] = row
    report["replayed"] = out
    report["load_after"] = uptime()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
