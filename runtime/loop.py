"""The speculative loop: backend-agnostic, the one place that decides what is accepted.

One loop advances a batch of rows (`stream_batch`); batch 1 (`stream`, `generate`) is the
same loop with one row. Each round: one `draft_block` call for every row, one `target`
call verifying every row's block (padded to the longest verify), then acceptance, stops,
commit and rollback per row. A finished row leaves and a waiting request joins its slot
at the round boundary, prefilled by its own calls (one row, chunked) before the next round.

Same bookkeeping as the PyTorch oracle (models/generate.py `speculative_generate`), so the
two agree token for token and round for round: prefill -> first token from the last
prompt position; each round drafts [anchor, MASK x (K-1)], verifies s = min(K, room)
positions [anchor, drafts[:s-1]] in one target call, accepts the longest prefix where the
drafts equal the target's choices, adds the target's choice after it, and keeps the
`produced` positions (anchor + accepted) in both caches. Rollback is the backend's valid
length. With `draft=False` the same loop is plain decoding (K = 1: no drafts, verify the
anchor alone), the baseline every speedup is measured against.

Adaptive verify (`verify`, runtime/settings.py) verifies the confident prefix of the drafts
(a CPU verify costs in proportion to its length); `control` (runtime/controller.py) picks
drafting or plain steps each round from recent acceptance and calibrated costs. Both are
lossless: the target chooses every token. Sampling (T > 0) is per row (runtime/sampling.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from . import contract as C
from .backend import Backend
from .errors import DFlashError, InternalError
from .logprobs import Logprobs, check_logprobs, prefill_call
from .sampling import (GREEDY, Sampling, accept, check_request, choose, cut_at_stop, draft_uniforms, position_uniforms,
                       probabilities, rejection)
from .settings import VerifyPolicy, pad_verify
from .walk import drafter_sampler  # q of the draft logits, or of DFlash 2's candidate walk


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens emitted per round
    verify_lengths: list[int] = field(default_factory=list)  # positions the target verified per round
    confidences: list = field(default_factory=list)  # the drafter's top-1 probabilities per round (calibration)
    stopped: bool = False  # ended on a stop token
    finished: bool = False  # the row left the batch (stop token or length): set before its last tokens are yielded
    prompt_len: int = 0
    reused: int = 0  # prompt positions found in the caches (not prefilled)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # draft_context + draft_block calls of the rounds
    verify_s: float = 0.0  # target calls of the rounds
    total_s: float = 0.0
    round_s: list[tuple[float, float, float]] = field(default_factory=list)  # (draft, verify, host) per round
    drafted: list[bool] = field(default_factory=list)  # per round: whether this row verified drafts

    @property
    def tau(self) -> float:  # the drafted rounds' mean (plain steps emit 1 each); plain decoding: 1
        a = [n for n, d in zip(self.acceptance_lengths, self.drafted) if d] or self.acceptance_lengths
        return float(np.mean(a)) if a else 0.0

    @property
    def mean_verify_len(self) -> float:
        return float(np.mean(self.verify_lengths)) if self.verify_lengths else 0.0

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def host_s(self) -> float:
        """Time in the rounds outside graph calls: sampling, acceptance, bookkeeping."""
        return self.decode_s - self.draft_s - self.verify_s

    @property
    def tokens_per_second(self) -> float:
        """Decode rate: tokens the rounds produced over the rounds' wall time (prefill excluded)."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass
class Request:
    """One prompt of a batch and how to generate from it: the loop's record of a request, made
    by the command line or by the server's validation (serve/validate.py), whose checks are the
    loop's own (runtime/sampling.py); each row keeps its own sampling and seed."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's eos ids
    reuse: int = 0  # prompt tokens already in the slot's caches (batch 1: a server slot's prompt reuse)
    speculative: bool | str = True  # False: plain (its anchor alone); True: as `control` decides; "always"
    logprobs: Logprobs | None = None  # asks for the target's log-probabilities, and receives them (runtime/logprobs.py)
    prefix: object = None  # batched prompt reuse (runtime/prefix.py Hook): restore at join, park at leave
    # what the tokens may be (serve/grammar.py Constraint: allowed(), accepts(t), consume(t)); None: anything.
    # Each position's token is the target's choice under the mask (`_constrained`)
    constraint: object = None


@dataclass
class BatchStats:
    """What a batched run measured: wall time, rounds, and how full the batch was."""

    batch: int = 1
    rounds: int = 0
    plain_rounds: int = 0  # rounds that drafted nothing (the controller's, or no speculative row)
    busy_rows: int = 0  # sum over rounds of the rows that were generating
    wall_s: float = 0.0
    prefill_s: float = 0.0  # joining rows' prefills
    decode_s: float = 0.0  # the rounds (each row's first token comes from its prefill)

    @property
    def occupancy(self) -> float:
        """Mean fraction of the batch's rows generating per round."""
        return self.busy_rows / (self.rounds * self.batch) if self.rounds else 0.0


