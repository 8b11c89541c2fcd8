"""Log-probabilities of the target's own distribution for the tokens a request sees.

The numbers are the target's (temperature 1, no top-k / top-p: what the model assigns,
whatever the request samples with), computed on the host from the logits the target call
already returns: in a prefill or a verify, the row of position i scores the token at i + 1.
So speculative decoding does not change them: an emitted token's row is the target's output
for the same prefix a plain step computes (a multi-token call may differ in the last bits).

A token's log-probability and its top-k alternatives are one float32 subtraction,
`logit - logsumexp(row)`, of the same row: the chosen token's value equals its top-k value
bit for bit when it is the most likely (lm-eval's `is_greedy` compares them with ==).

Only exports whose target graph takes `logits_index` (every export since ragged batches,
runtime/contract.py) are served: an older export is refused in one line (re-export).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import contract as C
from .errors import DFlashError


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens and theirs, most likely first


@dataclass
class Logprobs:
    """A row's record: the emitted tokens' entries (and the prompt's with `echo`), as they come."""

    k: int = 0  # alternatives per token (0: the token's own log-probability only)
    echo: bool = False  # also every prompt token from the second on (needs every prompt position's logits)
    prompt: list[TokenLogprob | None] = field(default_factory=list)  # echo: [None, entry of prompt[1], ...]
    tokens: list[TokenLogprob] = field(default_factory=list)  # one per emitted token, in order

    def add(self, logits: np.ndarray, tokens: list[int]) -> None:
        """Entries of `tokens`, the i-th scored by `logits[i]` (the rows of the call that chose them)."""
        self.tokens += entries(logits, tokens, self.k)

    def prefilled(self, logits: np.ndarray, prompt: list[int], start: int) -> None:
        """Echo: one prefill chunk's logits (positions start .. start+n-1) score prompt[start+1 ..]."""
        if start == 0:
            self.prompt.append(None)  # nothing scores the first token
        self.prompt += entries(logits, prompt[start + 1 : start + 1 + len(logits)], self.k)


def check_logprobs(lp: Logprobs | None, manifest, reuse: int) -> None:
    """Refuse, in one line, a request's log-probabilities that cannot be served (once, before its prefill)."""
    if lp is None:
        return
    if not C.ragged(manifest):
        raise DFlashError("log-probabilities need a target graph that takes `logits_index` (exports made "
                          "since batched decoding); re-export the model")
    if lp.k < 0:
        raise DFlashError(f"logprobs must be >= 0 (got {lp.k})")
    if lp.echo and reuse != max(len(lp.prompt) - 1, 0):
        raise DFlashError(f"echo scores every prompt position: the prefill must start at 0 (reused {reuse})")


def prefill_call(backend, slot: int, ids: np.ndarray, want_logits: bool, lp: Logprobs | None, prompt: list[int],
                 start: int):
    """One prefill chunk (`ids` [1, n], prompt positions start..start+n-1) of a row through the
    target: the last position's logits (and argmax) are computed, with echo every position's,
    and their log-probabilities recorded (the request passed `check_logprobs`)."""
    n = ids.shape[1]
    if lp is None:
        return backend.target_rows([slot], ids, [n], np.array([[n - 1]]), want_logits=want_logits)
    res = backend.target_rows([slot], ids, [n], np.arange(n)[None] if lp.echo else np.array([[n - 1]]), True)
    if lp.echo:
        lp.prefilled(res.logits[0], prompt, start)
    return res


def entries(logits: np.ndarray, tokens: list[int], k: int) -> list[TokenLogprob]:
    """TokenLogprob of tokens[i] under logits[i] (float32, [>= len(tokens), V])."""
    n = len(tokens)
    if n == 0:
        return []
    x = np.asarray(logits[:n], np.float32)
    top, m = _top(x, max(k, 1))
    e = np.subtract(x, m[:, None])
    np.exp(e, out=e)
    lse = (m + np.log(e.sum(axis=-1, dtype=np.float32))).astype(np.float32)[:, None]
    ids = np.asarray(tokens, np.int64)
    own = x[np.arange(n), ids] - lse[:, 0]
    out = []
    if k:
        vals = np.take_along_axis(x, top, axis=-1) - lse
        order = np.lexsort((top, -vals), axis=-1)  # most likely first, ties by id
        top, vals = np.take_along_axis(top, order, -1), np.take_along_axis(vals, order, -1)
    for i in range(n):
        alt = list(zip(top[i].tolist(), vals[i].tolist())) if k else []
        out.append(TokenLogprob(int(ids[i]), float(own[i]), alt))
    return out


GROUPS = 64  # a large vocabulary's rows are searched in this many strided groups (below)


def _top(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids of each row's k largest values [n, k] (unordered) and each row's max [n].

    `argpartition` over a 152k row costs ~10x a pass over it, so a large row is first cut into
    GROUPS strided groups (group g: g, g + G, g + 2G, ...), whose maxima are elementwise maxima
    of GROUPS contiguous slices (one fast pass). The k largest values lie in the k groups with
    the largest maxima (a group holding one of them has a max at least the k-th value, and at
    most k - 1 groups have a larger one), so only those k x GROUPS candidates are ranked."""
    n, V = x.shape
    k = min(k, V)
    G = V // GROUPS
    if G < 256 or k * GROUPS * 4 > V:
        return np.argpartition(-x, k - 1, axis=-1)[:, :k], x.max(axis=-1)
    W = G * GROUPS
    gm = x[:, :W].reshape(n, GROUPS, G).max(axis=1)  # [n, G]: group maxima
    groups = np.argpartition(-gm, k - 1, axis=-1)[:, :k]
    cand = (groups[:, :, None] + G * np.arange(GROUPS)[None, None, :]).reshape(n, k * GROUPS)
    m = gm.max(axis=-1)
    if W < V:  # the tail outside the groups: every one a candidate
        cand = np.concatenate([cand, np.broadcast_to(np.arange(W, V), (n, V - W))], axis=1)
        m = np.maximum(m, x[:, W:].max(axis=-1))
    pick = np.argpartition(-np.take_along_axis(x, cand, -1), k - 1, axis=-1)[:, :k]
    return np.take_along_axis(cand, pick, -1), m
