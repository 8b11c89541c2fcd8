"""A minimal greedy speculative loop over the three exported graphs: numpy + plain sess.run.

Deliberately independent of runtime/ (no IO binding, caches grown by concatenation): it
checks the graphs against the PyTorch oracle (models.speculative_generate), not a runtime.
Same round bookkeeping as the oracle, so tokens and acceptance lengths must match exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..runtime import contract as C
from ..runtime.sampling import accept


class Graphs:
    """One ORT session per graph of an exported directory (CPU unless told otherwise)."""

    def __init__(self, root: str | Path, manifest: C.Manifest, providers=("CPUExecutionProvider",)):
        from .validate import ort_session

        self.manifest = manifest
        self.sessions = {g: ort_session(Path(root) / f, providers) for g, f in C.GRAPH_FILES.items()}
        self.names = {g: [o.name for o in s.get_outputs()] for g, s in self.sessions.items()}

    def run(self, graph: str, feeds: dict) -> dict[str, np.ndarray]:
        return dict(zip(self.names[graph], self.sessions[graph].run(None, feeds)))


def _empty(graph: str, m: C.Manifest) -> list[np.ndarray]:
    """The graph's per-layer cache inputs, empty (past length 0), in the contract's order."""
    caches = [t for t in C.io(graph, m)[0] if C.find(graph, t.name).per_layer]
    dtype = C.dtype(caches[0], m)
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    return [np.zeros(C.shape(t, m, batch=1, past=0, past_ctx=0), dtype) for t in caches]


def greedy_speculative(g: Graphs, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """-> (tokens, acceptance lengths) at temperature 0 with no stop tokens."""
    m = g.manifest
    K, n = m.block_size, len(prompt)
    max_length = n + max_new_tokens
    tkv, dkv = _empty(C.TARGET, m), _empty(C.DRAFT_BLOCK, m)

    def target(ids: list[int], positions: np.ndarray):
        feeds = {C.INPUT_IDS: np.array([ids], np.int64), C.POSITION_IDS: positions[None]}
        for i in range(m.target_layers):
            feeds[C.past_key(i)], feeds[C.past_value(i)] = tkv[2 * i], tkv[2 * i + 1]
        out = g.run(C.TARGET, feeds)
        new = [out[C.new_key(i) if h == 0 else C.new_value(i)] for i in range(m.target_layers) for h in (0, 1)]
        return out[C.NEXT_IDS][0].tolist(), out[C.TAPS], new

    next_ids, taps, new = target(prompt, np.arange(n))
    tkv = [np.concatenate([a, b], 1) for a, b in zip(tkv, new)]
    anchor, start = next_ids[-1], n
    out, lengths = [anchor], []
    ctx_taps, ctx_pos = taps, np.arange(n)
    while start + 1 < max_length:
        ctx = g.run(C.DRAFT_CONTEXT, {C.TAPS: ctx_taps, C.CTX_POSITION_IDS: ctx_pos[None]})
        dkv = [np.concatenate([dkv[2 * j + h], ctx[C.ctx_key(j) if h == 0 else C.ctx_value(j)]], 1)
               for j in range(m.draft_layers) for h in (0, 1)]
        positions = np.arange(start, start + K)
        feeds = {C.BLOCK_IDS: np.array([[anchor] + [m.mask_token_id] * (K - 1)], np.int64),
                 C.BLOCK_POSITION_IDS: positions[None]}
        for j in range(m.draft_layers):
            feeds[C.past_ctx_key(j)], feeds[C.past_ctx_value(j)] = dkv[2 * j], dkv[2 * j + 1]
        drafts = g.run(C.DRAFT_BLOCK, feeds)[C.DRAFT_IDS][0].tolist()

        s = min(K, max_length - start)
        choice, taps, new = target([anchor] + drafts[: s - 1], positions[:s])
        a = accept(drafts[: s - 1], choice[: s - 1])
        emitted = (drafts[:a] + [choice[a]])[: max_length - start - 1]
        produced = len(emitted)
        tkv = [np.concatenate([t, x[:, :produced]], 1) for t, x in zip(tkv, new)]
        ctx_taps, ctx_pos = taps[:, :produced], positions[:produced]
        out += emitted
        lengths.append(produced)
        start += produced
        anchor = emitted[-1]
    return out, lengths


def greedy_plain(g: Graphs, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding through target.onnx alone (prefill, then 1-token steps): the
    reference a speculative run over the same graphs must reproduce token for token."""
    m = g.manifest
    kv = _empty(C.TARGET, m)
    ids, pos, out = list(prompt), 0, []
    while len(out) < max_new_tokens:
        feeds = {C.INPUT_IDS: np.array([ids], np.int64), C.POSITION_IDS: np.arange(pos, pos + len(ids))[None]}
        for i in range(m.target_layers):
            feeds[C.past_key(i)], feeds[C.past_value(i)] = kv[2 * i], kv[2 * i + 1]
        o = g.run(C.TARGET, feeds)
        kv = [np.concatenate([kv[2 * i + h], o[C.new_key(i) if h == 0 else C.new_value(i)]], 1)
              for i in range(m.target_layers) for h in (0, 1)]
        pos += len(ids)
        ids = [int(o[C.NEXT_IDS][0, -1])]
        out += ids
    return out
