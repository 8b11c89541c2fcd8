"""MatMulNBits' accuracy_level, chosen for one quantized artifact by measurement.

Level 0 multiplies fp32 activations by the dequantized weights; level 4 quantizes each block of
activations to int8 and runs int8 dot products. On CPU (ONNX Runtime 1.32, one 1024 x 3072 node)
level 4 was 3x faster for 4-bit weights and 50x for 8-bit ones (whose level-0 kernel is a slow
path), at the price of the activations' rounding error on top of the weights'. Neither price
is the same for every model, so both levels are measured on the artifact itself:

- speed: a 1-token target step after a short prompt, both levels' sessions open at once and
  their steps interleaved (a shared machine's load hits both alike), median of STEPS;
- accuracy: the target's logits over a PROBE_TOKENS prompt against the float export's
  (mean absolute error, top-1 agreement).

Level 4 is chosen when its step is at least SPEED_MARGIN faster and its logits' mean error is
at most ERROR_BUDGET times level 0's (activation rounding may at most double the error that
weight rounding already costs); otherwise level 0. `--quant-accuracy-level` overrides the
choice; the manifest's `quantization` records the level, where it came from and the probe.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..runtime import contract as C, manifest as M
from ..lazy import lazy_import
from ..runtime.load import ort_backend_class

onnx = lazy_import("onnx")  # on first use (lazy.py)

LEVELS = (0, 4)
SPEED_MARGIN = 1.10  # level 4's step must be this much faster: below it, timing noise decides
ERROR_BUDGET = 2.0  # level 4's logits error vs float, at most this times level 0's
PROBE_TOKENS = 32
STEPS = 15


def set_level(root: Path, level: int) -> None:
    """Write `level` into every MatMulNBits and QMoE node of the artifact's graphs (weights untouched)."""
    for f in C.GRAPH_FILES.values():
        path = Path(root) / f
        model = onnx.load(str(path), load_external_data=False)
        nodes = [n for n in model.graph.node if n.op_type in ("MatMulNBits", "QMoE")]  # QMoE: MoE experts
        if not nodes:
            continue
        for n in nodes:
            for a in list(n.attribute):
                if a.name == "accuracy_level":
                    n.attribute.remove(a)
            n.attribute.append(onnx.helper.make_attribute("accuracy_level", int(level)))
        onnx.save_model(model, str(path))


def _logits(backend, prompt: np.ndarray) -> np.ndarray:
    backend.reset()
    out = backend.target(prompt, want_logits=True).logits.astype(np.float64)
    backend.commit(len(prompt))
    return out


def choose(root: Path, float_root: Path, m: M.Manifest, seed: int = 0) -> dict:
    """{"accuracy_level", "accuracy_level_from": "measured", "accuracy_probe": {...}} for `root`
    (a quantized artifact whose manifest is written), measured against `float_root`, its float export."""
    Backend = ort_backend_class()
    n = max(1, min(PROBE_TOKENS, m.max_context - 2))
    prompt = np.random.default_rng(seed).integers(0, m.vocab_size, n).astype(np.int64)
    ref_backend = Backend(float_root, drafter=False, verify=False, low_memory=True)  # no prepacked copies
    try:
        ref = _logits(ref_backend, prompt)
    finally:
        ref_backend.close()
    backends, probe = {}, {}
    try:
        for level in LEVELS:  # each session is built from the file as it is now
            set_level(root, level)
            backends[level] = b = Backend(root, drafter=False, verify=False)
            logits = _logits(b, prompt)
            err = np.abs(logits - ref)
            probe[str(level)] = {"logits_mean_abs_err": float(err.mean()), "logits_max_abs_err": float(err.max()),
                                 "top1_agreement": float(np.mean(logits.argmax(-1) == ref.argmax(-1)))}
        times = {level: [] for level in LEVELS}
        tok = prompt[-1:]
        for i in range(2 + STEPS):  # interleaved; the first two rounds warm up
            for level, b in backends.items():
                t0 = time.perf_counter()
                b.target(tok)
                dt = time.perf_counter() - t0
                b.commit(0)
                if i >= 2:
                    times[level].append(dt)
    finally:
        for b in backends.values():
            b.close()
    for level in LEVELS:
        probe[str(level)]["step_ms"] = float(np.median(times[level])) * 1e3
    level = pick(probe)
    probe["rule"] = (f"4 if step_ms[0] >= {SPEED_MARGIN} x step_ms[4] and logits_mean_abs_err[4] <= {ERROR_BUDGET} x "
                     f"logits_mean_abs_err[0] (vs the float export, {n} random tokens), else 0")
    return {"accuracy_level": level, "accuracy_level_from": "measured", "accuracy_probe": probe}


def pick(probe: dict) -> int:
    """The rule: level 4 when it is SPEED_MARGIN faster and within ERROR_BUDGET of level 0's error."""
    p0, p4 = probe["0"], probe["4"]
    faster = p0["step_ms"] >= SPEED_MARGIN * p4["step_ms"]
    within = p4["logits_mean_abs_err"] <= ERROR_BUDGET * max(p0["logits_mean_abs_err"], 1e-12)
    return 4 if faster and within else 0
