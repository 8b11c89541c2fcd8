"""Recorded runs replayed through the speculation controller: its decisions and their cost, without a machine.

A trace is one prompt's rounds from a run that drafted every round, as (tokens emitted,
positions verified) per round; the acceptance is a property of the drafter and the text
(greedy), so it can be replayed under any decision rule. A drafted round starting at
position t emits what the recorded round covering t emitted from t on (all of it when it
starts there) and verifies that round's length; a plain step emits one token. Time is charged
from a cost model (runtime/controller.py Costs: calibrated calls and the loop's host work),
never from a clock, so a replay is deterministic: the tests replay recorded traces
(tests/fixtures/speculation_traces.json) and bench/speculation_replay.py records them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from .controller import Controller, Costs
from .loop import Generation


def accepted_at(rounds: list, t: int) -> tuple[int, int]:
    """(tokens, verify length) of a drafted round at position t: the recorded round covering t, from t on."""
    p = 0
    for a, s in rounds:
        if p <= t < p + a:
            return (a if t == p else p + a - t), s
        p += a
    return 1, 1


@dataclass
class Replay:
    """What a mode did over a set of traces: tokens, time (the cost model's unit), rounds of each kind."""

    tokens: int = 0
    time: float = 0.0
    drafted: int = 0
    plain: int = 0
    per_prompt: list = field(default_factory=list)  # (tokens, time) per trace

    @property
    def rate(self) -> float:
        return self.tokens / self.time if self.time else 0.0


def replay(traces: list[list], mode: str, decide: Costs, charge: Costs | None = None, step_ms: float | None = None,
           block_size: int = 16) -> Replay:
    """Replay `traces` (prompt after prompt, one controller for all of them, as one run serves its
    requests) under `mode` ("auto", "always", "never"): `auto` decides with the costs `decide`; every
    round is charged by `charge` (default: `decide`): a drafted round `spec_ms` at its verify length
    (plus the drafter's catch-up call after plain steps), a plain step under `auto` `plain_ms`, and
    under `never` `step_ms` (plain decoding: no controller's host work; default `plain_ms`). The
    controller reads each round's charged time as the loop's measured one (its load correction)."""
    charge = charge or decide
    ctl = Controller(decide, block_size)
    out = Replay()
    for rounds in traces:
        row = SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(), done=False)
        t, spent, n, last = 0, 0.0, sum(a for a, _ in rounds), None
        while t < n:
            spec = mode == "always" or (mode == "auto" and ctl.decide([row], None))
            a, s = accepted_at(rounds, t) if spec else (1, 1)
            a = min(a, n - t)
            row.gen.acceptance_lengths.append(a)
            row.gen.verify_lengths.append(s)
            row.gen.drafted.append(spec)
            if spec:
                ms = charge.spec_ms(1, s) + (charge.context[0] if last is False else 0.0)
            else:
                ms = step_ms if mode == "never" and step_ms is not None else charge.plain_ms(1)
            row.gen.round_s.append((0.0, ms / 1e3, 0.0))  # the round's time as the controller reads it
            spent += ms
            out.drafted, out.plain = out.drafted + spec, out.plain + (not spec)
            t, last = t + a, spec
        out.tokens, out.time = out.tokens + n, out.time + spent
        out.per_prompt.append((n, spent))
    return out
