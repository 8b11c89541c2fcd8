"""The one KV-cache style of models/: static buffers written by index (gpt-fast's KVCache.update).

Sequence-major `[B, max_len, Hkv, D]` per layer, as the exported runtimes keep theirs. A
forward writes its S new positions at [length, length + S) of every layer (`update`) and
attends over the returned views [0, length + S); the caller then `commit`s how many of
the S are real. Rollback after a rejected draft is committing fewer: the other slots are
scratch, overwritten by the next forward.
"""

from __future__ import annotations

import torch

from ..runtime.errors import DFlashError

KV = list[tuple[torch.Tensor, torch.Tensor]]


class KVCache:
    def __init__(self, layers: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int = 1):
        self.k = [torch.zeros(batch, max_len, kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(batch, max_len, kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
        self.length = 0  # committed positions

    @classmethod
    def for_model(cls, model, max_len: int, batch: int = 1) -> "KVCache":
        c = model.config
        return cls(c.num_layers, max_len, c.num_kv_heads, c.head_dim, next(model.parameters()).dtype, batch)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [B, S, Hkv, D] at [length, length + S) of `layer`; -> keys, values [B, length + S, ...]."""
        end = self.length + k.shape[1]
        if end > self.max_len:
            raise DFlashError(f"KV cache overflow: {end} positions > max context {self.max_len}")
        self.k[layer][:, self.length : end] = k
        self.v[layer][:, self.length : end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def commit(self, n: int) -> None:
        """Keep n of the positions the last forward wrote."""
        self.length += n

    def append(self, new: KV) -> None:
        """Write K/V computed elsewhere (the drafter's context projection) and keep them all."""
        for layer, (k, v) in enumerate(new):
            self.update(layer, k, v)
        self.commit(new[0][0].shape[1])

    def view(self) -> KV:
        """Zero-copy views of the committed prefix."""
        return [(k[:, : self.length], v[:, : self.length]) for k, v in zip(self.k, self.v)]
