"""The calibration's round costs time each graph call where a round runs it.

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
from dflash_export.runtime.calibrate import cost_model, round_costs
from dflash_export.runtime.contract import DRAFT_BLOCK, DRAFT_CONTEXT, TARGET
from dflash_export.runtime.controller import Costs
from dflash_export.runtime.loop import generate
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
    _, _, out = artifact(CASES["qwen3"])
    clock = Clock()
    be = charged(OrtBackend(out, threads=1), clock)
    monkeypatch.setattr(calibrate, "time", clock)
    monkeypatch.setattr(loop, "time", clock)
    ps = prompts(2, be.manifest.vocab_size, seed=3)
    costs = Costs.from_json(cost_model({1: round_costs(be, ps[0], 1, repeats=2)}))
    seen = set()
    for p in ps:
        g = generate(be, p, 24, stop_token_ids=(), verify=VerifyPolicy(0.3, 2))  # verify lengths vary
        for t, s in zip(g.round_s[:-1], g.verify_lengths):  # the last round has no draft_context call
            assert sum(t) * 1e3 == pytest.approx(costs.spec_ms(1, s)), (s, t)
            seen.add(s)
        plain = generate(be, p, 8, draft=False, stop_token_ids=())
        for t in plain.round_s:
            assert sum(t) * 1e3 == pytest.approx(costs.plain_ms(1))
    print(f"drafted rounds checked at verify lengths {sorted(seen)}")
    assert len(seen) > 1
