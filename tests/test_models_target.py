"""The reference target against transformers' own implementation (fp32, max abs error 1e-4).

One full-sequence transformers forward is the truth; ours runs the same tokens as a
prefill, a 1-token step and a K-token verify on top of the growing past, all through the
same `Target.forward`. Taps for every layer id, the last one included, are compared with
transformers' own `output_hidden_states` (the last entry is post-final-norm there, and so
it is here: the z-lab drafters read `hidden_states[i + 1]` as transformers returns them).
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_export.models import Target, TargetConfig
from dflash_export.models.tiny import hf_model, make_target

TOL = 1e-4
N_PROMPT, K = 11, 5


def _hf_truth(hf, ids: torch.Tensor):
    """transformers' logits [S,V] and its `output_hidden_states` [S, L*H] (entries 1..L) for one sequence.

    Tap i is `hidden_states[i + 1]` exactly as transformers returns it: the raw output of
    decoder layer i, except the last entry, which transformers takes after the final norm.
    """
    with torch.no_grad():
        r = hf(ids, output_hidden_states=True, use_cache=False)
    layers = len(hf.model.layers)
    assert len(r.hidden_states) == layers + 1
    return r.logits[0].float(), torch.cat(r.hidden_states[1:], -1)[0]


def _ours_incremental(model: Target, ids: torch.Tensor):
    """Prefill N_PROMPT, one 1-token step, one K-token verify: concatenated logits and taps."""
    past = model.empty_kv()
    logits, taps, cuts = [], [], [(0, N_PROMPT), (N_PROMPT, N_PROMPT + 1), (N_PROMPT + 1, N_PROMPT + 1 + K)]
    with torch.no_grad():
        for a, b in cuts:
            lg, tp, new = model(ids[:, a:b], torch.arange(a, b)[None], past)
            assert len(new) == model.config.num_layers and new[0][0].shape[1] == b - a  # only new positions
            past = [(torch.cat([pk, k], 1), torch.cat([pv, v], 1)) for (pk, pv), (k, v) in zip(past, new)]
            logits.append(lg[0])
            taps.append(tp[0])
    return torch.cat(logits), torch.cat(taps)


def _check_parity(directory):
    hf = hf_model(directory)
    cfg = TargetConfig.load(directory)
    model = Target.from_pretrained(directory, tap_ids=list(range(cfg.num_layers)))
    ids = torch.randint(0, cfg.vocab_size, (1, N_PROMPT + 1 + K), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_taps = _hf_truth(hf, ids)
    logits, taps = _ours_incremental(model, ids)
    assert (logits - ref_logits).abs().max().item() <= TOL
    assert (taps - ref_taps).abs().max().item() <= TOL
    assert ref_logits.std() > 0.1  # not a degenerate model that any code would match
    # the rotation frequencies themselves (llama3 scaling touches only some of them)
    torch.testing.assert_close(model.inv_freq, hf.model.rotary_emb.inv_freq.float(), atol=0, rtol=1e-6)
    return hf, model


CASES = {
    "llama-llama3rope-tied": dict(arch="llama", tie=True, llama3_rope=True),
    "llama-untied-mha": dict(arch="llama", tie=False, llama3_rope=False, heads=4, kv_heads=4),
    "qwen3-gqa": dict(arch="qwen3"),
    "qwen3-tied-gqa4": dict(arch="qwen3", tie=True, heads=8, kv_heads=2, head_dim=16),
    "qwen2-bias-gqa": dict(arch="qwen2"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_target_matches_transformers(tmp_path, name):
    kw = CASES[name]
    d = make_target(tmp_path / name, seed=3, **kw)
    hf, model = _check_parity(d)
    cfg = model.config
    if kw["arch"] == "qwen3":
        assert cfg.qk_norm and hasattr(model.model.layers[0].self_attn, "q_norm")
    if kw["arch"] == "qwen2":
        assert cfg.qkv_bias and model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    if kw["arch"] == "llama" and kw.get("llama3_rope"):
        assert cfg.rope.kind == "llama3"
    if kw.get("tie"):
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_sharded_checkpoint_matches_transformers(tmp_path):
    d = make_target(tmp_path / "sharded", arch="llama", seed=5, sharded=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _check_parity(d)


def test_qwen3_attention_bias_matches_transformers(tmp_path):
    """Qwen3 with attention_bias=true has biases on q/k/v *and* o_proj in transformers."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.08)
    model.save_pretrained(tmp_path)
    _check_parity(tmp_path)


def test_batched_rows_are_independent(tmp_path):
    """Two sequences in one batch give the same as each alone (the oracle's exact-probability
    computations batch sequences)."""
    d = make_target(tmp_path / "t", arch="qwen3", seed=2)
    model = Target.from_pretrained(d, tap_ids=[1, 2])
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None].expand(2, 9)
    with torch.no_grad():
        both, taps, _ = model(ids, pos, model.empty_kv(2))
        for b in range(2):
            one, t1, _ = model(ids[b : b + 1], pos[:1], model.empty_kv(1))
            assert (one[0] - both[b]).abs().max() <= TOL and (t1[0] - taps[b]).abs().max() <= TOL
