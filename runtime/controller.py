"""Speculation control: draft a round only when it is expected to beat plain steps.

A drafted round of R rows costs one `draft_block` call, one verify of the longest row's
length S and one `draft_context` call, and emits each row's accepted drafts plus one
token; a plain step costs one 1-position target call (and, while drafting may resume, one
`draft_context` call, so the drafter's context stays current) and emits one token per row.
Drafting pays when the rows' mean expected tokens per drafted round exceeds

    ratio(R, S) = (draft(R) + verify(R, S) + context(R)) / (step(R) + context(R))

Each row keeps an exponential average of the tokens its drafted rounds emitted (`ALPHA`,
starting at `PRIOR`) and of its verify length. While a round goes plain every row counts
its plain rounds and is drafted again (a probe) after `gap` of them; a probe that does not
pay doubles the row's gap up to `max_gap(ratio)`, which bounds what probing costs: a probe
still emits at least the one token a plain step would, so it adds at most (ratio - 1)
step-times per `gap` plain steps, at most `PROBE_BOUND` (2%) of plain throughput once the gap
has grown (the first probes of a stretch come sooner: gaps from `max_gap / 8`).

Lossless: the target chooses every token in either kind of round, so greedy rows give the
target's greedy output whatever is decided. A sampled row that verifies by rejection
sampling (its tokens depend on which rounds drafted) decides for itself from its own
history and the batch-1 costs, so its output stays its seed's whatever else is in the
batch; sample-and-compare rows draw the same tokens in either kind of round.

Costs come from `bench --calibrate` (runtime.json `costs`: ms by rows and verify length);
without them `DEFAULT_COSTS`, in units of a plain step: a verify of s positions costs
1 + 0.08 (s - 1) steps, a draft 1 step, a context update 0.1 step (the ratios measured on a
2-core CPU), which drafts a full 16-token block only at more than 3.0 tokens a round. On a GPU a verify costs about a step: calibrate there, and the break-even
drops to ~1.2-1.5 tokens a round (`break_even`; docs/runtime.md shows the table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import DFlashError

ALPHA = 0.3  # weight of the newest drafted round in a row's averages
PRIOR = 4.0  # tokens per drafted round assumed for a new row (it drafts its first rounds)
PROBE_BOUND = 0.02  # probes cost at most this fraction of plain throughput once the gap is at its maximum
MODES = ("auto", "always", "never")


@dataclass
class Costs:
    """ms (or any one unit) of a round's calls, by the batch rows measured (`rows`, ascending)."""

    rows: list[int]
    step: list[float]  # one plain step (the target over 1 position per row)
    verify: list[list[float]]  # [rows][s - 1]: the target over s positions per row
    draft: list[float]  # one draft_block call
    context: list[float]  # one draft_context call (a position or a few per row)
    source: str = "default"  # "calibrated" (runtime.json) or "default"

    def _at(self, values: list[float], r: int) -> float:
        """Linear in rows between the measured ones; beyond the last, per row as the last."""
        xs = self.rows
        if r >= xs[-1]:
            return values[-1] * r / xs[-1]
        return float(np.interp(r, xs, values))

    def spec_ms(self, r: int, s: int) -> float:
        s = max(1, min(s, len(self.verify[0])))
        return self._at(self.draft, r) + self._at([v[s - 1] for v in self.verify], r) + self._at(self.context, r)

    def plain_ms(self, r: int) -> float:
        return self._at(self.step, r) + self._at(self.context, r)

    def ratio(self, r: int, s: int) -> float:
        """Tokens a drafted round must emit per row to match plain steps (the break-even)."""
        return self.spec_ms(r, s) / self.plain_ms(r)

    def to_json(self) -> dict:
        return {"rows": self.rows, "step_ms": self.step, "verify_ms": self.verify, "draft_ms": self.draft,
                "context_ms": self.context}

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        c = cls([int(r) for r in d["rows"]], [float(x) for x in d["step_ms"]],
                [[float(x) for x in v] for v in d["verify_ms"]], [float(x) for x in d["draft_ms"]],
                [float(x) for x in d["context_ms"]], "calibrated")
        n = len(c.rows)
        if not n or c.rows != sorted(set(c.rows)) or c.rows[0] < 1 or any(len(x) != n for x in (c.step, c.verify, c.draft, c.context)):
            raise ValueError("costs need one entry per measured row count (ascending)")
        if any(not v or len(v) != len(c.verify[0]) for v in c.verify) or min(c.step) <= 0:
            raise ValueError("costs need positive step times and one verify length curve per row count")
        return c


def default_costs(block_size: int, rows: int = 8) -> Costs:
    """The uncalibrated model (see the module docstring), in units of one batch-1 step; a
    batch of R rows costs as R rows of positions would at 0.08 step per extra position."""
    rs = list(range(1, rows + 1))
    call = lambda positions: 1 + 0.08 * (positions - 1)  # noqa: E731
    return Costs(rs, [call(r) for r in rs], [[call(r * s) for s in range(1, block_size + 1)] for r in rs],
                 [call(r) for r in rs], [0.1 * call(r) for r in rs])


