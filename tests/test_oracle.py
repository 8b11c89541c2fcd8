"""The oracle generator: lossless at temperature 0, the target's own distribution above it.

Greedy: speculative output == our plain greedy == transformers' `generate(do_sample=False)`,
token for token, over seeded cases across Llama / Qwen3 / Qwen2-shaped tiny targets, real
random drafters of 1-3 layers and "noisy oracle" drafters (the target's own greedy
continuation with some positions corrupted, so that long and short acceptances both occur).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_export.models import Target, autoregressive_generate, new_drafter, speculative_generate
from dflash_export.runtime.errors import DFlashError
from dflash_export.models.tiny import hf_model, make_target
from dflash_export.runtime.sampling import Sampling

ARCHS = ("llama", "qwen3", "qwen2")
TAPS = {1: [2], 2: [0, 3], 3: [1, 2, 3]}  # drafter depth -> tapped target layers (4-layer targets)


class OracleDrafter:
    """Same interface as `Drafter` for `speculative_generate`; drafts are one-hot logits of a
    known continuation at the block's positions (each corrupted with probability `corrupt`)."""

    def __init__(self, inner, sequence: list[int], vocab: int, corrupt: float = 0.0, seed: int = 0):
        self.inner, self.config, self.sequence, self.vocab = inner, inner.config, sequence, vocab
        self.corrupt, self.rng = corrupt, np.random.default_rng(seed)
        self.calls = 0

    def parameters(self):
        return self.inner.parameters()

    def context_kv(self, taps, positions):
        return self.inner.context_kv(taps, positions)

    def draft_tokens(self, logits):
        return logits.argmax(-1)

    def draft_logits(self, target, block_ids, block_position_ids, past_ctx):
        self.calls += 1
        logits = torch.zeros(1, block_ids.shape[1] - 1, self.vocab)
        for i, p in enumerate(block_position_ids[0, 1:].tolist()):
            tok = self.sequence[p] if p < len(self.sequence) else 0
            if self.rng.random() < self.corrupt:
                tok = (tok + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab
            logits[0, i, tok] = 1.0
        return logits


def _random_drafter(target, layers: int, seed: int):
    torch.manual_seed(seed)
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4) if layers == 2 else {}
    d = new_drafter(target.config, num_layers=layers, target_layer_ids=TAPS[layers], block_size=4,
                    mask_token_id=target.config.vocab_size - 2, **kw)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    return d.eval()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Per arch: (our target, transformers' model, drafters by depth). Built once."""
    root = tmp_path_factory.mktemp("zoo")
    out = {}
    for i, arch in enumerate(ARCHS):
        d = make_target(root / arch, arch=arch, seed=10 + i, layers=4)
        target = Target.from_pretrained(d)
        out[arch] = (target, hf_model(d), {n: _random_drafter(target, n, 20 + 3 * i + n) for n in (1, 2, 3)})
    return out


def _check_structure(g, k: int, max_new: int, stop: int | None):
    assert all(1 <= a <= k for a in g.acceptance_lengths), g.acceptance_lengths
    assert 1 + sum(g.acceptance_lengths) == len(g.tokens)
    if g.stopped:
        assert g.tokens[-1] == stop and stop not in g.tokens[:-1] and len(g.tokens) <= max_new
    else:
        assert len(g.tokens) == max_new and (stop is None or stop not in g.tokens)


N_CASES = 60


def test_greedy_speculative_equals_greedy_decoding(zoo):
    rng = np.random.default_rng(1234)
    stats = {"rounds": 0, "long": 0, "stopped": 0, "cut": 0}
    for case in range(N_CASES):
        arch = ARCHS[case % 3]
        target, hf, drafters = zoo[arch]
        layers = 1 + (case // 3) % 3
        inner = drafters[layers]
        target.tap_ids = list(inner.config.target_layer_ids)
        vocab, eos = target.config.vocab_size, target.config.vocab_size - 1
        k = int(rng.integers(2, 17))
        prompt = rng.integers(0, vocab - 2, int(rng.integers(1, 41))).tolist()
        max_new = int(rng.integers(20, 33))

        plain = autoregressive_generate(target, prompt, max_new, stop_token_ids=(eos,))
        with torch.no_grad():
            hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
        assert plain.tokens == hf_out, f"case {case}: our greedy decoding differs from transformers'"

        if case % 2:  # a noisy oracle: the target's greedy continuation, a quarter corrupted (rounds verify
            # positions below len(prompt) + max_new only, and nothing after a stop token is emitted)
            drafter = OracleDrafter(inner, prompt + plain.tokens, vocab, corrupt=0.25, seed=case)
        else:
            drafter = inner
        spec = speculative_generate(target, drafter, prompt, max_new, mask_token_id=vocab - 2, block_size=k,
                                    stop_token_ids=(eos,))
        assert spec.tokens == plain.tokens, f"case {case} ({arch}, {layers} layers, K={k}, prompt {len(prompt)})"
        _check_structure(spec, k, max_new, eos)
        stats["rounds"] += len(spec.acceptance_lengths)
        stats["long"] += sum(a > 1 for a in spec.acceptance_lengths)
        stats["stopped"] += spec.stopped
        stats["cut"] += (not spec.stopped) and 0 < spec.acceptance_lengths[-1] < k
    # the cases exercised what they claim to: long acceptances, stops, and limit cuts
    assert stats["long"] > 50 and stats["cut"] > 5, stats


@pytest.mark.parametrize("arch", ARCHS)
def test_forced_correct_drafter_accepts_whole_blocks(zoo, arch):
    target, _, drafters = zoo[arch]
    inner = drafters[1]
    target.tap_ids = list(inner.config.target_layer_ids)
    prompt = [5, 17, 3, 42, 8, 1, 9]
    for k, rounds, extra in ((2, 9, 0), (5, 4, 0), (8, 3, 3), (16, 2, 7)):
        max_new = 1 + rounds * k + extra  # the prefill token, `rounds` full blocks, a cut last round
        greedy = autoregressive_generate(target, prompt, max_new + k)
        drafter = OracleDrafter(inner, prompt + greedy.tokens, target.config.vocab_size)
        g = speculative_generate(target, drafter, prompt, max_new, mask_token_id=7, block_size=k)
        assert g.tokens == greedy.tokens[:max_new]
        assert g.acceptance_lengths[:rounds] == [k] * rounds
        assert g.acceptance_lengths[rounds:] == ([extra] if extra else [])
        assert drafter.calls == len(g.acceptance_lengths)
        _check_structure(g, k, max_new, None)


def test_block_size_one_is_plain_decoding(zoo):
    target, _, drafters = zoo["qwen3"]
    target.tap_ids = list(drafters[1].config.target_layer_ids)
    g = speculative_generate(target, drafters[1], [4, 5, 6], 15, mask_token_id=3, block_size=1)
    assert g.tokens == autoregressive_generate(target, [4, 5, 6], 15).tokens and g.acceptance_lengths == [1] * 14


# -- sampling -------------------------------------------------------------------------


def test_sampling_is_deterministic_per_seed(zoo):
    target, _, drafters = zoo["llama"]
    drafter = drafters[3]
    target.tap_ids = list(drafter.config.target_layer_ids)
    prompt = [3, 1, 4, 1, 5]
    runs = {}
    for seed in range(4):
        a = speculative_generate(target, drafter, prompt, 25, mask_token_id=9, sampling=Sampling(1.3, seed=seed))
        b = speculative_generate(target, drafter, prompt, 25, mask_token_id=9, sampling=Sampling(1.3, seed=seed))
        assert a == b
        c = autoregressive_generate(target, prompt, 25, sampling=Sampling(1.3, seed=seed))
        assert c == autoregressive_generate(target, prompt, 25, sampling=Sampling(1.3, seed=seed))
        runs[seed] = tuple(a.tokens)
        _check_structure(a, drafter.config.block_size, 25, None)
    assert len(set(runs.values())) > 1  # the seed matters


def test_top_k_1_and_tiny_top_p_are_greedy(zoo):
    target, _, drafters = zoo["qwen2"]
    drafter = drafters[2]
    target.tap_ids = list(drafter.config.target_layer_ids)
    prompt = [11, 12, 13]
    greedy = autoregressive_generate(target, prompt, 20).tokens
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        s = Sampling(2.0, seed=3, **kw)
        assert speculative_generate(target, drafter, prompt, 20, mask_token_id=9, sampling=s).tokens == greedy
        assert autoregressive_generate(target, prompt, 20, sampling=s).tokens == greedy


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_p=0.4), dict(top_k=5, top_p=0.6)])
def test_top_k_top_p_restrict_the_sampled_tokens(zoo, kw):
    """Every sampled token lies in the target's top-k / nucleus at its position."""
    from dflash_export.runtime.sampling import probabilities

    target, _, drafters = zoo["qwen3"]
    drafter = drafters[1]
    target.tap_ids = list(drafter.config.target_layer_ids)
    prompt = [2, 7, 1, 8]
    for seed in range(5):
        s = Sampling(3.0, seed=seed, **kw)
        for g in (speculative_generate(target, drafter, prompt, 20, mask_token_id=9, sampling=s),
                  autoregressive_generate(target, prompt, 20, sampling=s)):
            seq = prompt + g.tokens
            with torch.no_grad():
                logits, _, _ = target(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1)[None], target.empty_kv())
            p = probabilities(logits[0, len(prompt) - 1 :].numpy(), s)
            assert all(p[i, t] > 0 for i, t in enumerate(g.tokens))


