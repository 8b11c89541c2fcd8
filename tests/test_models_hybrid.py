"""Hybrid Qwen3.5 targets (Gated DeltaNet + gated attention) in the PyTorch reference.

Truth is transformers' own `Qwen3_5ForCausalLM` / `Qwen3_5ForConditionalGeneration` (fp32,
1e-4): our target runs a prefill, a 1-token step and a K-token verify on top of the growing
cache (the DeltaNet states committed by `HybridCache.append`), several `layer_types`
patterns, a prefill longer than one chunk, and a verify of which only a prefix is committed
(the rollback after a rejected draft) followed by other tokens. The oracle's speculative
output equals transformers' `generate` on many seeds, with drafts rejected at every block
position; released drafter configs attach to hybrid targets.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_export.models import Target, TargetConfig, autoregressive_generate, new_drafter, speculative_generate
from dflash_export.models.qwen35 import HybridTarget
from dflash_export.runtime.errors import DFlashError
from test_formats import SUPPORTED, fixture, shrink, write_drafter
from test_oracle import OracleDrafter
from dflash_export.models.tiny import make_target
from dflash_export.runtime.sampling import Sampling

TOL = 1e-4
N_PROMPT, K = 11, 5
LIN, FULL = "linear_attention", "full_attention"
PATTERNS = {
    "3lin-1full": dict(layer_types=None),  # transformers' default: every 4th layer is attention
    "alternating-tied": dict(layer_types=[LIN, FULL, LIN, FULL], tie=True),
    "full-first-gqa": dict(layer_types=[FULL, LIN, LIN, LIN], heads=8, kv_heads=2),
    "all-linear": dict(layer_types=[LIN] * 3),
    "vl-layout": dict(arch="qwen35-vl", layer_types=[LIN, LIN, FULL]),
}


def _hf(directory):
    import transformers

    cls = (transformers.Qwen3_5ForConditionalGeneration if "Conditional" in
           json.loads((directory / "config.json").read_text())["architectures"][0] else transformers.Qwen3_5ForCausalLM)
    return cls.from_pretrained(str(directory), dtype=torch.float32).eval()


def _target(tmp_path, name, seed=0, **over):
    kw = dict(arch="qwen35", hidden=32, heads=4, kv_heads=2, intermediate=64, seed=seed)
    kw.update(over)
    layers = len(kw["layer_types"]) if kw.get("layer_types") else 4
    return make_target(tmp_path / name, layers=layers, **kw)


def _hf_truth(hf, ids):
    """transformers' logits [S,V] and hidden_states[1:] concatenated [S, L*H]."""
    with torch.no_grad():
        r = hf(ids, output_hidden_states=True, use_cache=False)
    return r.logits[0].float(), torch.cat(r.hidden_states[1:], -1)[0]


def _run(model, cache, ids, a, b, commit=None):
    with torch.no_grad():
        lg, tp, new = model(ids[:, a:b], torch.arange(a, b)[None], cache.view())
    cache.append(new, commit)
    return lg[0], tp[0]


@pytest.mark.parametrize("name", PATTERNS)
def test_prefill_step_verify_match_transformers(tmp_path, name):
    d = _target(tmp_path, name, **PATTERNS[name])
    hf, cfg = _hf(d), TargetConfig.load(d)
    model = Target.from_pretrained(d, tap_ids=list(range(cfg.num_layers)))
    assert isinstance(model, HybridTarget) and cfg.linear_layers
    n = N_PROMPT + 1 + K
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_taps = _hf_truth(hf, ids)
    cache = model.new_cache(n)
    parts = [_run(model, cache, ids, a, b) for a, b in [(0, N_PROMPT), (N_PROMPT, N_PROMPT + 1), (N_PROMPT + 1, n)]]
    logits, taps = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    err = max((logits - ref_logits).abs().max().item(), (taps - ref_taps).abs().max().item())
    print(f"{name}: max abs error {err:.2e} (logits std {ref_logits.std():.2f})")
    assert err <= TOL and ref_logits.std() > 0.1
    torch.testing.assert_close(model.inv_freq, hf.model.rotary_emb.inv_freq.float() if name != "vl-layout"
                               else hf.model.language_model.rotary_emb.inv_freq.float(), atol=0, rtol=1e-6)


