"""`check`, ragged batches: the graphs' inputs for a given past (batch-1 and ragged
contracts alike), and parity per row of a ragged batch against each row alone in PyTorch."""

from __future__ import annotations

import numpy as np

from ..runtime import contract as C, manifest as M
from ..runtime.lazy import lazy_import

torch = lazy_import("torch")  # torch and the graphs: on first use (runtime/lazy.py)
G = lazy_import("dflash_export.export.graphs")
gqa = lazy_import("dflash_export.export.gqa")


def _flat(kv) -> list:
    return [t for pair in kv for t in pair]


def _position_major(m: M.Manifest | None, kv) -> list:
    """[B, P, ...] attention K/V -> the ragged graphs' [P, B, ...] (a target's linear states and
    sliding layers' rings, given its manifest `m`, stay as they are; KV-sharing layers have none)."""
    kinds = C.layer_kinds(C.TARGET, m) if m is not None else [C.ATTENTION] * len(kv)
    return [t if kinds[i] in (C.LINEAR, C.SLIDING) else t.transpose(0, 1).contiguous()
            for i, pair in enumerate(kv) if kinds[i] != C.SHARED for t in pair]


def ring_slots(p: int, ring: int) -> list[int]:
    """The positions a ring of `ring` slots holds after p positions: slot s keeps the last one = s mod ring."""
    return [p - 1 - (p - 1 - s) % ring for s in range(min(p, ring))]


def in_window_rings(m: M.Manifest, kv, p: int) -> list:
    """A sliding-window target's prefix past (slot = position, per layer) as the runtime holds it:
    each sliding layer's last `ring` positions in their ring slots (runtime/window.py)."""
    w = C.window(m)
    if not w or w["ring"] is None:
        return kv
    kinds, pos = C.layer_kinds(C.TARGET, m), ring_slots(p, w["ring"])
    return [(pair[0][:, pos], pair[1][:, pos]) if kinds[i] == C.SLIDING else pair for i, pair in enumerate(kv)]


def target_inputs(m: M.Manifest, kv, p: int, s: int, lengths=None, counts=None, scales=None) -> list:
    """The target graph's inputs after ids and positions, for past `kv` of p positions and s
    new ones (`lengths`: each row's valid past, ragged graphs; default all p; `counts`: each
    row's new tokens, the ort flavour's rows of different counts, default all s; `scales`: the
    ort flavour's int8 cache, per layer (k_scale, v_scale): the past stored quantized)."""
    b = kv[0][0].shape[0] if kv else 1
    if C.window(m) and lengths is None:  # a prefix of every row: the sliding layers' rings from it
        kv = in_window_rings(m, kv, p)
    lengths = torch.full((b,), p, dtype=torch.long) if lengths is None else lengths
    picks = [torch.arange(s).expand(b, s).contiguous()] if C.ragged(m) else []
    if C.flavour(m) == "ort":  # lengths + the whole head-major buffers holding the past (contract.TARGET_ORT)
        bufs = []
        flat_scales = [x for pair in scales for x in pair] if scales else [None] * len(_flat(kv))
        for t, sc in zip(_flat(kv), flat_scales):
            buf = torch.zeros(b, t.shape[2], m.max_context, t.shape[3], dtype=t.dtype if sc is None else torch.int8)
            buf[:, :, :p] = gqa.quantize(t.transpose(1, 2), sc)
            bufs.append(buf)
        return [(lengths + (s if counts is None else counts) - 1).int(), torch.tensor(p + s, dtype=torch.int32), *picks, *bufs]
    if not C.ragged(m):
        return _flat(kv)
    return [lengths, *picks, *_position_major(m, kv)]


def stored_rows(names: list[str], outs: list, rows: list[tuple[int, int, int]]) -> list:
    """The int8 cache values an ort-flavour target call stored (its present_* outputs), in the
    order the reference quantizes them (gqa.stored_as): per layer, per row (r, start, count) of
    `rows`, K then V."""
    present = {n: o for n, o in zip(names, outs) if n.startswith("present_")}
    layers = len(present) // 2
    return [torch.from_numpy(np.ascontiguousarray(present[f"present_{kv}.{i}"][r : r + 1, :, a : a + c]))
            for i in range(layers) for r, a, c in rows if c for kv in ("key", "value")]


def in_ring(m: M.Manifest, kv, p: int):
    """[B, p, ...] context K/V (slot = position) as the runtime's ring holds them (Manifest.draft_ring):
    slot s keeps the last position = s mod ring; unchanged while p fits."""
    r = C.ring(m)
    if r is None or p <= r:
        return kv
    pos = [p - 1 - (p - 1 - s) % r for s in range(r)]
    return [(k[:, pos], v[:, pos]) for k, v in kv]


def block_inputs(m: M.Manifest, ctx, p: int, scored: int | None = None) -> list:
    """draft_block's inputs after ids and positions for a context of p positions (its head over
    the first `scored` drafts, default all, where the graph takes draft_index)."""
    ctx = in_ring(m, ctx, p)
    if not C.ragged(m):
        return _flat(ctx)
    index = [torch.arange(scored or m.block_size - 1)] if C.draft_index(m) else []
    return [torch.full((ctx[0][0].shape[0],), p, dtype=torch.long), *index, *_position_major(None, ctx)]


