"""Speed settings stay lossless: adaptive verify, per-position sampling, runtime.json, thread defaults.

Adaptive verify must not change a single greedy token (it only ends rounds earlier), and at
temperature > 0 the output must keep the target's distribution whatever lengths the rounds
verify: tested with chi-square against the exact joint of a 10-token target, as
test_oracle.py tests the full-block loop, with confidences drawn at random so that every
verify length occurs.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from runtime_cases import CASES, artifact, prompts
from test_oracle import N_SAMPLES, TEMP, V_SMALL, OracleDrafter, _chi2_p, _exact_joint, _random_drafter_small
from dflash_export.models.tiny import make_target

from dflash_export.cli import cli
from dflash_export.models import Target, autoregressive_generate
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.backend import Backend, Draft, TargetOut
from dflash_export.runtime.calibrate import SPIN_MODES, SPIN_US, choose_count, choose_policy, choose_spin, replay, spin_label
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.loop import generate
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import FULL, RunOptions, Settings, VerifyPolicy, load_settings, resolve, save_settings
from dflash_export.runtime.sampling import Sampling


def test_policy_verifies_the_confident_prefix():
    conf = np.array([0.9, 0.8, 0.5, 0.9, 0.1], np.float32)  # cumulative: .9 .72 .36 .324 .0324
    assert VerifyPolicy(0.3, 1).length(conf, 6) == 1 + 4
    assert VerifyPolicy(0.5, 1).length(conf, 6) == 1 + 2
    assert VerifyPolicy(0.95, 1).length(conf, 6) == 1  # nothing confident: the anchor alone
    assert VerifyPolicy(0.95, 3).length(conf, 6) == 3  # but never under min_len
    assert VerifyPolicy(0.01, 1).length(conf, 4) == 4  # never past what the round may verify
    assert FULL.length(conf, 6) == 6 and VerifyPolicy(0.5).length(None, 6) == 6  # no confidences: full block


def test_replay_keeps_the_full_block_when_verify_cost_is_flat():
    rng = np.random.default_rng(0)
    rounds = [(rng.random(15).astype(np.float32), int(rng.integers(0, 16))) for _ in range(200)]
    flat = [5.0] * 16
    policy, table = choose_policy(rounds, flat, 1.0)
    assert policy is None and table[0]["relative_rate"] == 1.0  # shorter verify only loses tokens
    steep = [1.0 + s for s in range(16)]  # cost grows with length: a confident prefix pays
    confident = [(np.where(np.arange(15) < a, 0.99, 0.01).astype(np.float32), a) for _, a in rounds]
    policy, _ = choose_policy(confident, steep, 1.0)
    assert policy is not None
    assert replay(confident, policy, steep, 1.0)[0] > replay(confident, FULL, steep, 1.0)[0]


def test_thread_count_needs_a_margin_to_grow():
    # a draw in tokens/s (the noise of a shared machine) keeps the smaller count
    assert choose_count({1: 676.2, 2: 676.0}) == 1 and choose_count({1: 676.0, 2: 676.2}) == 1
    assert choose_count({1: 100.0, 2: 104.0, 4: 90.0}) == 1
    assert choose_count({1: 100.0, 2: 110.0, 4: 111.0}) == 2  # 4 threads: within 5 % of 2
    assert choose_count({1: 0.0, 2: 50.0}) == 2


def test_spinning_is_chosen_per_count_where_it_pays():
    # a quiet machine: spinning workers answer at once; a shared one: they are preempted mid-call
    off, full, b50, b1000 = (False, None), (True, None), (True, 50), (True, 1000)
    rates = {(1, *off): 300.0, (2, *off): 280.0, (2, *full): 520.0, (4, *off): 200.0, (4, *full): 205.0}
    assert choose_spin(rates) == {1: off, 2: full, 4: off}  # 4: within the margin, off
    assert choose_spin({(2, *off): 745.0, (2, *full): 168.0}) == {2: off}
    assert choose_spin({(1, *full): 10.0}) == {1: full}  # --spin given: the one state measured
    # bounded spinning: chosen where it pays; a draw goes to less spinning (shorter bound, then bounded over full)
    assert choose_spin({(2, *off): 680.0, (2, *full): 86.0, (2, *b50): 900.0, (2, *b1000): 700.0}) == {2: b50}
    assert choose_spin({(2, *off): 300.0, (2, *full): 520.0, (2, *b50): 400.0, (2, *b1000): 515.0}) == {2: b1000}
    assert choose_spin({(2, *off): 300.0, (2, *full): 520.0, (2, *b50): 400.0, (2, *b1000): 450.0}) == {2: full}
    assert choose_spin({(2, *off): 500.0, (2, *full): 520.0, (2, *b50): 521.0, (2, *b1000): 522.0}) == {2: off}


def test_spinning_stops_between_calls():
    """Each graph has its own session and thread pool: with --spin, the pools stop spinning when
    their call returns, so they do not take the vCPUs the next graph's call needs; a bounded spin
    (runtime.json's spin_us) reaches every session's options."""
    path = artifact(CASES["qwen3"])[2]
    keys = ("session.intra_op.allow_spinning", "session.force_spinning_stop", "session.intra_op.spin_duration_us")
    for spin, us in ((False, None), (True, None), (True, 50), (False, 50)):
        be = OrtBackend(path, threads=2, spin=spin, spin_us=us)
        for s in be.sessions.values():
            o = s.get_session_options()
            entries = {}
            for k in keys:
                try:
                    entries[k] = o.get_session_config_entry(k)
                except RuntimeError:  # not set
                    pass
            assert entries.get("session.intra_op.allow_spinning") == ("1" if spin else "0")
            assert (entries.get("session.force_spinning_stop") == "1") == spin
            assert entries.get("session.intra_op.spin_duration_us") == ("50" if spin and us else None)


# -- the ORT loop: greedy and sampled outputs do not depend on the verify lengths --------


@pytest.fixture(scope="module")
def backend():
    return OrtBackend(artifact(CASES["qwen3"])[2])


POLICIES = [VerifyPolicy(0.5, 1), VerifyPolicy(0.2, 2), VerifyPolicy(0.9, 1), VerifyPolicy(0.05, 3)]


def test_adaptive_verify_is_lossless_greedy(backend):
    k, shorter = backend.manifest.block_size, 0
    for prompt in prompts(6, backend.manifest.vocab_size, seed=5):
        plain = generate(backend, prompt, 40, draft=False).tokens
        full = generate(backend, prompt, 40)
        assert full.tokens == plain and full.mean_verify_len > 0
        for policy in POLICIES:
            g = generate(backend, prompt, 40, verify=policy)
            assert g.tokens == plain, policy
            assert all(1 <= s <= k for s in g.verify_lengths) and len(g.verify_lengths) == len(g.acceptance_lengths)
            assert all(a <= s for a, s in zip(g.acceptance_lengths, g.verify_lengths))
            shorter += sum(s < k for s in g.verify_lengths)
    assert shorter > 0, "the policies should have cut some rounds"


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_sampled_output_does_not_depend_on_verify_length(backend, temperature, top_k, top_p):
    """Sample-and-compare, one uniform per absolute position: full block, adaptive and plain
    sampling draw the same tokens. (Rejection sampling, the default, depends on the drafts and
    so on the verify length; it repeats exactly with its seed.)"""
    for seed, prompt in enumerate(prompts(4, backend.manifest.vocab_size, seed=6)):
        s = Sampling(temperature, top_k, top_p, seed)
        compare = Sampling(temperature, top_k, top_p, seed, method="compare")
        plain = generate(backend, prompt, 32, draft=False, sampling=s).tokens
        assert generate(backend, prompt, 32, sampling=compare).tokens == plain
        for policy in POLICIES:
            assert generate(backend, prompt, 32, verify=policy, sampling=compare).tokens == plain
        rej = generate(backend, prompt, 32, verify=POLICIES[0], sampling=s).tokens
        assert generate(backend, prompt, 32, verify=POLICIES[0], sampling=s).tokens == rej


# -- the distribution with random verify lengths, on a 10-token target ---------------------


class TorchBackend(Backend):
    """The Backend interface over the PyTorch modules, with random confidences (any policy
    must be lossless for any confidences, so random ones exercise every verify length)."""

    def __init__(self, target, drafter, k: int, mask: int, max_len: int = 64):
        self.t, self.d, self.k, self.mask = target, drafter, k, mask
        self.manifest = SimpleNamespace(block_size=k, vocab_size=target.config.vocab_size, eos_token_ids=[])
        self.max_len = self.max_chunk = max_len
        self.kv = self.ctx = None
        self.rng = np.random.default_rng(0)

    def reset(self):
        super().reset()
        self.kv = [(torch.zeros(1, 0, 2, 8), torch.zeros(1, 0, 2, 8))] * self.t.config.num_layers
        self.ctx = None

    def keep(self, n):  # the loop starts each sequence with keep(reuse); these tests never reuse
        assert n == 0
        self.reset()

    def _target(self, ids, want_logits):
        n = len(ids)
        past = [(k[:, : self.target_len], v[:, : self.target_len]) for k, v in self.kv]
        with torch.no_grad():
            logits, self.taps, new = self.t(torch.tensor(np.asarray(ids))[None], torch.arange(self.target_len, self.target_len + n)[None], past)
        self.kv = [(torch.cat([pk, k], 1), torch.cat([pv, v], 1)) for (pk, pv), (k, v) in zip(past, new)]
        return TargetOut(logits[0].argmax(-1).numpy(), logits[0].numpy())

    def draft_context(self, n):
        with torch.no_grad():
            new = self.d.context_kv(self.taps[:, :n], torch.arange(self.context_len, self.context_len + n)[None])
        self.ctx = new if self.ctx is None else [(torch.cat([a, c], 1), torch.cat([b, e], 1))
                                                 for (a, b), (c, e) in zip(self.ctx, new)]
        self.context_len += n

    def draft_block(self, anchor, scored=None):  # every draft scored (a caller reads the first `scored`)
        block = torch.tensor([[anchor] + [self.mask] * (self.k - 1)])
        pos = torch.arange(self.context_len, self.context_len + self.k)[None]
        with torch.no_grad():
            logits = self.d.draft_logits(self.t, block, pos, self.ctx)
        self.dlogits = logits[0].numpy()
        return Draft(logits[0].argmax(-1).numpy(), self.rng.random(self.k - 1).astype(np.float32))

    def draft_logits_rows(self, n):  # rejection sampling's q: the loop's default at T > 0
        return self.dlogits[None]


def test_adaptive_verify_keeps_the_target_distribution(tmp_path):
    """Rejection sampling (the loop's default) with random verify lengths: a round that
    verifies s < K positions samples the bonus from p after s - 1 accepted drafts."""
    d = make_target(tmp_path / "small", arch="qwen3", seed=1, vocab=V_SMALL, hidden=32, layers=2, heads=4,
                    kv_heads=2, head_dim=8, intermediate=48)
    target = Target.from_pretrained(d, tap_ids=[0, 1])
    prompt = [1, 2, 3]
    greedy = autoregressive_generate(target, prompt, 3 + 4).tokens
    drafter = OracleDrafter(_random_drafter_small(target), prompt + greedy, V_SMALL)
    be = TorchBackend(target, drafter, k=4, mask=8)
    policy = VerifyPolicy(0.5, 1)
    spec, lengths, accepted = [], [], 0
    for s in range(N_SAMPLES):
        g = generate(be, prompt, 3, sampling=Sampling(TEMP, seed=s), verify=policy)
        spec.append(g.tokens)
        lengths += g.verify_lengths
        accepted += g.acceptance_lengths[0] > 1
    spec = np.array(spec)
    assert spec.shape == (N_SAMPLES, 3)
    assert len(set(lengths)) >= 3 and accepted > N_SAMPLES // 20  # several verify lengths, drafts accepted
    V = V_SMALL

    def counts(cols):
        idx = np.ravel_multi_index(tuple(spec[:, c] for c in cols), (V,) * len(cols))
        return np.bincount(idx, minlength=V ** len(cols)).astype(float)

    exact, colder = _exact_joint(target, prompt, TEMP), _exact_joint(target, prompt, TEMP * 0.5)
    pvals = {"(0,)": _chi2_p(counts((0,)), N_SAMPLES * exact.sum((1, 2))),
             "(0,1)": _chi2_p(counts((0, 1)), N_SAMPLES * exact.sum(2).ravel()),
             "(1,2)": _chi2_p(counts((1, 2)), N_SAMPLES * exact.sum(0).ravel()),
             "(2,)": _chi2_p(counts((2,)), N_SAMPLES * exact.sum((0, 1)))}
    control = _chi2_p(counts((0, 1)), N_SAMPLES * colder.sum(2).ravel())
    print(f"chi-square p-values {pvals}; control at T/2 {control:.2e}; verify lengths seen {sorted(set(lengths))}")
    assert min(pvals.values()) >= 1e-3, pvals
    assert control < 1e-6


# -- runtime.json and the CLI ----------------------------------------------------------------


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def art(tmp_path):
    """A private copy: calibration writes runtime.json into it."""
    d = tmp_path / "out"
    shutil.copytree(artifact(CASES["qwen3"])[2], d)
    return d


def test_runtime_json_is_allowed_and_not_hashed(art):
    key = "ort:cpu"
    assert load_settings(art, key) == Settings()
    save_settings(art, key, Settings(threads=1, verify=VerifyPolicy(0.3, 2), measured={"x": 1}))
    save_settings(art, "trt", Settings(verify=None))
    m = M.load_manifest(art, verify=True)  # still verifies: the file is allowed, and never hashed
    assert C.RUNTIME not in m.files and C.RUNTIME not in M.hash_files(art)
    assert load_settings(art, key).verify == VerifyPolicy(0.3, 2) and load_settings(art, "trt").verify is None
    assert resolve(art, m, RunOptions()).verify == VerifyPolicy(0.3, 2)
    assert resolve(art, m, RunOptions(verify="full")).verify is None  # --verify full ignores the calibration
    assert resolve(art, m, RunOptions(threads=3)).threads == 3 and resolve(art, m, RunOptions()).threads == 1
    assert resolve(art, m, RunOptions(provider="cuda")).verify is None and resolve(art, m, RunOptions()).spin is False
    # per-graph threads and the prefill chunk reach the sessions; --threads overrides every graph
    per = {C.TARGET: 2, C.DRAFT_CONTEXT: 1, C.DRAFT_BLOCK: 1}
    save_settings(art, key, Settings(threads=1, graph_threads=per, prefill_chunk=64))
    cfg = resolve(art, m, RunOptions())
    assert cfg.graph_threads == per and cfg.prefill_chunk == 64 and resolve(art, m, RunOptions(threads=3)).graph_threads == {}
    be = OrtBackend(art, **cfg.ort_kwargs())
    assert {g: s.get_session_options().intra_op_num_threads for g, s in be.sessions.items()} == per
    assert be.max_chunk == 64
    g = generate(be, list(range(1, 100)), 4)
    assert g.tokens == generate(OrtBackend(art, threads=1), list(range(1, 100)), 4, draft=False).tokens
    # a calibrated bounded spin reaches the sessions, also under an explicit --spin; --no-spin turns it off
    save_settings(art, key, Settings(threads=2, spin=True, spin_us=50, graph_threads=per))
    assert (resolve(art, m, RunOptions()).spin_us, resolve(art, m, RunOptions(spin=True)).spin) == (50, True)
    for spin, bound in ((None, "50"), (False, None)):
        o = OrtBackend(art, drafter=False, **resolve(art, m, RunOptions(spin=spin)).ort_kwargs()).sessions[C.TARGET]
        try:
            got = o.get_session_options().get_session_config_entry("session.intra_op.spin_duration_us")
        except RuntimeError:  # not set
            got = None
        assert got == bound
    raw = json.loads((art / C.RUNTIME).read_text())
    raw["devices"][key]["spin_us"] = -5
    (art / C.RUNTIME).write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match="spin_us must be a positive integer"):
        load_settings(art, key)
    raw["devices"][key]["spin_us"] = None
    raw["devices"][key]["graph_threads"]["target"] = 0
    (art / C.RUNTIME).write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match="graph_threads.target must be a positive integer"):
        load_settings(art, key)
    (art / C.RUNTIME).write_text("{not json")
    with pytest.raises(DFlashError, match="runtime.json: unreadable"):
        load_settings(art, key)
    r = run("generate", art, "--prompt-ids", "1,2,3", "--max-new-tokens", "4")
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "runtime.json" in r.output


def test_bench_calibrate_then_generate_auto(art):
    r = run("bench", art, "--calibrate", "--max-new-tokens", "24", "--warmup", "0", "--json", "--context", "8,40")
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    for key in ("best_threads", "speedup_vs_best_plain", "mean_verify_len", "by_threads", "calibration", "tau"):
        assert key in j, key
    assert set(j["step_ms_by_context"]) == {"8", "40"} and all(v > 0 for v in j["step_ms_by_context"].values())
    assert j["lossless"] and 1 <= j["mean_verify_len"] <= j["block_size"]
    entry = json.loads((art / C.RUNTIME).read_text())["devices"]["ort:cpu"]
    assert entry["threads"] >= 1 and len(entry["measured"]["verify_ms_by_length"]) == j["block_size"]
    costs = entry["costs"]  # the speculation controller's round costs (rows 1, 2, 4 where the export takes batches)
    assert costs["rows"][0] == 1 and all(len(v) == j["block_size"] for v in costs["verify_ms"]) and min(costs["step_ms"]) > 0
    assert j["speculation"] == "auto" and j["costs"] == "calibrated" and set(j["rounds"]) == {"drafted", "plain"}
    by_threads = entry["measured"]["speculative_tokens_per_second_by_threads"]
    if entry["threads"] > 1 or len(by_threads) > 1:  # every count above one ran blocking, bounded and full spinning
        many = [k for k in by_threads if k.isdigit() and int(k) > 1]
        spinning = {spin_label(int(k), *m) for k in many for m in SPIN_MODES[1:]}
        assert {k for k in by_threads if not k.isdigit()} == spinning
        assert isinstance(entry["spin"], bool) and j["spin"] == entry["spin"] and j["spin_us"] == entry["spin_us"]
        assert entry["spin_us"] in ((None, *SPIN_US) if entry["spin"] else (None,))
    by_graph = entry["measured"]["graph_ms_by_threads"]  # each graph's call at each count -> its count
    if len(by_graph) > 1:
        assert set(entry["graph_threads"]) == {C.TARGET, C.DRAFT_CONTEXT, C.DRAFT_BLOCK}
        for g, t in entry["graph_threads"].items():
            assert by_graph[str(t)][g] <= 1.05 * min(ms[g] for ms in by_graph.values())
    chunks = entry["measured"]["prefill_ms_by_chunk"]  # time to first token by prefill chunk -> the chunk
    assert str(entry["prefill_chunk"]) in chunks and chunks[str(entry["prefill_chunk"])] <= 1.02 * min(chunks.values())
    assert j["prefill_chunk"] == entry["prefill_chunk"] and j["ttft_ms"] > 0
    assert j["ttft_prompt_tokens"] == min(512, M.load_manifest(art).max_context - 1)
    assert j["verify"] == (entry["verify"] or "full") and j["threads"] == entry["threads"]
    M.load_manifest(art, verify=True)
    outs = {}
    for mode in ("auto", "full"):
        r = run("generate", art, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "30", "--json", "--verify", mode)
        assert r.exit_code == 0, r.output
        outs[mode] = json.loads(r.stdout)
    assert outs["auto"]["tokens"] == outs["full"]["tokens"]
    assert outs["full"]["verify"] == "full" and outs["full"]["mean_verify_len"] > 0


def test_speed_options_errors(art):
    for args, msg in [(("--threads", "0"), "--threads must be >= 1"),
                      (("--context", "8,4000"), "needs an export with --max-context >= 4008"),
                      (("--context", "x"), "--context must be comma-separated integers")]:
        r = run("bench", art, "--max-new-tokens", "4", *args)
        assert r.exit_code == 2 and msg in r.output and r.output.count("\n") == 1, r.output


def test_serve_engine_uses_the_calibrated_settings(art, monkeypatch):
    """serve resolves threads, spinning and the verify policy as generate/bench do."""
    from dflash_export.serve.engine import load_engine
    from dflash_export.serve.options import ServeOptions

    monkeypatch.setattr("dflash_export.serve.text.Text", lambda *args: SimpleNamespace(template_source=None))  # no tokenizer

    save_settings(art, "ort:cpu", Settings(threads=1, verify=VerifyPolicy(0.2, 2)))
    engine = load_engine(ServeOptions(art, model_name="m"))
    try:
        assert engine.verify == VerifyPolicy(0.2, 2) and engine.slots[0].backend.threads == 1
        assert engine.slots[0].backend.spin is False
    finally:
        engine.close()
    engine = load_engine(ServeOptions(art, model_name="m", verify="full", threads=2, spin=True))
    try:
        assert engine.verify is None and engine.slots[0].backend.threads == 2 and engine.slots[0].backend.spin
    finally:
        engine.close()
