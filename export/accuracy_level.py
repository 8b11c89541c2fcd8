"""MatMulNBits' accuracy_level, chosen for one quantized artifact by measurement.

Level 0 multiplies fp32 activations by the dequantized weights; level 4 quantizes each block of
activations to int8 and runs int8 dot products. On CPU (ONNX Runtime 1.32, one 1024 x 3072 node)
level 4 was 3x faster for 4-bit weights and 50x for 8-bit ones (whose level-0 kernel is a slow
path), at the price of the activations' rounding error on top of the weights'. Neither price
is the same for every model, so both levels are measured on the artifact itself:

- speed: a 1-token target step after a short prompt, median of STEPS per level; one session
  is open at a time (two would hold the artifact twice), in the order 0, 4, 4, 0 so that a
  shared machine's drift in load hits both levels alike;
- accuracy: the target's logits over a PROBE_TOKENS prompt against a float reference (mean
  absolute error, top-1 agreement): the quantized target graph with every MatMulNBits and
  GatherBlockQuantized given back its float weight from the float export (`reference`), i.e.
  the float export's target for a dense model. A MoE target's experts stay quantized in the
  reference (QMoE at level 0; --moe standard's gathered codes as they are): a float copy of
  them is the memory that quantizing a MoE target streams to avoid (export/stream.py). Level 0's error there is the dense layers' rounding
  alone, so the budget on level 4 is stricter for MoE targets than for dense ones.

Level 4 is chosen when its step is at least SPEED_MARGIN faster and its logits' mean error is
at most ERROR_BUDGET times level 0's (activation rounding may at most double the error that
weight rounding already costs); otherwise level 0. `--quant-accuracy-level` overrides the
choice; the manifest's `quantization` records the level, where it came from and the probe.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from ..runtime import contract as C, manifest as M
from ..runtime.errors import InternalError
from ..runtime.lazy import lazy_import
from ..runtime.load import ort_backend_class

onnx = lazy_import("onnx")  # on first use (runtime/lazy.py)

LEVELS = (0, 4)
SPEED_MARGIN = 1.10  # level 4's step must be this much faster: below it, timing noise decides
ERROR_BUDGET = 2.0  # level 4's logits error vs float, at most this times level 0's
PROBE_TOKENS = 32
STEPS = 16  # per level, over two sessions
REFERENCE = ".probe-reference"  # the float reference's directory, inside the quantized staging directory


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
    ref_root = reference(root, float_root)
    try:
        ref_backend = Backend(ref_root, drafter=False, verify=False, low_memory=True)  # no prepacked copies
        try:
            ref = _logits(ref_backend, prompt)
        finally:
            ref_backend.close()
            del ref_backend
    finally:
        shutil.rmtree(ref_root, ignore_errors=True)
    probe, times = {}, {level: [] for level in LEVELS}
    tok = prompt[-1:]
    for level in (*LEVELS, *LEVELS[::-1]):  # each session is built from the file as it is now
        set_level(root, level)
        b = Backend(root, drafter=False, verify=False)
        try:
            if str(level) not in probe:
                logits = _logits(b, prompt)
                err = np.abs(logits - ref)
                probe[str(level)] = {"logits_mean_abs_err": float(err.mean()), "logits_max_abs_err": float(err.max()),
                                     "top1_agreement": float(np.mean(logits.argmax(-1) == ref.argmax(-1)))}
            else:
                _logits(b, prompt)
            for i in range(2 + STEPS // 2):  # the first two warm up
                t0 = time.perf_counter()
                b.target(tok)
                dt = time.perf_counter() - t0
                b.commit(0)
                if i >= 2:
                    times[level].append(dt)
        finally:
            b.close()
            del b
    for level in LEVELS:
        probe[str(level)]["step_ms"] = float(np.median(times[level])) * 1e3
    level = pick(probe)
    probe["rule"] = (f"4 if step_ms[0] >= {SPEED_MARGIN} x step_ms[4] and logits_mean_abs_err[4] <= {ERROR_BUDGET} x "
                     f"logits_mean_abs_err[0] (vs the float reference, {n} random tokens), else 0")
    return {"accuracy_level": level, "accuracy_level_from": "measured", "accuracy_probe": probe}


def reference(root: Path, float_root: Path) -> Path:
    """A directory beside the quantized artifact's files whose target graph is the quantized one
    with each MatMulNBits -> MatMul and GatherBlockQuantized -> Gather over the float export's
    weight (copied file to file into its reference.data, never held), and its QMoE nodes at
    level 0. The artifact's other files are hard links (same directory tree: no copy)."""
    root, float_root = Path(root), Path(float_root)
    out = root / REFERENCE
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    graph_file = _target_file(root)
    for f in os.listdir(root):  # every file the manifest names (the runtime opens them all); the target graph is rewritten
        if (root / f).is_file() and f != graph_file:
            try:
                os.link(root / f, out / f)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(root / f, out / f)
    model = onnx.load(str(root / graph_file), load_external_data=False)
    float_model = onnx.load(str(float_root / _target_file(float_root)), load_external_data=False)
    floats = {t.name: t for t in float_model.graph.initializer}
    wanted, nodes = {}, []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            name = node.input[1].rsplit("_Q", 1)[0]
            attr = {a.name: a.i for a in node.attribute}
            w = wanted[name] = floats.get(name)
            if w is None:
                raise InternalError(f"the float export has no {name} for {node.name}")
            if list(w.dims) == [attr["K"], attr["N"]]:
                nodes.append(onnx.helper.make_node("MatMul", [node.input[0], name], list(node.output), name=node.name))
            else:  # a tied head kept as the table [N, K]
                t = f"{name}_T"
                nodes += [onnx.helper.make_node("Transpose", [name], [t], perm=[1, 0], name=f"{node.name}_T"),
                          onnx.helper.make_node("MatMul", [node.input[0], t], list(node.output), name=node.name)]
        elif node.op_type == "GatherBlockQuantized":
            name = node.input[0].rsplit("_Q", 1)[0]
            wanted[name] = floats[name]
            nodes.append(onnx.helper.make_node("Gather", [name, node.input[1]], list(node.output), name=node.name))
        else:
            if node.op_type == "QMoE":
                for a in list(node.attribute):
                    if a.name == "accuracy_level":
                        node.attribute.remove(a)
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", 0))
            nodes.append(node)
    used = {i for n in nodes for i in n.input}
    kept = [t for t in model.graph.initializer if t.name in used and t.name not in wanted]
    with open(out / "reference.data", "wb", buffering=0) as f:  # unbuffered: tell() is the fd's offset
        for name, t in wanted.items():
            kept.append(_copied(t, float_root, f))
    del model.graph.node[:], model.graph.initializer[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(kept)
    onnx.save_model(model, str(out / graph_file))
    return out


def _target_file(root: Path) -> str:
    return M.load_manifest(root, verify=False).graphs[C.TARGET].file


def _copied(t, src_root: Path, f):
    """TensorProto `t` of the float export with its bytes appended to `f` (reference.data, unbuffered),
    copied file to file by the kernel, not read into memory."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return t
    info = {e.key: e.value for e in t.external_data}
    length, start = int(info["length"]), int(info.get("offset", 0))
    f.write(b"\0" * ((-f.tell()) % 4096))  # aligned, so ORT can map it
    offset = f.tell()
    with open(src_root / info["location"], "rb") as src:
        done = 0
        while done < length:
            try:
                n = os.copy_file_range(src.fileno(), f.fileno(), length - done, start + done)
            except OSError:  # another filesystem, an old kernel: through a bounded buffer
                src.seek(start + done)
                n = f.write(src.read(min(length - done, 1 << 24)))
            if n <= 0:
                raise InternalError(f"copying {t.name} from the float export: {src.name} ends early")
            done += n
    new = onnx.TensorProto()
    new.CopyFrom(t)
    del new.external_data[:]
    for k, v in (("location", "reference.data"), ("offset", str(offset)), ("length", str(length))):
        new.external_data.add(key=k, value=v)
    return new


def pick(probe: dict) -> int:
    """The rule: level 4 when it is SPEED_MARGIN faster and within ERROR_BUDGET of level 0's error."""
    p0, p4 = probe["0"], probe["4"]
    faster = p0["step_ms"] >= SPEED_MARGIN * p4["step_ms"]
    within = p4["logits_mean_abs_err"] <= ERROR_BUDGET * max(p0["logits_mean_abs_err"], 1e-12)
    return 4 if faster and within else 0
