"""The speculation controller (runtime/controller.py): rounds that switch between drafting and
plain steps stay lossless, the drafter's context survives plain stretches, the cost model
backs off where drafting does not pay and almost never where a verify costs about a step,
probing stays within its bound, and runtime.json's costs load (or their absence: the default).

Lossless here means: every greedy row equals the target's own plain greedy decoding (the
same artifact, draft=False), on every cached tiny model (tests/runtime_cases.py: Qwen3,
Llama, Qwen2, block 16, both attention flavours, a hybrid Gated DeltaNet target), many
random prompts, batch 1 and batch 3 with rows joining late, with decisions forced by a coin
and by a test cost model whose break-even sits inside the rows' acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from runtime_cases import CASES, ORT_CASES, artifact, prompts
from test_batch import HYBRID

from dflash_export.runtime.controller import (PROBE_BOUND, SKIP, Controller, Costs, RowControl, controller_for,
                                              default_costs, max_gap, rounds_of)
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.loop import Generation, Request, generate, generate_batch
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import Settings, load_settings, save_settings
from dflash_export.runtime.sampling import Sampling

MODELS = {**CASES, **ORT_CASES, "hybrid": HYBRID}


class Coin(Controller):
    """Decides each round by a seeded coin (the bookkeeping and catch-up are the controller's)."""

    def __init__(self, block_size: int, seed: int, p: float = 0.5, per_row: bool = False):
        super().__init__(default_costs(block_size), block_size)
        self.rng, self.p, self.per_row = np.random.default_rng(seed), p, per_row

    def choose(self, rows, per_row=False):
        if self.per_row:  # each row its own coin: drafted and plain rows in one round
            return {id(r): bool(self.rng.random() < self.p) for r in rows}
        spec = bool(self.rng.random() < self.p)
        return {id(r): spec for r in rows}


def flat_costs(block: int, ratio: float) -> Costs:
    """A test cost model: verify free, so the break-even is `ratio` at every length and batch."""
    return Costs([1], [1.0], [[1.0] * block], [ratio - 1.0], [0.0])


@pytest.mark.parametrize("name", list(MODELS))
def test_switching_rounds_equal_plain_greedy(name):
    _, _, out = artifact(MODELS[name])
    be1, be3 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=3)
    K, V = be1.manifest.block_size, be1.manifest.vocab_size
    ps = prompts(6, V, seed=11)
    new = [int(n) for n in np.random.default_rng(11).integers(4, 40, len(ps))]
    refs = [generate(be1, p, n, draft=False, stop_token_ids=()).tokens for p, n in zip(ps, new)]
    kinds = set()
    ctls = [Coin(K, seed=1), Coin(K, seed=2, p=0.2), Coin(K, seed=3, per_row=True), Controller(flat_costs(K, 2.0), K)]
    for i, ctl in enumerate(ctls):
        for p, n, ref in zip(ps, new, refs):
            g = generate(be1, p, n, stop_token_ids=(), control=ctl)
            assert g.tokens == ref, (name, i)
            kinds |= set(g.drafted)
        gens, stats = generate_batch(be3, [Request(p, n, stop_token_ids=()) for p, n in zip(ps, new)], control=ctl)
        assert [g.tokens for g in gens] == refs, (name, i)
        assert stats.plain_rounds == sum(1 for g in gens for d in g.drafted if not d) or stats.plain_rounds > 0
    assert kinds == {True, False}  # both kinds of round ran


def test_plain_stretches_keep_the_drafters_context():
    """Plain steps' taps kept on the host reach the drafter's context at the next drafted round:
    the drafted rounds accept exactly what they accept when every plain step projects its own
    position (a backend without host taps), so the drafter saw the same context."""
    _, _, out = artifact(CASES["qwen3"])
    be = OrtBackend(out, threads=1)

    class NoHostTaps:  # the backend seen as one without host taps: a draft_context call per plain round
        def __init__(self, inner):
            self.__dict__["inner"] = inner

        def __getattr__(self, name):
            if name == "last_taps":  # the Backend interface's default: no host taps
                return lambda rows: None
            return getattr(self.inner, name)

    for seed, p in enumerate(prompts(5, be.manifest.vocab_size, seed=4)):
        kept = generate(be, p, 60, stop_token_ids=(), control=Coin(be.manifest.block_size, seed, p=0.3))
        each = generate(NoHostTaps(be), p, 60, stop_token_ids=(), control=Coin(be.manifest.block_size, seed, p=0.3))
        assert kept.drafted == each.drafted and False in kept.drafted
        assert kept.acceptance_lengths == each.acceptance_lengths
        assert kept.tokens == each.tokens == generate(be, p, 60, draft=False, stop_token_ids=()).tokens
    assert max(kept.acceptance_lengths) > 1  # the drafter's context was right: drafts were accepted