@dataclass
class _Row:
    index: int  # the request's position in the input
    req: Request
    gen: Generation
    stop: set
    max_length: int
    u: np.ndarray | None
    ud: np.ndarray | None = None  # rejection sampling's draft / accept uniforms (None: argmax drafts)
    anchor: int = 0
    start: int = 0  # position of the anchor
    ctl: object = None  # the controller's record of this row (runtime/controller.py RowControl)

    @property
    def done(self) -> bool:
        return self.gen.stopped or self.start + 1 >= self.max_length


def stream_batch(
    backend: Backend,
    requests: Iterable[Request],
    *,
    batch: int | None = None,
    draft: bool = True,
    prefill_chunk: int | None = None,
    verify: VerifyPolicy | None = None,
    outs: list[Generation] | None = None,
    stats: BatchStats | None = None,
    poll: Callable[[int, bool], list[Request]] | None = None,
    drop: Callable[[int], bool] | None = None,
    control=None,
) -> Iterator[tuple[int, list[int]]]:
    """Yield (request index, tokens) as each row's tokens are accepted; per-request
    statistics go to `outs` (appended in request order as rows join), the batch's to `stats`.

    Up to `batch` (default: the backend's max_batch) rows generate at once; greedy rows give
    exactly their own batch-1 output, sampled rows their own seed's, whatever else is in
    the batch (tests/test_batch.py; docs/batching.md says where float rounding could differ).

    In flight (a server): `poll(free, idle)` is asked at every round boundary for up to
    `free` requests to join, numbered on from the iterable's; with `idle` (no row running)
    it may block, and an empty answer then ends the stream. `drop(index)` True takes a
    running row out at the boundary (a cancelled request: freed within one round).
    """
    m, clock = backend.manifest, time.perf_counter
    B = batch or backend.max_batch
    if not 1 <= B <= backend.max_batch:
        raise DFlashError(f"batch {B}: the backend was loaded for at most {backend.max_batch} rows")
    if draft and not backend.has_drafter:
        raise DFlashError("this backend was loaded without the drafter; use autoregressive mode (--no-draft)")
    k = m.block_size if draft else 1
    chunk = min(prefill_chunk or backend.max_chunk, backend.max_chunk)  # the backend's: calibrated
    st = stats if stats is not None else BatchStats()
    st.batch = B
    waiting = iter(enumerate(requests))
    rows: list[_Row] = []  # row b sits in the backend's slot b: the batch's rows are always slots 0..len-1
    backend.set_width(0)
    joined = 0  # requests taken so far (the next one's index)
    t_start = clock()

    def join(q: Request) -> Iterator[tuple[int, list[int]]]:  # a new row takes the next slot
        nonlocal joined
        slot = len(rows)
        backend.set_width(slot + 1)
        row = _prefill(backend, slot, joined, q, draft and q.speculative, chunk)
        joined += 1
        st.prefill_s += row.gen.prefill_s
        if outs is not None:
            outs.append(row.gen)
        row.gen.finished = row.done
        yield row.index, [row.anchor]
        if row.done:
            _leave(backend, rows, slot)
        else:
            rows.append(row)

    while True:
        if drop is not None:  # cancelled rows leave at the round boundary
            for b in reversed([b for b, r in enumerate(rows) if drop(r.index)]):
                _leave(backend, rows, b)
        while len(rows) < B:  # joins, at the round boundary
            nxt = next(waiting, None)
            if nxt is None:
                break
            yield from join(nxt[1])
        given = poll(B - len(rows), not rows) if poll is not None and len(rows) < B else []
        for q in given:
            yield from join(q)
        if not rows:
            if given:  # every joining row finished at its prefill: ask again
                continue
            st.wall_s = clock() - t_start
            return
        yield from _round(backend, rows, st, k=k, spec=draft and any(r.req.speculative for r in rows),
                          verify=verify, control=control)
        for b in reversed([b for b, r in enumerate(rows) if r.done]):  # leaves, at the round boundary
            _leave(backend, rows, b)


