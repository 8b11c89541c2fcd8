"""Measurements that choose runtime settings (`bench --calibrate`) and report costs (`bench --context`).

- `thread_candidates`: the intra-op thread counts worth trying on this machine.
- `verify_costs`: ms of one target call of s = 1..K positions, interleaved, medians.
- `choose_policy`: the adaptive verify policy that maximises tokens per second, replaying
  full-block rounds (drafter confidences + acceptance) against the measured cost curve. A
  policy is kept only if it beats the full block by more than `MARGIN`, so where verify
  cost is flat in its length (a GPU) the full block stays.
- `step_ms_by_context`: a 1-token step after a prefix of each given length.
All of it runs through the Backend interface: any backend, no torch.
"""

from __future__ import annotations

import os
import time

import numpy as np

from .backend import Backend
from .errors import DFlashError
from .settings import FULL, VerifyPolicy

THETAS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)
MIN_LENS = (1, 2, 3, 4, 6)
MARGIN = 0.02  # a policy must beat the full block by 2% in the replay to be chosen


def thread_candidates() -> list[int]:
    n = os.cpu_count() or 1
    return sorted({1, n} | {2**i for i in range(1, 8) if 2**i < n})


def _prefill(backend: Backend, ids: list[int]) -> None:
    backend.reset()
    for i in range(0, len(ids), backend.max_chunk):
        chunk = ids[i : i + backend.max_chunk]
        backend.target(np.asarray(chunk, np.int64))
        backend.commit(len(chunk))


def _median_ms(samples: list[float]) -> float:
    return float(np.median(samples)) * 1e3


def verify_costs(backend: Backend, prompt: list[int], repeats: int = 15) -> list[float]:
    """[ms of a target call of s positions for s = 1..K] after `prompt` (rolled back each time)."""
    k = backend.manifest.block_size
    _prefill(backend, prompt)
    times: dict[int, list[float]] = {s: [] for s in range(1, k + 1)}
    ids = np.asarray((prompt * k)[:k], np.int64)
    for _ in range(repeats):  # interleaved, so drifts in machine load hit every length alike
        for s in range(1, k + 1):
            t0 = time.perf_counter()
            backend.target(ids[:s])
            times[s].append(time.perf_counter() - t0)
            backend.commit(0)
    return [_median_ms(times[s]) for s in range(1, k + 1)]


def replay(rounds: list[tuple[np.ndarray, int]], policy: VerifyPolicy, costs_ms: list[float], draft_ms: float):
    """(tokens per ms, mean verify length) if `policy` had cut these full-block rounds:
    a round verifying s positions emits min(accepted, s - 1) + 1 tokens."""
    k = len(costs_ms)
    emitted = spent = verified = 0.0
    for conf, accepted in rounds:
        s = policy.length(conf, k)
        emitted += min(accepted, s - 1) + 1
        spent += draft_ms + costs_ms[s - 1]
        verified += s
    return emitted / spent, verified / len(rounds)


def choose_policy(rounds, costs_ms: list[float], draft_ms: float) -> tuple[VerifyPolicy | None, list[dict]]:
    """The best policy of the grid in the replay (None: the full block), and the grid's table."""
    if not rounds:
        raise DFlashError("calibration saw no speculative rounds; use longer --max-new-tokens")
    full_rate, full_len = replay(rounds, FULL, costs_ms, draft_ms)
    table, best, best_rate = [], None, full_rate * (1 + MARGIN)
    for theta in THETAS[1:]:
        for min_len in MIN_LENS:
            p = VerifyPolicy(theta, min_len)
            rate, mean_len = replay(rounds, p, costs_ms, draft_ms)
            table.append({"theta": theta, "min_len": min_len, "relative_rate": rate / full_rate, "mean_verify_len": mean_len})
            if rate > best_rate:
                best, best_rate = p, rate
    table.insert(0, {"theta": 0.0, "min_len": len(costs_ms), "relative_rate": 1.0, "mean_verify_len": full_len})
    return best, table


def step_ms_by_context(backend: Backend, contexts: list[int], repeats: int = 30, seed: int = 0) -> dict[str, float]:
    """{context: ms of a 1-token target step after that many positions} (median of repeats)."""
    m = backend.manifest
    need = max(contexts) + m.block_size
    if need > backend.max_len:
        raise DFlashError(f"--context {max(contexts)} needs an export with --max-context >= {need} "
                          f"(context + block size); this one holds {backend.max_len}")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, m.vocab_size - 2, max(contexts)).tolist()
    out = {}
    for c in contexts:
        _prefill(backend, prefix[:c])
        tok = np.asarray(prefix[c - 1 : c], np.int64)
        times = []
        for _ in range(3 + repeats):
            t0 = time.perf_counter()
            backend.target(tok)
            times.append(time.perf_counter() - t0)
            backend.commit(0)
        out[str(c)] = _median_ms(times[3:])
    backend.reset()
    return out
