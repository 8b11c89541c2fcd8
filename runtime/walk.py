"""DFlash 2's candidate walk on the host, for sampled rows (greedy rows use the graph's walk).

A DFlash 2 `draft_block` returns, per draft position i, its top-k candidate ids
`draft_candidates[i]` and the walk's scores `draft_scores[i, p, c]`: the score of candidate c
after the p-th candidate of position i-1 (position 0: after the anchor, every row p alike).
The greedy walk (`draft_ids`) runs inside the graph: K-1 gathers and argmaxes over [k, k]
tables, a static loop TensorRT takes. At temperature T > 0 each step instead draws its
candidate from q = softmax(scores[i, prev] / T) over the k candidates, at the position's draft
uniform (runtime/sampling.py's layout); that q, spread over the candidate ids, is the draft
distribution rejection sampling verifies against (no top-k/top-p on q, as the official
reference). The walk is sequential and tiny (K-1 steps over k numbers), so it runs here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import contract as C
from .sampling import Drafted, Sampling, inverse_cdf, sample_drafts


def sample_walk(cand: np.ndarray, scores: np.ndarray, u: np.ndarray, temperature: float) -> Drafted:
    """cand [n, k] ids, scores [n, k, k], u [n'] draft uniforms (n' < n: the rest are never
    verified, drawn at 0.5) -> Drafted with q [n, k] over each position's own ids (`ids` [n, k])."""
    n, k = cand.shape
    u = np.pad(np.asarray(u, np.float64)[:n], (0, max(0, n - len(u))), constant_values=0.5)
    q = np.empty((n, k))
    pick = np.empty(n, np.int64)
    p = 0
    for i in range(n):
        z = scores[i, p].astype(np.float64) / temperature
        e = np.exp(z - z.max())
        q[i] = e / e.sum()
        p = pick[i] = inverse_cdf(q[i : i + 1], u[i : i + 1])[0]
    rows = np.arange(n)
    return Drafted(np.asarray(cand)[rows, pick].astype(np.int64), q, q[rows, pick], np.asarray(cand, np.int64))


def drafter_sampler(backend, n: int) -> Callable[[int, np.ndarray, Sampling], Drafted]:
    """(row, draft uniforms, Sampling) -> that row's sampled drafts from the last
    `draft_block_rows` call of `n` rows: from the draft logits, or by DFlash 2's walk."""
    walk = backend.draft_walk_rows(n) if C.selector(backend.manifest) else None
    if walk is not None:
        cand, scores = walk
        return lambda b, u, s: sample_walk(cand[b], scores[b], u, s.temperature)
    logits, ids = backend.draft_logits_rows(n), backend.draft_vocab_ids
    return lambda b, u, s: sample_drafts(logits[b], u, s, ids)