def ragged_rows(target, drafter, m: M.Manifest, sessions: dict, seed: int, strict: bool, compare, to_numpy,
                against: str = "pytorch", kv_scales=None) -> list:
    """Parity per row of a ragged batch: two rows with different past lengths (and verify
    lengths, the shorter padded) through the target and the block graph in one call each,
    every row's valid outputs against that row alone through PyTorch (batch 1)."""
    if not C.ragged(m) or (C.flavour(m) == "ort" and not C.row_counts(m)):  # older ort exports: one row a call
        return []
    g = torch.Generator().manual_seed(seed + 11)
    K, lens, news = m.block_size, [9, 4], [m.block_size, max(1, m.block_size // 2)]
    P, S = max(lens), max(news)
    rows_ids = [torch.randint(0, m.vocab_size, (1, n + s), generator=g) for n, s in zip(lens, news)]
    tg, bg = G.wrapper(C.TARGET, target, drafter, C.flavour(m), m.max_context, kv_scales=kv_scales), G.wrapper(C.DRAFT_BLOCK, target, drafter, ring=C.ring(m),
                                                             index=C.draft_index(m))
    refs, pasts, ctxs = [], [], []
    with torch.inference_mode():
        for ids, n, s in zip(rows_ids, lens, news):
            _, taps, past = target(ids[:, :n], torch.arange(n)[None], target.empty_kv())
            if hasattr(target, "new_cache"):
                cache = target.new_cache(n)
                cache.append(past)
                past = cache.view()
            ctx = drafter.context_kv(taps, torch.arange(n)[None])
            t_ref = tg(ids[:, n:n + s], torch.arange(n, n + s)[None], *target_inputs(m, past, n, s, scales=kv_scales))
            blk = torch.cat([ids[:, n:n + 1], torch.full((1, K - 1), m.mask_token_id)], 1)
            b_ref = bg(blk, torch.arange(n, n + K)[None], *block_inputs(m, ctx, n))
            refs.append((t_ref, b_ref, blk))
            pasts.append(past)
            ctxs.append(ctx)
    pad = lambda t, p: torch.cat([t, t.new_zeros(t.shape[0], p - t.shape[1], *t.shape[2:])], 1)  # noqa: E731
    kinds, w = C.layer_kinds(C.TARGET, m), C.window(m)
    if w:  # each row's sliding layers as its ring, all rows' rings bound to the longest row's slots
        pasts = [in_window_rings(m, p_, n) for p_, n in zip(pasts, lens)]
    size = {C.ATTENTION: P, C.SLIDING: min(P, (w or {}).get("ring") or P)}
    batch_past = [None if kinds[i] == C.SHARED else
                  tuple(torch.cat([pad(p_[i][j], size[kinds[i]]) if kinds[i] in size else p_[i][j] for p_ in pasts], 0)
                        for j in range(2)) for i in range(len(pasts[0]))]
    ctxs, Pc = [in_ring(m, c, n) for c, n in zip(ctxs, lens)], min(P, C.ring(m) or P)
    batch_ctx = [tuple(torch.cat([pad(c[i][j], Pc) for c in ctxs], 0) for j in range(2)) for i in range(len(ctxs[0]))]
    ids = torch.cat([pad(r[:, n:n + s], S) for r, n, s in zip(rows_ids, lens, news)], 0)
    pos = torch.stack([torch.arange(n, n + S) for n in lens])
    lengths = torch.tensor(lens)
    _np = to_numpy
    rows = []
    for graph, inputs, which in (
        (C.TARGET, [ids, pos, *target_inputs(m, batch_past, P, S, lengths, torch.tensor(news), kv_scales)], 0),
        (C.DRAFT_BLOCK, [torch.cat([r[2] for r in refs]), torch.stack([torch.arange(n, n + K) for n in lens]),
                         lengths, *([torch.arange(K - 1)] if C.draft_index(m) else []),
                         *_position_major(None, batch_ctx)], 1),
    ):
        names_in, names_out = C.names(graph, m)
        got = sessions[graph].run(names_out, dict(zip(names_in, (_np(t) for t in inputs))))
        if graph == C.TARGET and kv_scales is not None:  # each row's reference given ORT's int8 stores
            for r, (n, s) in enumerate(zip(lens, news)):
                past = target_inputs(m, pasts[r], n, s, scales=kv_scales)  # (quantized outside stored_as)
                with gqa.stored_as(stored_rows(names_out, got, [(r, n, s)])), torch.inference_mode():
                    t_ref = tg(rows_ids[r][:, n:n + s], torch.arange(n, n + s)[None], *past)
                refs[r] = (t_ref, *refs[r][1:])
        for r, s in enumerate(news if graph == C.TARGET else [K - 1] * 2):
            ref = [_np(t)[:, :s] for t in refs[r][which]]  # every output is [B, positions, ...]
            mine = [o[r : r + 1, :s] for o in got]
            case = f"ragged B=2 row {r} (past {lens[r]}, {s} of {S} new)" if graph == C.TARGET else \
                f"ragged B=2 row {r} (context {lens[r]})"
            rows += compare(graph, case, names_out, mine, ref, strict, against)
    return rows
