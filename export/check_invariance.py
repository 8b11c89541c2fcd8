"""`check`: does a row's target output depend on how many rows share the call?

The loop's plain steps run one row, its verifies a block of rows, a batch several sequences'
rows at once; speculative == plain greedy holds only if the target gives a row the same logits
in each. Quantized kernels may not (export/even_rows.py says where and how the export avoids
it), and other CPUs tile differently, so this measures it on the machine that runs `check`:
the same positions' logits computed one row at a time (plain steps), as one verify block, and
(ragged exports) as one row of a two-row batch beside another sequence. Any difference, however
small, fails: near-ties of the argmax are where it would change a token (a batch's difference
is reported; see row_invariance).
"""

from __future__ import annotations

import numpy as np

from ..runtime import contract as C, manifest as M
from ..runtime.load import ort_backend_class

BATCH_ROWS = 2
OTHER_EXTRA = 3


def _prefill(be, slot: int, prompt: np.ndarray) -> None:
    be.target_rows([slot], prompt[None], np.array([len(prompt)]), None)
    be.commit_rows([slot], [len(prompt)])


def _alone(be, prompt: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids' logits one plain step at a time after `prompt` (row 0)."""
    rows = []
    _prefill(be, 0, prompt)
    for t in ids:
        rows.append(be.target_rows([0], np.array([[t]]), np.array([1]), None, want_logits=True).logits[0, 0].copy())  # the buffer is reused
        be.commit_rows([0], [1])
    return np.stack(rows)


def _diff(a: np.ndarray, b: np.ndarray) -> dict:
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"rows": len(a), "rows_differing": int((d.max(-1) > 0).sum()), "max_abs": float(d.max()),
            "argmax_differing": int((a.argmax(-1) != b.argmax(-1)).sum())}


def row_invariance(root, m: M.Manifest, seed: int = 0, prompt_len: int = 9) -> dict:
    """{"block": diff, "batch": diff or None, "invariant": bool}: block-size positions after a
    random prompt, computed alone vs as one verify block (vs one row of a two-row batch whose
    other row has a longer past). `invariant` is the block's: it decides speculative == plain.
    The batch's is reported: a row there attends over the batch's longest past, padding masked,
    and the attention's reductions over a longer row may round differently at any dtype
    (docs/batching.md), which padding the GEMM rows cannot change."""
    rng = np.random.default_rng(seed + 7)
    k = min(max(m.block_size, 2), m.max_context - prompt_len - 1)
    prompt = rng.integers(0, m.vocab_size, prompt_len)
    other = rng.integers(0, m.vocab_size, prompt_len + OTHER_EXTRA)
    ids = rng.integers(0, m.vocab_size, k)
    ragged = C.ragged(m)
    be = ort_backend_class()(root, verify=False, drafter=False, max_batch=BATCH_ROWS if ragged else 1)
    try:
        if ragged:
            be.set_width(1)
        alone = _alone(be, prompt, ids)
        be.reset()
        _prefill(be, 0, prompt)
        block = be.target_rows([0], ids[None], np.array([k]), None, want_logits=True).logits[0]
        out = {"block": _diff(alone, block), "batch": None}
        if ragged:
            be.reset()
            be.set_width(BATCH_ROWS)
            _prefill(be, 0, prompt)
            _prefill(be, 1, other)
            both = np.zeros((BATCH_ROWS, k), np.int64)
            both[0], both[1, : k - 1] = ids, rng.integers(0, m.vocab_size, k - 1)  # another sequence, another count
            res = be.target_rows(list(range(BATCH_ROWS)), both, np.array([k, k - 1]), None, want_logits=True)
            out["batch"] = _diff(alone, res.logits[0])
    finally:
        be.close()
    out["invariant"] = out["block"]["rows_differing"] == 0
    return out
