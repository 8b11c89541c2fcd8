"""Speculation control: each round, each row drafts only when that is expected to beat plain steps.

Rows decide per round, together: the drafting rows share one `draft_block` and one
`draft_context` call, and the target verifies them as the backend does (`verify_per_row`):
one call padded to the longest drafting row (the others verify their anchor alone in it), or
a call per row (older exports of ONNX Runtime's GroupQueryAttention flavour), each other row's step its own
call too. A round without drafts is one plain step of every row. `Costs.round_ms` charges
each what the calibration measured; the auto rows draft best-first (by their estimates) as
long as that raises the round's expected tokens per ms. At one row the break-even is

    ratio(1, S) = (draft + verify(S) + context) / step

Each row keeps a discounted mean of the tokens its drafted rounds emitted (GAMMA: the last
~10 rounds, effective sample (1 + GAMMA) / (1 - GAMMA) = 19 rounds; a new row starts with one
round's worth of PRIOR tokens above the batch-1 break-even) and an average verify length.
Acceptance is bursty: on the demo pair's off-domain traces a drafted round's tokens have a
standard deviation about equal to their mean (1.9), with runs of 3-5-token rounds where the
target repeats itself, and code alternates poor rounds with whole accepted blocks. The
estimate is the mean plus HOPE (1.5) standard errors while the row's account (below) is in
credit, so code drafts through a poor round or two; the mean alone once it is not: an
optimism that is not paid for (2 standard errors, always, as before) stayed above a
break-even of ~2.8 while the mean sat 20-30 % below it, drafting 29-37 % of off-domain rounds.

The promise, `auto` never slower than plain: each row keeps an account, in tokens, of what its
drafted rounds gained over plain steps in their time (a round emitting a tokens at a break-even
b adds a - b; b is the round's time in the row's plain steps, host work and the measured load
correction included, its extra time shared among the rows that drafted in it: `charge`) plus
an allowance of EPS (1 %) of every token it emitted, from ALLOW (8) tokens at its start. While
the account is negative (the measured gain of drafting below 1, beyond the allowance) the
estimate has no optimism and a plain stretch does not restart its probes at the short first
gap: it goes on doubling the gap of the last stretch up to `max_gap`, so the drafted-round rate
falls to the probe rate (PROBE_BOUND of plain throughput), and the decisions are skipped until
the next probe is due; a probe or stretch that pays puts the account back. What `auto` can
lose to plain steps per row: the allowance, EPS of its tokens, the probes' PROBE_BOUND and the
rounds a stretch drafts before its mean falls. Replaying the demo pair's recorded traces
(tests/test_controller.py, runtime/replay.py) holds it at >= 0.97x plain on them.

Verify length (calibrated costs; the uncalibrated model verifies the whole block, as the
official loop does): a drafting row's estimate at its average verify length is read as a per-draft
acceptance `alpha` (`best_length`), and the row verifies the length s >= 2 with the most
expected tokens per ms under the costs (its `cap`; the calibrated verify policy may cut it
shorter): the block where a verify costs about a step, a short verify where the cost grows
with the length (a MoE target's verify of s tokens reads up to k*s experts). Whether it
drafts at all compares that round with a plain step (`pays`); the prior is the break-even
at the length the row verifies.

Probes: while plain, a row counts its plain rounds and drafts again after `gap` of them; a
probe that does not pay doubles the gap, up to `max_gap`. At a probe the rounds before the
plain stretch count FADE ** (plain rounds) less (the text has moved on: code prompts often
start with a few poor rounds, then accept whole blocks). A probe still emits at least the
token a step would, so it adds at most `probe_cost` (a drafted round with the probing row
alone drafting, less the step it replaces, plus the catch-up call; times the rows, since
each may probe) per gap + 1 rounds: with the gap at its maximum, probing costs at most
`PROBE_BOUND` = 2% of plain throughput. (The first gap of a plain stretch is max_gap / FIRST,
at least 2, so the first probes of a stretch come sooner and cost more: code often turns from
a few poor rounds to whole accepted blocks, and a 128-token request lasts ~100 plain rounds.)
A due probe is skipped where it cannot pay (`could_pay`: no verify length whose break-even is
below it, e.g. one row drafting beside 3 plain rows on a CPU); the row looks again LOOK
rounds later, and drafts meanwhile only if its estimate says so.

Across requests: a row that starts while the rows read last (a server's or a CLI run's
previous request; in a batch, every row that decides with the batch) are all in a plain
stretch continues that stretch: the last one's record and probe schedule (plain rounds since
a drafted round, the gap) taken as they were. So a drafter known not to pay is not paid for
at every request's first round, and a stretch spanning short requests reaches the largest
gap (PROBE_BOUND) as one long request does. Otherwise a new row starts from its PRIOR
(drafting known to pay, or nothing known: its first round drafts); rows that decide for
themselves always do (their tokens must not depend on what ran before).

Host work: a round where every row drafts ("always", or 3+ drafted rounds with the mean at
SURE x the break-even) lets the next SKIP rounds draft without deciding (the same rows; the
GAMMA average moves by a few percent a round, so they would have drafted anyway); rows still
stop at most SKIP rounds after deciding every round would have stopped them. Likewise a
plain round whose best drafted alternative has an expected rate below 1 / SURE of the plain
step's lets the next SKIP rounds step undecided (a probe then comes at most SKIP rounds
late). Rows that decide for themselves (rejection sampling) are never skipped.

Lossless: the target chooses every token in either kind of round, so greedy rows give the
target's greedy output whatever is decided. A sampled row that verifies by rejection
sampling (its tokens depend on which rounds drafted) decides for itself from its own
history and the batch-1 costs, so its output stays its seed's whatever else is in the
batch; sample-and-compare rows draw the same tokens in either kind of round.

Costs come from `bench --calibrate` (runtime.json `costs`: ms by rows and verify length);
once MEASURED_MIN rounds of each kind ran at a batch size, the wall time of drafted rounds
over what the model charged them, against the same for plain rounds, corrects drafted
rounds' cost (`correction`, within 0.7-1.5x) for the rows that do not decide for themselves.
Without them, `default_costs`, in units of a batch-1 step: a call over p positions costs
1 + 0.08 (p - 1) steps (a 16-token verify 2.2 steps, as measured on 2-core CPUs), a draft
1 step, a context update 0.1 step: a full 16-token block pays only above 3.3 tokens a
round. That is cautious: where a verify costs about a step (a GPU at small batch) the
break-even is ~1.2-1.4 tokens a round and drafting almost never stops (docs/runtime.md
shows both); calibrate on the deployed hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import DFlashError

GAMMA = 0.9  # a row's drafted rounds count with weight GAMMA ** (drafted rounds since): about the last 10
PRIOR = 1.0  # a new row's estimate: as if one drafted round had emitted the batch-1 break-even + PRIOR tokens
ALPHA = 0.3  # weight of the newest drafted round in a row's average verify length
FADE = 0.97  # at a probe, the rounds before its plain stretch count FADE ** (plain rounds) less: the text moved on
HOPE = 1.5  # standard errors of optimism in a row's estimate while its account is in credit
EPS, ALLOW = 0.01, 8.0  # a row's allowance for drafted rounds that lose: EPS of its tokens, ALLOW tokens to start
MEASURED_WEIGHT, MEASURED_MIN = 0.1, 8  # the measured round times: newest round's weight, rounds of each kind before use
PROBE_BOUND = 0.02  # probes cost at most this fraction of plain throughput once the gap is at its maximum
LOOK = 8  # plain rounds between looks at a due probe that cannot pay at the batch size
SURE, SKIP = 1.5, 3  # a round clearly paying (or clearly not) by SURE x: the next SKIP rounds do the same undecided
FIRST = 16  # a plain stretch's first gap: max_gap / FIRST (at least 2)
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
    # a draft call whose head scores one draft (exports with contract.DRAFT_INDEX), by rows; None: a
    # draft costs `draft` at every verify length. The head is linear in the drafts it scores, so a
    # round verifying s positions pays draft_one + (draft - draft_one) (s - 2) / (K - 2) (`draft_ms`)
    draft_one: list[float] | None = None
    # whether a drafted round may verify fewer than the block (`best_length`): not on the
    # uncalibrated model, which knows no verify's real cost; there a drafting row verifies the
    # whole block, as the official loop does, round for round
    short_verifies: bool = True
    # the loop's own work in a round outside the graph calls, by rows (`calibrate.host_ms`: measured in
    # the loop's rounds): a drafted round's (the decision, acceptance, the verify lengths), and a
    # plain round's under `auto` (the decision or its skip, the drafter's kept taps); None: 0
    host_draft: list[float] | None = None
    host_plain: list[float] | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    def _at(self, values: list[float], r: int) -> float:
        """Linear in rows between the measured ones; beyond the last, per row as the last."""
        xs = self.rows
        if r >= xs[-1]:
            return values[-1] * r / xs[-1]
        i = next(i for i, x in enumerate(xs) if x >= r)
        if xs[i] == r or i == 0:
            return values[i]
        w = (r - xs[i - 1]) / (xs[i] - xs[i - 1])
        return values[i - 1] + w * (values[i] - values[i - 1])

    def _memo_of(self, key, fn) -> float:
        if key not in self._memo:  # the loop asks every round: a dict look-up, not the arithmetic
            self._memo[key] = fn()
        return self._memo[key]

    def verify_ms(self, r: int, s: int) -> float:
        """One verify call of r rows, s positions each (as calibrated: on a per-row backend, r calls)."""
        s = max(1, min(s, len(self.verify[0])))
        return self._memo_of(("verify", r, s), lambda: self._at([v[s - 1] for v in self.verify], r))

    def draft_ms(self, r: int, s: int) -> float:
        """One draft call of r rows for a round whose longest verify is s positions (s - 1 drafts scored)."""
        full, k = self._at(self.draft, r), len(self.verify[0])
        if self.draft_one is None or s >= k or k <= 2:
            return full
        one = self._at(self.draft_one, r)
        return one + (full - one) * (max(2, s) - 2) / (k - 2)

    def host_ms(self, r: int, drafted: bool) -> float:
        """The loop's host work in a round of r rows (calibrated; 0 without a measurement)."""
        host = self.host_draft if drafted else self.host_plain
        return self._at(host, r) if host else 0.0

    def spec_ms(self, r: int, s: int) -> float:
        return self.draft_ms(r, s) + self.verify_ms(r, s) + self._at(self.context, r) + self.host_ms(r, True)

    def round_ms(self, r: int, lengths, per_row: bool = False) -> float:
        """A round of r rows whose drafting rows verify `lengths` (the others their anchor alone;
        no lengths: a plain step). Batched verify: one call padded to the longest length.
        Per-row verify (`backend.verify_per_row`): a call per row, a non-drafting row's too (one
        row's call costs 1/r of the calibrated r rows' calls, one position as two, and at least
        a batch-1 call: the default model prices r rows as one call)."""
        if not lengths:
            return self.plain_ms(r)
        if not per_row or r == 1:
            return self._memo_of(("spec", r, max(lengths)), lambda: self.spec_ms(r, max(lengths)))
        one = lambda s: max(self.verify_ms(r, max(2, s)) / r, self.verify_ms(1, s))  # noqa: E731
        return self._memo_of(("rows", r, tuple(sorted(lengths))), lambda: self.draft_ms(r, max(lengths)) + self._at(
            self.context, r) + sum(map(one, lengths)) + (r - len(lengths)) * one(1) + self.host_ms(r, True))

    def plain_ms(self, r: int) -> float:
        return self._memo_of(("step", r), lambda: self._at(self.step, r) + self.host_ms(r, False))

    def ratio(self, r: int, s: int) -> float:
        """Tokens a drafted round must emit per row to match plain steps (the break-even)."""
        return self._memo_of(("ratio", r, s), lambda: self.spec_ms(r, s) / self.plain_ms(r))

    def probe(self, r: int, s: int) -> float:
        """What a probe may add, in plain steps: a drafted round instead of a step (which emits
        at least the step's one token per row), plus the drafter's catch-up call."""
        return (self.spec_ms(r, s) + self._at(self.context, r)) / self.plain_ms(r) - 1

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        c = cls([int(r) for r in d["rows"]], [float(x) for x in d["step_ms"]],
                [[float(x) for x in v] for v in d["verify_ms"]], [float(x) for x in d["draft_ms"]],
                [float(x) for x in d["context_ms"]], "calibrated",
                draft_one=[float(x) for x in d["draft_one_ms"]] if d.get("draft_one_ms") is not None else None,
                host_draft=[float(x) for x in d["host_draft_ms"]] if d.get("host_draft_ms") is not None else None,
                host_plain=[float(x) for x in d["host_plain_ms"]] if d.get("host_plain_ms") is not None else None)
        n = len(c.rows)
        if not n or c.rows != sorted(set(c.rows)) or c.rows[0] < 1 or any(
                len(x) != n for x in (c.step, c.verify, c.draft, c.context, c.draft_one or c.draft,
                                      c.host_draft or c.draft, c.host_plain or c.draft)):
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
                 [call(r) for r in rs], [0.1 * call(r) for r in rs], short_verifies=False)


