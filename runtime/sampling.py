"""Sampling and request rules shared by the PyTorch oracle and every runtime backend.

Both sides call `choose` with float logits and uniforms from `position_uniforms`: one
uniform per absolute position of the sequence, drawn once from the seed. The token at
position t is the inverse CDF of the target's distribution at t evaluated at u[t], however
many positions a round verified and however the rounds fell, so speculative sampling
(full or adaptive verify) and plain sampling with the same seed and equal logits produce
the same tokens, and each token is an exact target sample given its prefix.
Temperature 0 is argmax (first index on ties, like torch.argmax and ONNX ArgMax).
"""

from __future__ import annotations

import numpy as np

from .errors import DFlashError


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not temperature >= 0:
        raise DFlashError(f"temperature must be >= 0 (got {temperature}); use 0 for greedy decoding")
    if top_k < 0:
        raise DFlashError(f"top-k must be >= 0 (got {top_k}); 0 disables it")
    if not 0 < top_p <= 1:
        raise DFlashError(f"top-p must be in (0, 1] (got {top_p}); 1 disables it")


def probabilities(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Row-wise sampling distribution [n, V] in float64 after temperature, top-k, top-p."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    if 0 < top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[..., -top_k, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep_sorted = (np.cumsum(sorted_p, axis=-1) - sorted_p) < top_p  # always keeps the top token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def position_uniforms(seed: int, length: int) -> np.ndarray:
    """u[t] for every absolute position t < length: the sampling randomness of the token at t."""
    return np.random.default_rng(seed).random(length)


def choose(
    logits: np.ndarray,
    u: np.ndarray | None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> np.ndarray:
    """The target's choice at each row of logits [n, V]: argmax, or the inverse CDF at u[row]
    (`u`: the uniforms of the positions these rows choose, from `position_uniforms`)."""
    logits = np.asarray(logits)
    if temperature == 0:
        return logits.argmax(axis=-1).astype(np.int64)
    p = probabilities(logits, temperature, top_k, top_p)
    u = np.asarray(u, dtype=np.float64)[: p.shape[0]]
    cdf = np.cumsum(p, axis=-1)
    idx = (cdf < (u * cdf[:, -1])[:, None]).sum(axis=-1)
    return np.minimum(idx, p.shape[-1] - 1).astype(np.int64)


def accept(draft: np.ndarray, choice: np.ndarray) -> int:
    """Length of the longest prefix where the drafts equal the target's choices."""
    mismatch = np.nonzero(np.asarray(draft) != np.asarray(choice)[: len(draft)])[0]
    return int(mismatch[0]) if len(mismatch) else len(draft)


def check_request(prompt: list[int], max_new_tokens: int, vocab_size: int, max_context: int | None = None,
                  what: str = "max context") -> int:
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
            f"{max_context}; shorten the prompt, lower --max-new-tokens or export with a larger --max-context"
        )
    return need


def cut_at_stop(emitted: list[int], stop: set[int]) -> tuple[list[int], bool]:
    """Emitted tokens up to and including the first stop token, and whether one was hit."""
    for i, t in enumerate(emitted):
        if t in stop:
            return emitted[: i + 1], True
    return emitted, False