@pytest.mark.parametrize("name", ["qwen3", "qwen3-ort"])
def test_sampled_rows_keep_their_seed_under_the_controller(name):
    """Rejection-sampled rows decide for themselves (batch-1 costs, own history): alone or in a
    batch, with switching, the same seed gives the same tokens; sample-and-compare rows draw
    exactly the target's plain sampled tokens, whichever rows draft beside them."""
    _, _, out = artifact(MODELS[name])
    be1, be3 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=3)
    K, V = be1.manifest.block_size, be1.manifest.vocab_size
    ctl = Controller(flat_costs(K, 3.0), K)
    ps = prompts(5, V, seed=9)
    def s(i, method="rejection"):
        return Sampling(0.9, top_k=20, seed=50 + i, method=method)

    alone = [generate(be1, p, 30, sampling=s(i), control=ctl, stop_token_ids=()) for i, p in enumerate(ps)]
    gens, _ = generate_batch(be3, [Request(p, 30, s(i), stop_token_ids=()) for i, p in enumerate(ps)], control=ctl)
    assert [g.tokens for g in gens] == [g.tokens for g in alone]
    assert {d for g in alone for d in g.drafted} == {True, False}
    plain = [generate(be1, p, 30, sampling=s(i), draft=False, stop_token_ids=()).tokens for i, p in enumerate(ps)]
    for i, p in enumerate(ps):
        assert generate(be1, p, 30, sampling=s(i, "compare"), control=Coin(K, i), stop_token_ids=()).tokens == plain[i]
    for per_row in (False, True):  # rows drafting and plain in one round, by each row's own coin
        reqs = [Request(p, 30, s(i, "compare"), stop_token_ids=()) for i, p in enumerate(ps)]
        gens, _ = generate_batch(be3, reqs, control=Coin(K, 7, per_row=per_row))
        assert [g.tokens for g in gens] == plain
    mixed = [Request(p, 30, s(i, "rejection" if i % 2 else "compare"), stop_token_ids=()) for i, p in enumerate(ps)]
    gens, _ = generate_batch(be3, mixed, control=Controller(flat_costs(K, 3.0), K))  # rejection rows decide alone
    assert [g.tokens for g in gens] == [alone[i].tokens if i % 2 else plain[i] for i in range(len(ps))]


@pytest.mark.parametrize("name", ["qwen3", "qwen3-ort"])
def test_always_rows_draft_and_never_rows_do_not(name):
    """An "always" row drafts every round and a `speculative: false` row steps beside it, on
    the `ort` flavour and the standard one (one padded call each: GroupQueryAttention takes each
    row's count of new tokens): every
    row's greedy tokens are its plain decoding's; an auto row where drafting does not pay
    backs off."""
    _, _, out = artifact(MODELS[name])
    be1, be3 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=3)
    assert not be3.verify_per_row
    K = be3.manifest.block_size
    ctl = Controller(flat_costs(K, 100.0), K)  # drafting never pays
    ps = prompts(3, be3.manifest.vocab_size, seed=2)
    reqs = [Request(ps[0], 20, stop_token_ids=(), speculative="always"), Request(ps[1], 20, stop_token_ids=()),
            Request(ps[2], 20, stop_token_ids=(), speculative=False)]
    gens, stats = generate_batch(be3, reqs, control=ctl)
    assert all(gens[0].drafted) and not any(gens[2].drafted)  # rounds where one row drafts and another steps
    assert [g.tokens for g in gens] == [generate(be1, p, 20, draft=False, stop_token_ids=()).tokens for p in ps]
    gens, stats = generate_batch(be3, reqs[1:], control=ctl)
    assert stats.plain_rounds > 0 and rounds_of(gens)["drafted"] < 3  # backed off after its first round or two


# -- the cost model, without a backend ---------------------------------------------------------


def simulate(costs: Costs, block: int, accept, rounds: int, rows: int = 1, request: int = 0):
    """The controller's decisions over rows whose drafted rounds would emit accept(rng) tokens
    each at the full block (a round verifying s positions, the controller's cap: at most s):
    (drafted rounds, plain rounds, tokens, time in the cost model's unit, mean tokens of a
    drafted row-round). `request` > 0: every row is a new request after that many tokens."""
    ctl, rng = Controller(costs, block), np.random.default_rng(0)
    new = lambda: SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(),  # noqa: E731
                                  done=False)
    rs = [new() for _ in range(rows)]
    drafted = plain = tokens = drafted_tokens = 0
    spent, last = 0.0, None
    for _ in range(rounds):
        spec = ctl.decide(rs, backend=None)
        S = max(r.ctl.cap or block for r in rs) if spec else 1
        for r in rs:
            a = min(int(accept(rng)), S) if spec else 1
            r.gen.acceptance_lengths.append(a)
            r.gen.verify_lengths.append(S)
            r.gen.drafted.append(spec)
            tokens += a
            drafted_tokens += a if spec else 0
        catch_up = costs._at(costs.context, rows) if spec and last is False else 0.0  # the plain steps' context
        spent += costs.spec_ms(rows, S) + catch_up if spec else costs.plain_ms(rows)
        drafted, plain, last = drafted + spec, plain + (not spec), spec
        if request:
            rs = [new() if sum(r.gen.acceptance_lengths) >= request else r for r in rs]
    return drafted, plain, tokens, spent, drafted_tokens / max(1, drafted * rows)


