"""The three exported graphs as flat-tensor torch modules over `models/`, with their tracing inputs.

Each wrapper maps the contract's tensors (runtime/contract.py, in its order) onto one call
of the reference modules, so the ONNX graphs compute exactly what the PyTorch oracle computes.
Sample sizes for tracing are all >= 2 and pairwise distinct: torch.export specialises a
dim of size 0 or 1 and may merge dims whose sample sizes coincide; the graphs are then
checked at past length 0 and sequence length 1 after export (export/check.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.layers import apply_rope, rope_cos_sin
from ..runtime import contract as C
from .gqa import gqa, skip_rms



def _pairs(flat: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2)]


def _flat(pairs) -> list[torch.Tensor]:
    return [t for kv in pairs for t in kv]


def _rows_first(past: tuple, linear: list[bool]) -> tuple:
    """Position-major caches [P, B, ...] (contract.RAGGED) -> the models' [B, P, ...]; a
    hybrid target's linear-attention states are batch-major already."""
    return tuple(t if linear[i // 2] else t.transpose(0, 1) for i, t in enumerate(past))


def _picked(target, x, logits_index):
    """fp32 logits at the positions `logits_index` [B, N] picks from x [B, S, H], and their argmax."""
    x = x.gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
    logits = target.logits(x)
    return logits, logits.argmax(-1)


class TargetGraph(nn.Module):
    """input_ids, position_ids, past_lengths, logits_index, past K/V -> logits at the picked
    positions (fp32), next_ids, taps, new K/V (contract.RAGGED; `ragged=False`: the batch-1
    graph of older exports, contract.GRAPHS).

    Hybrid targets: a linear-attention layer's pair is (conv_state, rec_state) in and its
    four per-position outputs (new_conv, delta_k, delta_u, delta_g) out (models/qwen35.py).
    """

    def __init__(self, target):
        super().__init__()
        self.target = target
        self.linear = [getattr(layer, "kind", "") == "linear_attention" for layer in target.model.layers]

    def forward(self, input_ids, position_ids, past_lengths, logits_index, *past):
        if any(self.linear):  # hybrid: its attention layers take [B, P, ...]
            x, taps, new = self.target.hidden(input_ids, position_ids, _pairs(_rows_first(past, self.linear)), past_lengths)
        else:
            x, taps, new = self.target.hidden(input_ids, position_ids, _pairs(past), past_lengths, position_major=True)
        return (*_picked(self.target, x, logits_index), taps, *_flat(new))


class WindowedTargetGraph(nn.Module):
    """The ragged target graph of a gpt-oss / Gemma 4 target (models/windowed.py): full layers'
    past position-major [P, B, ...] as every target's; sliding layers' past the ring slots
    [B, Pw, ...] (contract.WINDOW_KV); KV-sharing layers none. Each slot's position comes from
    the row's `past_lengths`: a full layer's slot t holds position t (while t < length); a ring
    slot s holds the newest position below the length congruent to s mod ring."""

    def __init__(self, target):
        super().__init__()
        self.target = target
        kinds = target.config.windowed.kinds
        self.ring = kinds["sliding_attention"].window if "sliding_attention" in kinds else None

    def forward(self, input_ids, position_ids, past_lengths, logits_index, *past):
        t = self.target
        pairs, layers, slots = iter(_pairs(past)), [], {}
        for i, shape in enumerate(t.kv_shapes()):
            kv = None if shape is None else next(pairs)
            if kv is not None and t.kinds[i] == "full_attention":
                kv = (kv[0].transpose(0, 1), kv[1].transpose(0, 1))
            layers.append(kv)
            if kv is not None and t.kinds[i] not in slots:
                n = torch.arange(kv[0].shape[1], device=input_ids.device)[None]
                last = past_lengths[:, None] - 1
                if t.kinds[i] == "full_attention":
                    slots[t.kinds[i]] = torch.where(n <= last, n, -1)
                else:  # (+ ring: a non-negative operand, as ONNX exports of an integer remainder need)
                    slots[t.kinds[i]] = last - torch.remainder(last - n + self.ring, self.ring)
        x, taps, new = t.hidden(input_ids, position_ids, layers, slots)
        return (*_picked(t, x, logits_index), taps, *_flat(kv for kv in new if kv is not None))


class TargetGraph1(TargetGraph):
    """The batch-1 target graph of exports made before ragged batches (contract.GRAPHS)."""

    def forward(self, input_ids, position_ids, *past):
        logits, taps, new = self.target(input_ids, position_ids, _pairs(past))
        return (logits, logits.argmax(-1), taps, *_flat(new))


class TargetOrtGraph(nn.Module):
    """The "ort" flavour of the target graph (contract.TARGET_ORT): the same decoder in fewer
    nodes (ONNX Runtime pays a fixed cost per node). Per layer: one GroupQueryAttention over
    a head-major cache it updates in place, rotating q/k itself from cos/sin tables of
    max_context rows (head dims that are multiples of 16, as it requires; others rotate in
    the graph), and SkipSimplifiedLayerNormalization for each residual add + the next
    RMSNorm. Packing q/k/v and gate/up into one MatMul each was measured too and gave
    nothing on CPU (bench/context_scaling.py), so the weights stay as they are. Llama / Qwen2 / Qwen3
    decoder layers only (the hybrid targets keep the standard graph). position_ids is
    unused when GQA rotates: the runtime feeds positions equal to the cache rows, which is
    what GQA assumes.

    kv_scales: per layer (k_scale, v_scale), float32 [Hkv, 1, D] (export/kv_calibrate.py): the
    cache is then int8 (Manifest.kv_cache) and the scales are constants of the graph.
    """

    row_counts = True  # query_seqlens from seqlens_k and position_ids (contract.row_counts)

    def __init__(self, target, max_context: int, kv_scales: list | None = None):
        super().__init__()
        self.target = target
        self.int8_cache = kv_scales is not None
        for i, (ks, vs) in enumerate(kv_scales or ()):
            self.register_buffer(f"k_scale_{i}", ks.float().contiguous(), persistent=False)
            self.register_buffer(f"v_scale_{i}", vs.float().contiguous(), persistent=False)
        d, dtype = target.model.layers[0].self_attn.d, target.model.embed_tokens.weight.dtype
        self.rotary = d % 16 == 0
        if self.rotary:  # the same products as rope_cos_sin, one row per position
            freqs = torch.arange(max_context).float()[:, None] * target.inv_freq.float()[None]
            scale = target.config.rope.attention_factor  # YaRN's, as rope_cos_sin
            self.register_buffer("cos_cache", (freqs.cos() * scale).to(dtype), persistent=False)
            self.register_buffer("sin_cache", (freqs.sin() * scale).to(dtype), persistent=False)

    def forward(self, input_ids, position_ids, seqlens_k, total, logits_index, *cache):
        return self.run(input_ids, position_ids, seqlens_k, total, logits_index, cache)

    def run(self, input_ids, position_ids, seqlens_k, total, logits_index, cache):
        t, (b, s) = self.target, input_ids.shape
        layers = t.model.layers
        x = t.embed(input_ids)
        if not self.rotary:
            cos, sin = rope_cos_sin(position_ids, t.inv_freq, x.dtype, t.config.rope.attention_factor)
        h = layers[0].input_layernorm(x)
        outs, present = {}, []
        # each row's count of new tokens: the runtime feeds seqlens_k = length + count - 1 and
        # positions from the row's length (older runtimes: count = S, as without the input)
        counts = (seqlens_k + 1 - position_ids[:, 0].to(seqlens_k.dtype),) if self.row_counts else ()
        for i, layer in enumerate(layers):
            a = layer.self_attn
            q, k, v = a.q_proj(h).view(b, s, a.h, a.d), a.k_proj(h).view(b, s, a.hkv, a.d), a.v_proj(h)
            if a.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            if not self.rotary:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            rot = (self.cos_cache, self.sin_cache) if self.rotary else (None, None)
            scales = (getattr(self, f"k_scale_{i}"), getattr(self, f"v_scale_{i}")) if self.int8_cache else ()
            rows = counts if counts or not scales else (None,)
            o, pk, pv = gqa(q.reshape(b, s, -1), k.reshape(b, s, -1), v, cache[2 * i], cache[2 * i + 1],
                            seqlens_k, total, *rot, a.h, a.hkv, *rows, *scales)
            norm = layer.post_attention_layernorm
            h, x = skip_rms(x, a.o_proj(o), norm.weight, norm.eps)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else t.model.norm
            h, x = skip_rms(x, layer.mlp(h), norm.weight, norm.eps)
            present += [pk, pv]
            outs[i] = x
        outs[len(layers) - 1] = h  # as Target.final: the last layer's tap is after the final norm
        taps = torch.cat([outs[i] for i in t.tap_ids], dim=-1) if t.tap_ids else h[..., :0]
        if logits_index is not None:
            return (*_picked(t, h, logits_index), taps, *present)
        logits = t.logits(h)
        return (logits, logits.argmax(-1), taps, *present)


class TargetOrtGraph1(TargetOrtGraph):
    """The ort flavour's batch-1 graph of exports made before ragged batches (contract.TARGET_ORT)."""

    row_counts = False

    def forward(self, input_ids, position_ids, seqlens_k, total, *cache):
        return self.run(input_ids, position_ids, seqlens_k, total, None, cache)


class DraftContextGraph(nn.Module):
    """taps of newly accepted positions -> drafter context K/V to append."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, taps, ctx_position_ids):
        return tuple(_flat(self.drafter.context_kv(taps, ctx_position_ids)))


class SharedHead(nn.Module):
    """The target's embedding and LM head alone, so the block graph carries no other target weight."""

    def __init__(self, target):
        super().__init__()
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head

    def embed(self, ids):
        return self.embed_tokens(ids)


class DraftBlockGraph(nn.Module):
    """block ids + positions (+ per-row context lengths) over the drafter's context cache ->
    draft_ids, draft_logits (fp32), draft_conf (fp32 top-1 probability per position:
    adaptive verify's input). A DFlash 2 drafter adds its selector's candidates and walk
    scores, and its draft_ids / draft_conf are the greedy walk's (Drafter.block_outputs per
    family). The ragged graph takes the cache position-major [PC, B, ...] and hides each row's slots from its `ctx_lengths` on (Drafter.block_mask's anchors).

    With a draft vocabulary (Drafter.set_draft_vocab) the graph holds the [N, H] head and
    the N ids instead of reading the shared LM head: logits are [.., N], ids target ids, and
    draft_conf is the softmax over the N scored tokens."""

    def __init__(self, drafter, target, ring: int | None = None):
        super().__init__()
        self.drafter, self.ring = drafter, ring  # ring: the context cache's slots (Manifest.draft_ring)
        self.shared = SharedHead(target)
        if drafter.vocab_head is not None:
            self.shared.lm_head = None  # not traced: the graph must not hold the full head

    def forward(self, block_ids, block_position_ids, ctx_lengths, *past_ctx):
        return self.run(block_ids, block_position_ids, ctx_lengths, past_ctx, True)

    def run(self, block_ids, block_position_ids, ctx_lengths, past_ctx, position_major: bool = False):
        return self.drafter.block_outputs(self.shared, block_ids, block_position_ids, _pairs(past_ctx), ctx_lengths,
                                          position_major, self.ring)


class DraftBlockIndexGraph(DraftBlockGraph):
    """The block graph whose head scores only the draft positions `draft_index` [n] names
    (contract.DRAFT_INDEX; the hidden states are gathered before the head, so its MatMul is n
    rows, not K-1)."""

    def forward(self, block_ids, block_position_ids, ctx_lengths, draft_index, *past_ctx):
        return self.drafter.block_outputs(self.shared, block_ids, block_position_ids, _pairs(past_ctx), ctx_lengths,
                                          True, self.ring, draft_index)


class DraftBlockGraph1(DraftBlockGraph):
    """The batch-1 block graph of exports made before ragged batches (contract.GRAPHS)."""

    def forward(self, block_ids, block_position_ids, *past_ctx):
        return self.run(block_ids, block_position_ids, None, past_ctx)


def _sample_sizes(block_size: int) -> dict[str, int]:
    """Distinct tracing sizes >= 2 for the dynamic roles, all different from the block size."""
    free = (n for n in range(2, 64) if n != block_size)
    return {role: next(free) for role in C.DYNAMIC}


def trace_inputs(graph: str, m, dtype: torch.dtype):
    """Sample inputs and torch.export dynamic shapes for the graph's wrapper, from the contract.

    `m` is the manifest being written (sizes, mask token). Ids are random in the vocabulary
    (block ids: [anchor, mask, ...]), positions continue after the sampled past.
    """
    n, static = _sample_sizes(m.block_size), C.sizes(m)
    ins, _ = C.io(graph, m)
    dims = {r: torch.export.Dim(r, min=0) if C.DYNAMIC[r] == 0 else torch.export.Dim(r) for r in C.DYNAMIC}
    if C.max_seq(m) and graph == C.TARGET:  # hybrid: one delta-rule chunk per call (models/gdn.py)
        dims[C.SEQ] = torch.export.Dim(C.SEQ, max=C.max_seq(m))
    start = {C.TARGET: n[C.PAST], C.DRAFT_CONTEXT: 3, C.DRAFT_BLOCK: n[C.PAST_CTX]}[graph]
    args, shapes = [], []
    past_seq = n[C.PAST] + n[C.SEQ]  # the ort flavour's lengths, as the runtime feeds them
    for t in ins:
        size = [n[r] if r in C.DYNAMIC else static[r] for r in t.dims]
        if t.dtype in (C.MODEL, C.CACHE) and C.dtype(t, m) == "int8":  # a quantized cache (Manifest.kv_cache)
            x = torch.randint(-127, 128, size, dtype=torch.int8)
        elif t.dtype in (C.MODEL, C.CACHE):
            x = torch.randn(size).to(dtype)
        elif t.dtype == C.FLOAT32:  # a recurrent state
            x = torch.randn(size) * 0.1
        elif t.name in C.POSITIONS:
            x = torch.arange(start, start + size[1]).expand(*size).contiguous()
        elif t.name in (C.PAST_LENGTHS, C.CTX_LENGTHS):  # every row full: the graph is checked ragged after export
            x = torch.full(size, n[C.PAST] if t.name == C.PAST_LENGTHS else n[C.PAST_CTX], dtype=torch.long)
        elif t.name == C.LOGITS_INDEX:
            x = torch.randint(0, n[C.SEQ], size)
        elif t.name == C.DRAFT_INDEX:  # (repeats allowed: the sample size may exceed K - 1)
            x = torch.randint(0, m.block_size - 1, size)
        elif t.name in (C.SEQLENS_K, C.TOTAL_LEN):
            x = torch.full(size, past_seq - (t.name == C.SEQLENS_K), dtype=torch.int32)
        elif t.name == C.BLOCK_IDS:
            x = torch.full(size, m.mask_token_id, dtype=torch.long)
            x[:, 0] = torch.randint(0, m.vocab_size, (size[0],))
        else:
            x = torch.randint(0, m.vocab_size, size)
        args.append(x)
        shapes.append({axis: dims[r] for axis, r in enumerate(t.dims) if r in C.DYNAMIC})
    fixed = sum(not t.per_layer for t in C.spec(graph, m).inputs)  # wrappers take the per-layer ones as *args
    nested = (*shapes[:fixed], tuple(shapes[fixed:])) if fixed < len(shapes) else tuple(shapes)
    return tuple(args), nested


def wrapper(graph: str, target, drafter, attention: str = "standard", max_context: int = 0,
            ragged: bool = True, ring: int | None = None, index: bool = False, kv_scales: list | None = None) -> nn.Module:
    """The module export traces for `graph` (`ragged=False`: older exports' batch-1 graphs, for check;
    `index`: draft_block takes draft_index, Manifest.draft_index; `kv_scales`: the ort target's int8 cache)."""
    if graph == C.TARGET and attention == "ort":
        return (TargetOrtGraph if ragged else TargetOrtGraph1)(target, max_context, kv_scales)
    if graph == C.TARGET and hasattr(target, "kv_shapes"):  # gpt-oss / Gemma 4: ragged graphs only
        return WindowedTargetGraph(target)
    if graph == C.TARGET:
        return (TargetGraph if ragged else TargetGraph1)(target)
    if graph == C.DRAFT_BLOCK:
        return (DraftBlockIndexGraph if index else DraftBlockGraph if ragged else DraftBlockGraph1)(drafter, target, ring)
    return DraftContextGraph(drafter)
