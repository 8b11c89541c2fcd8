"""Target step and verify time of a small MoE export, per expert form: standard ops float / int8 /
int4 (gathered codes dequantized after the gather) against ONNX Runtime's MoE / QMoE (CPU).

    OMP_WAIT_POLICY=PASSIVE nice -n 19 python bench/moe_standard_quant.py [--work /tmp/moe-sq] [--threads 1]

A random Qwen3-MoE target made with transformers' own classes (2 layers, hidden 512, 32 experts
of width 256, 4 per token, vocab 4096) and a 1-layer drafter, exported with `--moe standard`
and `--moe op`, each quantized int8 and int4 (block 32, MatMulNBits accuracy level 4 for the
attention layers of every quantized artifact alike). Then, interleaved over --rounds (every
artifact in turn each round, so the machine's drift hits all alike): after a 32-token prompt,
the target graph's 1-token step and K-token verify (the backend's `target` call, committed 0),
median ms per artifact over the rounds' medians, and the target's data file size. Then the
dequantization alone, three ways (`dequantize_forms`: why the export writes Cast + Sub + Mul).
Prints one JSON object and writes it next to this script. About 3 minutes of CPU, most of it
exporting (the artifacts are kept in --work and reused).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import transformers
from common import uptime

from dflash_export.export.artifact import export_artifact
from dflash_export.export.quantize import QuantOptions, quantize_artifact
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.models.tiny import make_drafter

SHAPE = dict(layers=2, hidden=512, experts=32, width=256, top_k=4, vocab=4096)


def build(work: Path, block: int) -> dict[str, Path]:
    t = work / "t"
    if not (t / "config.json").is_file():
        torch.manual_seed(0)
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=1024, num_hidden_layers=SHAPE["layers"],
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=SHAPE["experts"],
            num_experts_per_tok=SHAPE["top_k"], moe_intermediate_size=SHAPE["width"], norm_topk_prob=True,
            eos_token_id=SHAPE["vocab"] - 1, bos_token_id=0, max_position_embeddings=4096)
        transformers.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(t)
    d = make_drafter(work / "d", t, block_size=block)
    out = {}
    for form in ("standard", "op"):
        f = work / form
        if not (f / "manifest.json").is_file():
            export_artifact(t, d, f, moe=form, block_size=block, max_context=256, progress=False, room_check=False)
        out[f"{form} fp32"] = f
        for scheme in ("int8", "int4"):
            q = work / f"{form}-{scheme}"
            if not (q / "manifest.json").is_file():
                quantize_artifact(f, q, QuantOptions(scheme, block_size=32, accuracy_level=4), force=True, progress=False)
            out[f"{form} {scheme}"] = q
    return out


def timed(be: OrtBackend, prompt: np.ndarray, block: int, reps: int) -> tuple[float, float]:
    """(step ms, verify ms): medians of `reps` target calls after the prompt, nothing committed."""
    be.reset()
    be.target(prompt)
    be.commit(len(prompt))
    out = []
    for n in (1, block):
        toks = prompt[:n]
        be.target(toks)  # warm-up
        be.commit(0)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            be.target(toks)
            ts.append(time.perf_counter() - t0)
            be.commit(0)
        out.append(statistics.median(ts) * 1e3)
    return out[0], out[1]


def dequantize_forms(threads: int, reps: int) -> dict:
    """One gather of k experts' [N, K] int8 codes and their dequantization, then a batched MatMul,
    as three one-graph sessions timed interleaved: Cast + Sub + Mul at opset 20 (what the export
    writes), DequantizeLinear's blocked form (opset 21), and the float gather it replaces. For T
    tokens, median ms, and the max abs difference of each against the float one."""
    import onnxruntime as ort
    from onnx import TensorProto as TP, helper as h, numpy_helper as nh

    e, n, k, block, top = 32, 1024, 512, 32, 4
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (e, n, k), dtype=np.uint8)
    scales = (rng.random((e, n, k // block), dtype=np.float32) * 0.01).astype(np.float32)

    def session(form: str) -> ort.InferenceSession:
        inits = [nh.from_array(codes, "codes"), nh.from_array(scales, "scales")]
        nodes = [h.make_node("Gather", ["codes", "ids"], ["q"]), h.make_node("Gather", ["scales", "ids"], ["s"])]
        if form == "Cast+Sub+Mul":
            inits += [nh.from_array(np.array([-1, n, k // block, block], np.int64), "blocks"),
                      nh.from_array(np.array([-1, n, k // block, 1], np.int64), "srows"),
                      nh.from_array(np.array([-1, top, n, k], np.int64), "back"), nh.from_array(np.array(128, np.float32), "zp")]
            nodes += [h.make_node("Reshape", ["q", "blocks"], ["qb"]), h.make_node("Cast", ["qb"], ["qf"], to=TP.FLOAT),
                      h.make_node("Sub", ["qf", "zp"], ["qc"]), h.make_node("Reshape", ["s", "srows"], ["sb"]),
                      h.make_node("Mul", ["qc", "sb"], ["wb"]), h.make_node("Reshape", ["wb", "back"], ["w"])]
        elif form == "DequantizeLinear":
            inits.append(nh.from_array(np.array(128, np.uint8), "zp"))
            nodes += [h.make_node("Shape", ["s"], ["ss"]), h.make_node("Expand", ["zp", "ss"], ["z"]),
                      h.make_node("DequantizeLinear", ["q", "s", "z"], ["w"], axis=3, block_size=block)]
        else:
            w = (codes.astype(np.float32) - 128) * np.repeat(scales, block, -1)
            inits, nodes = [nh.from_array(w, "codes")], [h.make_node("Gather", ["codes", "ids"], ["w"])]
        nodes.append(h.make_node("MatMul", ["w", "x"], ["y"]))
        g = h.make_graph(nodes, "g", [h.make_tensor_value_info("ids", TP.INT64, ["T", top]),
                                      h.make_tensor_value_info("x", TP.FLOAT, ["T", 1, k, 1])],
                         [h.make_tensor_value_info("y", TP.FLOAT, None)], inits)
        m = h.make_model(g, opset_imports=[h.make_opsetid("", 21 if form == "DequantizeLinear" else 20)])
        m.ir_version = 10
        o = ort.SessionOptions()
        o.intra_op_num_threads, o.log_severity_level = threads, 3
        return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])

    sessions = {f: session(f) for f in ("float gather", "Cast+Sub+Mul", "DequantizeLinear")}
    out = {"experts": e, "n": n, "k": k, "block": block, "top_k": top}
    for t in (1, 16):
        feeds = {"ids": rng.integers(0, e, (t, top)).astype(np.int64), "x": rng.random((t, 1, k, 1), dtype=np.float32)}
        ys = {f: s.run(None, feeds)[0] for f, s in sessions.items()}
        times = {f: [] for f in sessions}
        for _ in range(reps):
            for f, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, feeds)
                times[f].append(time.perf_counter() - t0)
        out[f"T={t}"] = {f: {"ms": round(statistics.median(v) * 1e3, 3),
                             "max_abs_vs_float": float(np.abs(ys[f] - ys["float gather"]).max())} for f, v in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/moe-standard-quant"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--block", type=int, default=8, help="the drafter's block size: the verify's length")
    a = ap.parse_args()
    load_before = uptime()
    arts = build(a.work, a.block)
    backends = {k: OrtBackend(p, threads=a.threads, drafter=False) for k, p in arts.items()}
    prompt = np.random.default_rng(0).integers(0, SHAPE["vocab"] - 2, 32).astype(np.int64)
    runs = {k: {"step_ms": [], "verify_ms": []} for k in backends}
    for _ in range(a.rounds):
        for k, be in backends.items():
            s, v = timed(be, prompt, a.block, a.reps)
            runs[k]["step_ms"].append(s)
            runs[k]["verify_ms"].append(v)
    forms = dequantize_forms(a.threads, 3 * a.reps)
    res = {k: {"step_ms": round(statistics.median(r["step_ms"]), 3), "verify_ms": round(statistics.median(r["verify_ms"]), 3),
               "target_data_mb": round(os.path.getsize(arts[k] / "target.data") / 2**20, 2)} for k, r in runs.items()}
    base = res["standard fp32"]
    for r in res.values():
        r["step_vs_standard_fp32"] = round(r["step_ms"] / base["step_ms"], 2)
        r["verify_vs_standard_fp32"] = round(r["verify_ms"] / base["verify_ms"], 2)
    report = {"command": f"python bench/moe_standard_quant.py --threads {a.threads} --rounds {a.rounds} --reps {a.reps} "
                         f"--block {a.block}",
              "date": datetime.now(timezone.utc).isoformat(timespec="minutes"), "machine": platform.processor()
              or platform.machine(), "cpus": os.cpu_count(), "shape": SHAPE, "verify_tokens": a.block,
              "load_before": load_before, "results": res, "dequantize_forms": forms, "runs": runs,
              "load_after": uptime()}
    print(json.dumps({k: report[k] for k in ("command", "date", "load_before", "results", "dequantize_forms", "load_after")},
                     indent=1))
    Path(__file__).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
