"""Mixture-of-experts targets (models/moe.py, export/moe.py): Qwen3-MoE, Qwen3.5-MoE (its text
model inside the VL class too) and Qwen3-Next, built with transformers' own classes.

- ONNX Runtime's com.microsoft::MoE on one node against transformers' own MoE blocks;
- the PyTorch reference against transformers, in both checkpoint layouts;
- refusals: expert tensors that disagree with the config, DeepSeek-V3 / Kimi K2 variants;
- exported both ways (--moe op | standard): `check` parity, and the runtime's greedy
  speculative decoding == transformers' own greedy generate, one row and batched rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from runtime_cases import Case, artifact, prompts
from test_hybrid_runtime import rejected_everywhere

from dflash_export.cli import cli
from dflash_export.errors import DFlashError
from dflash_export.export import moe as moe_export
from dflash_export.models import Target, TargetConfig
from dflash_export.runtime import manifest as M
from dflash_export.runtime.loop import Request, generate, generate_batch
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.testing import hf_model, make_drafter, make_target

LIN, FULL = "linear_attention", "full_attention"
ort = pytest.importorskip("onnxruntime")


# -- the contrib op's semantics, one node ------------------------------------------------


def _one_node(num_experts: int, k: int, normalize: bool, fc1: np.ndarray, fc2: np.ndarray):
    from onnx import TensorProto, helper, numpy_helper

    h = fc1.shape[2]
    node = helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=k,
                            activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=int(normalize))
    graph = helper.make_graph(
        [node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, h]),
                        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, num_experts])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, h])],
        [numpy_helper.from_array(fc1, "fc1"), numpy_helper.from_array(fc2, "fc2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("family,normalize", [("qwen3_moe", False), ("qwen3_moe", True), ("qwen3_5_moe", True)])
def test_contrib_op_matches_transformers_blocks(family, normalize):
    """com.microsoft::MoE with the raw router logits, interleaved fc1 and normalize_routing_weights
    = norm_topk_prob is transformers' sparse block (Qwen3.5-MoE: plus the gated shared expert,
    computed beside the op as the export does), on several token counts."""
    if not moe_export.ort_has_op():
        pytest.skip(f"onnxruntime {ort.__version__} has no CPU MoE kernel")
    torch.manual_seed(0)
    kw = dict(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        block = Block(transformers.Qwen3MoeConfig(**kw, norm_topk_prob=normalize))
    else:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block
        block = Block(transformers.Qwen3_5MoeTextConfig(**kw, shared_expert_intermediate_size=24))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    ex = block.experts
    sess = _one_node(8, 3, normalize, moe_export.interleave(ex.gate_up_proj.data).numpy(), ex.down_proj.data.numpy())
    for tokens in (1, 5, 16):
        x = torch.randn(1, tokens, 32)
        with torch.no_grad():
            ref = block(x)[0]
            logits = torch.nn.functional.linear(x[0], block.gate.weight)
            shared = (torch.sigmoid(block.shared_expert_gate(x[0])) * block.shared_expert(x[0])
                      if family == "qwen3_5_moe" else 0)
        got = sess.run(None, {"x": x[0].numpy(), "logits": logits.numpy()})[0] + np.asarray(shared)
        err = float(np.abs(got - ref.numpy()).max())
        print(f"{family} norm={normalize} tokens={tokens}: max abs error {err:.1e} (tolerance 1e-5)")
        assert err <= 1e-5


# -- the PyTorch reference against transformers --------------------------------------------

REFERENCE = {  # arch, make_target's expert overrides, layer pattern, fused checkpoint layout
    "qwen3_moe-dense-layer": ("qwen3_moe", dict(mlp_only_layers=[1], norm_topk_prob=False), None, False),
    "qwen3_moe-sparse-step": ("qwen3_moe", dict(decoder_sparse_step=2, norm_topk_prob=True), None, True),
    "qwen35_moe": ("qwen35_moe", {}, [LIN, FULL, LIN], True),
    "qwen35_moe-vl": ("qwen35_moe-vl", {}, [FULL, LIN, LIN], False),
    "qwen3_next": ("qwen3_next", dict(mlp_only_layers=[0], norm_topk_prob=False), [LIN, LIN, FULL], False),
}


@pytest.mark.parametrize("name", REFERENCE)
def test_reference_matches_transformers(name, tmp_path):
    """Logits and taps of models.Target == transformers' own model (1e-4), per-expert keys or fused."""
    arch, moe, layer_types, fused = REFERENCE[name]
    d = make_target(tmp_path / "t", arch, layers=3, hidden=32, vocab=64, layer_types=layer_types, moe=moe,
                    fused_experts=fused)
    target, hf = Target.from_pretrained(d, [0, 2]), hf_model(d)
    c = target.config.moe
    dense = [i for i in range(3) if i not in c.sparse_layers]
    assert dense == {"qwen3_moe-dense-layer": [1], "qwen3_moe-sparse-step": [0, 2], "qwen3_next": [0]}.get(name, [])
    ids = torch.randint(0, 64, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True, use_cache=False)
        logits, taps, _ = target(ids, torch.arange(13)[None], target.empty_kv())
    err = max(float((logits - out.logits).abs().max()),
              float((taps - torch.cat([out.hidden_states[1], out.hidden_states[3]], -1)).abs().max()))
    print(f"{name}: max abs error vs transformers {err:.1e} (tolerance 1e-4)")
    assert err <= 1e-4