DEMO_HISTOGRAM = [188, 124, 66, 38, 50, 24, 29, 31, 8, 14, 9, 3, 6, 6, 4, 53]  # demo/RESULTS.md, shipped drafter


def demo_accept(rng):
    p = np.array(DEMO_HISTOGRAM, float)
    return 1 + rng.choice(16, p=p / p.sum())


def test_gpu_like_costs_almost_never_back_off():
    """A verify costing about a step (a GPU at small batch): the break-even is ~1.4 tokens a
    round (1.5 at 4 rows); with the demo drafter's acceptance (tau 4.7, independent rounds)
    under 3% of rounds go plain, within 2% of drafting every round, and even
    a weak drafter (1 or 2 tokens a round, mean 1.5) keeps drafting most rounds."""
    gpu = Costs([1, 4], [1.0, 1.1], [[1.0 + 0.005 * s for s in range(16)], [1.1 + 0.01 * s for s in range(16)]],
                [0.25, 0.3], [0.05, 0.06])
    assert gpu.ratio(1, 16) < 1.4 and gpu.ratio(4, 16) < 1.5
    for rows in (1, 4):
        d, p, tokens, spent, tau = simulate(gpu, 16, demo_accept, 3000, rows)
        always = rows * tau / gpu.spec_ms(rows, 16)  # every round drafted, at the same draws' mean
        print(f"GPU-like costs, {rows} row(s): {p / (d + p):.1%} of rounds plain, {tokens / spent / always:.3f}x always")
        assert p / (d + p) < 0.03 and tokens / spent > 0.98 * always, (rows, d, p)
    d, p, *_ = simulate(gpu, 16, lambda rng: 1 + rng.integers(0, 2), 2000)
    assert d > p


def test_cpu_like_costs_back_off_off_domain_and_probing_is_bounded():
    """Default (CPU-like) costs: a drafter that accepts nothing goes plain after its first
    rounds, and over a long stretch probing costs at most PROBE_BOUND of plain throughput
    beyond the start of the stretch; the demo drafter's acceptance keeps drafting."""
    c = default_costs(16)
    n = 3000
    d, p, tokens, spent, _ = simulate(c, 16, lambda rng: 1, n)
    plain_rate = 1 / c.plain_ms(1)
    assert p > 0.95 * n
    # the first probes of a stretch come sooner (gaps max_gap/16, /8, /4, /2): all within the first 2 * max_gap rounds
    g = max_gap(c.probe(1, 16))
    start = 2 * g
    d_late, p_late, tokens_late, spent_late = [x - y for x, y in zip((d, p, tokens, spent),
                                                                     simulate(c, 16, lambda rng: 1, start))]
    assert (tokens_late / spent_late) >= plain_rate * (1 - PROBE_BOUND - 1e-9), (d_late, p_late)
    assert (tokens / spent) >= plain_rate * 0.95  # the whole stretch, its start included
    d, p, *_ = simulate(c, 16, demo_accept, 2000)
    assert d > p


CPU_ORT = Costs([1, 2, 4], [1.18, 1.26, 1.47], [[1.18, 1.21] + [1.27] * 4 + [1.6] * 10, [1.26, 2.32] + [2.6] * 4 + [3.4] * 10,
                                                [1.47, 4.94] + [5.1] * 4 + [7.0] * 10], [1.48, 2.09, 3.14], [0.29, 0.33, 0.37])
"""The demo pair's calibrated round costs (ms) on a 2-vCPU machine, `--attention ort` (a verify call per row)."""


