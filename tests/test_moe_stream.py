"""Routed experts streamed from the checkpoint at export (export/stream.py), in both layouts.

- the reader gives each expert exactly as the PyTorch reference loads it (bf16 checkpoints,
  per-expert keys and transformers 5.x's fused tensors, gate/up rows as is or interleaved);
- an export (and its quantization) never holds a layer's experts as one array, and writes the
  reference's bytes;
- a checkpoint that fails mid-stream, or whose experts disagree with its config: one line,
  exit 2, nothing written (no output, no staging folder).

The exported graphs' losslessness (streamed experts, both graph forms) is tests/test_moe.py's.
"""

from __future__ import annotations

import io
import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import load_file, save_file

from dflash_export.cli import cli
from dflash_export.runtime.errors import DFlashError
from dflash_export.export import artifact, moe as moe_export, save, stream
from dflash_export.export.quantize import QuantOptions
from dflash_export.models import Target, moe
from dflash_export.models.tiny import make_drafter, make_target


def _bf16_target(d, fused: bool, **kw):
    """A tiny Qwen3-MoE checkpoint in bf16, like the released ones (4 experts of width 16)."""
    make_target(d, "qwen3_moe", layers=2, hidden=32, vocab=64, fused_experts=fused, **kw)
    for f in d.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, str(f), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("fused", [False, True])
def test_reader_gives_each_expert_as_the_reference_loads_it(tmp_path, fused):
    d = _bf16_target(tmp_path / "t", fused)
    ref, reader = Target.from_pretrained(d), stream.ExpertReader(d)
    blocks = moe.blocks(ref)
    assert sorted(reader.layers) == list(ref.config.moe.sparse_layers) and len(blocks) == 2
    for layer, block in zip(ref.config.moe.sparse_layers, blocks):
        ex = block.experts
        inter = moe_export.interleave(ex.gate_up_proj.data)
        for e in range(4):
            assert np.array_equal(reader.fc1(layer, e, interleaved=False), ex.gate_up_proj[e].detach().numpy())
            assert np.array_equal(reader.fc1(layer, e, interleaved=True), inter[e].numpy())
            assert np.array_equal(reader.fc2(layer, e), ex.down_proj[e].detach().numpy())
    assert stream.expert_elements(d) == 2 * 4 * 3 * 16 * 32


