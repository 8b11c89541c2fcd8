"""What `quantize` holds in memory (export/quantize.py, export/accuracy_level.py), on tiny exports.

- the quantizer reads only the weights it quantizes: the embedding, a float LM head and a MoE
  target's experts keep their bytes on disk and are written file to file (or, the experts,
  quantized one at a time);
- the accuracy-level probe never opens the float export: its reference is the quantized target
  graph with the float weights given back to its MatMulNBits / GatherBlockQuantized nodes (a MoE
  target's QMoE experts stay quantized), which for a dense model is the float export's target,
  logit for logit.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from runtime_cases import CASES as DENSE, artifact, prompts
from test_moe import CASES as MOE

from dflash_export.export import accuracy_level as AL, moe as moe_export
from dflash_export.export.quantize import QuantOptions, quantize_artifact
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.ort.backend import OrtBackend


def test_quantize_reads_only_what_it_quantizes_and_probes_without_the_float_export(tmp_path, monkeypatch):
    """A MoE op export quantized int4 with the accuracy level measured: the only target tensors
    read whole are the linear weights that became MatMulNBits; the probe's sessions open the
    quantized artifact and its reference (QMoE kept, no MatMulNBits), never the float export."""
    if not moe_export.ort_has_op():
        pytest.skip("onnxruntime has no CPU MoE kernel")
    _, _, src = artifact(MOE["qwen3_moe-op"])
    loaded, opened, load = [], [], ir.ExternalTensor._load
    monkeypatch.setattr(ir.ExternalTensor, "_load", lambda self: loaded.append(self.name) or load(self))
    Backend = AL.ort_backend_class()

    def opening(root, **kw):
        g = onnx.load(str(root / "target.onnx"), load_external_data=False)
        opened.append((root, sorted({n.op_type for n in g.graph.node} & {"MoE", "QMoE", "MatMulNBits"})))
        return Backend(root, **kw)

    monkeypatch.setattr(AL, "ort_backend_class", lambda: opening)
    out = tmp_path / "q"
    quantize_artifact(src, out, QuantOptions("int4", 16), progress=False)
    q = M.load_manifest(out).quantization
    linear = {n for n in q["weights"]["target"] if ".mlp.experts." not in n}
    target = {t.name for t in onnx.load(str(src / "target.onnx"), load_external_data=False).graph.initializer}
    read = set(loaded) & target  # (the drafter's K/V projections, in both drafter graphs, are hashed whole)
    assert linear and read <= linear, sorted(read - linear)
    assert not set(loaded) & set(C.SHARED_INITIALIZERS)  # the embedding and the float head
    roots = [r for r, _ in opened]
    assert src not in roots and roots[0].name == AL.REFERENCE and opened[0][1] == ["QMoE"], opened
    assert all(ops == ["MatMulNBits", "QMoE"] for _, ops in opened[1:]) and len(opened) == 5, opened
    assert not (out / AL.REFERENCE).exists() and q["accuracy_level_from"] == "measured"


@pytest.mark.parametrize("name,options", [
    ("qwen3", QuantOptions("int4", 32, True, draft=True, accuracy_level=0)),
    ("llama", QuantOptions("int8", 32, True, lm_head=True, embedding=True, accuracy_level=0)),  # tied, head + lookup
])
def test_probe_reference_is_the_float_target(name, options, tmp_path):
    """The probe's float reference of a dense artifact computes what the float export computes
    (every quantized node given its float weight back, a tied head through the table)."""
    _, _, src = artifact(DENSE[name])
    out = tmp_path / name
    quantize_artifact(src, out, options, progress=False)
    ref = AL.reference(out, src)
    ops = {n.op_type for n in onnx.load(str(ref / "target.onnx"), load_external_data=False).graph.node}
    assert not ops & {"MatMulNBits", "GatherBlockQuantized"}, ops
    a, b, q = (OrtBackend(d, drafter=False, verify=False) for d in (src, ref, out))
    worst, moved = 0.0, 0.0
    for prompt in prompts(3, a.manifest.vocab_size, seed=3):
        la, lb, lq = (AL._logits(x, np.array(prompt, np.int64)) for x in (a, b, q))
        worst, moved = max(worst, float(np.abs(la - lb).max())), max(moved, float(np.abs(la - lq).max()))
    print(f"{name}: reference vs float export max abs {worst:.1e}; quantized vs float {moved:.1e}")
    assert worst <= 1e-5 and moved > 1e-4  # the reference is the float model, and the quantized one is not