def alpha(tokens: float, length: int) -> float:
    """The per-draft acceptance a whose rounds of `length` positions emit `tokens` on average:
    (1 - a^length) / (1 - a) = tokens (1 token: 0; `length` tokens: 1), by bisection."""
    if tokens >= length - 1e-9 or length <= 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(length)) < tokens else (lo, a)
    return lo


def _best(costs: Costs, rows: int, per_row: bool, block: int, a: float) -> tuple[int, float]:
    emitted = lambda s: float(s) if a >= 1 else (1 - a**s) / (1 - a)  # noqa: E731
    if block < 2:
        return block, 1.0
    s = max(range(2 if costs.short_verifies else block, block + 1), key=lambda s: (emitted(s) / costs.round_ms(rows, (s,), per_row), s))
    return s, emitted(s)


def max_gap(probe: float) -> int:
    """The largest probe gap: a probe adding `probe` steps per gap + 1 rounds is <= PROBE_BOUND of them."""
    return max(1, math.ceil(probe / PROBE_BOUND) - 1)


@dataclass
class RowControl:
    """One row's record: averages over its drafted rounds, and its probe schedule."""

    emitted: float = 0.0  # discounted sum of tokens its drafted rounds emitted
    squares: float = 0.0  # ... of their squares
    weight: float = 0.0  # discounted count of its drafted rounds
    length: float = 0.0  # exponential average of the verify length (0: none yet)
    plain: int = 0  # plain rounds since it last drafted
    gap: int = 0  # plain rounds before its next probe (0: not plain yet)
    drafts: bool = True  # this round: the row verifies its drafts
    own: bool = False  # decides for itself (rejection sampling: its tokens depend on it)
    seen: int = 0  # rounds of the row's Generation already read
    prior: float = 4.0  # its estimate before any round (so one round of a single token stops a CPU row)
    clocked: int = -2  # its rounds at the last decision (the next round's time is then measured)
    account: float = 0.0  # tokens its drafted rounds gained over plain steps in their time, + EPS of its tokens
    share: int = 1  # the rows that drafted with it in its last decided round (they share the round's extra time)
    last_gap: int = 0  # the gap of its last plain stretch when a probe turned it back to drafting

    @property
    def tokens(self) -> float:
        """Expected tokens of its next drafted round: the discounted mean, PRIOR as one round's worth."""
        return (self.prior + self.emitted) / (1 + self.weight)

    @property
    def hopeful(self) -> float:
        """`tokens` plus HOPE standard errors of the rounds' mean while its account is in credit
        (optimism paid from the allowance: bursty code keeps drafting through a poor round or
        two), the mean alone once drafting has lost more than the allowance."""
        if self.weight < 1.5 or self.losing:
            return self.tokens
        mean = self.emitted / self.weight
        var = max(0.0, self.squares / self.weight - mean * mean)
        return self.tokens + HOPE * math.sqrt(var / self.weight)

    @property
    def losing(self) -> bool:
        """Its drafted rounds lost more time than its allowance: the measured gain of drafting is below 1."""
        return self.account < 0

    taps: list = field(default_factory=list)  # its plain steps' taps, for the drafter's context (host backends)
    cap: int = 0  # this round's verify length at most (0: the block; set when it drafts)