@pytest.mark.parametrize("fused,scheme", [(True, "int4"), (False, "int8")])
def test_export_quantize_writes_no_float_expert(tmp_path, monkeypatch, fused, scheme):
    """`export --quantize` from a bf16 checkpoint, either layout: no float expert tensor is ever
    written, to the hidden float export or anywhere else (every data file's writes are watched:
    an expert initializer in float is at most a one-expert stand-in), and none is asked for
    whole; each expert is read from the checkpoint once per quantized part written (codes,
    scales), with gate/up rows interleaved for the MoE op; the artifact holds the reference's
    experts quantized (QMoE), and loads in ONNX Runtime."""
    def whole(self):  # (tensors under 1 KiB stay inline in the .onnx file: those are read whole)
        assert self.nbytes < save.INLINE_BELOW, f"{self.name} was materialized whole"
        return whole_of[type(self)](self)

    load, whole_of = ir.ExternalTensor._load, {c: c._whole for c in (stream.StreamedExperts, stream.StreamedQuantized)}

    def load_no_experts(self):
        assert ".mlp.experts." not in (self.name or ""), f"{self.name} was loaded whole"
        return load(self)

    fc2, read = stream.ExpertReader.fc2, []
    externalize, written = save.DataWriter.externalize, []

    def watched(self, graph, model):  # what goes into a data file, as it is written
        written.extend((self.root.name, v.name, v.const_value.dtype, tuple(v.const_value.shape))
                       for v in model.graph.initializers.values() if v.const_value.nbytes >= save.INLINE_BELOW)
        return externalize(self, graph, model)

    monkeypatch.setattr(stream.StreamedExperts, "_whole", whole)
    monkeypatch.setattr(stream.StreamedQuantized, "_whole", whole)
    monkeypatch.setattr(ir.ExternalTensor, "_load", load_no_experts)
    monkeypatch.setattr(stream.ExpertReader, "fc2", lambda self, layer, e, *a: read.append((layer, e)) or fc2(self, layer, e, *a))
    monkeypatch.setattr(save.DataWriter, "externalize", watched)
    t = _bf16_target(tmp_path / "t", fused=fused)
    make_drafter(tmp_path / "d", t)
    r = CliRunner().invoke(cli, ["export", "--target", str(t), "--draft", str(tmp_path / "d"), "--out",
                                 str(tmp_path / "o"), "--moe", "op", "--quantize", scheme, "--quant-block-size", "16",
                                 "--quant-accuracy-level", "0", "--max-context", "64", "--quiet"])
    assert r.exit_code == 0, r.output
    bits = int(scheme[3:])
    # an expert initializer under its own name is float (its quantized parts are <name>_Q4, <name>_scales)
    floats = [(root, name, shape) for root, name, _, shape in written if stream.INITIALIZER.search(name)]
    assert len(floats) == 4 and all(shape[0] == 1 for _, _, shape in floats), floats  # stand-ins of one expert alone
    assert {root for root, _, _ in floats} == {f".o.partial-{os.getpid()}"}  # in the float export only
    quantized = {name for _, name, dtype, _ in written if ".mlp.experts." in name and dtype == ir.DataType.UINT8}
    assert len(quantized) == 4 and all(n.endswith(f"_Q{bits}") for n in quantized), quantized
    assert sorted(read) == sorted([(i, e) for i in (0, 1) for e in range(4)] * 2)  # codes, then scales
    graph = onnx.load(str(tmp_path / "o" / "target.onnx"))
    assert any(n.op_type == "MatMulNBits" for n in graph.graph.node)
    assert sum(n.op_type == "QMoE" for n in graph.graph.node) == 2
    got = {i.name: numpy_helper.to_array(i) for i in graph.graph.initializer if ".mlp.experts." in i.name}
    ref = Target.from_pretrained(t)
    want = {}
    for i, b in zip(ref.config.moe.sparse_layers, moe.blocks(ref)):
        want[f"model.layers.{i}.mlp.experts.gate_up_proj"] = moe_export.interleave(b.experts.gate_up_proj.data).numpy()
        want[f"model.layers.{i}.mlp.experts.down_proj"] = b.experts.down_proj.detach().numpy()
    want = {f"{name}{suffix}": np.stack([stream.quantize_expert(x, bits, 16)[part] for x in w])
            for name, w in want.items() for suffix, part in ((f"_Q{bits}", 0), ("_scales", 1))}
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and np.array_equal(got[name], w), name