def test_no_probe_where_a_lone_drafting_row_cannot_pay():
    """At 4 rows of the CPU costs above, one row drafting beside 3 plain rows needs more tokens
    than it verifies (its round: a 4-row draft call, its verify, 3 one-position calls): rows that
    accept nothing do not probe there, and do at 1 row (where a probe can pay), within its bound."""
    ctl = Controller(CPU_ORT, 16)
    assert not ctl.could_pay(RowControl(), 4, True) and ctl.could_pay(RowControl(), 1, True)
    d, p, *_ = simulate(CPU_ORT, 16, lambda rng: 1, 600, rows=4)
    assert d <= 2, d  # a new row's first round or two, before its estimate falls
    d1, p1, tokens, spent, _ = simulate(CPU_ORT, 16, lambda rng: 1, 600, rows=1)
    assert d1 > 4 and tokens / spent > 0.9 / CPU_ORT.plain_ms(1), (d1, p1)


def test_sure_rows_skip_decisions_and_still_stop():
    """Every row drafting well above its break-even (SURE x): the next SKIP rounds draft without
    a decision (its host work saved); when acceptance collapses the rows still stop, at most
    SKIP rounds later than deciding every round would; plain rounds far from paying skip too."""
    def run(skip, rows=1, n=120):  # rounds accepting 12 of 16 until n - 60, then nothing
        ctl, calls = Controller(CPU_ORT, 16), []
        choose = ctl.choose
        ctl.choose = lambda rows, per_row=False: (calls.append(len(rs[0].gen.drafted)), choose(rows, per_row))[1]
        rs = [SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(), done=False)
              for _ in range(rows)]
        for t in range(n):
            ctl._sure = ctl._sure[:1] + (min(ctl._sure[1], skip),) + ctl._sure[2:]
            spec = ctl.decide(rs, SimpleNamespace(verify_per_row=True))
            for r in rs:
                r.gen.acceptance_lengths.append((12 if t < n - 60 else 1) if spec else 1)
                r.gen.verify_lengths.append(16 if spec else 1)
                r.gen.drafted.append(spec)
        return calls, rs[0].gen.drafted
    calls, drafted = run(SKIP)
    calls0, drafted0 = run(0)
    assert len(calls0) == 120 and sum(t < 60 for t in calls) <= 60 / (SKIP + 1) + 4, calls  # decided every SKIP + 1 rounds
    assert 60 < drafted0.index(False) <= drafted.index(False) <= drafted0.index(False) + SKIP
    calls, drafted = run(SKIP, rows=4, n=100)  # 4 rows on a CPU: plain, far from paying
    calls0, drafted0 = run(0, rows=4, n=100)
    assert len(calls0) == 100 and len(calls) <= 100 / (SKIP + 1) + 10, len(calls)
    assert not any(drafted[50:]) and not any(drafted0[50:])


def test_a_long_plain_stretch_at_four_rows():
    """4 rows that cannot pay on a CPU, 600 plain rounds, then 2 rows: the skipped rounds are
    still clocked (the load correction keeps learning), the rows' kept taps reach the drafter
    once they fill a chunk (not one copy per round for the whole request), and a probe gap
    pushed on by the looks falls back within max_gap once probes can pay again."""
    ctl = Controller(CPU_ORT, 16)
    flushed = []
    backend = SimpleNamespace(verify_per_row=True, max_chunk=64, last_taps=lambda n: np.zeros((n, 8), np.float32),
                              context_from_taps=lambda b, taps: flushed.append(len(taps)))
    rs = [SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(), done=False)
          for _ in range(4)]
    for t in range(700):
        rows = rs if t < 600 else rs[:2]
        spec = ctl.decide(rows, backend)
        for r in rows:
            r.gen.acceptance_lengths.append(9 if spec else 1)
            r.gen.verify_lengths.append(16 if spec else 1)
            r.gen.drafted.append(spec)
            r.gen.round_s.append((0.0, 0.0015, 0.0))
        if not spec:
            ctl.plain_step(backend, rows, [1] * len(rows))
    assert ctl.measured[(4, False)][1] > 100  # skipped rounds clocked too
    assert flushed.count(64) >= 4 * (600 // 64) and max(flushed) == 64 and max(len(r.ctl.taps) for r in rs) < 64
    # a probe that beats the break-even while the row's estimate stays below it keeps its gap: capped
    c = RowControl(emitted=20.0, weight=10.0, length=16.0, plain=604, gap=604)
    g = Generation(acceptance_lengths=[1] * 604 + [9], verify_lengths=[1] * 604 + [16], drafted=[False] * 604 + [True])
    c.seen = 604
    ctl._read(c, g, 2, True)
    assert 9 > ctl.break_even(c, 2, True) > c.tokens and 0 < c.gap <= max_gap(ctl.probe_cost(c, 2, True))


def test_coin_flips_are_not_skipped():
    """A `choose` that does not report its edge (the tests' coins) never gets plain rounds skipped."""
    ctl = Coin(16, seed=5)
    row = SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(), done=False)
    for _ in range(400):
        spec = ctl.decide([row], None)
        row.gen.acceptance_lengths.append(1)
        row.gen.verify_lengths.append(16 if spec else 1)
        row.gen.drafted.append(spec)
    assert 0.4 < np.mean(row.gen.drafted) < 0.6