# -- refusals ------------------------------------------------------------------------------


def _edit(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fused", [False, True])
def test_expert_tensors_that_disagree_with_the_config_are_named(tmp_path, fused):
    d = make_target(tmp_path / "t", "qwen3_moe", layers=2, hidden=32, vocab=64, fused_experts=fused)
    _edit(d, moe_intermediate_size=12)
    with pytest.raises(DFlashError) as e:
        Target.from_pretrained(d)
    msg = str(e.value)
    name = "model.layers.0.mlp.experts.down_proj" if fused else "model.layers.0.mlp.experts.0.down_proj.weight"
    shapes = ("[4, 32, 16]", "[4, 32, 12]") if fused else ("[32, 16]", "[32, 12]")
    assert name in msg and all(s in msg for s in shapes) and "\n" not in msg, msg
    _edit(d, moe_intermediate_size=16, num_local_experts=3)
    with pytest.raises(DFlashError, match="num_experts 3") as e:
        Target.from_pretrained(d)
    assert "\n" not in str(e.value)


def test_unsupported_moe_variants_are_refused_naming_what_is_missing():
    v3 = {**transformers.DeepseekV3Config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    with pytest.raises(DFlashError) as e:
        TargetConfig.from_dict(v3)
    msg = str(e.value)
    assert "group-limited expert routing" in msg and "MLA attention" in msg and "\n" not in msg, msg
    kimi = {**v3, "n_group": 1, "topk_group": 1}  # Kimi K2: one group, MLA
    with pytest.raises(DFlashError, match="MLA attention") as e:
        TargetConfig.from_dict(kimi)
    assert "group-limited" not in str(e.value)


def test_moe_path_choice_and_refusals(tmp_path):
    t = make_target(tmp_path / "t", "qwen3_moe", layers=2, hidden=32, vocab=64)
    make_drafter(tmp_path / "d", t)
    assert moe_export.choose_path(None, "fp16") == "standard"
    assert moe_export.choose_path(None, "fp32") == ("op" if moe_export.ort_has_op() else "standard")
    runner = CliRunner()
    for args, msg in [(["--moe", "op", "--dtype", "fp16"], "float32 only"), (["--moe", "fancy"], "'fancy' is not one of")]:
        r = runner.invoke(cli, ["export", "--target", str(t), "--draft", str(tmp_path / "d"), "--out",
                                str(tmp_path / "o"), *args])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output, r.output
        assert not (tmp_path / "o").exists()
    dense = make_target(tmp_path / "dense", "qwen3", layers=2, hidden=32, vocab=64)
    r = runner.invoke(cli, ["export", "--target", str(dense), "--draft", str(tmp_path / "d"), "--out",
                            str(tmp_path / "o"), "--moe", "op"])
    assert r.exit_code == 2 and "has no experts" in r.output, r.output
    assert "com.microsoft::MoE" in runner.invoke(cli, ["export", "--help"]).output


# -- exported both ways, run losslessly ----------------------------------------------------

CASES = {  # tiny exports, cached by content (tests/runtime_cases.py); unbiased: every token depends on the experts
    "qwen3_moe-op": Case("qwen3_moe", layers=3, block=6, hidden=32, max_context=160, moe="op",
                         moe_config=(("mlp_only_layers", (1,)), ("norm_topk_prob", False))),
    "qwen3_moe-standard": Case("qwen3_moe", layers=3, block=6, hidden=32, max_context=160, moe="standard",
                               moe_config=(("mlp_only_layers", (1,)), ("norm_topk_prob", False))),
    # the VL class's text model: gated attention + DeltaNet, every MLP experts + shared expert
    "qwen35_moe-vl-op": Case("qwen35_moe-vl", layers=2, block=4, hidden=32, seed=2, max_context=160, moe="op",
                             layer_types=(LIN, FULL)),
    "qwen3_next-standard": Case("qwen3_next", layers=3, block=6, hidden=32, seed=1, max_context=160,
                                moe="standard", layer_types=(LIN, FULL, LIN), moe_config=(("mlp_only_layers", (0,)),)),
}


def _hf_greedy(hf, prompt: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=list(eos),
                           pad_token_id=eos[0])[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", CASES)
def test_runtime_greedy_equals_transformers(name):
    """Speculative greedy decoding by the runtime loop over the exported graphs == transformers'
    own greedy generate (and plain decoding through the same graphs), on several prompts; and
    with drafts forced wrong at each block position in turn (a rollback after every count of
    accepted drafts)."""
    tdir, _, out = artifact(CASES[name])
    m = M.load_manifest(out)
    assert m.moe["path"] == CASES[name].moe and m.moe["experts"] == 4 and m.moe["top_k"] == 2
    hf, be, eos = hf_model(tdir), OrtBackend(out, threads=1, max_chunk=16), tuple(m.eos_token_ids)
    taus = []
    for i, prompt in enumerate(prompts(5, m.vocab_size, seed=7)):
        n = 16 + 4 * i
        g = generate(be, prompt, n)
        ref = _hf_greedy(hf, prompt, n, eos)
        assert g.tokens == ref, (name, i)
        assert generate(be, prompt, n, draft=False).tokens == ref, (name, i)
        taus.append(g.tau)
    rejected_everywhere(be, prompt, 12, ref[:12])
    print(f"{name}: 5 prompts identical to transformers' greedy, tau {np.mean(taus):.2f}; rollbacks at every position")


@pytest.mark.parametrize("name", ["qwen3_moe-op", "qwen3_moe-standard"])
def test_batched_rows_equal_their_batch1_output(name):
    """Rows of one batch go through the MoE flattened (one call): each row == its batch-1 output."""
    _, _, out = artifact(CASES[name])
    be1, be3 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=3)
    ps = prompts(5, be1.manifest.vocab_size, seed=3)
    refs = [generate(be1, p, 12 + 3 * i, stop_token_ids=()).tokens for i, p in enumerate(ps)]
    gens, stats = generate_batch(be3, [Request(p, 12 + 3 * i, stop_token_ids=()) for i, p in enumerate(ps)])
    assert [g.tokens for g in gens] == refs and stats.rounds > 0


@pytest.mark.parametrize("name", ["qwen3_moe-op", "qwen3_next-standard"])
def test_check_parity_per_graph_and_end_to_end(name):
    tdir, ddir, out = artifact(CASES[name])
    r = CliRunner().invoke(cli, ["check", str(out), "--target", str(tdir), "--draft", str(ddir), "--num-prompts", "3",
                                 "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    rows = [row for g in rep["graphs"].values() for row in g]
    worst = max(row["max"] for row in rows if row["max"] is not None)
    print(f"check {name}: {len(rows)} outputs, worst max abs error {worst:.1e} (tolerance {rep['tolerance']})")
    assert rep["passed"] and worst <= 1e-4 and rep["end_to_end"]["identical"] == 3