def max_gap(ratio: float) -> int:
    """The largest probe gap: (ratio - 1) / (gap + 1) <= PROBE_BOUND."""
    return max(1, math.ceil((ratio - 1) / PROBE_BOUND) - 1)


@dataclass
class RowControl:
    """One row's record: averages over its drafted rounds, and its probe schedule."""

    tokens: float = PRIOR  # exponential average of tokens per drafted round
    length: float = 0.0  # exponential average of the verify length (0: none yet)
    plain: int = 0  # plain rounds since it last drafted
    gap: int = 0  # plain rounds before its next probe (0: not plain yet)
    drafts: bool = True  # this round: the row verifies its drafts
    own: bool = False  # decides for itself (rejection sampling: its tokens depend on it)
    seen: int = 0  # rounds of the row's Generation already read


@dataclass
class Controller:
    """Per round: draft (the verify policy's lengths) or plain steps; see the module docstring.
    One controller serves any number of loops: a row's record lives on the row."""

    costs: Costs
    block_size: int

    def _length(self, rows) -> int:
        ls = [r.ctl.length for r in rows if r.ctl.length > 0]
        return max(1, min(self.block_size, math.ceil(max(ls)) if ls else self.block_size))

    def _ratio(self, c: RowControl, rows: int, s: int) -> float:
        """The break-even a row is held to: a row that decides for itself, at batch 1 and its own length."""
        if c.own:
            return self.costs.ratio(1, math.ceil(c.length) if c.length else self.block_size)
        return self.costs.ratio(rows, s)

    def _read(self, c: RowControl, g, rows: int, s: int) -> None:
        """The row's rounds since the last look (its Generation): averages, counts, gaps."""
        for a, v, d in zip(g.acceptance_lengths[c.seen :], g.verify_lengths[c.seen :], g.drafted[c.seen :]):
            if not d:
                c.plain += 1
                c.gap = c.gap or max(2, max_gap(self._ratio(c, rows, s)) // 8)
                continue
            c.tokens += ALPHA * (a - c.tokens)
            c.length = float(v) if c.length == 0 else c.length + ALPHA * (v - c.length)
            if c.gap:  # a probe: back to drafting if it paid, else wait twice as long
                c.gap = 0 if c.tokens > self._ratio(c, rows, s) else min(2 * c.gap, max_gap(self._ratio(c, rows, s)))
            c.plain = 0
        c.seen = len(g.acceptance_lengths)

    def _wants(self, c: RowControl, ratio: float) -> bool:
        """A row's own wish: its average pays, or its probe is due."""
        return c.tokens > ratio or (c.gap > 0 and c.plain >= c.gap)

    def decide(self, rows) -> bool:
        """Whether this round drafts; sets each row's `ctl.drafts` (rows: the loop's `_Row`s,
        `req.speculative` False / True (auto) / "always", `ud` set: rejection sampling)."""
        R = len(rows)
        for r in rows:
            if r.ctl is None:
                r.ctl = RowControl(own=r.ud is not None, seen=len(r.gen.acceptance_lengths))
        S = self._length(rows)
        auto = [r for r in rows if r.req.speculative is True]
        for r in auto:
            self._read(r.ctl, r.gen, R, S)
        ratio = self.costs.ratio(R, S)
        own = {id(r): self._wants(r.ctl, self._ratio(r.ctl, R, S)) for r in auto if r.ctl.own}
        shared = [r for r in auto if not r.ctl.own]
        gain = bool(shared) and (sum(r.ctl.tokens for r in shared) + R - len(shared)) / R > ratio
        probe = any(r.ctl.gap > 0 and r.ctl.plain >= r.ctl.gap for r in shared)
        spec = any(r.req.speculative == "always" for r in rows) or gain or probe or any(own.values())
        for r in rows:
            r.ctl.drafts = spec and bool(r.req.speculative) and own.get(id(r), True)
        return spec


def controller_for(mode: str, costs: dict | None, block_size: int) -> Controller | None:
    """The controller of `--speculation auto` (None for always/never: the loop's `draft` says
    which): runtime.json's calibrated costs, else the default model."""
    if mode not in MODES:
        raise DFlashError(f"--speculation must be one of {', '.join(MODES)} (got {mode!r})")
    if mode != "auto":
        return None
    return Controller(Costs.from_json(costs) if costs else default_costs(block_size), block_size)


def rounds_of(gens) -> dict:
    """{"drafted": rounds that verified drafts, "plain": plain steps} over generations' rows."""
    drafted = sum(sum(g.drafted) for g in gens)
    return {"drafted": drafted, "plain": sum(len(g.drafted) for g in gens) - drafted}