def per_row_rounds(costs: Costs, accepts: list, per_row: bool, rounds: int = 400):
    """Rows drafting `accepts[b]` tokens a round under the controller (the backend's verify per
    row or batched): the fraction of each row's rounds that verified more than 4 positions (per row,
    a short verify costs about a one-position call), and tokens per unit of time."""
    ctl, rng = Controller(costs, 16), np.random.default_rng(0)
    rs = [SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(), done=False)
          for _ in accepts]
    backend = SimpleNamespace(verify_per_row=per_row)
    tokens = spent = 0.0
    for _ in range(rounds):
        ctl.decide(rs, backend)
        lengths = tuple(r.ctl.cap or 16 for r in rs if r.ctl.drafts)
        S = max(lengths, default=1)
        for r, acc in zip(rs, accepts):
            s = (r.ctl.cap or 16 if per_row else S) if r.ctl.drafts else 1
            a = min(int(acc(rng)), s)
            r.gen.acceptance_lengths.append(a)
            r.gen.verify_lengths.append(s)
            r.gen.drafted.append(r.ctl.drafts)
            tokens += a
        spent += costs.round_ms(len(rs), lengths, per_row)
    return [float(np.mean([v > 4 for v in r.gen.verify_lengths])) for r in rs], tokens / spent


def test_per_row_decisions_where_the_verify_is_per_row():
    """A backend whose verify runs a call per row (ONNX Runtime's GroupQueryAttention flavour):
    a drafted round costs the draft call, each drafting row's own verify and each other row's
    one-position call, so in a batch of two code-like rows (tau 4.7) and two rows that accept
    nothing the first draft (most rounds) and the others step or verify a few positions (about as
    cheap as a step's call: nearly always), and that beats both all-plain
    and all-drafted rounds by 5%. Where one padded call verifies every row, a round drafts all rows or none."""
    one = [1.0 + 0.02 * s for s in range(16)]  # a call of one row over s positions (a GPU-like flat verify)
    per_row = Costs([1, 4], [1.0, 2.5], [one, [2.5] + [4 * x for x in one[1:]]], [0.5, 0.8], [0.05, 0.1])
    accepts = [demo_accept, demo_accept, lambda rng: 1, lambda rng: 1]
    share, rate = per_row_rounds(per_row, accepts, True)
    assert min(share[:2]) > 0.7 and max(share[2:]) < 0.1, share  # bursty acceptance: the code rows step now and then
    plain_rate = 4 / per_row.plain_ms(4)
    all_rate = (2 * 4.7 + 2) / per_row.round_ms(4, (16,) * 4, True)
    assert rate > 1.05 * max(plain_rate, all_rate), (rate, plain_rate, all_rate)
    batched = Costs([1, 4], [1.0, 1.8], [[1.0 + 0.01 * s for s in range(16)], [1.8 + 0.02 * s for s in range(16)]],
                    [0.3, 0.4], [0.05, 0.06])
    rounds = per_row_rounds(batched, accepts, False, 100)
    ctl = Controller(batched, 16)
    rs = [SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(), done=False)
          for _ in accepts]
    for _ in range(50):
        spec = ctl.decide(rs, SimpleNamespace(verify_per_row=False))
        assert len({r.ctl.drafts for r in rs}) == 1  # all or none
        for r in rs:
            r.gen.acceptance_lengths.append(1)
            r.gen.verify_lengths.append(16 if spec else 1)
            r.gen.drafted.append(spec)
    assert rounds[0][0] > 0.9  # the code-like rows' acceptance carries the round: all draft


def test_tau_counts_drafted_rounds_only():
    g = Generation(acceptance_lengths=[5, 1, 1, 3], drafted=[True, False, False, True])
    assert g.tau == 4.0 and rounds_of([g]) == {"drafted": 2, "plain": 2}
    assert Generation(acceptance_lengths=[1, 1], drafted=[False, False]).tau == 1.0  # plain decoding


