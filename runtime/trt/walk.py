"""TensorRT backend, DFlash 2 part: the draft_block outputs beyond DFlash's.

NOT YET EXECUTED ON TENSORRT HARDWARE (no NVIDIA GPU in development); tested against the double of
the real bindings (tests/trt_fake.py: ONNX Runtime plays the engine), tokens compared with ONNX
Runtime's. A DFlash 2 `draft_block` also writes `draft_candidates` [B, K-1, k] and `draft_scores`
[B, K-1, k, k] (runtime/walk.py): every engine output needs an address, so they get device
buffers sized for max_batch rows; greedy rounds read only `draft_ids` (the graph's own walk),
sampled rows copy the two to the host for the walk (`draft_walk_rows`).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from .. import contract as C


class TrtSelector:
    @cached_property
    def draft_outputs(self) -> dict[str, int]:
        """Addresses of draft_block's outputs (ids, logits, conf, and DFlash 2's candidates and
        scores, whose buffers are made here), built once, on the first draft."""
        out = {C.DRAFT_IDS: self.d_draft, C.DRAFT_LOGITS: self.d_dlogits}
        if self.d_conf is not None:
            out[C.DRAFT_CONF] = self.d_conf
        sel = C.selector(self.manifest)
        if sel:
            n, k = self.max_batch * (self.k - 1), sel["top_k"]
            self.h_walk = {C.DRAFT_CANDIDATES: np.zeros((n, k), np.int64), C.DRAFT_SCORES: np.zeros((n, k, k), np.float32)}
            self.d_walk = {name: self._malloc(a.nbytes) for name, a in self.h_walk.items()}
            out |= self.d_walk
        return out

    def draft_walk_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """DFlash 2: the last draft_block call's candidates [n, K-1, k] and walk scores [n, K-1, k, k]."""
        m = n * (self.k - 1)
        for name, a in self.h_walk.items():
            self._d2h(a[:m], self.d_walk[name])
        self._sync()
        cand, scores = self.h_walk[C.DRAFT_CANDIDATES], self.h_walk[C.DRAFT_SCORES]
        return cand[:m].reshape(n, self.k - 1, -1), scores[:m].reshape(n, self.k - 1, *scores.shape[1:])
