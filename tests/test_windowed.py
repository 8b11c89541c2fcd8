"""gpt-oss and Gemma 4 targets (models/windowed.py): sliding and full attention layers, the
sliding layers' rings (runtime/window.py), and the families' own attention.

References: transformers' own GptOssForCausalLM / Gemma4ForCausalLM (logits, taps, greedy
`generate`) and the official z-lab `dflash_generate` with its own DFlashDraftModel over the
same drafter files (tokens and rounds). The tiny pairs (tests/runtime_cases.py WINDOWED_CASES)
have a window of 4, so every prompt wraps the rings, and a biased target, so rounds accept
some drafts and roll the rest back.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from runtime_cases import GEMMA4_MOE, WINDOWED_CASES, artifact, prompts

from dflash_export.cli.info import describe
from dflash_export.runtime.errors import DFlashError
from dflash_export.export.check import run_check
from dflash_export.export.trt_build import build_plan
from dflash_export.models import Target, TargetConfig
from dflash_export.runtime import contract as C
from dflash_export.runtime.loop import Request, generate, generate_batch
from dflash_export.runtime.manifest import load_manifest
from dflash_export.runtime.memory import cache_bytes_per_position, ring_bytes
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.window import WindowRings
from dflash_export.models.tiny import hf_model, make_target

SW, FA = "sliding_attention", "full_attention"
TARGETS = {  # family features a test pair does not cover: a longer window, Gemma's double-wide shared MLPs
    "gpt_oss": dict(layer_types=[SW, FA, SW, FA, SW], window=5),
    "gemma4": dict(layer_types=[SW, SW, FA, SW, FA, SW], window=3,
                   extra=dict(num_kv_shared_layers=2, hidden_size_per_layer_input=8, use_double_wide_mlp=True)),
    "gemma4-moe": dict(layer_types=[SW, FA, SW], window=3, extra=dict(GEMMA4_MOE, top_k_experts=3)),
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_targets_match_transformers(tmp_path, name):
    """Logits and every tap against transformers, in one pass and position by position on the cache."""
    arch = name.split("-")[0]
    d = make_target(tmp_path, arch, layers=len(TARGETS[name]["layer_types"]), hidden=32, **TARGETS[name])
    hf = hf_model(d)
    ours = Target.from_pretrained(d, list(range(hf.config.num_hidden_layers)))
    ids = torch.randint(0, 99, (1, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True, use_cache=False)
        taps = torch.cat(ref.hidden_states[1:], -1)
        logits, got, _ = ours(ids, torch.arange(15)[None], ours.empty_kv())
        cache, steps = ours.new_cache(15), []
        for a, b in ((0, 6), *((j, j + 1) for j in range(6, 15))):  # prefill, then steps past the window
            steps.append(ours(ids[:, a:b], torch.arange(a, b)[None], cache)[0])
            cache.commit(b - a)
    scale = taps.abs().max()
    assert (got - taps).abs().max() <= 1e-5 * scale, (got - taps).abs().max()
    for mine in (logits, torch.cat(steps, 1)):
        assert (mine - ref.logits).abs().max() < 1e-4


def test_yarn_dense_target_matches_transformers(tmp_path):
    """YaRN on a Qwen3 target (its attention factor scales cos and sin, so the scores by its square)."""
    make_target(tmp_path, "qwen3", layers=2, hidden=32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                              "original_max_position_embeddings": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert TargetConfig.load(tmp_path).rope.attention_factor > 1.1
    ids = torch.randint(0, 99, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf_model(tmp_path)(ids, use_cache=False).logits
        ours = Target.from_pretrained(tmp_path)
        got = ours(ids, torch.arange(40)[None], ours.empty_kv())[0]
    assert (got - ref).abs().max() < 1e-4


@pytest.fixture(scope="module", params=list(WINDOWED_CASES))
def pair(request):
    return request.param, artifact(WINDOWED_CASES[request.param])


def test_check_passes_with_wrapped_rings(pair):
    """Every graph in every regime (a past beyond the window included), ragged rows, and end to end."""
    name, (t, d, out) = pair
    report = run_check(out, t, d, prompts=3, max_new_tokens=16, progress=False)
    print(report.summary())
    assert report.passed, report.summary()
    assert any("rings wrapped" in r.case for r in report.rows)
    # the experts' graph form: gpt-oss on ONNX Runtime's MoE op, Gemma 4's GeGLU in standard ops
    path = {"gpt_oss": "op", "gemma4": "standard"}[name]
    assert load_manifest(out).moe["path"] == path
    ops = {n.op_type for n in onnx.load(out / "target.onnx", load_external_data=False).graph.node}
    assert ("MoE" in ops) == (path == "op"), ops


def test_greedy_equals_official_and_transformers(pair, monkeypatch):
    """Token for token transformers' greedy `generate`; round for round the official z-lab loop over
    transformers' target (its cache crops sliding layers itself) with its own drafter class."""
    from dflash import model as dm

    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # its stats sync CUDA; no GPU here
    name, (t, d, out) = pair
    hf = hf_model(t)
    official = dm.DFlashDraftModel.from_pretrained(str(d), dtype=torch.float32).eval()
    backend, accepted = OrtBackend(out), []
    for prompt in prompts(3, 100, seed=4):
        n = 20
        ours = generate(backend, prompt, n, stop_token_ids=())
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        ref = dm.dflash_generate(official, hf, torch.tensor([prompt]), n, None, return_stats=True)
        assert ours.tokens == plain[0, len(prompt):].tolist() == ref.output_ids[0, len(prompt):].tolist(), name
        assert ours.acceptance_lengths == ref.acceptance_lengths, name
        accepted += ours.acceptance_lengths
    assert 1 < np.mean(accepted) < WINDOWED_CASES[name].block, accepted  # drafts accepted and rolled back