def test_costs_in_runtime_json(tmp_path):
    """Calibrated costs round-trip; files without them (older ones) load with the default model;
    a malformed cost table is one line at load."""
    (tmp_path / "manifest.json").write_text("{}")
    assert load_settings(tmp_path, "ort:cpu").costs == {}  # no runtime.json
    assert controller_for("auto", {}, 8).costs.source == "default"
    assert controller_for("always", {}, 8) is None and controller_for("never", {}, 8) is None
    costs = {"rows": [1, 2], "step_ms": [1.0, 1.5], "verify_ms": [[1.0, 1.2], [1.5, 2.0]], "draft_ms": [0.8, 1.0],
             "context_ms": [0.1, 0.1]}
    save_settings(tmp_path, "ort:cpu", Settings(threads=1, costs=costs))
    s = load_settings(tmp_path, "ort:cpu")
    c = controller_for("auto", s.costs, 2).costs
    assert c.source == "calibrated" and c.ratio(1, 2) == pytest.approx((0.8 + 1.2 + 0.1) / 1.0)
    assert c.plain_ms(3) == pytest.approx(1.5 * 3 / 2)  # beyond the measured rows: per row as the last
    raw = json.loads((tmp_path / "runtime.json").read_text())
    raw["devices"]["ort:cpu"].pop("costs")  # a file written before the cost model
    (tmp_path / "runtime.json").write_text(json.dumps(raw))
    assert load_settings(tmp_path, "ort:cpu").costs == {}
    raw["devices"]["ort:cpu"]["costs"] = {**costs, "step_ms": [1.0]}
    (tmp_path / "runtime.json").write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match="malformed entry"):
        load_settings(tmp_path, "ort:cpu")
    with pytest.raises(DFlashError, match="--speculation must be one of"):
        controller_for("sometimes", {}, 8)
    c = Controller(default_costs(16), 16)
    assert c._wants(RowControl(prior=c.costs.ratio(1, 16) + 1), 1, False)  # a new row drafts its first round


def test_cli_speculation_modes(tmp_path):
    """`generate --speculation auto|always|never` (and the old --no-draft) give the same greedy
    tokens and report the rounds each way; contradictory flags are one line."""
    from click.testing import CliRunner

    from dflash_export.cli import cli

    _, _, out = artifact(CASES["qwen3"])
    runs = {}
    for mode in (["--speculation", "auto"], ["--speculation", "always"], ["--speculation", "never"], ["--no-draft"]):
        r = CliRunner().invoke(cli, ["generate", str(out), "--prompt-ids", "5,9,13,2", "--max-new-tokens", "24",
                                     "--json", "--threads", "1", *mode])
        assert r.exit_code == 0, r.output
        runs[" ".join(mode)] = json.loads(r.stdout.splitlines()[-1])
    assert len({tuple(x["tokens"]) for x in runs.values()}) == 1
    assert runs["--speculation never"]["rounds"]["drafted"] == 0 and runs["--no-draft"]["rounds"]["drafted"] == 0
    assert runs["--speculation always"]["rounds"]["plain"] == 0 and runs["--speculation auto"]["speculation"] == "auto"
    r = CliRunner().invoke(cli, ["generate", str(out), "--prompt-ids", "5,9", "--no-draft", "--speculation", "always"])
    assert r.exit_code != 0 and "--no-draft means --speculation never" in r.output and "Traceback" not in r.output


def moe_costs(top: float) -> Costs:
    """A MoE target's costs in plain steps (a verify of s positions routes to up to k*s experts):
    verify cost linear from a step at 1 position to `top` steps at 16; the drafter's calls cheap."""
    return Costs([1], [1.0], [[1.0 + (top - 1.0) * (s - 1) / 15 for s in range(1, 17)]], [0.2], [0.05])


@pytest.mark.parametrize("top", [3.0, 8.0, 22.0])
def test_moe_costs_verify_short_or_step(top):
    """Verify cost growing with its length (Qwen3-30B-A3B's expert shape: a 16-token verify ~22
    steps on 2 CPU threads): with a drafter that accepts nothing, 128-token requests run at
    >= 0.95x plain steps (no full block ever pays, so none is drafted); with the demo drafter's
    acceptance the controller verifies short blocks and beats both plain steps and drafting
    the full block every round (where either can pay)."""
    c = moe_costs(top)
    d, p, tokens, spent, _ = simulate(c, 16, lambda rng: 1, 1000, request=128)
    assert tokens / spent >= 0.95 / c.plain_ms(1), (d, p, tokens / spent)
    ctl = Controller(c, 16)
    assert ctl.best_length(RowControl(emitted=4.7, weight=1.0, length=16.0), 1, False)[0] < 16
    d, p, tokens, spent, tau = simulate(c, 16, demo_accept, 3000, request=128)
    full = np.mean([demo_accept(np.random.default_rng(i)) for i in range(2000)]) / c.spec_ms(1, 16)
    print(f"MoE verify {top:g} steps at 16: auto {tokens / spent:.3f} tok/step, full block {full:.3f}, plain 1")
    assert tokens / spent >= max(0.95, 1.02 * full), (d, p, tokens / spent, full)


