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
from .names import layer_names


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
    """Per linear-attention layer: the committed conv window and recurrent state of each batch
    row ([max_batch, ...]), and the buffers a target call writes its per-position outputs
    into, all by contract name.

    Host memory, shared by every backend: ONNX Runtime binds these buffers in place; the
    TensorRT backend copies the per-position outputs here after a call and the committed
    states back to the device before the next one (`changed`). A call over R rows of S
    positions writes its outputs as [R, S, ...] at the start of each buffer (`layout`);
    `buf[name]` views them as [max_batch, max_chunk, ...] (one row: the same bytes)."""

    def __init__(self, m: M.Manifest, max_chunk: int, max_batch: int = 1):
        if m.dtype == "bf16":
            raise DFlashError("hybrid targets exported in bf16 are not supported by the host state commit; "
                              "export in fp32 or fp16")
        self.layers = m.linear_layers
        self.names = layer_names(m.target_layers)
        self.changed = True  # the committed states moved since a device copy was last made of them
        self.buf, self.flat, self.rows_seq = {}, {}, (1, max_chunk)
        for i in self.layers:
            for t in C.LINEAR_STATE:
                self.buf[t.at(i).name] = np.zeros(C.shape(t, m, batch=max_batch), C.dtype(t, m))  # float32 | float16
            for t in C.LINEAR_NEW:
                shape = C.shape(t, m, batch=max_batch, seq=max_chunk)
                flat = self.flat[t.at(i).name] = np.zeros(int(np.prod(shape)), C.dtype(t, m))
                self.buf[t.at(i).name] = flat.reshape(shape)

    def layout(self, rows: int, seq: int) -> None:
        """The next call writes [rows, seq, ...] outputs (see `view`)."""
        self.rows_seq = (rows, seq)

    def view(self, name: str) -> np.ndarray:
        """The last call's per-position outputs of `name`, [rows, seq, ...]."""
        r, s = self.rows_seq
        flat = self.flat[name]
        per_pos = flat.size // (self.buf[name].shape[0] * self.buf[name].shape[1])
        return flat[: r * s * per_pos].reshape(r, s, *self.buf[name].shape[2:])

    def commit(self, n: int) -> None:
        """Apply the first n positions of the last call to every layer's state (row 0)."""
        self.commit_rows([0], [n])

    def commit_rows(self, rows, n) -> None:
        """Row rows[r] of the state takes the first n[r] positions of the last call's row r."""
        self.changed = self.changed or any(n)
        for i in self.layers:
            conv, new_conv = self.buf[self.names.conv_state[i]], self.view(self.names.new_conv[i])
            deltas = [self.view(name) for name in self.names.delta[i]]
            for r, (b, k) in enumerate(zip(rows, n)):
                if k:
                    conv[b] = np.concatenate([conv[b], new_conv[r, :k]], 0)[-conv.shape[1]:]
                commit_state(self.buf[self.names.rec_state[i]][b], *(d[r, :k] for d in deltas))

    def move(self, src: int, dst: int) -> None:
        """Row src's committed states to row dst (a batch's rows stay in its first slots)."""
        self.changed = True
        for i in self.layers:
            for name in (self.names.conv_state[i], self.names.rec_state[i]):
                self.buf[name][dst] = self.buf[name][src]

    def reset(self, row: int | None = None) -> None:
        """Zero the states of every row, or of one."""
        self.changed = True
        at = slice(None) if row is None else row
        for i in self.layers:
            self.buf[self.names.conv_state[i]][at] = 0
            self.buf[self.names.rec_state[i]][at] = 0

    def nbytes(self, templates) -> int:
        """Bytes of the buffers of the given templates (C.LINEAR_STATE: committed; C.LINEAR_NEW: per call)."""
        return sum(self.buf[t.at(i).name].nbytes for i in self.layers for t in templates)