def test_probabilities_support():
    from dflash_export.runtime.sampling import choose, probabilities

    logits = np.array([[2.0, 0.5, 1.0, -1.0, 3.0, 0.0]])
    p = probabilities(logits, Sampling(1.0, top_k=2))
    assert set(np.nonzero(p[0])[0]) == {0, 4} and np.isclose(p.sum(), 1.0)
    full = probabilities(logits, Sampling(1.0))
    order = np.argsort(-full[0])
    for top_p in (0.3, 0.6, 0.8, 0.95, 1.0):
        keep = set(np.nonzero(probabilities(logits, Sampling(1.0, top_p=top_p))[0])[0])
        mass_before = np.cumsum(full[0][order]) - full[0][order]
        assert keep == {int(i) for i, m in zip(order, mass_before) if m < top_p}  # smallest set reaching top_p
    u = np.random.default_rng(0).random(500)
    draws = choose(np.repeat(logits, 500, 0), u, Sampling(1.0, top_k=3, top_p=0.9))
    allowed = set(np.nonzero(probabilities(logits, Sampling(1.0, 3, 0.9))[0])[0])
    assert set(draws.tolist()) == allowed  # every kept token drawn, nothing else


# -- the distribution on a tiny vocabulary -----------------------------------------------

V_SMALL, TEMP, N_SAMPLES, N_SAMPLES_HYBRID = 10, 1.0, 2000, 400