def _round(backend: Backend, rows: list[_Row], st: BatchStats, *, k: int, spec: bool,
           verify: VerifyPolicy | None, control) -> Iterator[tuple[int, list[int]]]:
    """One round of every row: draft (unless plain), verify, accept, commit, keep the drafter's
    features; yields each row's tokens. `spec`: some row may draft (the controller decides)."""
    clock = time.perf_counter
    t = [clock()]  # t[0] start, then after: the decision, the draft call, the verify lengths, the verify call,
    anchors = np.array([r.anchor for r in rows], np.int64)  # acceptance and commit, the drafter's context
    spec = spec and (control is None or control.decide(rows, backend))
    longest, uses = _longest(rows, k, spec)
    t.append(clock())
    drafts, conf, drafted = _draft(backend, rows, anchors, int(max(longest)) - 1) if spec else (None, None, {})
    t.append(clock())
    lens = _verify_lengths(rows, longest, conf, verify)
    t.append(clock())
    ids, res = _verify(backend, rows, anchors, drafts, lens)
    t.append(clock())
    emitted_of = [_accept(r, int(lens[b]), ids[b], res, b, drafted.get(b)) for b, r in enumerate(rows)]
    produced = np.array([len(e) for e in emitted_of], np.int64)
    backend.commit_rows(list(range(len(rows))), produced)  # anchor + accepted drafts; the rest of each verify rolls back
    for r, emitted in zip(rows, emitted_of):
        r.start += len(emitted)
        r.anchor = emitted[-1]
    t.append(clock())
    _keep_features(backend, rows, produced, spec, control)
    t.append(clock())
    st.rounds, st.plain_rounds = st.rounds + 1, st.plain_rounds + (not spec)
    st.busy_rows += len(rows)
    st.decode_s += t[-1] - t[0]
    for b, r in enumerate(rows):
        _record(r, emitted_of[b], int(lens[b]), uses[b], t)
        yield r.index, emitted_of[b]


# -- one round's steps: draft, choose verify lengths, verify, accept, keep the drafter's features, record ----


def _longest(rows: list[_Row], k: int, spec: bool) -> tuple[np.ndarray, list[bool]]:
    """Each row's longest verify this round, known before the draft (its anchor + drafts: at most the
    block, the room left and the controller's cap; the verify policy may cut it after the draft),
    and whether it verifies drafts at all."""
    uses = [spec and bool(r.req.speculative) and (r.ctl is None or r.ctl.drafts) for r in rows]
    longest = np.array([min(k if uses[b] else 1, r.max_length - r.start, (r.ctl.cap or k) if r.ctl is not None else k)
                        for b, r in enumerate(rows)], np.int64)
    return longest, uses


