"""Sampling and request rules shared by the PyTorch oracle and every runtime backend.

Temperature 0 is argmax (first index on ties, like torch.argmax and ONNX ArgMax): the
drafts are the drafter's argmax and a round accepts the prefix where they equal the
target's argmax. Lossless token for token.

Temperature > 0, rejection sampling (the default; the official z-lab reference's rule):
the drafts are samples from the drafter's distribution q (its logits after the same
temperature / top-k / top-p as the target's p: `probabilities`), draft x at position t is
accepted when u_accept[t] * q(x) < p(x), i.e. with probability min(1, p(x)/q(x)); the
first rejected position takes a sample of the normalised residual max(0, p - q) (p where
that is all zero), and a fully accepted block the bonus sampled from p. The output is an
exact sample of the target (the standard speculative-sampling argument), and accepts more
than sample-and-compare whenever q resembles p. With a reduced draft vocabulary q is zero
outside its N tokens: the same rule, exactly.

Temperature > 0, sample-and-compare (`Sampling(method="compare")`): argmax drafts, the target's
choice at each position is a sample from p, accept while they are equal. Also exact; it
accepts less, but needs no drafter probabilities (an export whose draft vocabulary ids
the runtime cannot read, a backend without draft logits) and its output does not depend
on the drafts: speculative and plain decoding with the same seed give the same tokens.

Randomness layout: every uniform belongs to an absolute position t of the sequence and
is drawn once from the request's seed, so the same seed, artifact and settings give the
same output whatever else is in the batch and however the rounds fell:

    u[t]             position_uniforms(seed): the target's sample at t (plain decoding,
                     the first token after the prompt, compare's choice, the residual
                     or bonus sample of rejection sampling)
    ud[t, 0]         draft_uniforms(seed): the draft sample at t (inverse CDF of q)
    ud[t, 1]         draft_uniforms(seed): the accept test of the draft at t

A position's uniforms are consumed by the round that emits its token; the drafts a round
samples past its first rejection are discarded with it (q of every block position comes
from one drafter pass over masks, so nothing emitted depends on them). Under rejection
sampling the output depends on the drafts, hence on the drafter and on how many positions
a round verified (adaptive verify); under compare it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import DFlashError


SAMPLING = ("rejection", "compare")  # how a round verifies sampled drafts (module docstring)
# Below this temperature a request is greedy (vLLM's floor): logits / T overflows float64 long before
# T reaches 0 (5e-324 gave inf, NaN probabilities and token 0), and what a smaller T samples is the argmax
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Sampling:
    """How a request draws its tokens, one record from the command line or an HTTP request down to
    each row of the loop and the oracle. Checked when made (one-line DFlashError); a temperature
    below MIN_TEMPERATURE is greedy (0). `method`: how a round verifies sampled drafts (above)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    method: str = "rejection"

    def __post_init__(self):
        if self.method not in SAMPLING:
            raise DFlashError(f"unknown sampling {self.method!r}; choose rejection (the default) or compare")
        if not self.temperature >= 0:
            raise DFlashError(f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding")
        if self.top_k < 0:
            raise DFlashError(f"top-k must be >= 0 (got {self.top_k}); 0 disables it")
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"top-p must be in (0, 1] (got {self.top_p}); 1 disables it")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def probabilities(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """Row-wise sampling distribution [n, V] in float64 after temperature, top-k, top-p."""
    z = np.asarray(logits, dtype=np.float64) / s.temperature
    z = z - z.max(axis=-1, keepdims=True)
    if 0 < s.top_k < z.shape[-1]:
        kth = np.partition(z, -s.top_k, axis=-1)[..., -s.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if s.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep_sorted = (np.cumsum(sorted_p, axis=-1) - sorted_p) < s.top_p  # always keeps the top token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def position_uniforms(seed: int, length: int) -> np.ndarray:
    """u[t] for every absolute position t < length: the sampling randomness of the token at t."""
    return np.random.default_rng(seed).random(length)


def draft_uniforms(seed: int, length: int) -> np.ndarray:
    """[length, 2]: (draft sample, accept test) uniforms of every absolute position t < length,
    a stream of the seed independent of position_uniforms'."""
    return np.random.default_rng([seed, 1]).random((length, 2))


def inverse_cdf(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Index per row of p [n, V] (probabilities) at the uniforms u [n]."""
    cdf = np.cumsum(p, axis=-1)
    idx = (cdf < (np.asarray(u, np.float64)[: p.shape[0]] * cdf[:, -1])[:, None]).sum(axis=-1)
    return np.minimum(idx, p.shape[-1] - 1).astype(np.int64)


@dataclass
class Drafted:
    """Drafts sampled from q: tokens [n] (target ids), q [n, N] over the scored tokens (`ids`
    [N] their target ids, or [n, N] per position: DFlash 2's candidates, runtime/walk.py;
    None: the whole vocabulary), qx [n] = q of each draft."""

    tokens: np.ndarray
    q: np.ndarray
    qx: np.ndarray
    ids: np.ndarray | None = None


def sample_drafts(logits: np.ndarray, u: np.ndarray, s: Sampling, ids: np.ndarray | None = None) -> Drafted:
    """Drafts from the drafter's logits [n, N] (after its transforms) at the draft uniforms u [n]."""
    q = probabilities(logits, s)
    u = np.asarray(u, np.float64)[: len(q)]
    j = inverse_cdf(q, np.pad(u, (0, len(q) - len(u)), constant_values=0.5))  # past the budget: never verified
    return Drafted(j if ids is None else np.asarray(ids)[j], q, q[np.arange(len(j)), j], ids)


def rejection(d: Drafted, m: int, p: np.ndarray, u_accept: np.ndarray, u_target: np.ndarray) -> tuple[int, int]:
    """(accepted drafts a <= m, the token after them) for the first m drafts of `d` against the
    target's probabilities p [m + 1, V] (rows: the positions of the drafts, then the next);
    u_accept / u_target: the uniforms of those positions (see the layout above)."""
    px = p[np.arange(m), d.tokens[:m]]
    ok = np.asarray(u_accept[:m]) * d.qx[:m] < px
    a = int(np.cumprod(ok).sum()) if m else 0
    if a == m:
        return a, int(inverse_cdf(p[m : m + 1], u_target[m : m + 1])[0])
    r = p[a].copy()
    if d.ids is None:
        r -= d.q[a]
    else:
        np.subtract.at(r, d.ids if d.ids.ndim == 1 else d.ids[a], d.q[a])
    r = np.maximum(r, 0.0)
    total = r.sum()
    r = r / total if total > 0 else p[a]
    return a, int(inverse_cdf(r[None], u_target[a : a + 1])[0])


def choose(logits: np.ndarray, u: np.ndarray | None, s: Sampling = GREEDY) -> np.ndarray:
    """The target's choice at each row of logits [n, V]: argmax, or the inverse CDF at u[row]
    (`u`: the uniforms of the positions these rows choose, from `position_uniforms`)."""
    logits = np.asarray(logits)
    if s.greedy:
        return logits.argmax(axis=-1).astype(np.int64)
    return inverse_cdf(probabilities(logits, s), u)


def accept(draft: np.ndarray, choice: np.ndarray) -> int:
    """Length of the longest prefix where the drafts equal the target's choices (a plain loop: the
    loop's lists are a block long, where numpy's calls cost more than the comparisons)."""
    a, n = 0, min(len(draft), len(choice))
    while a < n and draft[a] == choice[a]:
        a += 1
    return a


def check_request(prompt: list[int], max_new_tokens: int, vocab_size: int, max_context: int | None = None,
                  what: str = "max context", fix: str = "export with a larger --max-context") -> int:
    """The generation's final length (prompt + new tokens), or a one-line error."""
    if len(prompt) == 0:
        raise DFlashError("the prompt is empty; give at least one token")
    if max_new_tokens < 1:
        raise DFlashError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise DFlashError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    need = len(prompt) + max_new_tokens
    if max_context is not None and need > max_context:
        raise DFlashError(
            f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) = {need} exceeds the {what} "
            f"{max_context}; shorten the prompt, lower --max-new-tokens or {fix}"
        )
    return need


def cut_at_stop(emitted: list[int], stop: set[int]) -> tuple[list[int], bool]:
    """Emitted tokens up to and including the first stop token, and whether one was hit."""
    for i, t in enumerate(emitted):
        if t in stop:
            return emitted[: i + 1], True
    return emitted, False