def test_batched_rows_equal_each_alone(pair):
    """Three rows of different lengths in one batch (the rings per row, all bound at once) decode
    exactly as each prompt alone."""
    _, (_, _, out) = pair
    ps = prompts(3, 100, seed=5)
    alone = [generate(OrtBackend(out), p, 16, stop_token_ids=()).tokens for p in ps]
    gens, _ = generate_batch(OrtBackend(out, max_batch=3), [Request(p, 16, stop_token_ids=()) for p in ps])
    assert [g.tokens for g in gens] == alone


def test_rings_keep_committed_positions_only(pair):
    """A call's new K/V reach a ring only when committed: a rejected draft never overwrites a slot
    the window still needs, and a long chunk leaves its last `ring` positions."""
    _, (_, _, out) = pair
    m = load_manifest(out)
    rings = WindowRings(m, max_chunk=16, max_batch=2)
    R, i = rings.ring, rings.layers[0]
    key, new = f"past_key.{i}", f"new_key.{i}"
    lengths = np.array([0, 0])

    def call(rows, seq, start, keep):
        rings.layout(len(rows), seq)
        view = rings.view(new)
        for r, b in enumerate(rows):
            view[r] = (start[r] + np.arange(seq))[:, None, None]  # every value: its position
        rings.commit_rows(rows, keep, lengths)
        lengths[rows] += keep

    call([0, 1], 9, [0, 0], [9, 3])  # a chunk longer than the ring; a row that keeps 3 of 9
    call([0, 1], 4, [9, 3], [1, 4])  # a verify of 4 that keeps 1, one that keeps all
    for b, n in enumerate(lengths):
        held = rings.buf[key][b, :, 0, 0]
        for s in range(min(n, R)):
            assert held[s] == n - 1 - (n - 1 - s) % R  # slot s: the newest committed position = s mod ring


def test_ring_memory_is_flat_in_the_context(pair):
    """The sliding layers' rings do not grow with max context; the full layers' caches do."""
    _, (_, _, out) = pair
    m = load_manifest(out)
    small, large = (dataclasses.replace(m, max_context=n) for n in (512, 8192))
    assert WindowRings(small, 16).nbytes() == WindowRings(large, 16).nbytes() > 0
    assert ring_bytes(small) == ring_bytes(large) > 0
    full = C.layer_kinds(C.TARGET, m).count(C.ATTENTION)
    assert cache_bytes_per_position(m, drafter=False) == 2 * full * m.target_kv_heads * m.target_head_dim * 4