@dataclass
class Controller:
    """Per round and per row: draft (the verify policy's lengths) or a plain step; see the
    module docstring. One loop at a time (a server slot each its own): a row's record lives on
    the row, the decisions skipped (SURE) on the controller."""

    costs: Costs
    block_size: int
    measured: dict = field(default_factory=dict)  # (rows, drafted) -> [mean of measured / modelled round time, rounds]
    _last: tuple = ()  # (rows, drafted, modelled ms) of the last decision
    _sure: tuple = ((), 0, False)  # (the rows' records, rounds left, drafts): rounds run without deciding
    _skipped: int = 0  # rounds since the last decision (the last of them is clocked against it)
    recent: RowControl | None = None  # a row in a plain stretch, as every row read last was: a new row continues it

    def new_row(self, own: bool, seen: int) -> RowControl:
        """A new row's record: the recent plain stretch's (see the module docstring), else one
        round's worth of PRIOR."""
        last = self.recent
        if last is not None and last.gap and not own:
            return RowControl(last.emitted, last.squares, last.weight, last.length, last.plain, last.gap, seen=seen,
                              prior=last.prior, last_gap=last.last_gap, account=last.account)
        return RowControl(own=own, seen=seen, prior=self.costs.ratio(1, self.block_size) + PRIOR, account=ALLOW)

    def _clock(self, rows) -> None:
        """The last round's wall time (any row that ran it has it last in `round_s`) over what the
        cost model charged for it: the costs as this machine runs them now, load included."""
        for r in rows:
            g = r.gen
            if self._last and r.ctl is not None and g.round_s and r.ctl.clocked == len(g.round_s) - 1 - self._skipped:
                R, kind, model = self._last
                t = sum(g.round_s[-1]) * 1e3 / model
                m = self.measured.setdefault((R, kind), [t, 0])
                t = min(2 * m[0], max(0.5 * m[0], t))  # a round the OS preempted moves the mean by a bounded step
                m[0], m[1] = m[0] + MEASURED_WEIGHT * (t - m[0]), m[1] + 1
                break
        for r in rows:
            if r.ctl is not None:
                r.ctl.clocked = len(r.gen.round_s)

    def correction(self, rows: int) -> float:
        """Drafted rounds' measured/modelled time over plain rounds' (1 until both kinds ran
        MEASURED_MIN times at this batch size): on a loaded machine a drafted round's calls may
        cost relatively more (or less) than the calibration saw."""
        d, p = self.measured.get((rows, True)), self.measured.get((rows, False))
        if not d or not p or min(d[1], p[1]) < MEASURED_MIN:
            return 1.0
        return min(1.5, max(0.7, d[0] / p[0]))

    def _len(self, c: RowControl) -> int:
        return max(1, min(self.block_size, math.ceil(c.length) if c.length else self.block_size))

    def best_length(self, c: RowControl, rows: int, per_row: bool) -> tuple[int, float]:
        """(verify length, expected tokens) of the row's drafted round with the most expected tokens
        per ms: its estimate at its average length read as a per-draft acceptance `alpha` (a round
        verifying s positions emits (1 - alpha^s) / (1 - alpha) on average), each s >= 2 priced by
        the cost model. Where a verify costs about a step this is the block; where it grows with
        its length (MoE targets: s positions route to up to k*s experts) a short verify."""
        L, t = self._len(c), min(c.hopeful, self._len(c))
        if c.own:
            rows, per_row = 1, False  # its own history and the batch-1 costs: its tokens stay its seed's
        key = ("best", rows, per_row, L, round(t, 2))
        return self.costs._memo_of(key, lambda: _best(self.costs, rows, per_row, self.block_size, alpha(t, L)))

    def break_even(self, c: RowControl, rows: int, per_row: bool, s: int = 0) -> float:
        """Tokens a row's drafted round verifying s positions (default: its average) must emit to
        pay for itself alone in a round of `rows` (one that decides for itself: at batch 1):
        1 + the round's extra time in per-row steps."""
        s = s or self._len(c)
        if c.own:
            return self.costs.ratio(1, s)
        step = self.costs.plain_ms(rows)
        return 1 + (self.costs.round_ms(rows, (s,), per_row) * self.correction(rows) - step) / step * rows

    def charge(self, c: RowControl, rows: int, per_row: bool, s: int) -> float:
        """A drafted round's cost to the row's account, in its plain steps: its break-even, the extra
        time of the round shared among the `c.share` rows that drafted in it (one draft call for all)."""
        if c.own or c.share <= 1:
            return self.break_even(c, rows, per_row, s)
        step = self.costs.plain_ms(rows)
        return 1 + (self.costs.round_ms(rows, (s,) * c.share, per_row) * self.correction(rows) - step) / step * rows / c.share

    def could_pay(self, c: RowControl, rows: int, per_row: bool) -> bool:
        """Whether a probe can pay at all: some verify length s with its break-even below s (the
        most a round emits); one row drafting beside 3 plain rows on a CPU cannot."""
        step = self.costs.plain_ms(rows)  # break_even(s) < s <=> correction < step (1 + (s - 1) / rows) / round_ms(s)
        top = self.costs._memo_of(("pay_up_to", rows, per_row, self.block_size), lambda: max(
            step * (1 + (s - 1) / rows) / self.costs.round_ms(rows, (s,), per_row) for s in range(2, self.block_size + 1)))
        return self.correction(rows) < top

    def probe_cost(self, c: RowControl, rows: int, per_row: bool) -> float:
        """What one probe may add, in plain rounds of `rows` rows: a drafted round instead of a step
        (which emits at least the step's one token per row) plus the drafter's catch-up call,
        times the rows (each may probe)."""
        if c.own:
            return self.costs.probe(1, self._len(c))
        step = self.costs.plain_ms(rows)
        spec = self.costs.round_ms(rows, (self.block_size,), per_row) + self.costs._at(self.costs.context, 1)
        return rows * (spec / step - 1)

    def _read(self, c: RowControl, g, rows: int, per_row: bool) -> None:
        """The row's rounds since the last look (its Generation): averages, counts, gaps."""
        for a, v, d in zip(g.acceptance_lengths[c.seen :], g.verify_lengths[c.seen :], g.drafted[c.seen :]):
            c.account += EPS * a
            if not d:
                c.plain += 1
                if not c.gap:  # a plain stretch starts: its first gap is short while drafting has paid, else
                    top = max_gap(self.probe_cost(c, rows, per_row))  # the probe schedule goes on where it was
                    c.gap = min(2 * c.last_gap, top) if c.losing and c.last_gap else max(2, top // FIRST)
                continue
            f = GAMMA * FADE ** c.plain  # the rounds before a plain stretch count less after it (the text moved on)
            c.emitted, c.squares, c.weight = f * c.emitted + a, f * c.squares + a * a, f * c.weight + 1
            c.account += a - self.charge(c, rows, per_row, v)
            c.length = float(v) if c.length == 0 else c.length + ALPHA * (v - c.length)
            c.prior = self.costs.ratio(1, self._len(c)) + PRIOR  # at the length it verifies (a block's prior overrates short ones)
            if c.gap:  # a probe: back to drafting if the estimate now pays; a probe that did not pay itself doubles the gap
                ratio = self.break_even(c, rows, per_row, v)
                c.last_gap = c.gap
                c.gap = 0 if self.pays(c, rows, per_row) else min(c.gap if a > ratio else 2 * c.gap, max_gap(
                    self.probe_cost(c, rows, per_row)))
            c.plain = 0
        c.seen = len(g.acceptance_lengths)

    def pays(self, c: RowControl, rows: int, per_row: bool) -> bool:
        """Whether the row's best drafted round (`best_length`) is expected to emit more than its break-even."""
        s, tokens = self.best_length(c, rows, per_row)
        return tokens > self.break_even(c, rows, per_row, s)

    def _wants(self, c: RowControl, rows: int, per_row: bool) -> bool:
        """A row's own wish: its best drafted round pays, or its probe is due."""
        return self.pays(c, rows, per_row) or (c.gap > 0 and c.plain >= c.gap)

    def decide(self, rows, backend=None) -> bool:
        """Whether this round drafts; sets each row's `ctl.drafts` (rows: the loop's `_Row`s,
        `req.speculative` False / True (auto) / "always", `ud` set: rejection sampling), or on a
        skipped decision leaves them as the last decision set them. Before a drafted round the
        rows' plain steps reach the drafter's context (`backend`)."""
        ctls, left, spec = self._sure
        if left and len(ctls) == len(rows) and all(r.ctl is c for r, c in zip(rows, ctls)):
            self._sure, self._skipped = (ctls, left - 1, spec), self._skipped + 1  # the same rows, clearly on one side
            if not spec:  # the last round was a plain step of every row: counted now (a new request may take the stretch on)
                for r, c in zip(rows, ctls):
                    if c.gap and c.seen == len(r.gen.drafted) - 1 and not r.gen.drafted[-1]:
                        c.plain, c.seen, c.account = c.plain + 1, c.seen + 1, c.account + EPS
            return spec
        for r in rows:
            if r.ctl is None:
                r.ctl = self.new_row(r.ud is not None, len(r.gen.acceptance_lengths))
        self._clock(rows)
        self._skipped, self._edge = 0, math.inf  # (a `choose` that does not set the edge never skips plain rounds)
        per_row = backend is not None and backend.verify_per_row
        want = self.choose(rows, per_row)
        spec = any(want.values())
        D = tuple(r.ctl.cap or self._len(r.ctl) for r in rows if want.get(id(r)))
        self._last = (len(rows), spec, self.costs.round_ms(len(rows), D, per_row))
        for b, r in enumerate(rows):
            r.ctl.drafts = spec and bool(r.req.speculative) and want.get(id(r), False)
            r.ctl.share = len(D)
            if spec and r.ctl.taps:
                backend.context_from_taps(b, np.stack(r.ctl.taps))
                r.ctl.taps = []
        if spec:  # every row drafts, each clearly paying
            sure = all(r.ctl.drafts and not r.ctl.own and (r.req.speculative == "always" or r.ctl.weight >= 3 and
                       r.ctl.tokens >= SURE * self.break_even(r.ctl, len(rows), per_row)) for r in rows)
            left = SKIP if sure else 0
        else:  # no row drafts: skip SKIP rounds where no drafted round would come near paying even SURE x more
            # hopeful, and up to the first due probe where every row is in a plain stretch losing (a row's
            # estimate does not move while it steps)
            auto = not any(r.ctl.own or r.req.speculative != True for r in rows)  # noqa: E712
            left = SKIP if auto and self._edge * SURE <= 1 else 0
            if auto and all(r.ctl.gap and r.ctl.losing for r in rows):
                left = max(left, min(r.ctl.gap - r.ctl.plain for r in rows) - 1)
        self._sure = (tuple(r.ctl for r in rows), left, spec)
        return spec

    def choose(self, rows, per_row: bool = False) -> dict:
        """{id(row): whether it drafts this round}. Forced: "always" rows, due probes, rows that
        decide for themselves (their own wish); the other auto rows draft best-first as long as
        that raises the round's expected tokens per ms (the whole batch's plain step the rival)."""
        R = len(rows)
        want, free = {}, []
        for r in rows:
            c = r.ctl
            if r.req.speculative:
                self._read(c, r.gen, R, per_row)
            due = c.gap > 0 and c.plain >= c.gap  # a probe is due
            if not r.req.speculative or r.req.speculative == "always":
                want[id(r)] = bool(r.req.speculative)
            elif c.own:
                want[id(r)] = self._wants(c, R, per_row)
            elif due and self.could_pay(c, R, per_row):
                want[id(r)] = True
            else:
                c.gap = c.plain + LOOK if due else c.gap  # a probe that cannot pay at this batch size: look again later
                free.append(r)
        read = [r.ctl for r in rows if r.req.speculative and not r.ctl.own]
        if read:  # what a new row starts from: a plain stretch only while every row is in one
            self.recent = read[-1] if all(c.gap for c in read) else None
        hope = {id(r): r.ctl.hopeful for r in rows if r.req.speculative}
        free.sort(key=lambda r: -hope[id(r)])
        sure = [r for r in rows if want.get(id(r))]
        fix = self.correction(R)
        best, best_rate, plain, self._edge = 0, -1.0, R / self.costs.plain_ms(R), 0.0  # edge: best drafted rate / plain
        best_of = {id(r): self.best_length(r.ctl, R, per_row) for r in rows if r.req.speculative == True}  # noqa: E712
        for r in rows:
            r.ctl.cap = best_of[id(r)][0] if id(r) in best_of else 0
        tokens = sum(best_of[id(r)][1] if id(r) in best_of else hope[id(r)] for r in sure) + R - len(sure)
        lengths = [r.ctl.cap or self._len(r.ctl) for r in sure]
        for d in range(len(free) + 1):
            if d:
                tokens += best_of[id(free[d - 1])][1] - 1
                lengths.append(free[d - 1].ctl.cap)
            rate = plain
            if lengths:
                rate = tokens / (self.costs.round_ms(R, tuple(lengths), per_row) * fix)
                self._edge = max(self._edge, rate / plain)
            if rate > best_rate:
                best, best_rate = d, rate
        for i, r in enumerate(free):
            want[id(r)] = i < best
        return want

    def plain_step(self, backend, rows, produced) -> None:
        """After a plain round: each speculative row's new position must reach the drafter's
        context before it drafts again. A backend with host taps (ONNX Runtime, CPU) keeps them
        here (a copy of one position's features per row; projected in one call at the next
        drafted round, or once they fill a chunk); any other projects them now (a draft_context
        call per plain round)."""
        keep = [b for b, r in enumerate(rows) if r.req.speculative and not r.done and r.ctl is not None]
        if not keep:
            return
        taps = backend.last_taps(len(rows))
        if taps is None:
            more = np.array([produced[b] if b in keep else 0 for b in range(len(rows))], np.int64)
            backend.draft_context_rows(list(range(len(rows))), more)
            return
        for b in keep:
            c = rows[b].ctl
            c.taps.append(taps[b])
            if len(c.taps) >= backend.max_chunk:  # a row that stays plain (4 rows on a CPU) holds a chunk at most
                backend.context_from_taps(b, np.stack(c.taps))
                c.taps = []


def auto_policy(costs: Costs, block: int) -> list[dict]:
    """What `--speculation auto` does with these costs, per measured batch size (every row
    drafting): the tokens a drafted round verifying s positions must emit per row to match plain
    steps (`break_even`; a round emits at most s), and the longest verify that can pay at all
    (None: none can; the rows then step, their probes bounded). `bench` and `info` report it."""
    lengths = sorted({s for s in (2, 4, 8, block) if 2 <= s <= block})
    out = []
    for r in costs.rows:
        paying = [s for s in range(2, block + 1) if costs.ratio(r, s) < s]
        out.append({"rows": r, "break_even": {str(s): round(costs.ratio(r, s), 2) for s in lengths},
                    "longest_paying": max(paying, default=None)})
    return out


def describe_auto(policy: list[dict], source: str) -> str:
    """`auto_policy` (of `source` costs: calibrated or default) in a line for people."""
    parts = []
    for p in policy:
        be = p["break_even"]
        pays = ("no verify length can pay: plain steps" if p["longest_paying"] is None else
                f"verifies of up to {p['longest_paying']} can pay")
        parts.append(f"{p['rows']} row(s): verify {'/'.join(be)} pays above {'/'.join(f'{x:g}' for x in be.values())}"
                     f" tokens a round, {pays}")
    return f"auto ({source} costs): " + "; ".join(parts)


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
