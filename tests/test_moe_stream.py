"""Routed experts streamed from the checkpoint at export (export/stream.py), in both layouts.

- the reader gives each expert exactly as the PyTorch reference loads it (bf16 checkpoints,
  per-expert keys and transformers 5.x's fused tensors, gate/up rows as is or interleaved);
- an export never holds a layer's experts as one array, and writes the reference's bytes;
- a checkpoint that fails mid-stream, or whose experts disagree with its config: one line,
  exit 2, nothing written (no output, no staging folder).

The exported graphs' losslessness (streamed experts, both graph forms) is tests/test_moe.py's.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import numpy_helper
from safetensors.torch import load_file, save_file

from dflash_export.cli import cli
from dflash_export.export import moe as moe_export, stream
from dflash_export.models import Target, moe
from dflash_export.testing import make_drafter, make_target


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


def test_export_streams_experts_one_at_a_time(tmp_path, monkeypatch):
    """fp16 from a fused bf16 checkpoint: no expert initializer is ever asked for as a whole
    (only written expert by expert), and target.data holds the reference's fp16 experts."""
    def whole(self):
        raise AssertionError(f"{self.name} was materialized whole")

    fc2, read = stream.ExpertReader.fc2, []
    monkeypatch.setattr(stream.StreamedExperts, "_whole", whole)
    monkeypatch.setattr(stream.ExpertReader, "fc2", lambda self, layer, e: read.append((layer, e)) or fc2(self, layer, e))
    t = _bf16_target(tmp_path / "t", fused=True)
    make_drafter(tmp_path / "d", t)
    r = CliRunner().invoke(cli, ["export", "--target", str(t), "--draft", str(tmp_path / "d"), "--out",
                                 str(tmp_path / "o"), "--dtype", "fp16", "--moe", "standard", "--max-context", "64",
                                 "--quiet"])
    assert r.exit_code == 0, r.output
    assert sorted(read) == [(i, e) for i in (0, 1) for e in range(4)]  # each expert read once, from the checkpoint
    graph = onnx.load(str(tmp_path / "o" / "target.onnx"))
    got = {i.name: numpy_helper.to_array(i) for i in graph.graph.initializer if ".mlp.experts." in i.name}
    ref = Target.from_pretrained(t, dtype=torch.float16)
    want = {f"model.layers.{i}.mlp.experts.{p}": getattr(b.experts, p).detach().numpy()
            for i, b in zip(ref.config.moe.sparse_layers, moe.blocks(ref)) for p in ("gate_up_proj", "down_proj")}
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == np.float16 and np.array_equal(got[name], w), name


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
    read, calls = stream.ExpertReader._read, []

    def cut_short(self, e, first, count):
        calls.append(e.key)
        if len(calls) == 3:
            os.truncate(e.path, e.start)
        return read(self, e, first, count)

    monkeypatch.setattr(stream.ExpertReader, "_read", cut_short)
    _nothing_written(tmp_path, _export(tmp_path, t), "model.safetensors", "ends past the end of the file")
    assert len(calls) == 3


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