def test_info_names_the_family_and_its_attention(pair):
    name, (_, _, out) = pair
    t = describe(out, verify=False)["target"]
    kinds = t["attention_kinds"]
    assert t["family"] == name and set(kinds) == {SW, FA}
    assert kinds[SW]["cache"] == "ring of 4 slots" and kinds[SW]["window"] == 4
    assert t["experts"] == {"experts": 4, "top_k": 2, "activation": {"gpt_oss": "swiglu", "gemma4": "geglu"}[name],
                            "path": {"gpt_oss": "op", "gemma4": "standard"}[name]}
    if name == "gemma4":  # layers 2 and 3 read layers 0 and 1's K/V; full layers have their own shape
        assert t["kv_shared"] == {2: 0, 3: 1} and kinds[FA]["head_dim"] == 2 * kinds[SW]["head_dim"]
        assert t["final_logit_softcapping"] == 30.0
    else:
        assert t["sinks"] and kinds[SW]["rope"] == "yarn"


def test_unsupported_variants_are_one_line_errors(pair, tmp_path):
    name, (t, _, out) = pair
    for model_type, arch in (("deepseek_v3", "DeepseekV3ForCausalLM"), ("kimi_k25", "Kimi_K25ForConditionalGeneration")):
        with pytest.raises(DFlashError, match=r"multi-head latent attention \(MLA.*group-limited expert routing") as e:
            TargetConfig.from_dict({"architectures": [arch], "model_type": model_type})
        assert "\n" not in str(e.value)
    with pytest.raises(DFlashError, match="TensorRT engines for .* are not built in this version"):
        build_plan(load_manifest(out))
    if name == "gemma4":
        cfg = json.loads((t / "config.json").read_text())
        with pytest.raises(DFlashError, match="use_bidirectional_attention='all'"):
            TargetConfig.from_dict({**cfg, "use_bidirectional_attention": "all"})


# harmony-format turns (gpt-oss's chat format) with the Jinja its template relies on: a macro, a
# namespace, strftime_now, raise_exception, tojson (written here for the test, not the released file)
HARMONY = """{%- macro header() -%}You are a model.\\nCurrent date: {{ strftime_now("%Y-%m-%d") }}\\n
{%- endmacro -%}
<|start|>system<|message|>{{ header() }}<|end|>
{%- set seen = namespace(user=false) -%}
{%- for m in messages -%}
{%- if m.role not in ("system", "developer", "user", "assistant") %}{{ raise_exception("unknown role") }}{% endif -%}
{%- if m.role == "user" %}{% set seen.user = true %}{% endif -%}
<|start|>{{ m.role }}<|message|>{{ m.content if m.content is string else m.content | tojson }}<|end|>
{%- endfor -%}
{%- if add_generation_prompt and seen.user %}<|start|>assistant{% endif -%}"""


