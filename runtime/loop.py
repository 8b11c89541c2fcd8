"""The speculative loop: backend-agnostic, the one place that decides what is accepted.

Same bookkeeping as the PyTorch oracle (models/generate.py `speculative_generate`), so the
two agree token for token and round for round: prefill -> first token from the last
prompt position; each round drafts [anchor, MASK x (K-1)], verifies s = min(K, room)
positions [anchor, drafts[:s-1]] in one target call, accepts the longest prefix where the
drafts equal the target's choices, adds the target's choice after it, and keeps the
`produced` positions (anchor + accepted) in both caches. Rollback is the backend's valid
length. With `draft=False` the same loop is plain decoding (K = 1: no drafts, verify the
anchor alone), the baseline every speedup is measured against.

Adaptive verify (`verify=VerifyPolicy`, runtime/settings.py) verifies only the confident
prefix of the drafts, from the drafter's top-1 probabilities: on a CPU, where a verify
costs in proportion to its length, the unlikely tail is not worth its time. Still
lossless: the target chooses every emitted token, a shorter verify only ends the round
sooner. Sampling draws the uniform of each absolute position (sampling.position_uniforms),
so a sampled output does not depend on how many positions the rounds verified.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .backend import Backend
from .errors import DFlashError, InternalError
from .sampling import accept, check_request, check_sampling, choose, cut_at_stop, position_uniforms
from .settings import VerifyPolicy


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens emitted per round
    verify_lengths: list[int] = field(default_factory=list)  # positions the target verified per round
    confidences: list = field(default_factory=list)  # the drafter's top-1 probabilities per round (calibration)
    stopped: bool = False  # ended on a stop token
    prompt_len: int = 0
    reused: int = 0  # prompt positions found in the caches (not prefilled)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # draft_context + draft_block calls of the rounds
    verify_s: float = 0.0  # target calls of the rounds
    total_s: float = 0.0
    round_s: list[tuple[float, float, float]] = field(default_factory=list)  # (draft, verify, host) per round

    @property
    def tau(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0

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


def stream(
    backend: Backend,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_token_ids: tuple[int, ...] | None = None,
    draft: bool = True,
    prefill_chunk: int | None = None,
    reuse: int = 0,
    verify: VerifyPolicy | None = None,
    out: Generation | None = None,
) -> Iterator[list[int]]:
    """Yield the tokens of each round as it is accepted; statistics accumulate in `out`.

    `reuse`: the first `reuse` prompt tokens are already in the backend's caches (the
    previous sequence started with them, as a server slot tracks); only the rest is
    prefilled. At least the last prompt token is always run, for the first choice.
    """
    check_sampling(temperature, top_k, top_p)
    m = backend.manifest
    max_length = check_request(prompt, max_new_tokens, m.vocab_size, backend.max_len, "exported max context")
    if draft and not getattr(backend, "has_drafter", True):
        raise DFlashError("this backend was loaded without the drafter; use autoregressive mode (--no-draft)")
    g = out if out is not None else Generation()
    stop = set(m.eos_token_ids if stop_token_ids is None else stop_token_ids)
    u = position_uniforms(seed, max_length + 1) if temperature > 0 else None  # u[t]: token at position t
    sample = temperature > 0
    k = m.block_size if draft else 1
    chunk = min(prefill_chunk or backend.max_chunk, backend.max_chunk)  # the backend's: calibrated
    g.prompt_len, g.reused, clock = len(prompt), reuse, time.perf_counter
    t0 = clock()

    if not 0 <= reuse < len(prompt) or (draft and reuse > backend.context_len):
        raise InternalError(f"reuse {reuse} of a {len(prompt)}-token prompt (drafter context {backend.context_len})")
    backend.keep(reuse)
    for i in range(reuse, len(prompt), chunk):
        ids = prompt[i : i + chunk]
        last = i + chunk >= len(prompt)
        res = backend.target(np.asarray(ids, np.int64), want_logits=sample and last)
        backend.commit(len(ids))
        if draft:
            backend.draft_context(len(ids))
    anchor = int(choose(res.logits[-1:], u[len(prompt):], temperature, top_k, top_p)[0] if sample else res.next_ids[-1])
    start, g.stopped = len(prompt), anchor in stop  # `start` = position of the anchor
    g.tokens.append(anchor)
    g.prefill_s = g.total_s = clock() - t0
    yield [anchor]

    while not g.stopped and start + 1 < max_length:
        t1 = clock()
        d = backend.draft_block(anchor) if draft else None
        drafts = d.ids.tolist() if draft else []
        t2 = clock()
        s = min(k, max_length - start)
        if draft and d.conf is not None:
            g.confidences.append(d.conf.copy())
            if verify is not None:
                s = verify.length(d.conf, s)
        res = backend.target(np.asarray([anchor] + drafts[: s - 1], np.int64), want_logits=sample)
        t3 = clock()
        choice = (choose(res.logits, u[start + 1 :], temperature, top_k, top_p) if sample else res.next_ids).tolist()
        a = accept(drafts[: s - 1], choice[: s - 1])
        emitted = (drafts[:a] + [choice[a]])[: max_length - start - 1]
        emitted, g.stopped = cut_at_stop(emitted, stop)
        produced = len(emitted)
        backend.commit(produced)  # anchor + accepted drafts; the rest of the verify is rolled back
        start += produced
        anchor = emitted[-1]
        t4 = clock()
        if draft and not g.stopped and start + 1 < max_length:  # the next round needs their features
            backend.draft_context(produced)
        t5 = clock()
        g.round_s.append(((t2 - t1) + (t5 - t4), t3 - t2, t4 - t3))
        g.draft_s += g.round_s[-1][0]
        g.verify_s += t3 - t2
        g.tokens += emitted
        g.acceptance_lengths.append(produced)
        g.verify_lengths.append(s)
        g.total_s += t5 - t1  # the consumer's time between rounds is not ours
        yield emitted


def generate(backend: Backend, prompt: list[int], max_new_tokens: int, **kwargs) -> Generation:
    """Run `stream` to the end; see it for the arguments."""
    g = Generation()
    for _ in stream(backend, prompt, max_new_tokens, out=g, **kwargs):
        pass
    return g
