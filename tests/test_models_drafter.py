"""The drafter's split path (`context_kv` into a cache + `block`) against a from-the-paper one.

The reference below is written the way the DFlash paper and z-lab's code describe one
drafter pass: a single forward over `[context features ; block]`, keys/values from
`k_proj/v_proj(hidden_norm(fc(taps)))` and from the block, queries from the block only,
RoPE at the true positions, attention over all of it (full layers: no mask; sliding
layers: causal + window, by position). It shares only the weights with `Drafter`: its own
RoPE, its own masks, torch's SDPA.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from dflash_export.models import KVCache, Target, new_drafter
from dflash_export.models.tiny import make_target

TOL = 1e-4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = make_target(tmp_path_factory.mktemp("t") / "qwen3", arch="qwen3", seed=4, layers=4)
    return Target.from_pretrained(d, tap_ids=[1, 2])


def _rope(x, pos, theta):
    """x [S, H, D] rotated by position (half-split convention), inv_freq from theta."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float()[:, None], torch.cat([ang.sin()] * 2, -1).float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _mask(qpos, kpos, causal: bool, window: int | None):
    vis = torch.ones(len(qpos), len(kpos), dtype=torch.bool)
    dq = qpos[:, None] - kpos[None, :]
    if causal:
        vis &= dq >= 0
    if window is not None:
        vis &= dq < window
        if not causal:
            vis &= -dq < window
    return vis