def _chi2_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson goodness of fit; cells expected below 5 are pooled into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _chi2_two_sample_p(a: np.ndarray, b: np.ndarray) -> float:
    """Homogeneity of two equal-size count vectors (cells with fewer than 10 in total pooled)."""
    tot = a + b
    small = tot < 10
    a = np.append(a[~small], a[small].sum())
    b = np.append(b[~small], b[small].sum())
    tot = a + b
    keep = tot > 0
    stat = float(((a[keep] - b[keep]) ** 2 / tot[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _exact_joint(target, prompt: list[int], temperature: float) -> np.ndarray:
    """P(t1, t2, t3) [V,V,V] of plain sampling, from three batched forwards."""
    from dflash_export.runtime.sampling import probabilities

    V, n = V_SMALL, len(prompt)

    def next_probs(seqs: list[list[int]]) -> np.ndarray:
        ids = torch.tensor(seqs)
        with torch.no_grad():
            logits, _, _ = target(ids, torch.arange(ids.shape[1])[None].expand_as(ids), target.empty_kv(len(seqs)))
        return probabilities(logits[:, -1].numpy(), Sampling(temperature))

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(V)])  # [V, V]
    p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert np.isclose(joint.sum(), 1.0) and n
    return joint


@pytest.mark.parametrize("arch,sampling", [("qwen3", "rejection"), ("qwen3", "compare"), ("qwen35", "rejection")])
def test_speculative_sampling_has_the_target_distribution(tmp_path, arch, sampling):
    """Both verify rules (rejection with the drafter's q, the default; sample-and-compare), on
    a dense and a hybrid (Gated DeltaNet + attention) target. A q off by a factor fails the
    rule's own check (tests/test_rejection.py).

    First 3 tokens: speculative samples vs the exact target distribution and vs plain
    sampling, by chi-square (p >= 1e-3 for each of 4+2 tests; hybrid: the 4 against the exact
    distribution, from fewer samples); the same statistic rejects the distribution at half the
    temperature (p < 1e-6), so the test has the power to fail."""
    d = make_target(tmp_path / "small", arch=arch, seed=1, vocab=V_SMALL, hidden=32, layers=2, heads=4,
                    kv_heads=2, head_dim=8, intermediate=48,
                    layer_types=["linear_attention", "full_attention"] if arch == "qwen35" else None)
    # hybrid: fewer samples and no plain-sampling side (the dense case tests the sampler itself;
    # here only the target's distribution through the hybrid cache's commit/rollback is new)
    hybrid = arch == "qwen35"
    n_samples = N_SAMPLES_HYBRID if hybrid else N_SAMPLES
    target = Target.from_pretrained(d, tap_ids=[0, 1])
    prompt = [1, 2, 3]
    inner = _random_drafter_small(target)
    greedy = autoregressive_generate(target, prompt, 3 + 4).tokens
    drafter = OracleDrafter(inner, prompt + greedy, V_SMALL)  # drafts the greedy path: often accepted

    spec, plain, accepted = [], [], 0
    for s in range(n_samples):
        g = speculative_generate(target, drafter, prompt, 3, mask_token_id=8, block_size=4,
                                 sampling=Sampling(TEMP, seed=s, method=sampling))
        spec.append(g.tokens)
        accepted += g.acceptance_lengths[0] > 1
        if not hybrid:
            plain.append(autoregressive_generate(target, prompt, 3, sampling=Sampling(TEMP, seed=10**6 + s)).tokens)
    spec, plain = np.array(spec), np.array(plain)
    assert spec.shape == (n_samples, 3) and (hybrid or plain.shape == spec.shape)
    assert accepted > n_samples // 10  # drafts were accepted, not only the bonus tokens

    exact = _exact_joint(target, prompt, TEMP)
    colder = _exact_joint(target, prompt, TEMP * 0.5)
    V = V_SMALL

    def counts(x, cols):
        idx = np.ravel_multi_index(tuple(x[:, c] for c in cols), (V,) * len(cols))
        return np.bincount(idx, minlength=V ** len(cols)).astype(float)

    views = {  # marginal over the other positions
        (0,): lambda j: j.sum((1, 2)), (2,): lambda j: j.sum((0, 1)),
        (0, 1): lambda j: j.sum(2).ravel(), (1, 2): lambda j: j.sum(0).ravel(),
    }
    pvals = {}
    for cols, marg in views.items():
        pvals[f"spec{cols}"] = _chi2_p(counts(spec, cols), n_samples * marg(exact))
        if not hybrid:
            pvals[f"plain{cols}"] = _chi2_p(counts(plain, cols), n_samples * marg(exact))
    for cols in ((0, 1), (1, 2)) if not hybrid else ():
        pvals[f"spec-vs-plain{cols}"] = _chi2_two_sample_p(counts(spec, cols), counts(plain, cols))
    control = _chi2_p(counts(spec, (0, 1)), n_samples * views[(0, 1)](colder))
    print(f"chi-square p-values {pvals}; control at T/2: {control:.2e}; first rounds with drafts accepted: {accepted}")
    assert min(pvals.values()) >= 1e-3, pvals
    assert control < 1e-6


def _random_drafter_small(target):
    torch.manual_seed(0)
    return new_drafter(target.config, num_layers=1, target_layer_ids=[0, 1], block_size=4, mask_token_id=8).eval()


# -- bad input --------------------------------------------------------------------------


def test_bad_generation_input_is_a_one_line_error(zoo):
    target, _, drafters = zoo["qwen3"]
    drafter = drafters[1]
    target.tap_ids = list(drafter.config.target_layer_ids)
    ok = dict(mask_token_id=5)
    cases = [
        (dict(prompt=[]), r"the prompt is empty"),
        (dict(max_new_tokens=0), r"max_new_tokens must be >= 1"),
        (dict(prompt=[1, 101]), r"prompt token ids \[101\] are outside the vocabulary \[0, 101\)"),
        (dict(mask_token_id=101), r"mask_token_id 101 is outside the vocabulary"),
        (dict(block_size=0), r"block size must be >= 1"),
        (dict(max_context=10), r"exceeds the max context 10"),
    ]
    for change, msg in cases:
        args = dict(prompt=[1, 2, 3], max_new_tokens=8, **ok)
        args.update(change)
        with pytest.raises(DFlashError, match=msg) as e:
            speculative_generate(target, drafter, args.pop("prompt"), args.pop("max_new_tokens"), **args)
        assert "\n" not in str(e.value)
    for change, msg in ((dict(temperature=-1.0), r"temperature must be >= 0"), (dict(top_k=-2), r"top-k must be >= 0"),
                        (dict(top_p=0.0), r"top-p must be in \(0, 1\]"), (dict(method="typical"), "unknown sampling")):
        with pytest.raises(DFlashError, match=msg) as e:
            Sampling(**change)  # the record checks itself: nothing takes a bad one
        assert "\n" not in str(e.value)
    assert Sampling(5e-324, seed=3).greedy and not Sampling(1e-5).greedy  # below the floor: greedy
    with pytest.raises(DFlashError, match=r"the target taps layers \[\] but the drafter reads \[2\]"):
        speculative_generate(Target(target.config), drafter, [1, 2], 4, mask_token_id=5)
    with pytest.raises(DFlashError, match=r"max_new_tokens must be >= 1"):
        autoregressive_generate(target, [1], 0)
