"""runtime/contract.py: the graph contract as data, and the exported graphs agreeing with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from runtime_cases import CASES, artifact

from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.names import layer_names, names_of
from dflash_export.runtime.errors import DFlashError

GEOM = SimpleNamespace(target_layers=3, draft_layers=2, block_size=8, vocab_size=50, target_layer_ids=[0, 2],
                       hidden_size=16, target_kv_heads=2, target_head_dim=4, draft_kv_heads=1, draft_head_dim=4,
                       dtype="fp16")


def test_per_layer_tensors_expand_in_order():
    ins, outs = C.names(C.TARGET, GEOM)
    assert ins == ["input_ids", "position_ids", "past_key.0", "past_value.0", "past_key.1", "past_value.1",
                   "past_key.2", "past_value.2"]
    assert outs[:3] == ["logits", "next_ids", "taps"] and outs[3:5] == ["new_key.0", "new_value.0"] and len(outs) == 9
    assert C.names(C.DRAFT_CONTEXT, GEOM) == (["taps", "ctx_position_ids"], ["ctx_key.0", "ctx_value.0", "ctx_key.1", "ctx_value.1"])
    assert C.names(C.DRAFT_BLOCK, GEOM)[1] == ["draft_ids", "draft_logits", "draft_conf"]
    N = names_of(GEOM)  # the per-layer name table a backend builds once
    assert [N.past_key[1], N.new_value[2], N.ctx_key[0], N.past_ctx_value[1], N.present_key[0]] == \
        ["past_key.1", "new_value.2", "ctx_key.0", "past_ctx_value.1", "present_key.0"]
    assert len(N.past_key) == GEOM.target_layers and len(N.ctx_value) == GEOM.draft_layers


def test_roles_sizes_shapes_and_dtypes():
    assert C.role(C.TARGET, "past_key.11", 1) == C.PAST and C.role(C.TARGET, "input_ids", 1) == C.SEQ
    assert C.role(C.DRAFT_BLOCK, "block_ids", 1) == C.BLOCK and C.BLOCK not in C.DYNAMIC  # the static block
    assert C.role(C.DRAFT_BLOCK, "past_ctx_key.0", 1) == C.PAST_CTX and C.DYNAMIC[C.PAST_CTX] == 0
    with pytest.raises(DFlashError, match="no tensor"):
        C.role(C.TARGET, "past_key.x", 1)
    taps = C.tensor(C.TARGET, "taps", GEOM)
    assert C.shape(taps, GEOM, batch=1, seq=5) == (1, 5, 32)  # two taps x hidden 16
    assert C.shape(C.tensor(C.DRAFT_BLOCK, "draft_logits", GEOM), GEOM, batch=2) == (2, 7, 50)
    assert C.dtype(taps, GEOM) == "float16" and C.dtype(C.tensor(C.TARGET, "logits", GEOM), GEOM) == "float32"


def test_exported_graphs_match_the_contract():
    """What export wrote (the manifest's record of the ONNX I/O) is the contract, dim by dim."""
    m = M.load_manifest(artifact(CASES["qwen3"])[2])
    static = C.sizes(m)
    for g in C.GRAPHS:
        ins, outs = C.io(g, m)
        spec = m.graphs[g]
        for t, s in zip(ins + outs, spec.inputs + spec.outputs, strict=True):
            assert (t.name, C.dtype(t, m)) == (s.name, s.dtype)
            assert [d if d in C.DYNAMIC else static[d] for d in t.dims] == s.shape


def test_hybrid_target_layers_carry_their_states():
    """A hybrid target's linear-attention layers carry conv/recurrent states instead of K/V,
    in layer order, with the Gated DeltaNet roles sized from the manifest's `linear`."""
    linear = dict(conv_kernel=4, conv_dim=80, k_heads=2, v_heads=4, k_dim=8, v_dim=12, max_seq=64)
    m = SimpleNamespace(**vars(GEOM), target_layer_types=["linear_attention", "full_attention", "linear_attention"],
                        linear=linear)
    ins, outs = C.names(C.TARGET, m)
    assert ins[2:] == ["conv_state.0", "rec_state.0", "past_key.1", "past_value.1", "conv_state.2", "rec_state.2"]
    assert outs[3:] == ["new_conv.0", "delta_k.0", "delta_u.0", "delta_g.0", "new_key.1", "new_value.1",
                        "new_conv.2", "delta_k.2", "delta_u.2", "delta_g.2"]
    assert C.names(C.DRAFT_BLOCK, m) == C.names(C.DRAFT_BLOCK, GEOM)  # drafter graphs unchanged
    rec = C.tensor(C.TARGET, "rec_state.2", m)
    assert C.shape(rec, m, batch=1) == (1, 4, 8, 12) and C.dtype(rec, m) == "float32"  # the state stays fp32
    assert C.shape(C.tensor(C.TARGET, "conv_state.0", m), m, batch=1) == (1, 3, 80)
    assert C.dtype(C.tensor(C.TARGET, "delta_k.0", m), m) == "float16"
    assert C.role(C.TARGET, "delta_u.7", 1) == C.SEQ and C.role(C.TARGET, "conv_state.3", 1) == C.CONV_WINDOW
    assert C.max_seq(m) == 64 and C.max_seq(GEOM) is None
    assert layer_names(3).delta[2] == ("delta_k.2", "delta_u.2", "delta_g.2")
