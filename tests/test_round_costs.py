"""The calibration's round costs time each graph call where a round runs it, and the loop's host work.

On a small model a call runs slower right after the other model's call (its weights were
evicted from the CPU caches), so a cost model of calls repeated back to back under-prices a
round. Here a backend double charges every call by what ran before it (a clock that advances
only at graph calls: no timing), and the costs `round_costs` measures must add up to what the
loop's own rounds are then charged, drafted and plain.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_cases import CASES, artifact, prompts

from dflash_export.runtime import calibrate, loop
from dflash_export.runtime.calibrate import cost_model, host_ms, round_costs
from dflash_export.runtime.contract import DRAFT_BLOCK, DRAFT_CONTEXT, TARGET
from dflash_export.runtime.controller import Controller, Costs
from dflash_export.runtime.loop import Generation, generate
from dflash_export.runtime.measure import summarize
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import VerifyPolicy

CALLS = {"target_rows": TARGET, "draft_context_rows": DRAFT_CONTEXT, "draft_block_rows": DRAFT_BLOCK}


class Clock:
    """time.perf_counter for the calibration and the loop: what the graph calls were charged so far."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def charged(be: OrtBackend, clock: Clock) -> OrtBackend:
    """The backend, each of its graph calls advancing `clock` by its own cost (the target's growing
    with its positions) times 1 + 1.0 if the call before it ran the other model + 0.5 if the one
    before that did (a draft_context and a draft_block call are the same model)."""
    before: list[str] = [TARGET, TARGET]
    model = lambda g: g == TARGET  # noqa: E731

    def wrap(fn, graph):
        def call(rows, ids, *a, **k):
            own = 1.0 + 0.1 * np.asarray(ids).shape[1] if graph == TARGET else 0.7 if graph == DRAFT_BLOCK else 0.2
            clock.now += own * (1 + 1.0 * (model(before[-1]) != model(graph)) + 0.5 * (model(before[-2]) != model(graph)))
            before.append(graph)
            return fn(rows, ids, *a, **k)
        return call

    for name, graph in CALLS.items():
        setattr(be, name, wrap(getattr(be, name), graph))
    return be


def test_round_costs_add_up_to_the_loops_rounds(monkeypatch):
    """The calibrated calls (`round_costs`) and the loop's host work (`host_ms`: here a known charge
    in the acceptance of every round and in the controller's keeping of a plain step's features)
    add up to what each kind of round is charged: a drafted round at every verify length, a plain
    round under `auto`, a round of plain decoding."""
    _, _, out = artifact(CASES["qwen3"])
    clock = Clock()
    be = charged(OrtBackend(out, threads=1), clock)
    monkeypatch.setattr(calibrate, "time", clock)
    monkeypatch.setattr(loop, "time", clock)
    accept, keep = loop._accept, Controller.plain_step

    def slow_accept(*a, **k):  # the host work of every round, drafted or plain
        clock.now += 0.3
        return accept(*a, **k)

    def slow_keep(*a, **k):  # the controller's in a plain round
        clock.now += 0.2
        return keep(*a, **k)
    monkeypatch.setattr(loop, "_accept", slow_accept)
    monkeypatch.setattr(Controller, "plain_step", slow_keep)
    ps = prompts(2, be.manifest.vocab_size, seed=3)
    policy = VerifyPolicy(0.3, 2)
    raw = cost_model({1: round_costs(be, ps[0], 1, repeats=2) | host_ms(be, ps[0], 1, policy, new=12)})
    costs = Costs.from_json(raw)
    assert raw["host_draft_ms"][0] == pytest.approx(300) and raw["host_plain_ms"][0] == pytest.approx(500)
    assert raw["host_step_ms"][0] == pytest.approx(300)
    seen = set()
    never = Costs([1], [1.0], [[1.0] * 16], [1e9], [0.0])
    for p in ps:
        g = generate(be, p, 24, stop_token_ids=(), verify=policy)  # verify lengths vary
        for t, s in zip(g.round_s[:-1], g.verify_lengths):  # the last round has no draft_context call
            assert sum(t) * 1e3 == pytest.approx(costs.spec_ms(1, s)), (s, t)
            seen.add(s)
        plain = generate(be, p, 8, draft=False, stop_token_ids=())
        for t in plain.round_s:
            assert sum(t) * 1e3 == pytest.approx(costs.step[0] + raw["host_step_ms"][0])
        auto = generate(be, p, 12, stop_token_ids=(), control=Controller(never, 16))
        steps = [sum(t) for t, d in zip(auto.round_s, auto.drafted) if not d][2:]  # the first two follow a drafted round
        assert len(steps) > 5 and all(x * 1e3 == pytest.approx(costs.plain_ms(1)) for x in steps), steps
    print(f"drafted rounds checked at verify lengths {sorted(seen)}")
    assert len(seen) > 1


def test_loop_efficiency_counts_the_whole_run():
    """bench's ideal speedup prices every round of the speculative run, drafted or the controller's
    plain step: a loop with no host work reads 1.0 whatever share of its rounds drafted."""
    def gen(rounds, drafted):  # rounds: (tokens, draft s, verify s); no host time
        g = Generation(tokens=[0] + [1] * sum(a for a, _, _ in rounds), acceptance_lengths=[a for a, _, _ in rounds],
                       verify_lengths=[16 if d else 1 for d in drafted], drafted=list(drafted),
                       round_s=[(d, v, 0.0) for _, d, v in rounds])
        g.draft_s, g.verify_s = sum(d for _, d, _ in rounds), sum(v for _, _, v in rounds)
        g.total_s = g.draft_s + g.verify_s
        return g
    step = 0.001
    base = gen([(1, 0.0, step)] * 40, [False] * 40)
    for share in (1.0, 0.5, 0.1):
        n = int(10 * share)
        spec = gen([(4, 0.0015, 0.002)] * n + [(1, 0.0, step)] * (40 - 4 * n), [True] * n + [False] * (40 - 4 * n))
        r = summarize([spec], [base], 16)
        assert r["loop_efficiency"] == pytest.approx(1.0), (share, r["loop_efficiency"])
