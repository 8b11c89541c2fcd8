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

from ..runtime import contract as C



def _pairs(flat: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2)]


def _flat(pairs) -> list[torch.Tensor]:
    return [t for kv in pairs for t in kv]


class TargetGraph(nn.Module):
    """input_ids, position_ids, past K/V -> logits (fp32), next_ids, taps, new K/V.

    Hybrid targets: a linear-attention layer's pair is (conv_state, rec_state) in and its
    four per-position outputs (new_conv, delta_k, delta_u, delta_g) out (models/qwen35.py).
    """

    def __init__(self, target):
        super().__init__()
        self.target = target

    def forward(self, input_ids, position_ids, *past):
        logits, taps, new = self.target(input_ids, position_ids, _pairs(past))
        return (logits, logits.argmax(-1), taps, *_flat(new))


class TargetOrtGraph(nn.Module):
    """The "ort" flavour of the target graph (contract.TARGET_ORT): the same decoder, with each
    layer's attention one GroupQueryAttention over a head-major cache it updates in place.
    Llama / Qwen2 / Qwen3 decoder layers only (the hybrid targets keep the standard graph)."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def forward(self, input_ids, position_ids, seqlens_k, total, *cache):
        from ..models.layers import rope_cos_sin
        from .gqa import gqa

        t, (b, s) = self.target, input_ids.shape
        x = t.embed(input_ids)
        cos, sin = rope_cos_sin(position_ids, t.inv_freq, x.dtype)
        outs, present = {}, []
        for i, layer in enumerate(t.model.layers):
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(x), cos, sin)
            o, pk, pv = gqa(q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1), cache[2 * i],
                            cache[2 * i + 1], seqlens_k, total, a.h, a.hkv)
            x = x + a.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            present += [pk, pv]
            outs[i] = x
        x, taps = t.final(outs)
        logits = t.logits(x)
        return (logits, logits.argmax(-1), taps, *present)


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
    """block ids + positions over the drafter's context cache -> draft_ids, draft_logits (fp32),
    draft_conf (fp32 top-1 probability per position: adaptive verify's input).

    With a draft vocabulary (Drafter.set_draft_vocab) the graph holds the [N, H] head and
    the N ids instead of reading the shared LM head: logits are [.., N], ids target ids, and
    draft_conf is the softmax over the N scored tokens."""

    def __init__(self, drafter, target):
        super().__init__()
        self.drafter = drafter
        self.shared = SharedHead(target)
        if drafter.vocab_head is not None:
            self.shared.lm_head = None  # not traced: the graph must not hold the full head

    def forward(self, block_ids, block_position_ids, *past_ctx):
        logits = self.drafter.draft_logits(self.shared, block_ids, block_position_ids, _pairs(past_ctx))
        return self.drafter.draft_tokens(logits), logits, torch.softmax(logits, -1).amax(-1)


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
        if t.dtype == C.MODEL:
            x = torch.randn(size).to(dtype)
        elif t.dtype == C.FLOAT32:  # a recurrent state
            x = torch.randn(size) * 0.1
        elif t.name in C.POSITIONS:
            x = torch.arange(start, start + size[1]).expand(*size).contiguous()
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


def wrapper(graph: str, target, drafter, attention: str = "standard") -> nn.Module:
    if graph == C.TARGET and attention == "ort":
        return TargetOrtGraph(target)
    return {C.TARGET: lambda: TargetGraph(target), C.DRAFT_CONTEXT: lambda: DraftContextGraph(drafter),
            C.DRAFT_BLOCK: lambda: DraftBlockGraph(drafter, target)}[graph]()