def _draft(backend: Backend, rows: list[_Row], anchors: np.ndarray, scored: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """One draft_block call for every row, its head over the first `scored` drafts (the longest verify's;
    at least one): (drafts, their confidences, row -> drafts sampled from q for the rows that sample by
    rejection; those rows' drafts are replaced by the sampled ones). No verify reads a draft past
    `scored`: every row verifies at most its longest, and pad_verify pads to the longest row's."""
    drafts, conf = backend.draft_block_rows(list(range(len(rows))), anchors, max(1, scored))
    drafted = _sample_drafts(backend, rows, drafts) if any(r.ud is not None for r in rows) else {}
    if drafted:
        drafts = drafts.copy()
        for b, d in drafted.items():
            drafts[b] = d.tokens
    if any(r.req.constraint is not None for r in rows) and backend.samples_drafts and not C.selector(backend.manifest):
        drafts = _masked_drafts(backend, rows, drafts, max(1, scored))
    return drafts, conf, drafted


def _masked_drafts(backend: Backend, rows: list[_Row], drafts: np.ndarray, scored: int) -> np.ndarray:
    """Constrained rows draft under the grammar: each draft position's argmax over the draft logits of
    the tokens the grammar allows after the drafts before it (the drafter's own argmax wherever that
    is allowed). Proposals only: the verify still keeps a draft only where it equals the target's
    masked choice, so this changes how many are accepted, never which tokens come out."""
    logits, ids = backend.draft_logits_rows(len(rows)), backend.draft_vocab_ids
    drafts = drafts.copy()
    for b, r in enumerate(rows):
        c = r.req.constraint
        if c is None:
            continue
        taken = 0
        for i in range(min(scored, logits.shape[1], drafts.shape[1])):
            t = int(drafts[b, i])
            if not c.accepts(t):
                ok = c.allowed()
                ok = ok if ids is None else ok[ids]
                if not ok.any():
                    break
                j = int(np.where(ok, logits[b, i], -np.inf).argmax())
                t = drafts[b, i] = j if ids is None else int(ids[j])
            if t in r.stop:
                break
            c.consume(t)
            taken += 1
        c.rollback(taken)
    return drafts


def _verify_lengths(rows: list[_Row], longest: np.ndarray, conf: np.ndarray | None,
                    verify: VerifyPolicy | None) -> np.ndarray:
    """Each row's verify length: its longest (`_longest`), fewer where the verify policy trusts fewer drafts."""
    lens = np.zeros(len(rows), np.int64)
    for b, r in enumerate(rows):
        s = int(longest[b])
        if conf is not None and r.req.speculative:
            r.gen.confidences.append(conf[b].copy())
            if verify is not None:
                s = verify.length(conf[b], s)
        lens[b] = s
    return lens


def _verify(backend: Backend, rows: list[_Row], anchors: np.ndarray, drafts: np.ndarray | None, lens: np.ndarray):
    """One target call verifying every row's [anchor, drafts], padded to the longest verify (pad_verify
    lets the shorter speculative rows verify more there, for free; not on a per-row-verify backend,
    where each row's call is its own length): (the ids verified, the call's result)."""
    pads = not backend.verify_per_row  # padding is computed anyway only where rows share one call
    S = pad_verify(lens, [r.max_length - r.start if pads and r.req.speculative and r.ud is None else 0 for r in rows])
    ids = np.zeros((len(rows), S), np.int64)
    ids[:, 0] = anchors
    if drafts is not None and S > 1:
        ids[:, 1:] = drafts[:, : S - 1]
    sample = any(r.u is not None or r.req.logprobs is not None or r.req.constraint is not None for r in rows)
    return ids, backend.target_rows(list(range(len(rows))), ids, lens, None, want_logits=sample)


def _accept(r: _Row, s: int, ids: np.ndarray, res, b: int, drafted) -> list[int]:
    """Row b's tokens this round: the longest prefix of its s - 1 drafts the target agrees with (argmax,
    the row's own uniforms, or rejection sampling against q), the target's choice after it, cut at a stop."""
    q = r.req
    guess = ids[1:s].tolist()
    if q.constraint is not None:
        emitted = _constrained(r, s, guess, res.logits[b])
        if q.logprobs is not None:
            q.logprobs.add(res.logits[b], emitted)
        return emitted
    if drafted is not None:  # rejection sampling against the target's p
        p = probabilities(res.logits[b, :s], q.sampling)
        a, last = rejection(drafted, s - 1, p, r.ud[r.start + 1 :, 1], r.u[r.start + 1 :])
    else:
        if r.u is not None:
            choice = choose(res.logits[b, :s], r.u[r.start + 1 :], q.sampling).tolist()
        else:
            choice = res.next_ids[b, :s].tolist()
        a = accept(guess, choice[: s - 1])
        last = choice[a]
    emitted = (guess[:a] + [last])[: r.max_length - r.start - 1]
    emitted, r.gen.stopped = cut_at_stop(emitted, r.stop)
    if q.logprobs is not None:  # emitted[i] was chosen from the verify's row i
        q.logprobs.add(res.logits[b], emitted)
    return emitted


def _constrained(r: _Row, s: int, guess: list[int], logits: np.ndarray) -> list[int]:
    """A constrained row's tokens this round, position by position: the target's choice under the
    grammar's mask at this position (`masked_choice`), kept while it equals the draft there, so a draft
    is accepted only where the grammar allows it and the target would have chosen it under the mask;
    the grammar advances by each emitted token. The same tokens as plain decoding under the mask: at
    temperature 0 exactly, sampled with the row's own uniforms (sample-and-compare: the drafts do not
    change the output)."""
    c, out, room = r.req.constraint, [], r.max_length - r.start - 1
    for i in range(s):
        t = masked_choice(c, logits[i], None if r.u is None else r.u[r.start + 1 + i], r.req.sampling)
        c.consume(t)
        out.append(t)
        if t in r.stop:
            r.gen.stopped = True
            break
        if len(out) >= room or i == s - 1 or guess[i] != t:
            break
    return out


def masked_choice(c, logits: np.ndarray, u: float | None, s: Sampling) -> int:
    """The target's choice at one position under constraint `c`: the argmax of the allowed tokens (the
    unmasked argmax when the grammar allows it: then it is the masked one, and no mask is computed),
    or the inverse CDF at `u` of the sampling distribution over the allowed tokens."""
    if s.greedy:
        t = int(logits.argmax())
        if c.accepts(t):
            return t
    z = np.where(c.allowed(), logits, -np.inf)
    return int(z.argmax()) if s.greedy else int(choose(z[None], np.array([u]), s)[0])


def _keep_features(backend: Backend, rows: list[_Row], produced: np.ndarray, spec: bool, control) -> None:
    """The drafter's context for the next round: the features of what each continuing speculative row kept
    (a plain round: the controller keeps them for its next drafted round)."""
    if spec:
        more = [0 if r.done or not r.req.speculative else int(produced[b]) for b, r in enumerate(rows)]
        if any(more):
            backend.draft_context_rows(list(range(len(rows))), more)
    elif control is not None:
        control.plain_step(backend, rows, produced)


def _record(r: _Row, emitted: list[int], s: int, drafted: bool, t: list[float]) -> None:
    """The round in the row's Generation: its tokens, acceptance, verify length and times (draft:
    the draft call and the drafter's context; verify: the target call; host: the rest, the
    controller's decision and the acceptance included)."""
    start, decided, drafted_at, lengths, verified, accepted, end = t
    g = r.gen
    draft, verify = (drafted_at - decided) + (end - accepted), verified - lengths
    g.round_s.append((draft, verify, (end - start) - draft - verify))
    g.draft_s += draft
    g.verify_s += verify
    g.tokens += emitted
    g.acceptance_lengths.append(len(emitted))
    g.verify_lengths.append(s)
    g.drafted.append(drafted)
    g.total_s += end - start  # the consumer's time between rounds is not ours
    g.finished = r.done


def _sample_drafts(backend: Backend, rows: list[_Row], drafts: np.ndarray) -> dict:
    """Row b -> its drafts sampled from q (this round's draft call), for the rows that sample by rejection."""
    draw, out = drafter_sampler(backend, len(rows)), {}
    for b, r in enumerate(rows):
        if r.ud is not None:
            out[b] = draw(b, r.ud[r.start + 1 :, 0], r.req.sampling)
    return out


def _prefill(backend: Backend, slot: int, index: int, q: Request, draft: bool, chunk: int) -> _Row:
    """A joining row: its prompt through the target (and drafter context) on its slot alone;
    its first token from the last prompt position."""
    m = backend.manifest
    max_length = check_request(q.prompt, q.max_new_tokens, m.vocab_size, backend.max_len, *backend.limit)
    check_logprobs(q.logprobs, m, q.reuse)
    g = Generation(prompt_len=len(q.prompt), reused=q.reuse)
    s = q.sampling
    u = None if s.greedy else position_uniforms(s.seed, max_length + 1)  # u[t]: the token at position t
    row = _Row(index, q, g, set(m.eos_token_ids if q.stop_token_ids is None else q.stop_token_ids), max_length, u)
    if u is not None and draft and s.method == "rejection" and backend.samples_drafts and q.constraint is None:
        row.ud = draft_uniforms(s.seed, max_length + 1)
    t0 = time.perf_counter()
    if slot == 0 and backend.max_batch == 1:
        backend.keep(q.reuse)
    else:  # a batched row starts empty, or with a parked prefix (runtime/prefix.py)
        q.prefix.restore(slot) if q.prefix is not None else backend.reset_row(slot)
    held = int(backend.lengths[slot]), int(backend.ctx_lengths[slot]) if draft else q.reuse
    if not 0 <= q.reuse < len(q.prompt) or held != (q.reuse, q.reuse):
        raise InternalError(f"reuse {q.reuse} of a {len(q.prompt)}-token prompt in slot {slot}: caches hold {held}")
    for i in range(q.reuse, len(q.prompt), chunk):
        ids = np.asarray(q.prompt[i : i + chunk], np.int64)[None]
        last, n = i + chunk >= len(q.prompt), ids.shape[1]
        res = prefill_call(backend, slot, ids, (u is not None or q.constraint is not None) and last, q.logprobs,
                           q.prompt, i)  # last position's logits (echo: all)
        backend.commit_rows([slot], [n])
        if draft:
            backend.draft_context_rows([slot], [n])
    if q.constraint is not None:
        row.anchor = masked_choice(q.constraint, res.logits[0, -1], None if u is None else u[len(q.prompt)], s)
        q.constraint.consume(row.anchor)
    else:
        row.anchor = int(res.next_ids[0, -1] if u is None else
                         choose(res.logits[0, -1:], u[len(q.prompt):], s)[0])
    row.start, g.stopped = len(q.prompt), row.anchor in row.stop
    g.tokens.append(row.anchor)
    if q.logprobs is not None:
        q.logprobs.add(res.logits[0, -1:], [row.anchor])
    g.prefill_s = g.total_s = time.perf_counter() - t0
    return row


def _leave(backend: Backend, rows: list[_Row], b: int) -> None:
    """Row b (finished, or never started: b == len(rows)) frees its slot: the last row moves in (rows stay 0..len-1)."""
    last = len(rows) - 1 if b < len(rows) else b
    if backend.max_batch > 1:
        if b < len(rows) and rows[b].req.prefix is not None:  # parked for reuse (one row: caches kept)
            rows[b].req.prefix.park(b, rows[b].req.prompt + rows[b].gen.tokens)
        if b != last:
            backend.move_row(last, b)
            rows[b] = rows[last]
        else:
            backend.reset_row(b)
    if b < len(rows):
        rows.pop()
    backend.set_width(len(rows))


def stream(
    backend: Backend,
    prompt: list[int],
    max_new_tokens: int,
    *,
    sampling: Sampling = GREEDY,
    stop_token_ids: tuple[int, ...] | None = None,
    draft: bool = True,
    prefill_chunk: int | None = None,
    reuse: int = 0,
    verify: VerifyPolicy | None = None,
    out: Generation | None = None,
    control=None,
) -> Iterator[list[int]]:
    """Yield each round's tokens as accepted (statistics in `out`). `reuse`: the first `reuse` prompt
    tokens are already in the caches (a server slot's last sequence); the last one is always run."""
    q = Request(list(prompt), max_new_tokens, sampling, stop_token_ids, reuse)
    outs: list[Generation] = []
    for _, tokens in stream_batch(backend, [q], batch=1, draft=draft, prefill_chunk=prefill_chunk, verify=verify,
                                  outs=outs, control=control):
        if out is not None and outs[0] is not out:  # the caller's record: fill it as the loop's grows
            out.__dict__.update(outs[0].__dict__)
        yield tokens
    if out is not None and outs and outs[0] is not out:
        out.__dict__.update(outs[0].__dict__)


def generate(backend: Backend, prompt: list[int], max_new_tokens: int, **kwargs) -> Generation:
    """Run `stream` to the end; see it for the arguments."""
    g = Generation()
    for _ in stream(backend, prompt, max_new_tokens, out=g, **kwargs):
        pass
    return g


def generate_batch(backend: Backend, requests: list[Request], **kwargs) -> tuple[list[Generation], BatchStats]:
    """Run `stream_batch` to the end: one Generation per request (input order) and the batch's stats."""
    outs: list[Generation] = []  # rows join in request order: outs[i] is request i's
    stats = BatchStats()
    for _ in stream_batch(backend, requests, outs=outs, stats=stats, **kwargs):
        pass
    return outs, stats