def reference_draft(drafter, target, taps, ctx_pos, block_ids, block_pos):
    """One forward over [context ; block] (batch 1): final hidden states of the block [K, H]."""
    c = drafter.config
    theta = c.rope.theta
    ctx = drafter.hidden_norm(drafter.fc(taps[0]))  # [C, H]
    x = target.model.embed_tokens(block_ids[0])  # [K, H]
    kpos = torch.cat([ctx_pos[0], block_pos[0]])
    for j, layer in enumerate(drafter.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        both = torch.cat([ctx, h])  # context features skip input_layernorm and the MLP
        q = _rope(a.q_norm(a.q_proj(h).view(len(h), c.num_heads, c.head_dim)), block_pos[0], theta)
        k = _rope(a.k_norm(a.k_proj(both).view(len(both), c.num_kv_heads, c.head_dim)), kpos, theta)
        v = a.v_proj(both).view(len(both), c.num_kv_heads, c.head_dim)
        causal = c.is_causal if c.is_causal is not None else c.layer_types[j] == "sliding_attention"
        window = c.sliding_window if c.layer_types[j] == "sliding_attention" else None
        rep = c.num_heads // c.num_kv_heads
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1),
            attn_mask=_mask(block_pos[0], kpos, causal, window),
        )
        x = x + a.o_proj(out.transpose(0, 1).reshape(len(h), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def _drafter(target, seed, **kw):
    torch.manual_seed(seed)
    d = new_drafter(target.config, target_layer_ids=[1, 2], **kw)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
    return d.eval()


DRAFTERS = {
    "full-1": dict(num_layers=1),
    "full-3-gqa": dict(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=8),
    "sliding+full": dict(num_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         sliding_window=4),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_split_path_matches_one_pass_reference(target, name):
    """Context appended over several rounds (cache) == all at once == the one-pass reference."""
    drafter = _drafter(target, 0, **DRAFTERS[name])
    k, chunks = 6, [7, 3, 1, 5]  # prompt, then rounds accepting 3, 1, 5 positions
    total = sum(chunks)
    g = torch.Generator().manual_seed(1)
    taps = torch.randn(1, total, 2 * target.config.hidden_size, generator=g)
    c = drafter.config
    cache = KVCache(c.num_layers, total + k, c.num_kv_heads, c.head_dim, torch.float32)
    start = 0
    with torch.no_grad():
        for n in chunks:
            pos = torch.arange(start, start + n)[None]
            cache.append(drafter.context_kv(taps[:, start : start + n], pos))
            start += n
            block_ids = torch.tensor([[int(torch.randint(0, 100, (1,), generator=g))] + [99] * (k - 1)])
            block_pos = torch.arange(start, start + k)[None]
            ours = drafter.block(target.embed(block_ids), block_pos, cache.view())[0]
            ref = reference_draft(drafter, target, taps[:, :start], torch.arange(start)[None], block_ids, block_pos)
            assert (ours - ref).abs().max().item() <= TOL, f"round ending at {start}"
            assert ref.std() > 0.1
        # the incrementally built cache equals one context_kv over everything
        whole = drafter.context_kv(taps, torch.arange(total)[None])
        for (ck, cv), (wk, wv) in zip(cache.view(), whole):
            assert (ck - wk).abs().max() <= TOL and (cv - wv).abs().max() <= TOL
        logits = drafter.draft_logits(target, block_ids, block_pos, cache.view())
        assert logits.shape == (1, k - 1, target.config.vocab_size) and logits.dtype == torch.float32


def _block_out(drafter, target, taps, block_ids, start, k):
    with torch.no_grad():
        past = drafter.context_kv(taps, torch.arange(start)[None])
        return drafter.block(target.embed(block_ids), torch.arange(start, start + k)[None], past)[0]


def test_sliding_layers_see_only_their_window(target):
    """All-sliding drafter (window 3): context older than the window and later block
    positions cannot affect an output; a full-attention drafter sees both."""
    window, start, k = 3, 10, 5
    sliding = _drafter(target, 1, num_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=window)
    full = _drafter(target, 1, num_layers=2)
    g = torch.Generator().manual_seed(2)
    taps = torch.randn(1, start, 2 * target.config.hidden_size, generator=g)
    ids = torch.tensor([[5, 99, 99, 99, 99]])
    old = taps.clone()
    old[:, : start - window + 1] += 3.0  # positions <= start - window: outside every block query's window
    recent = taps.clone()
    recent[:, start - 1] += 3.0  # the anchor's predecessor: inside the window
    later = ids.clone()
    later[0, 3] = 7  # a block position after query 0..2
    for d, sees_everything in ((sliding, False), (full, True)):
        base = _block_out(d, target, taps, ids, start, k)
        d_old = (_block_out(d, target, old, ids, start, k) - base).abs().amax(-1)
        d_recent = (_block_out(d, target, recent, ids, start, k) - base).abs().amax(-1)
        d_later = (_block_out(d, target, taps, later, start, k) - base).abs().amax(-1)
        if sees_everything:
            assert d_recent.min() > 1e-3 and d_old.min() > 1e-3 and d_later[:3].min() > 1e-3
        else:  # layer 1: query i sees context position start-1 while i <= window - 2; each
            # further layer reaches window - 1 block positions further
            reach = (window - 2) + (2 - 1) * (window - 1)
            assert d_recent[: reach + 1].min() > 1e-3 and d_recent[reach + 1 :].max() == 0
            assert d_old.max() == 0 and d_later[:3].max() == 0 and d_later[3:].min() > 1e-3


def test_is_causal_false_sliding_is_a_symmetric_window(target):
    """`is_causal: false` (as in the DFlash2 fixture) makes sliding layers bidirectional."""
    d = _drafter(target, 2, num_layers=1, layer_types=["sliding_attention"], sliding_window=2)
    d.config.is_causal = False
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(1, 6, 2 * target.config.hidden_size, generator=g)
    ids = torch.tensor([[5, 99, 99, 99]])
    base = _block_out(d, target, taps, ids, 6, 4)
    ref = reference_draft(d, target, taps, torch.arange(6)[None], ids, torch.arange(6, 10)[None])
    assert (base - ref).abs().max() <= TOL
    later = ids.clone()
    later[0, 1] = 7
    delta = (_block_out(d, target, taps, later, 6, 4) - base).abs().amax(-1)
    assert delta[0] > 1e-3 and delta[3] == 0  # query 0 sees position +1; query 3 is 2 away
