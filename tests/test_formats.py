"""Drafter configs as released (tests/fixtures/drafter-configs), tiny weights in their layout,
round trips, and one refusal per kind of bad checkpoint, each with its message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_export.models import (
    DraftConfig, Drafter, KVCache, Target, TargetConfig, default_target_layer_ids, speculative_generate,
)
from dflash_export.models.rope import parse_rope
from dflash_export.runtime.errors import DFlashError
from dflash_export.models.tiny import make_target
from runtime_cases import FIXTURES, shrink_released

SUPPORTED = ["qwen3-8b-dflash-b16.config.json", "qwen3.5-27b-dflash.config.json",
             "qwen3.6-27b-dflash.partial-config.json"]
L_TINY, H_TINY, V_TINY = 8, 32, 64


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def shrink(cfg: dict) -> dict:
    """Same keys and structure, tiny sizes: hidden 32, 4 heads (2 kv) of 8, an 8-layer target
    (explicit tap ids scaled into it, derived ones left to derive), vocab 64, window 3."""
    return shrink_released(cfg, L_TINY, H_TINY, V_TINY)


def z_lab_rule(L: int, n: int) -> list[int]:
    return [L // 2] if n == 1 else [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("t") / "qwen3", arch="qwen3", seed=7, vocab=V_TINY, hidden=H_TINY,
                       layers=L_TINY, heads=4, kv_heads=2, head_dim=8, intermediate=48)


def write_drafter(cfg: dict, directory: Path, seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    d = Drafter(DraftConfig.from_dict(cfg))
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    d.save_pretrained(directory)
    return d


# -- the released configs, as they are --------------------------------------------------


def test_all_fixtures_are_here():
    names = sorted(p.name for p in FIXTURES.glob("*.json"))
    assert names == sorted(SUPPORTED + ["dflash2-unsupported.config.json"])


def test_flat_config_derives_target_layer_ids():
    c = DraftConfig.from_dict(fixture("qwen3-8b-dflash-b16.config.json"))
    assert c.target_layer_ids == z_lab_rule(36, 5) == [1, 9, 17, 25, 33]
    assert c.block_size == 16 and c.num_target_layers == 36 and c.mask_token_id is None
    assert c.layer_types == ["full_attention"] * 5 and c.sliding_window is None
    assert c.rope.theta == 1e6 and c.rope.kind == "default"


@pytest.mark.parametrize("L", [4, 5, 8, 28, 32, 36, 48, 64])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_default_target_layer_ids_is_the_z_lab_rule(L, n):
    ids = default_target_layer_ids(L, n)
    assert ids == z_lab_rule(L, n) and len(ids) == n
    assert all(0 <= i < L for i in ids)


def test_nested_config_and_null_mask_token():
    c = DraftConfig.from_dict(fixture("qwen3.5-27b-dflash.config.json"))
    assert c.target_layer_ids == [3, 15, 31, 47, 59] and c.block_size == 16 and c.rope.theta == 1e7
    with pytest.raises(DFlashError, match=r"no mask_token_id .*--mask-token-id"):
        c.resolve_mask_token_id()
    assert c.resolve_mask_token_id(248077) == 248077


def test_sliding_layers_config():
    c = DraftConfig.from_dict(fixture("qwen3.6-27b-dflash.partial-config.json"))
    assert c.mask_token_id == c.resolve_mask_token_id() == 248070
    assert c.target_layer_ids == [1, 16, 31, 46, 61] and c.sliding_window == 2048
    assert [c.layer_window(j) for j in range(5)] == [2048] * 4 + [None]
    assert [c.layer_causal(j) for j in range(5)] == [True] * 4 + [False]  # z-lab: sliding layers are causal


def test_block_size_top_level_or_nested():
    cfg = fixture("qwen3.5-27b-dflash.config.json")
    del cfg["block_size"]
    cfg["dflash_config"]["block_size"] = 10
    assert DraftConfig.from_dict(cfg).block_size == 10
    del cfg["dflash_config"]["block_size"]
    assert DraftConfig.from_dict(cfg).block_size == 16  # z-lab's default


def test_sliding_window_needs_use_sliding_window():
    """As transformers' Qwen3Config (z-lab's drafter config class): no use_sliding_window, no window."""
    cfg = fixture("qwen3.6-27b-dflash.partial-config.json")
    cfg["use_sliding_window"] = False
    c = DraftConfig.from_dict(cfg)
    assert c.sliding_window is None and c.layer_window(0) is None and c.layer_causal(0)
    cfg = fixture("qwen3-8b-dflash-b16.config.json")  # no layer_types: max_window_layers decides
    del cfg["layer_types"]
    cfg.update(use_sliding_window=True, sliding_window=64, max_window_layers=3)
    c = DraftConfig.from_dict(cfg)
    assert c.layer_types == ["full_attention"] * 3 + ["sliding_attention"] * 2 and c.layer_window(4) == 64


@pytest.mark.parametrize("rope,kind,theta", [
    ({"rope_theta": 5e5}, "default", 5e5),
    ({"rope_parameters": {"rope_theta": 2e6, "rope_type": "default"}}, "default", 2e6),
    ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "llama3", 5e5),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, "linear", 1e4),
    ({}, "default", 1e4),
])
def test_rope_settings(rope, kind, theta):
    cfg = {k: v for k, v in fixture("qwen3.5-27b-dflash.config.json").items()
           if k not in ("rope_theta", "rope_scaling")}
    c = DraftConfig.from_dict({**cfg, **rope})
    assert c.rope.kind == kind and c.rope.theta == theta


# -- tiny weights in each layout: load, fit, run, round trip -------------------------------


@pytest.mark.parametrize("name", SUPPORTED)
def test_fixture_layout_loads_and_round_trips(tmp_path, tiny_target_dir, name):
    cfg = shrink(fixture(name))
    d1, d2 = tmp_path / "a", tmp_path / "b"
    original = write_drafter(cfg, d1)
    keys = set(load_file(d1 / "model.safetensors"))
    assert "fc.weight" in keys and "hidden_norm.weight" in keys and "layers.0.self_attn.q_norm.weight" in keys
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)  # the drafter owns neither

    loaded = Drafter.from_pretrained(d1)
    assert json.loads((d1 / "config.json").read_text()) == cfg
    tc = TargetConfig.load(tiny_target_dir)
    loaded.config.check_fits(tc)
    if name.startswith("qwen3-8b"):  # flat: derived for the 8-layer target
        assert loaded.config.target_layer_ids == z_lab_rule(L_TINY, cfg["num_hidden_layers"])
    target = Target.from_pretrained(tiny_target_dir, tap_ids=loaded.config.target_layer_ids)
    mask = loaded.config.resolve_mask_token_id(V_TINY - 3)

    def run(d: Drafter) -> torch.Tensor:
        with torch.no_grad():
            _, taps, _ = target(torch.arange(9)[None] + 3, torch.arange(9)[None], target.empty_kv())
            past = d.context_kv(taps, torch.arange(9)[None])
            block = torch.tensor([[5] + [mask] * (d.config.block_size - 1)])
            return d.draft_logits(target, block, torch.arange(9, 9 + d.config.block_size)[None], past)

    out = run(loaded)
    assert torch.equal(out, run(original)) and out.std() > 0
    loaded.save_pretrained(d2)
    assert (d2 / "config.json").read_bytes() == (d1 / "config.json").read_bytes()
    assert torch.equal(run(Drafter.from_pretrained(d2)), out)
    g = speculative_generate(target, loaded, [3, 4, 5], 12, mask_token_id=mask)
    assert len(g.tokens) == 12


# -- refusals ---------------------------------------------------------------------------


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def test_dflash2_loads_and_unknown_architectures_are_refused(tmp_path):
    from dflash_export.models.dflash2 import DFlash2Config, load_draft_config

    (tmp_path / "config.json").write_text(json.dumps(fixture("dflash2-unsupported.config.json")))
    c = load_draft_config(tmp_path)  # the released DFlash 2 config (tests/test_dflash2.py checks its tensors)
    assert isinstance(c, DFlash2Config) and c.family == "dflash2" and c.selector_top_k == 16
    cfg = fixture("dflash2-unsupported.config.json")
    cfg["architectures"] = ["DFlash3DraftModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=r"architecture 'DFlash3DraftModel' is not supported \(supported: "
                                          r"DFlashDraftModel, DFlash2DraftModel\)") as e:
        load_draft_config(tmp_path)
    one_line(e)
    # the DFlash2 features under the DFlash architecture name are refused, not half-read
    cfg["architectures"] = ["DFlashDraftModel"]
    with pytest.raises(DFlashError, match=r"DFlash2 features are not supported: selector_rank, conv_kernel_size"):
        DraftConfig.from_dict(cfg)


@pytest.fixture()
def good_drafter(tmp_path):
    d = tmp_path / "drafter"
    write_drafter(shrink(fixture("qwen3.5-27b-dflash.config.json")), d)
    return d


def test_a_drafter_loads_with_its_own_config_only(good_drafter):
    """export and check parse config.json once and hand it to the load (load_drafter's config);
    a config of the other family is refused in one line, not half-used."""
    from dflash_export.models.dflash2 import DFlash2Drafter, load_draft_config, load_drafter

    c = load_draft_config(good_drafter)
    assert type(load_drafter(good_drafter, config=c)) is Drafter and type(load_drafter(good_drafter)) is Drafter
    with pytest.raises(DFlashError, match=r"a DraftConfig cannot build a DFlash2Drafter") as e:
        DFlash2Drafter.from_pretrained(good_drafter, config=c)
    one_line(e)


def _rewrite(directory: Path, edit) -> None:
    state = load_file(directory / "model.safetensors")
    edit(state)
    save_file(state, str(directory / "model.safetensors"))


def test_extra_tensors_are_refused(good_drafter):
    _rewrite(good_drafter, lambda s: s.update({"candidate_selector.hidden_projection.weight": torch.zeros(4, 32)}))
    with pytest.raises(DFlashError, match=r"unsupported tensors candidate_selector\.hidden_projection\.weight; "
                                          r"this variant is not implemented") as e:
        Drafter.from_pretrained(good_drafter)
    one_line(e)


def test_missing_tensors_are_refused(good_drafter):
    _rewrite(good_drafter, lambda s: s.pop("layers.0.mlp.up_proj.weight"))
    with pytest.raises(DFlashError, match=r"missing tensors layers\.0\.mlp\.up_proj\.weight"):
        Drafter.from_pretrained(good_drafter)


def test_shape_mismatch_is_refused(good_drafter):
    _rewrite(good_drafter, lambda s: s.update({"fc.weight": torch.zeros(32, 64)}))
    with pytest.raises(DFlashError, match=r"tensor fc\.weight has shape \[32, 64\], expected \[32, 160\]"):
        Drafter.from_pretrained(good_drafter)


def test_drafter_that_does_not_fit_the_target_is_refused(tiny_target_dir):
    tc = TargetConfig.load(tiny_target_dir)
    base = shrink(fixture("qwen3.5-27b-dflash.config.json"))
    cases = [
        ({"hidden_size": 48}, r"hidden_size 48 does not match the target's 32"),
        ({"num_target_layers": 12}, r"num_target_layers 12 does not match the target's 8 layers"),
        ({"dflash_config": {"target_layer_ids": [1, 8], "mask_token_id": None}},
         r"target_layer_ids \[8\] are outside the target's 8 layers"),
        ({"vocab_size": 65}, r"vocab_size 65 does not match the target's 64"),
    ]
    for change, msg in cases:
        with pytest.raises(DFlashError, match=msg) as e:
            DraftConfig.from_dict({**base, **change}).check_fits(tc)
        one_line(e)


def _target_config(tiny_target_dir, tmp_path, edit) -> Path:
    d = tmp_path / "target"
    d.mkdir()
    cfg = json.loads((tiny_target_dir / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    for p in tiny_target_dir.glob("*.safetensors"):
        (d / p.name).write_bytes(p.read_bytes())
    return d


def test_unsupported_target_architecture_is_refused(tiny_target_dir, tmp_path):
    d = _target_config(tiny_target_dir, tmp_path, lambda c: c.update(architectures=["MistralForCausalLM"]))
    with pytest.raises(DFlashError, match=r"architecture 'MistralForCausalLM' is not supported \(supported: "
                                          r"LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3_5ForCausalLM, "
                                          r"Qwen3_5ForConditionalGeneration, Qwen3MoeForCausalLM, Qwen3_5MoeForCausalLM, "
                                          r"Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM, GptOssForCausalLM, Gemma4ForCausalLM, "
                                          r"Gemma4ForConditionalGeneration\)") as e:
        Target.from_pretrained(d)
    one_line(e)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_is_refused(tiny_target_dir, tmp_path, key):
    def edit(c):
        c.pop("rope_parameters", None)
        c[key] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 32}
    d = _target_config(tiny_target_dir, tmp_path, edit)
    with pytest.raises(DFlashError, match=r"rope type 'longrope' is not supported \(supported: default, linear, "
                                          r"llama3, yarn, proportional\)"):
        Target.from_pretrained(d)
    with pytest.raises(DFlashError, match=r"rope type 'dynamic' is not supported"):
        parse_rope({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "drafter")


def test_missing_config_and_weights_are_refused(tiny_target_dir, good_drafter, tmp_path):
    with pytest.raises(DFlashError, match=r"does not exist"):
        Target.from_pretrained(tmp_path / "nowhere")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((good_drafter / "model.safetensors").read_bytes())
    with pytest.raises(DFlashError, match=r"has no config\.json; pass a Hugging Face checkpoint directory") as e:
        Drafter.from_pretrained(no_config)
    one_line(e)
    (good_drafter / "model.safetensors").unlink()
    with pytest.raises(DFlashError, match=r"drafter directory .* has no \*\.safetensors weights"):
        Drafter.from_pretrained(good_drafter)
    # a shard index naming a shard that is not there
    d = _target_config(tiny_target_dir, tmp_path, lambda c: None)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002.safetensors"}}))
    with pytest.raises(DFlashError, match=r"shard model-00002\.safetensors listed in the index is missing"):
        Target.from_pretrained(d)
    (d / "model.safetensors").write_bytes(b"not safetensors")
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(DFlashError, match=r"unreadable safetensors file"):
        Target.from_pretrained(d)


def test_target_extra_tensor_is_refused(tiny_target_dir, tmp_path):
    d = _target_config(tiny_target_dir, tmp_path, lambda c: None)
    _rewrite(d, lambda s: s.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(32)}))
    with pytest.raises(DFlashError, match=r"unsupported tensors model\.layers\.0\.self_attn\.o_proj\.bias"):
        Target.from_pretrained(d)


def test_bad_config_values_are_one_line_errors(tmp_path):
    base = fixture("qwen3.5-27b-dflash.config.json")
    cases = [
        ({"num_hidden_layers": None}, r"lacks 'num_hidden_layers'"),
        ({"layer_types": ["full_attention"] * 2}, r"layer_types has 2 entries for 5 layers"),
        ({"layer_types": ["chunked_attention"] * 5}, r"layer type\(s\) \['chunked_attention'\] are not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
        ({"block_size": 0}, r"block_size must be >= 1"),
        ({"num_key_value_heads": 5}, r"divisible by num_key_value_heads"),
        ({"dflash_config": {}, "num_target_layers": None}, r"neither dflash_config\.target_layer_ids nor num_target_layers"),
        ({"dflash_config": {"target_layer_ids": [1], "selector_rank": 64}},
         r"DFlash2 features are not supported: selector_rank"),
        ({"dflash_config": {"target_layer_ids": [1], "final_logit_softcapping": -1}},
         r"final_logit_softcapping must be >= 0"),
        ({"output_multiplier": "x"}, r"must be numbers"),
    ]
    for change, msg in cases:
        with pytest.raises(DFlashError, match=msg) as e:
            DraftConfig.from_dict({**base, **change})
        one_line(e)
    ok = DraftConfig.from_dict({**base, "dflash_config": {"target_layer_ids": [1], "final_logit_softcapping": 0}})
    assert ok.target_layer_ids == [1] and ok.final_logit_softcapping is None and ok.output_multiplier == 1.0
    ok = DraftConfig.from_dict({**base, "output_multiplier": 0.5, "dflash_config": {
        "target_layer_ids": [1], "final_logit_softcapping": 30.0, "input_embedding_scale": 2.0}})
    assert (ok.output_multiplier, ok.final_logit_softcapping, ok.input_embedding_scale) == (0.5, 30.0, 2.0)
    with pytest.raises(DFlashError, match=r"rope_parameters / rope_scaling must be JSON objects"):
        DraftConfig.from_dict({**base, "rope_scaling": "llama3"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashError, match=r"invalid JSON"):
        DraftConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(DFlashError, match=r"expected a JSON object"):
        DraftConfig.load(tmp_path)


def test_kv_cache_overflow_is_a_one_line_error():
    cache = KVCache(1, 4, 2, 8, torch.float32)
    cache.append([(torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8))])
    with pytest.raises(DFlashError, match=r"KV cache overflow: 5 positions > max context 4"):
        cache.append([(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))])


def test_target_tap_ids_outside_the_target_are_refused(tiny_target_dir):
    with pytest.raises(DFlashError, match=r"tap layer ids \[8\] are outside the target's 8 layers") as e:
        Target.from_pretrained(tiny_target_dir, tap_ids=[1, 8])
    one_line(e)