# Qwen3-30B-A3B's layer shape at 2 layers, fp32 experts (ONNX Runtime's MoE op), 2 CPU threads at load
# average 12, in plain steps (bench/moe_policy.py, 2026-12-04 05:26 UTC): a draft call 1.71 steps (the
# drafter's head over 16 positions of 151936 tokens), a verify of s positions from 1.46 steps at 2 to 3.39 at 16
MOE_2L = Costs([1], [1.0], [[1.0, 1.46, 1.83, 1.77, 1.98, 2.15, 2.23, 2.26, 2.67, 2.59, 2.99, 3.02, 3.21, 3.37, 3.29,
                             3.39]], [1.71], [0.0057])


def requests(costs: Costs, accepts, n: int = 128, block: int = 16):
    """Requests of n tokens one after another under one controller (as `serve` or `generate
    --prompts` run them), request i's drafted round at position t emitting accepts[i](t) tokens
    (at most its verify length): per request (drafted rounds, tokens, time in the costs' unit,
    plain rounds before its first drafted round)."""
    ctl, out = Controller(costs, block), []
    for accept in accepts:
        row = SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(), done=False)
        t, spent, last = 0, 0.0, None
        while t < n:
            spec = ctl.decide([row], None)
            s = (row.ctl.cap or block) if spec else 1
            a = min(accept(t), s, n - t) if spec else 1
            row.gen.acceptance_lengths.append(a)
            row.gen.verify_lengths.append(s)
            row.gen.drafted.append(spec)
            spent += costs.spec_ms(1, s) + (costs.context[0] if last is False else 0.0) if spec else costs.plain_ms(1)
            t, last = t + a, spec
        out.append((sum(row.gen.drafted), t, spent, (row.gen.drafted + [True]).index(True)))
    return out


def test_new_requests_continue_a_plain_stretch():
    """A drafter that accepts nothing on the 2-layer MoE costs: the first request pays its first
    round and the first probes of its plain stretch; the requests after it start plain and probe
    on the same schedule (its gaps keep doubling across them), so 8 requests of 128 tokens run at
    >= 0.95x plain steps (each request cold: 0.91x)."""
    out = requests(MOE_2L, [lambda t: 1] * 8)
    rate = sum(x[1] for x in out) / sum(x[2] for x in out)
    drafted = [x[0] for x in out]
    print(f"accepts nothing, MoE 2-layer costs: {rate:.3f}x plain, drafted rounds per request {drafted}")
    assert rate >= 0.95 / MOE_2L.plain_ms(1), (rate, drafted)
    assert drafted[0] >= 2 and sum(drafted[1:]) <= len(drafted), drafted
    c = Controller(MOE_2L, 16)
    c.recent = RowControl(emitted=3.0, weight=3.0, length=2.0, plain=40, gap=48)
    assert (c.new_row(False, 0).plain, c.new_row(False, 0).gap) == (40, 48)
    fresh = c.new_row(True, 0)  # a row that decides for itself starts from its prior, whatever ran before
    assert (fresh.weight, fresh.gap, fresh.plain) == (0.0, 0, 0)
    # in a batch: a plain stretch carries over only while every row deciding with the batch is in one
    row = lambda ctl: SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=ctl, gen=Generation())  # noqa: E731
    drafting = RowControl(emitted=36.0, weight=3.0, length=16.0)
    plain = RowControl(emitted=3.0, weight=3.0, length=2.0, plain=10, gap=48)
    c.choose([row(drafting), row(plain)])
    assert c.new_row(False, 0).gap == 0 and c.new_row(False, 0).weight == 0.0
    c.choose([row(plain), row(RowControl(**{**vars(plain), "taps": [], "plain": 30}))])
    assert (c.new_row(False, 0).plain, c.new_row(False, 0).gap) == (30, 48)


def test_new_requests_draft_where_drafting_pays_and_find_a_turn():
    """A new request drafts its first round unless the recent row is in a plain stretch (a row
    drafting well: it does); after requests that accepted nothing, a drafter that turns good is
    found by the stretch's probes within its largest gap, and drafting resumes."""
    good = requests(MOE_2L, [lambda t: 12] * 3)
    assert all(d >= 10 for d, *_ in good), good  # ~128 / 12 drafted rounds each, from the first
    out = requests(MOE_2L, [lambda t: 1] * 4 + [lambda t: 12] * 6)
    g = max_gap(Controller(MOE_2L, 16).probe_cost(RowControl(), 1, False))
    turned = [d for d, *_ in out[4:]]
    i = next(i for i, x in enumerate(out[4:]) if x[0])
    print(f"4 requests accepting nothing, then 12 a round: drafted rounds {turned}, largest gap {g}")
    assert 128 * i + out[4 + i][3] <= g  # the first probe after the turn: within the largest gap
    assert min(turned[i + 1:]) >= 10 and sum(x[1] for x in out[4:]) / sum(x[2] for x in out[4:]) > 1.5