def test_served_chat_renders_the_checkpoint_template(tmp_path):
    """A template saved as transformers 5 saves it (chat_template.jinja) travels with the export and
    renders as transformers renders it; two chats served at once by the batched engine answer what
    offline decoding of the rendered prompts gives."""
    import asyncio
    import shutil

    from test_runtime_cli import char_tokenizer
    from test_serve import _call

    from dflash_export.runtime import manifest as M
    from dflash_export.serve.app import ServeOptions, create_app
    from dflash_export.serve.engine import load_engine
    from dflash_export.serve.text import Text

    art = tmp_path / "art"
    shutil.copytree(artifact(WINDOWED_CASES["gpt_oss"])[2], art)
    char_tokenizer(art / "tokenizer.json")
    (art / "chat_template.jinja").write_text(HARMONY)
    m = M.load_manifest(art, verify=False)
    m.tokenizer = True
    M.write_manifest(art, m)
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
             [{"role": "user", "content": "count: 1 2 3"}]]
    text = Text(art)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(art / "tokenizer.json"))
    hf.chat_template = HARMONY
    rendered = [text.render(c) for c in chats]
    assert rendered == [hf.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    assert rendered[0].startswith("<|start|>system<|message|>You are a model.") and rendered[0].endswith("<|start|>assistant")
    backend = OrtBackend(art)
    offline = [text.decode(generate(backend, text.encode(r), 10, stop_token_ids=()).tokens) for r in rendered]
    engine = load_engine(ServeOptions(art, model_name="m", max_batch=2))
    app = create_app(ServeOptions(art), engine=engine)

    async def both():
        return await asyncio.gather(*(_call(app, "POST", "/v1/chat/completions", json.dumps(
            {"messages": c, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).encode()) for c in chats))
    try:
        answers = asyncio.run(asyncio.wait_for(both(), 120))
    finally:
        engine.close()
    assert [a[0] for a in answers] == [200, 200], answers
    assert [a[1]["choices"][0]["message"]["content"] for a in answers] == offline


# -- experts: gpt-oss on ONNX Runtime's MoE op, released MXFP4 weights, Gemma 4's GeGLU refused there --


def test_gpt_oss_experts_on_the_contrib_op():
    """com.microsoft::MoE with activation_alpha 1.702, activation_beta 1, swiglu_limit 7 and
    swiglu_fusion 1 over the transposed [E, 2I, H] weights and the biases is transformers' own
    GptOssMLP (biased router, top-k then softmax, clamped SwiGLU), with the clamp engaged."""
    from onnx import TensorProto, helper, numpy_helper
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from dflash_export.export import moe as moe_export

    if not moe_export.ort_has_op():
        pytest.skip("this onnxruntime has no CPU MoE kernel")
    torch.manual_seed(0)
    block = GptOssMLP(transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=8,
                                                num_experts_per_tok=3))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
    ex = block.experts
    inits = {"fc1": ex.gate_up_proj.transpose(1, 2), "fc1_bias": ex.gate_up_proj_bias,
             "fc2": ex.down_proj.transpose(1, 2), "fc2_bias": ex.down_proj_bias}
    node = helper.make_node("MoE", ["x", "logits", "fc1", "fc1_bias", "fc2", "fc2_bias"], ["y"], domain="com.microsoft",
                            k=3, activation_type="swiglu", activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0,
                            swiglu_fusion=1, normalize_routing_weights=1)
    io = lambda n, w: helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, w])  # noqa: E731
    graph = helper.make_graph([node], "moe", [io("x", 32), io("logits", 8)], [io("y", 32)],
                              [numpy_helper.from_array(t.detach().contiguous().numpy(), n) for n, t in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for tokens in (1, 6, 16):
        x = torch.randn(tokens, 32) * 2
        with torch.no_grad():
            ref = block(x[None])[0][0]
            logits = block.router(x)[0]
            gate = (x @ ex.gate_up_proj + ex.gate_up_proj_bias[:, None])[..., ::2]
        assert gate.max() > 7, "the clamp should be exercised"
        got = sess.run(None, {"x": x.numpy(), "logits": logits.numpy()})[0]
        err, scale = float(np.abs(got - ref.numpy()).max()), float(ref.abs().max())
        print(f"gpt-oss experts, {tokens} tokens: max abs error {err:.1e} on values up to {scale:.0f} "
              f"(tolerance 1e-6 x that)")
        assert err <= 1e-6 * scale


def test_gemma4_experts_refuse_the_contrib_op():
    from dflash_export.export import moe as moe_export

    assert moe_export.choose_path(None, "fp32", "geglu") == "standard"
    with pytest.raises(DFlashError, match="SwiGLU experts only.*GEGLU.*--moe standard") as e:
        moe_export.choose_path("op", "fp32", "geglu")
    assert "\n" not in str(e.value)


def _mxfp4(directory, rng):
    """Rewrite a tiny gpt-oss checkpoint as the released ones are: every expert tensor as MXFP4
    blocks and scales (random codes, exponents around 2^0), plus its quantization_config."""
    from safetensors.torch import load_file, save_file

    f = directory / "model.safetensors"
    state, packed = load_file(f), {}
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows_cols = state.pop(name).transpose(1, 2).shape  # the checkpoint's [E, rows, cols]
        e, rows, cols = rows_cols
        packed[name + "_blocks"] = torch.from_numpy(rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8))
        packed[name + "_scales"] = torch.from_numpy(rng.integers(121, 126, (e, rows, cols // 32), dtype=np.uint8))
    save_file({**state, **packed}, str(f), metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (directory / "config.json").write_text(json.dumps(cfg))
    return packed


def test_mxfp4_experts_load_as_transformers_dequantises_them(tmp_path):
    """Released gpt-oss experts (MXFP4 blocks + scales) load as transformers' own converter reads
    them, and the target then equals transformers' model holding those weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    d = make_target(tmp_path, "gpt_oss", layers=2, hidden=64, intermediate=64, layer_types=[SW, FA])  # blocks of 32
    hf = hf_model(d)
    packed = _mxfp4(d, np.random.default_rng(0))
    ours = Target.from_pretrained(d, [0, 1])
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{i}.mlp.experts.{proj}"
                ref = convert_moe_packed_tensors(packed[name + "_blocks"], packed[name + "_scales"], dtype=torch.float32)
                getattr(layer.mlp.experts, proj).copy_(ref)
                assert torch.equal(getattr(ours.model.layers[i].mlp.experts, proj), ref.transpose(1, 2))
        ids = torch.randint(0, 99, (1, 9), generator=torch.Generator().manual_seed(3))
        ref = hf(ids, use_cache=False).logits
        got = ours(ids, torch.arange(9)[None], ours.empty_kv())[0]
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max(), (got - ref).abs().max()
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(DFlashError, match="quantization_config 'gptq' is not supported"):
        TargetConfig.from_dict({**cfg, "quantization_config": {"quant_method": "gptq"}})


@pytest.mark.parametrize("name", ["gpt_oss", "gemma4-moe"])
def test_experts_graph_forms_equal_the_reference(tmp_path, name):
    """Both graph forms export/moe.py installs (standard ops; the MoE op's torch semantics) give the
    reference's logits, on gpt-oss (biases, clamp) and Gemma 4 (per_expert_scale folded)."""
    from dflash_export.export import moe as moe_export

    arch = name.split("-")[0]
    d = make_target(tmp_path, arch, layers=len(TARGETS[name]["layer_types"]), hidden=32, **TARGETS[name])
    ids = torch.randint(0, 99, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        target = Target.from_pretrained(d)
        ref = target(ids, torch.arange(12)[None], target.empty_kv())[0]
        for path in ("standard", "op") if arch == "gpt_oss" else ("standard",):
            target = Target.from_pretrained(d)
            moe_export.use_path(target, path)
            got = target(ids, torch.arange(12)[None], target.empty_kv())[0]
            err = float((got - ref).abs().max())
            print(f"{name} {path}: max abs error {err:.1e} (tolerance 1e-5)")
            assert err <= 1e-5


def test_gpt_oss_experts_quantize_with_their_biases_and_clamp():
    """`quantize` turns gpt-oss's MoE node into QMoE: the expert biases and the clamped SwiGLU's
    attributes carry over (int8 block-wise stays within a few percent of the float node)."""
    from onnx import TensorProto, helper, numpy_helper

    from dflash_export.export import moe as moe_export

    if not moe_export.ort_has_op():
        pytest.skip("this onnxruntime has no CPU MoE kernel")
    rng = np.random.default_rng(0)
    E, H, I = 8, 32, 16
    inits = {"fc1": rng.normal(0, 0.5, (E, 2 * I, H)), "fc1_bias": rng.normal(0, 2.0, (E, 2 * I)),
             "fc2": rng.normal(0, 0.5, (E, H, I)), "fc2_bias": rng.normal(0, 2.0, (E, H))}
    node = helper.make_node("MoE", ["x", "logits", "fc1", "fc1_bias", "fc2", "fc2_bias"], ["y"], domain="com.microsoft",
                            k=3, activation_type="swiglu", activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0,
                            swiglu_fusion=1, normalize_routing_weights=1)
    io = lambda n, w: helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, w])  # noqa: E731
    graph = helper.make_graph([node], "moe", [io("x", H), io("logits", E)], [io("y", H)],
                              [numpy_helper.from_array(a.astype(np.float32), n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    feed = {"x": rng.normal(0, 2, (6, H)).astype(np.float32), "logits": rng.normal(size=(6, E)).astype(np.float32)}
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    moe_export.to_qmoe(model, bits=8, block=16, symmetric=True)
    assert [n.op_type for n in model.graph.node] == ["QMoE"]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    err, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    print(f"gpt-oss experts int8: max abs error {err:.2e} on values up to {scale:.1f} (tolerance 0.05 x that)")
    assert err <= 0.05 * scale