def _qmoe_node(bits: int, block: int, k: int, h: int, e: int, inits: dict):
    node = helper.make_node("QMoE", ["x", "logits", "fc1", "fc1_scales", "", "fc2", "fc2_scales"], ["y"],
                            domain="com.microsoft", k=k, activation_type="swiglu", swiglu_fusion=1,
                            normalize_routing_weights=1, expert_weight_bits=bits, block_size=block)
    graph = helper.make_graph(
        [node], "qmoe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, h]),
                         helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, e])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, h])],
        [numpy_helper.from_array(a, n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _dequantize(packed: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """[E, N, K*bits/8] + [E, N, K/block] -> float [E, N, K]; 4 bits: low nibble first; zero point 2^(bits-1)."""
    q = np.stack([packed & 0x0F, packed >> 4], -1).reshape(*packed.shape[:2], -1) if bits == 4 else packed
    q = q.astype(np.float32).reshape(*scales.shape, -1) - 2 ** (bits - 1)
    return (q * scales[..., None]).reshape(*packed.shape[:2], -1)


def _routed(x, logits, fc1: np.ndarray, fc2: np.ndarray) -> np.ndarray:
    """The MoE op's semantics (the PyTorch reference's experts): softmax, top-2, renormalised, SwiGLU."""
    weights, ids = moe.route(logits, 2, True)
    ex = moe.Experts(*fc1.shape[::2], fc1.shape[1] // 2)
    ex.gate_up_proj, ex.down_proj = torch.nn.Parameter(torch.from_numpy(fc1)), torch.nn.Parameter(torch.from_numpy(fc2))
    ex.interleaved = True
    with torch.no_grad():
        return ex(x, ids, weights).numpy()


@pytest.mark.parametrize("bits", [4, 8])
def test_streamed_quantized_experts_are_what_qmoe_reads(tmp_path, bits):
    """int4 / int8 experts quantized one at a time as they are written, from the checkpoint:
    ONNX Runtime's QMoE over them == the MoE op's semantics over their dequantized values
    (read back independently), and within quantization error of the float experts."""
    if not moe_export.ort_has_op():
        pytest.skip("onnxruntime has no CPU MoE kernel")
    d = _bf16_target(tmp_path / "t", fused=False)
    reader, block = stream.ExpertReader(d), 16
    parts = {}
    for name, fn, shape in [("fc1", lambda e: reader.fc1(0, e, interleaved=True), (4, 32, 32)),
                            ("fc2", lambda e: reader.fc2(0, e), (4, 32, 16))]:
        for part in ("codes", "scales"):
            t = stream.StreamedQuantized(fn, shape, ir.DataType.FLOAT, bits, block, part, f"{name}_{part}")
            buf = io.BytesIO()
            t.tofile(buf)
            parts[name if part == "codes" else f"{name}_scales"] = np.frombuffer(
                buf.getvalue(), t.dtype.numpy()).reshape(tuple(t.shape))
    sess = _qmoe_node(bits, block, 2, 32, 4, parts)
    fc1 = np.stack([reader.fc1(0, e, interleaved=True) for e in range(4)])
    fc2 = np.stack([reader.fc2(0, e) for e in range(4)])
    deq1, deq2 = _dequantize(parts["fc1"], parts["fc1_scales"], bits), _dequantize(parts["fc2"], parts["fc2_scales"], bits)
    x, logits = torch.randn(7, 32), torch.randn(7, 4)
    got = sess.run(None, {"x": x.numpy(), "logits": logits.numpy()})[0]
    as_read, float_ = _routed(x, logits, deq1, deq2), _routed(x, logits, fc1, fc2)
    scale = float(np.abs(float_).max())
    err, q_err = float(np.abs(got - as_read).max()) / scale, float(np.abs(as_read - float_).max()) / scale
    print(f"int{bits}: QMoE vs its dequantized weights {err:.1e}, dequantized vs float {q_err:.1e} (relative to max |y|)")
    assert err <= (1e-5 if bits == 4 else 2e-2) and q_err <= (0.2 if bits == 4 else 0.02)


def _export(tmp_path, t):
    return CliRunner().invoke(cli, ["export", "--target", str(t), "--draft", str(tmp_path / "d"), "--out",
                                    str(tmp_path / "o"), "--max-context", "64", "--quiet"])


def _nothing_written(tmp_path, r, *words):
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "t"]  # no output, no staging folder


def test_a_checkpoint_that_fails_mid_stream_leaves_nothing(tmp_path, monkeypatch):
    """The checkpoint is cut short while the experts are being written (after two experts)."""
    t = make_target(tmp_path / "t", "qwen3_moe", layers=2, hidden=32, vocab=64)
    make_drafter(tmp_path / "d", t)
    read, calls = stream.read_rows, []

    def cut_short(e, first, count):
        calls.append(e.key)
        if len(calls) == 3:
            os.truncate(e.path, e.start)
        return read(e, first, count)

    monkeypatch.setattr(stream, "read_rows", cut_short)
    _nothing_written(tmp_path, _export(tmp_path, t), "model.safetensors", "ends past the end of the file")
    assert len(calls) == 3


def test_a_checkpoint_changed_mid_stream_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    """`export --quantize int8`: the checkpoint is replaced after the target loaded (its shapes
    checked) by one whose layer-1 expert 2 has a wrong down projection. Layer 0's experts are
    already quantized into the output's staging folder when layer 1's is read: one line naming
    the tensor and both shapes, exit 2, neither the float export nor the quantized one left."""
    t = make_target(tmp_path / "t", "qwen3_moe", layers=2, hidden=32, vocab=64)
    make_drafter(tmp_path / "d", t)
    bad = {k: v for k, v in load_file(t / "model.safetensors").items()}
    key = "model.layers.1.mlp.experts.2.down_proj.weight"
    bad[key] = bad[key][:, :12].contiguous()
    attach, read = artifact.stream_experts, []

    def replaced_then_attached(*a):  # after the load and the trace, before any expert is read
        save_file(bad, str(t / "model.safetensors"), metadata={"format": "pt"})
        return attach(*a)

    fc2 = stream.ExpertReader.fc2
    monkeypatch.setattr(artifact, "stream_experts", replaced_then_attached)
    monkeypatch.setattr(stream.ExpertReader, "fc2", lambda self, layer, e, *a: read.append((layer, e)) or fc2(self, layer, e, *a))
    r = CliRunner().invoke(cli, ["export", "--target", str(t), "--draft", str(tmp_path / "d"), "--out",
                                 str(tmp_path / "o"), "--quantize", "int8", "--quant-block-size", "16",
                                 "--quant-accuracy-level", "0", "--max-context", "64", "--quiet"])
    _nothing_written(tmp_path, r, "model.safetensors", key, "[32, 12]", "[32, 16]")
    assert read[:4] == [(0, e) for e in range(4)] and read[-1] == (1, 2), read  # mid-stream: after layer 0


@pytest.mark.parametrize("fused", [False, True])
def test_experts_that_disagree_with_the_config_are_named(tmp_path, fused):
    """Through export, whose target loads with its experts left on disk: the tensor and both shapes."""
    t = make_target(tmp_path / "t", "qwen3_moe", layers=2, hidden=32, vocab=64, fused_experts=fused)
    make_drafter(tmp_path / "d", t)
    cfg = (t / "config.json").read_text()
    (t / "config.json").write_text(cfg.replace('"moe_intermediate_size": 16', '"moe_intermediate_size": 12'))
    name = "model.layers.0.mlp.experts.down_proj" if fused else "model.layers.0.mlp.experts.0.down_proj.weight"
    shapes = ("[4, 32, 16]", "[4, 32, 12]") if fused else ("[32, 16]", "[32, 12]")
    _nothing_written(tmp_path, _export(tmp_path, t), name, *shapes)


def test_room_check_counts_only_the_weights_export_holds(tmp_path, monkeypatch):
    """2 GB of weights of which 1.5 GB are streamed experts fit in 1 GB of memory; unstreamed they do not."""
    monkeypatch.setattr(artifact, "available_memory", lambda: 10**9)
    artifact.check_room(2 * 10**9, tmp_path, "fp32", streamed=15 * 10**8)
    with pytest.raises(DFlashError, match="needs about 2.6 GB of memory"):
        artifact.check_room(2 * 10**9, tmp_path, "fp32")


def test_disk_check_counts_streamed_experts_quantized(tmp_path, monkeypatch):
    """A Qwen3-30B-A3B-sized fp32 export (122 GB, 116 GB of it experts) with --quantize int4 writes
    no float experts: about 2 x 6 GB + 15 GB (default blocks of 128; 18 GB at blocks of 32), which 40 GB of free disk holds; without it, not."""
    monkeypatch.setattr(artifact.shutil, "disk_usage", lambda p: type("U", (), {"free": 40 * 10**9})())
    monkeypatch.setattr(artifact, "available_memory", lambda: None)
    weights, experts = 122 * 10**9, 116 * 10**9
    disk = artifact.disk_bytes(weights, experts, "fp32", QuantOptions("int4"), 2048, 768)
    assert 27 * 10**9 < disk < 28 * 10**9, disk  # 2 x 6 GB + 29e9 weights x (0.5 + 4 / 128) bytes (block 128)
    block32 = artifact.disk_bytes(weights, experts, "fp32", QuantOptions("int4", 32), 2048, 768)
    assert 29 * 10**9 < block32 < 31 * 10**9, block32  # 29e9 x (0.5 + 4 / 32) bytes
    artifact.check_room(weights, tmp_path, "fp32", experts, disk)
    assert artifact.disk_bytes(weights, experts, "fp32", None, 2048, 768) == weights
    with pytest.raises(DFlashError, match="writes about 122.0 GB"):
        artifact.check_room(weights, tmp_path, "fp32", experts, artifact.disk_bytes(weights, experts, "fp32", None, 2048, 768))
