"""One Qwen3-0.6B-shaped attention layer on ONNX Runtime's CPU provider: the ways a ragged batch
can attend over its KV cache, side by side in one process (interleaved, fastest of each).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/attention24.py --threads 1

- standard: the standard flavour's ragged graph (position-major past [P, B, Hkv, D] concatenated
  with the new K/V, GQA matmuls, per-row mask, softmax); the runtime writes the new K/V per row.
- gqa: com.microsoft.GroupQueryAttention writing a head-major [B, Hkv, max, D] buffer in place
  (the `ort` flavour). It refuses several new tokens per row with a past at batch > 1.
- opset 24: TensorScatter writes each row's new K/V into the same kind of static buffer at its
  own length (in place: past and present are one bound buffer) and Attention (opset 24: GQA
  heads, `nonpad_kv_seqlen` per row) reads it; with a boolean mask [B, 1, S, max] ("mask"),
  the same mask as 0 / -inf floats ("float mask"), or `is_causal` ("causal").
Heads 16 / 8 KV heads of 128, a buffer of --max positions, every row at the same context.
Each graph is first checked against a numpy reference on a ragged batch (2 rows at lengths 5
and 9, 4 new tokens each): max abs error of the outputs, and whether exactly the new
positions of the buffer were written (in place). Layer ms per call follow, per context, rows
and new tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h

H, HKV, D = 16, 8, 128
G = H // HKV
F, I64 = TP.FLOAT, TP.INT64


def _consts(nodes: list, **values) -> None:
    for name, v in values.items():
        t = TP.FLOAT if isinstance(v, float) or (isinstance(v, list) and isinstance(v[0], float)) else I64
        dims = [len(v)] if isinstance(v, list) else []
        nodes.append(h.make_node("Constant", [], [name], value=h.make_tensor(name, t, dims, v if dims else [v])))


def _io(kv_dims: list, new_kv: bool) -> tuple[list, list]:
    ins = [h.make_tensor_value_info("q", F, ["B", "S", H * D]), h.make_tensor_value_info("k", F, ["B", "S", HKV * D]),
           h.make_tensor_value_info("v", F, ["B", "S", HKV * D]), h.make_tensor_value_info("lens", I64, ["B"]),
           h.make_tensor_value_info("past_k", F, kv_dims), h.make_tensor_value_info("past_v", F, kv_dims)]
    outs = [h.make_tensor_value_info("out", F, ["B", "S", H * D])]
    if new_kv:
        outs += [h.make_tensor_value_info("present_k", F, kv_dims), h.make_tensor_value_info("present_v", F, kv_dims)]
    return ins, outs


def opset24(max_len: int, mask: str):
    """TensorScatter + Attention over a static [B, Hkv, max, D] buffer; mask "mask" | "float mask" | "causal"."""
    n: list = []
    _consts(n, shq=[0, 0, H, D], shk=[0, 0, HKV, D], sho=[0, 0, H * D], zero=0, one=1, maxc=max_len, ax0=[0], ax1=[1],
            axm1=[-1], zf=0.0, ninf=-1e30)
    for x, shape in (("q", "shq"), ("k", "shk"), ("v", "shk")):
        n += [h.make_node("Reshape", [x, shape], [x + "4"]), h.make_node("Transpose", [x + "4"], [x + "t"], perm=[0, 2, 1, 3])]
    n += [h.make_node("TensorScatter", ["past_k", "kt", "lens"], ["present_k"], axis=2),
          h.make_node("TensorScatter", ["past_v", "vt", "lens"], ["present_v"], axis=2),
          h.make_node("Shape", ["q"], ["s1"], start=1, end=2), h.make_node("Squeeze", ["s1", "ax0"], ["S"]),
          h.make_node("Add", ["lens", "S"], ["nonpad"])]
    m = ""
    if mask != "causal":  # key j visible to query i of row b iff j <= lens[b] + i
        n += [h.make_node("Range", ["zero", "S", "one"], ["ar"]), h.make_node("Unsqueeze", ["lens", "axm1"], ["l2"]),
              h.make_node("Add", ["l2", "ar"], ["pos"]), h.make_node("Unsqueeze", ["pos", "axm1"], ["pos3"]),
              h.make_node("Range", ["zero", "maxc", "one"], ["keys"]), h.make_node("LessOrEqual", ["keys", "pos3"], ["m3"]),
              h.make_node("Unsqueeze", ["m3", "ax1"], ["bmask"])]
        m = "bmask"
        if mask == "float mask":
            n.append(h.make_node("Where", ["bmask", "zf", "ninf"], ["fmask"]))
            m = "fmask"
    n += [h.make_node("Attention", ["qt", "present_k", "present_v", m, "", "", "nonpad"], ["y"],
                      **({"is_causal": 1} if mask == "causal" else {})),
          h.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]), h.make_node("Reshape", ["yt", "sho"], ["out"])]
    ins, outs = _io(["B", HKV, max_len, D], True)
    return h.make_model(h.make_graph(n, "opset24", ins, outs), opset_imports=[h.make_opsetid("", 24)], ir_version=11)


def gqa(max_len: int):
    n = [h.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
                     ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=H, kv_num_heads=HKV)]
    ins, outs = _io(["B", HKV, max_len, D], True)
    ins = [i for i in ins if i.name != "lens"] + [h.make_tensor_value_info("seqlens_k", TP.INT32, ["B"]),
                                                  h.make_tensor_value_info("total", TP.INT32, [])]
    return h.make_model(h.make_graph(n, "gqa", ins, outs),
                        opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)], ir_version=10)


def standard(split: bool = False):
    """The standard flavour's ragged attention: past [P, B, Hkv, D] ++ new, per-row masked softmax.
    split: the past is never concatenated; scores over past and new are (small), and the output
    is probs[:, :P] @ past_v + probs[:, P:] @ new_v."""
    n: list = []
    _consts(n, shq=[0, 0, HKV, G, D], shk=[0, 0, HKV, D], sh4=[0, HKV, -1, D], sh5=[0, HKV, G, -1, D], sho=[0, 0, H * D],
            zero=0, one=1, zero1=[0], ax0=[0], ax1=[1], axm1=[-1], scale=[D**-0.5], neg=[-3.4e38])
    n += [h.make_node("Reshape", ["k", "shk"], ["k4"]), h.make_node("Transpose", ["k4"], ["kS"], perm=[1, 0, 2, 3]),
          h.make_node("Reshape", ["v", "shk"], ["v4"]), h.make_node("Transpose", ["v4"], ["vS"], perm=[1, 0, 2, 3]),
          h.make_node("Reshape", ["q", "shq"], ["q5"]), h.make_node("Transpose", ["q5"], ["q5t"], perm=[0, 2, 3, 1, 4]),
          h.make_node("Reshape", ["q5t", "sh4"], ["qg"])]  # B Hkv (G S) D: the G heads of a KV head stacked
    if split:
        n += [h.make_node("Transpose", ["past_k"], ["pkT"], perm=[1, 2, 3, 0]),
              h.make_node("Transpose", ["past_v"], ["pvT"], perm=[1, 2, 0, 3]),
              h.make_node("Transpose", ["k4"], ["nkT"], perm=[0, 2, 3, 1]),
              h.make_node("Transpose", ["v4"], ["nvT"], perm=[0, 2, 1, 3]),
              h.make_node("MatMul", ["qg", "pkT"], ["scp"]), h.make_node("MatMul", ["qg", "nkT"], ["scn"]),
              h.make_node("Concat", ["scp", "scn"], ["sc0"], axis=-1)]
    else:
        n += [h.make_node("Concat", ["past_k", "kS"], ["kc"], axis=0), h.make_node("Concat", ["past_v", "vS"], ["vc"], axis=0),
              h.make_node("Transpose", ["kc"], ["kT"], perm=[1, 2, 3, 0]),
              h.make_node("Transpose", ["vc"], ["vT"], perm=[1, 2, 0, 3]),
              h.make_node("MatMul", ["qg", "kT"], ["sc0"])]
    n += [h.make_node("Mul", ["sc0", "scale"], ["sc"]),
          h.make_node("Shape", ["past_k"], ["p1"], start=0, end=1), h.make_node("Squeeze", ["p1", "ax0"], ["P"]),
          h.make_node("Shape", ["q"], ["s1"], start=1, end=2), h.make_node("Squeeze", ["s1", "ax0"], ["S"]),
          h.make_node("Add", ["P", "S"], ["T"]), h.make_node("Range", ["zero", "T", "one"], ["t"]),
          h.make_node("Range", ["zero", "S", "one"], ["sr"]), h.make_node("Add", ["sr", "P"], ["qpos"]),
          h.make_node("Unsqueeze", ["qpos", "axm1"], ["qp2"]), h.make_node("LessOrEqual", ["t", "qp2"], ["causal"]),
          h.make_node("Unsqueeze", ["lens", "axm1"], ["l2"]), h.make_node("Less", ["t", "l2"], ["inpast"]),
          h.make_node("GreaterOrEqual", ["t", "P"], ["isnew"]), h.make_node("Or", ["inpast", "isnew"], ["valid"]),
          h.make_node("Unsqueeze", ["valid", "ax1"], ["vb"]), h.make_node("And", ["vb", "causal"], ["vis"]),
          h.make_node("Concat", ["vis"] * G, ["visg"], axis=1), h.make_node("Unsqueeze", ["visg", "ax1"], ["vis4"]),
          h.make_node("Where", ["vis4", "sc", "neg"], ["scm"]), h.make_node("Softmax", ["scm"], ["p"], axis=-1)]
    if split:
        n += [h.make_node("Unsqueeze", ["P", "ax0"], ["P1"]), h.make_node("Unsqueeze", ["T", "ax0"], ["T1"]),
              h.make_node("Slice", ["p", "zero1", "P1", "axm1"], ["pp"]), h.make_node("Slice", ["p", "P1", "T1", "axm1"], ["pn"]),
              h.make_node("MatMul", ["pp", "pvT"], ["op"]), h.make_node("MatMul", ["pn", "nvT"], ["on"]),
              h.make_node("Add", ["op", "on"], ["o"])]
    else:
        n.append(h.make_node("MatMul", ["p", "vT"], ["o"]))
    n += [h.make_node("Reshape", ["o", "sh5"], ["o5"]),
          h.make_node("Transpose", ["o5"], ["o5t"], perm=[0, 3, 1, 2, 4]), h.make_node("Reshape", ["o5t", "sho"], ["out"])]
    ins, outs = _io(["P", "B", HKV, D], False)
    return h.make_model(h.make_graph(n, "standard", ins, outs), opset_imports=[h.make_opsetid("", 21)], ir_version=10)


def session(model, threads: int) -> ort.InferenceSession:
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    o.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])


def reference(q, k, v, ck, cv, lens) -> np.ndarray:
    """Per row: the new K/V written at lens[b], query i attends to [0, lens[b] + i]."""
    B, S, _ = q.shape
    out = np.zeros_like(q)
    for b, L in enumerate(lens):
        kk = np.concatenate([ck[b, :, :L], k[b].reshape(S, HKV, D).transpose(1, 0, 2)], 1)
        vv = np.concatenate([cv[b, :, :L], v[b].reshape(S, HKV, D).transpose(1, 0, 2)], 1)
        qq = q[b].reshape(S, H, D).transpose(1, 0, 2)
        for i in range(H):
            sc = qq[i] @ kk[i // G].T / np.sqrt(D)
            sc[np.arange(L + S)[None] > (L + np.arange(S))[:, None]] = -np.inf
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[b, :, i * D : (i + 1) * D] = (p / p.sum(-1, keepdims=True)) @ vv[i // G]
    return out


def call(kind: str, s, max_len: int, B: int, S: int, lens: list, reps: int, check: bool = False):
    """Fastest of `reps` runs (ms), and with `check` (max abs error, buffer written in place exactly)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, S, n * D), np.float32) for n in (H, HKV, HKV))
    ck, cv = (rng.standard_normal((B, HKV, max_len, D), np.float32) for _ in range(2))
    ck0 = ck.copy()
    io = s.io_binding()
    for name, a in (("q", q), ("k", k), ("v", v)):
        io.bind_cpu_input(name, a)
    if kind == "standard":  # the valid prefix, position-major; new K/V are the graph's k/v
        P = max(lens)
        kept = [np.ascontiguousarray(c[:, :, :P].transpose(2, 0, 1, 3)) for c in (ck, cv)]
        for name, a in zip(("past_k", "past_v"), kept):
            io.bind_cpu_input(name, a)
    else:  # one buffer bound as past and present
        for name, a in (("past_k", ck), ("past_v", cv)):
            io.bind_input(name, "cpu", 0, np.float32, list(a.shape), a.ctypes.data)
            io.bind_output(name.replace("past", "present"), "cpu", 0, np.float32, list(a.shape), a.ctypes.data)
    if kind == "gqa":
        seqlens, total = np.array(lens, np.int32) + S - 1, np.array(max(lens) + S, np.int32)
        io.bind_cpu_input("seqlens_k", seqlens)
        io.bind_cpu_input("total", total)
    else:
        lengths = np.array(lens, np.int64)
        io.bind_cpu_input("lens", lengths)
    out = np.empty((B, S, H * D), np.float32)
    io.bind_output("out", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
    s.run_with_iobinding(io)
    result = None
    if check:
        err = float(np.abs(out - reference(q, k, v, ck0, cv, lens)).max())
        new = [k[b].reshape(S, HKV, D).transpose(1, 0, 2) for b in range(B)]
        in_place = kind == "standard" or all(
            np.array_equal(ck[b, :, L : L + S], new[b]) and np.array_equal(ck[b, :, :L], ck0[b, :, :L])
            and np.array_equal(ck[b, :, L + S :], ck0[b, :, L + S :]) for b, L in enumerate(lens))
        result = {"max_abs_error": float(f"{err:.2e}"), "written_in_place": in_place}
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        s.run_with_iobinding(io)
        times.append(time.perf_counter() - t)
    return 1e3 * min(times, default=0.0), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max", type=int, default=1280, help="positions of the static buffer (export --max-context)")
    ap.add_argument("--contexts", default="300,1000")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps({"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": a.threads,
                      "onnxruntime": ort.__version__, "max": a.max}), flush=True)
    graphs = {"standard": standard(), "standard split": standard(True), "gqa": gqa(a.max), **{f"opset24 {m}": opset24(a.max, m)
                                                             for m in ("mask", "float mask", "causal")}}
    sessions = {name: session(g, a.threads) for name, g in graphs.items()}
    kind = {name: name.split()[0] for name in graphs}
    for name, s in sessions.items():  # gqa cannot take this ragged batch (4 new tokens per row with a past)
        if name != "gqa":
            print(json.dumps({"check": name, "rows": [5, 9], "new_tokens": 4,
                              **call(kind[name], s, a.max, 2, 4, [5, 9], 0, True)[1]}), flush=True)
    checked = call("gqa", sessions["gqa"], a.max, 2, 1, [5, 9], 0, True)[1]
    print(json.dumps({"check": "gqa", "rows": [5, 9], "new_tokens": 1, **checked}), flush=True)
    for ctx in (int(c) for c in a.contexts.split(",")):
        for B, S in ((1, 1), (4, 1), (1, 6), (4, 6)):
            ms: dict = {name: [] for name in sessions if not (name == "gqa" and B > 1 and S > 1)}
            for _ in range(a.rounds):
                for name in ms:
                    ms[name].append(call(kind[name], sessions[name], a.max, B, S, [ctx] * B, 8)[0])
            refused = {} if "gqa" in ms else {"gqa": "refused (several new tokens per row with a past at batch > 1)"}
            print(json.dumps({"context": ctx, "rows": B, "new_tokens": S,
                              "layer_ms": {k: round(min(v), 3) for k, v in ms.items()}, **refused}), flush=True)


if __name__ == "__main__":
    main()