# -- recorded runs of the demo pair, replayed (runtime/replay.py; bench/speculation_replay.py records them) --------

TRACES = json.loads((Path(__file__).parent / "fixtures" / "speculation_traces.json").read_text())


def replayed(costs: dict, name: str, dearer: float = 1.0, first: int | None = None, same_step: bool = False) -> dict:
    """{mode: Replay} of a recorded set under a cost model of the fixture, drafted rounds `dearer` than
    the model the controller decides with (its measured correction learns the difference). Plain
    decoding's rounds cost the step and its own host work; `same_step`: a plain round under `auto`
    (the controller's work in it too), so the ratio is the decisions' alone."""
    from dflash_export.runtime.replay import replay

    decide = Costs.from_json(costs)
    charge = Costs(decide.rows, decide.step, [[v * dearer for v in vs] for vs in decide.verify],
                   [d * dearer for d in decide.draft], decide.context, host_draft=decide.host_draft,
                   host_plain=decide.host_plain)
    step = decide.plain_ms(1) if same_step else costs["step_ms"][0] + costs["host_step_ms"][0]
    traces = TRACES["sets"][name][:first]
    return {m: replay(traces, m, decide, charge, step, TRACES["block_size"]) for m in ("auto", "always", "never")}


@pytest.mark.parametrize("label, dearer, bound", [("quiet", 1.0, 0.97), ("quiet", 1.2, 0.95), ("recorded", 1.0, 0.94)])
def test_recorded_off_domain_runs_stay_as_fast_as_plain(label, dearer, bound):
    """The demo pair's off-domain prompts (random-vocabulary text, tau ~2 against a break-even of
    ~2.7: drafting loses), replayed round by round through the controller at the fixture's costs
    (quiet: the quiet calibration's calls with the loop's host work; recorded: measured with the
    traces on a loaded machine, a break-even of ~6.7), drafted rounds as calibrated or 20%
    dearer: `auto` keeps >= 0.97x plain decoding (0.95x where the drafted rounds cost more than
    calibrated; 0.94x at the loaded recording) on all 24 prompts and on the first 8 (the
    demo's off-domain row and bench's synthetic prompts), drafting a few percent of its rounds.
    Plain decoding is charged as a plain round under `auto` here: what the decisions cost. The
    controller's own host work in a plain round (`host_plain` over `host_step`) is printed
    beside it; bench/round_model.py measures it in the loop."""
    costs = TRACES["costs"][label]
    for first in (None, 8):
        r = replayed(costs, "off-domain", dearer, first, same_step=True)
        auto, never = r["auto"], r["never"]
        host = replayed(costs, "off-domain", dearer, first)["never"].rate / never.rate  # the controller's host work
        print(f"{label} x{dearer} off-domain[:{first}]: auto/never {auto.rate / never.rate:.3f} (with the controller's "
              f"host work in plain rounds {auto.rate / never.rate / host:.3f}), always/never "
              f"{r['always'].rate / never.rate:.3f}, drafted {auto.drafted} of {auto.drafted + auto.plain} rounds")
        assert auto.rate >= bound * never.rate, (first, auto.rate / never.rate)
        assert auto.drafted <= 0.1 * (auto.drafted + auto.plain)


@pytest.mark.parametrize("label, dearer", [("quiet", 1.0), ("quiet", 1.2)])
def test_recorded_code_runs_keep_alwayss_speedup(label, dearer):
    """The demo pair's held-out code prompts (tau ~4.6), replayed: `auto` keeps >= 95% of drafting
    every round's rate where drafting pays."""
    r = replayed(TRACES["costs"][label], "held-out", dearer)
    auto, always, never = r["auto"], r["always"], r["never"]
    print(f"{label} x{dearer} held-out: auto/always {auto.rate / always.rate:.3f}, always/never {always.rate / never.rate:.3f}")
    assert always.rate > 1.3 * never.rate and auto.rate >= 0.95 * always.rate


def test_losing_rows_fall_to_the_probe_rate():
    """A row whose drafted rounds keep losing (1 token a round at a CPU break-even of ~2.7) drafts
    at the probe rate: its plain stretches do not restart at the short first gap, each gap
    doubles up to max_gap, and the drafted rounds' share over a long run is within the
    probe bound's (PROBE_BOUND of plain throughput at most)."""
    costs = Costs.from_json(TRACES["costs"]["quiet"])
    d, p, tokens, spent, _ = simulate(costs, 16, lambda rng: 1, 4000)
    top = max_gap(costs.probe(1, 16))
    assert d <= 4000 / top + 8, (d, top)  # the first gaps (max_gap / FIRST, doubling) add a handful
    assert tokens / spent >= (1 - 2 * PROBE_BOUND) / costs.plain_ms(1)