def test_prefill_longer_than_a_chunk_and_rollback(tmp_path):
    """70 prompt tokens (two chunks), then a 6-token verify of which only 2 positions are
    committed, then 4 other tokens: equal to transformers on the accepted sequence."""
    d = _target(tmp_path, "t", seed=3, layer_types=[LIN, FULL, LIN, LIN], hidden=48)
    hf, model = _hf(d), Target.from_pretrained(d, tap_ids=[0, 1, 2, 3])
    g = torch.Generator().manual_seed(2)
    prompt, rejected, after = (torch.randint(0, 101, (1, n), generator=g) for n in (70, 6, 4))
    cache = model.new_cache(100)
    lg0, _ = _run(model, cache, prompt, 0, 70)
    seq = torch.cat([prompt, rejected], 1)
    _run(model, cache, seq, 70, 76, commit=2)  # keep anchor + 1 draft, roll back 4 positions
    kept = torch.cat([prompt, rejected[:, :2], after], 1)
    lg1, tp1 = _run(model, cache, kept, 72, 76)
    ref_logits, ref_taps = _hf_truth(hf, kept)
    errs = [(lg0 - ref_logits[:70]).abs().max().item(), (lg1 - ref_logits[72:]).abs().max().item(),
            (tp1 - ref_taps[72:]).abs().max().item()]
    print(f"long prefill / rollback max abs errors {errs}")
    assert max(errs) <= TOL and cache.length == 76


# -- the oracle: lossless on hybrid targets --------------------------------------------


class RejectAt(OracleDrafter):
    """Drafts the target's greedy path but always gets block position `j` wrong (j >= K-1: never)."""

    def __init__(self, inner, sequence, vocab, j):
        super().__init__(inner, sequence, vocab)
        self.j = j

    def draft_logits(self, target, block_ids, block_position_ids, past_ctx):
        logits = super().draft_logits(target, block_ids, block_position_ids, past_ctx)
        if self.j < logits.shape[1]:
            tok = int(logits[0, self.j].argmax())
            logits[0, self.j] = 0
            logits[0, self.j, (tok + 1) % self.vocab] = 1.0
        return logits


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-zoo")
    out = []
    for i, (types, arch) in enumerate([([LIN, LIN, LIN, FULL], "qwen35"), ([LIN, FULL, LIN, FULL], "qwen35-vl"),
                                       ([FULL, LIN, LIN, LIN, LIN, FULL], "qwen35")]):
        d = make_target(root / f"t{i}", arch=arch, seed=30 + i, layers=len(types), layer_types=types, hidden=32,
                        heads=4, kv_heads=2, intermediate=64)
        target = Target.from_pretrained(d)
        drafters = []
        for layers in (1, 2):
            torch.manual_seed(40 + i + layers)
            kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4) if layers == 2 else {}
            dr = new_drafter(target.config, num_layers=layers, block_size=4, mask_token_id=99, **kw)
            with torch.no_grad():
                for p in dr.parameters():
                    if p.dim() > 1:
                        p.normal_(0.0, 0.08)
            drafters.append(dr.eval())
        out.append((target, _hf(d), drafters))
    return out


