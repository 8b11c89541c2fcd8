"""Committed Gated DeltaNet states of a hybrid target (Qwen3.5 / 3.6), host side (numpy).

A target call returns, per linear-attention layer, the conv inputs and the delta rule's
per-position (k, u, g) of its new positions (runtime/contract.py); the states themselves
change only here, when the loop commits how many of those positions are real. So rollback
after a rejected draft is committing fewer positions, as for the attention K/V, and costs
one small update per layer (docs/hybrid.md measures it):

    conv_state <- last (kernel-1) rows of [conv_state ; new_conv[:n]]
    rec_state  <- exp(c_n) rec_state + sum_{j<n} exp(c_n - c_j) k_j u_j^T,   c = cumsum(g)
"""

from __future__ import annotations

import numpy as np

from . import contract as C, manifest as M
from .errors import DFlashError


def commit_state(state: np.ndarray, k: np.ndarray, u: np.ndarray, g: np.ndarray) -> None:
    """In place: state [Hv,Dk,Dv] fp32 after n tokens with k [n,Hk,Dk], u [n,Hv,Dv], g [n,Hv]."""
    n = k.shape[0]
    if n == 0:
        return
    cum = np.cumsum(g.astype(np.float32), 0)  # n Hv
    w = np.exp(cum[-1] - cum)  # decay from each token to the last
    kk = np.repeat(k.astype(np.float32), state.shape[0] // k.shape[1], axis=1)  # value head h reads key head h // rep
    upd = np.matmul((kk * w[..., None]).transpose(1, 2, 0), u.astype(np.float32).transpose(1, 0, 2))  # Hv Dk Dv
    state *= np.exp(cum[-1])[:, None, None]
    state += upd


class LinearStates:
    """Per linear-attention layer (batch 1): the committed conv window and recurrent state, and
    the buffers a target call writes its per-position outputs into, all by contract name.

    Host memory, shared by every backend: ONNX Runtime binds these buffers in place; the
    TensorRT backend copies the per-position outputs here after a call and the committed
    states back to the device before the next one (`changed`)."""

    def __init__(self, m: M.Manifest, max_chunk: int):
        if m.dtype == "bf16":
            raise DFlashError("hybrid targets exported in bf16 are not supported by the host state commit; "
                              "export in fp32 or fp16")
        self.layers = m.linear_layers
        self.names = C.layer_names(m.target_layers)
        self.changed = True  # the committed states moved since a device copy was last made of them
        self.buf = {}
        for i in self.layers:
            for t in C.LINEAR_STATE:
                self.buf[t.at(i).name] = np.zeros(C.shape(t, m, batch=1), C.dtype(t, m))  # float32 | float16
            for t in C.LINEAR_NEW:
                self.buf[t.at(i).name] = np.zeros(C.shape(t, m, batch=1, seq=max_chunk), C.dtype(t, m))

    def commit(self, n: int) -> None:
        """Apply the first n positions of the last call to every layer's state."""
        self.changed = self.changed or n > 0
        N = self.names
        for i in self.layers:
            conv = self.buf[N.conv_state[i]]
            if n:
                conv[0] = np.concatenate([conv[0], self.buf[N.new_conv[i]][0, :n]], 0)[-conv.shape[1]:]
            commit_state(self.buf[N.rec_state[i]][0], *(self.buf[name][0, :n] for name in N.delta[i]))

    def reset(self) -> None:
        self.changed = True
        for i in self.layers:
            self.buf[self.names.conv_state[i]][...] = 0
            self.buf[self.names.rec_state[i]][...] = 0

    def nbytes(self, templates) -> int:
        """Bytes of the buffers of the given templates (C.LINEAR_STATE: committed; C.LINEAR_NEW: per call)."""
        return sum(self.buf[t.at(i).name].nbytes for i in self.layers for t in templates)