def test_greedy_speculative_equals_transformers_generate(zoo):
    rng = np.random.default_rng(7)
    rejected_at, rounds = set(), 0
    for case, k in enumerate([8, 3, 5, 2, 7, 4]):  # each target with each drafter
        target, hf, drafters = zoo[case % 3]
        inner = drafters[(case // 3) % 2]
        target.tap_ids = list(inner.config.target_layer_ids)
        vocab, eos = target.config.vocab_size, target.config.vocab_size - 1
        prompt = rng.integers(0, vocab - 2, int(rng.integers(1, 30))).tolist()
        max_new = int(rng.integers(16, 28))
        plain = autoregressive_generate(target, prompt, max_new, stop_token_ids=(eos,))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)[0, len(prompt):].tolist()
        assert plain.tokens == ref, f"case {case}: our greedy decoding differs from transformers'"
        free = autoregressive_generate(target, prompt, max_new + k).tokens
        kinds = [inner, OracleDrafter(inner, prompt + free, vocab, corrupt=0.3, seed=case)]
        kinds += [RejectAt(inner, prompt + free, vocab, j) for j in range(k)]  # every block position, and none
        for drafter in kinds:
            spec = speculative_generate(target, drafter, prompt, max_new, mask_token_id=99, block_size=k,
                                        stop_token_ids=(eos,))
            assert spec.tokens == ref, f"case {case}, K={k}, drafter {type(drafter).__name__}"
            assert 1 + sum(spec.acceptance_lengths) == len(spec.tokens)
            rounds += len(spec.acceptance_lengths)
            if isinstance(drafter, RejectAt) and drafter.j < k - 1:
                # each full round accepted exactly j drafts: the rollback dropped K-1-j verified positions
                assert set(spec.acceptance_lengths[:-1]) <= {drafter.j + 1}, (drafter.j, spec.acceptance_lengths)
                rejected_at.add(drafter.j)
    assert rejected_at == set(range(7)) and rounds > 200, (rejected_at, rounds)


def test_sampling_is_deterministic_and_top_k_1_is_greedy(zoo):
    target, _, drafters = zoo[0]
    target.tap_ids = list(drafters[0].config.target_layer_ids)
    prompt = [3, 1, 4, 1, 5]
    a = speculative_generate(target, drafters[0], prompt, 20, mask_token_id=99, sampling=Sampling(1.3, seed=5))
    assert a == speculative_generate(target, drafters[0], prompt, 20, mask_token_id=99, sampling=Sampling(1.3, seed=5))
    greedy = autoregressive_generate(target, prompt, 20).tokens
    assert speculative_generate(target, drafters[0], prompt, 20, mask_token_id=99,
                                sampling=Sampling(2.0, top_k=1, seed=3)).tokens == greedy


# -- released drafter configs on a hybrid target ------------------------------------------------


@pytest.mark.parametrize("name", SUPPORTED)
def test_released_drafter_configs_attach_to_a_hybrid_target(tmp_path, name):
    from dflash_export.models import Drafter
    from test_formats import L_TINY, V_TINY

    td = make_target(tmp_path / "t", arch="qwen35", seed=5, vocab=V_TINY, hidden=32, layers=L_TINY, heads=4,
                     kv_heads=2, intermediate=48)
    cfg = shrink(fixture(name))
    write_drafter(cfg, tmp_path / "d")
    drafter = Drafter.from_pretrained(tmp_path / "d")
    drafter.config.check_fits(TargetConfig.load(td))
    target = Target.from_pretrained(td, tap_ids=drafter.config.target_layer_ids)
    mask = drafter.config.resolve_mask_token_id(V_TINY - 3)  # the 3.5 config's mask id is null
    plain = autoregressive_generate(target, [3, 4, 5], 14).tokens
    g = speculative_generate(target, drafter, [3, 4, 5], 14, mask_token_id=mask)
    assert g.tokens == plain


def test_released_drafter_configs_plan_an_export_for_a_hybrid_target(tmp_path):
    """`export`'s checks before any weight (configs, fit, block size, mask id) accept every
    released config against a hybrid target (the 3.5 one with its null mask id given on the
    command line) and the plan describes the state tensors; the drafter graphs themselves do not
    depend on the target's kind (tests/test_hybrid_runtime.py exports and runs a hybrid pair)."""
    from dflash_export.export.artifact import hybrid_fields, plan
    from test_formats import L_TINY, V_TINY

    td = make_target(tmp_path / "t", arch="qwen35", seed=5, vocab=V_TINY, hidden=32, layers=L_TINY, heads=4,
                     kv_heads=2, intermediate=48)
    for name in SUPPORTED:
        write_drafter(shrink(fixture(name)), tmp_path / name)
        tc, dc, k, mask = plan(td, tmp_path / name, None, V_TINY - 3, 256)
        assert k == dc.block_size and mask in (V_TINY - 2, V_TINY - 3), name
        fields = hybrid_fields(tc)
        assert fields["target_layer_types"].count(LIN) == 6 and fields["linear"]["max_seq"] == 64, name
    with pytest.raises(DFlashError, match="block size 65 is too large for a hybrid target"):
        plan(td, tmp_path / SUPPORTED[0], 65, None, 256)


# -- refusals -----------------------------------------------------------------------------


def _edited(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_moe_over_dense_weights_and_unknown_layer_types_are_refused(tmp_path):
    d = _target(tmp_path, "t")

    def moe(c):  # an MoE architecture over a dense checkpoint: the tensors say what is wrong
        c["architectures"] = ["Qwen3_5MoeForCausalLM"]

    def bad_type(c):
        c["layer_types"][0] = "mamba"

    for edit, msg in [(moe, r"unsupported tensors model\.layers\.0\.mlp\.down_proj\.weight"),
                      (bad_type, r"layer type\(s\) \['mamba'\] are not supported")]:
        with pytest.raises(DFlashError, match=msg) as e:
            Target.from_pretrained(_edited(d, tmp_path / edit.__name__, edit))
        assert "\n" not in str(e.value)


def test_vision_tensors_are_skipped_with_a_note(tmp_path, capsys):
    d = _target(tmp_path, "vl", arch="qwen35-vl", layer_types=[LIN, FULL])
    Target.from_pretrained(d)
    err = capsys.readouterr().err
    assert "ignoring" in err and "model.visual.* tensors" in err
