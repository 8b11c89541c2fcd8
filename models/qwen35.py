"""The hybrid Qwen3.5 / 3.6 text target: Gated DeltaNet layers interleaved with gated attention.

Same contract as `Target` (one forward for prefill chunks, steps and verifies; only the new
positions come back), with per-layer caches that all roll back by length:

- `full_attention` layer: past K/V `[B,P,Hkv,D]` in, the new positions' K/V out.
- `linear_attention` layer: in, the committed conv window `[B,Kc-1,C]` and recurrent state
  `[B,Hv,Dk,Dv]`; out, per new position its conv input `[B,S,C]` and the delta rule's
  `(k [B,S,Hk,Dk], u [B,S,Hv,Dv], g [B,S,Hv])` (models/gdn.py). Committing the first n
  positions (`HybridCache.append`) is the rollback after a rejected draft.

Module and tensor names follow transformers' `Qwen3_5ForCausalLM`, so its state dict loads
as is; a `Qwen3_5ForConditionalGeneration` checkpoint loads its `model.language_model.*`
part (the vision tower and the multi-token-prediction head are not used and skipped).
Semantics as transformers: (1 + w) RMSNorms, partial rotary, sigmoid output gate on attention,
l2-normed q/k in the delta rule, taps = `hidden_states[i + 1]` (the last one after the norm).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..runtime.errors import DFlashError
from . import gdn
from .checkpoint import load_state_dict, strict_load
from .config import TargetConfig
from .layers import attend, causal_visible, rope_cos_sin
from .moe import fuse_experts, mlp_for


class OffsetRMSNorm(nn.Module):
    """transformers' Qwen3_5RMSNorm: weight stored zero-centred, scale (1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over one value head, times silu(z) (the DeltaNet's output norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [B,S,H,D]; the rest pass through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos[:, :, None] + rotated * sin[:, :, None], rest], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.h, self.hkv, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d * 2, bias=c.qkv_bias)  # queries and gates
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=c.o_bias)
        self.q_norm = OffsetRMSNorm(self.d, c.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.d, c.rms_norm_eps)

    def forward(self, x, cos, sin, past_k, past_v, visible):
        b, s, _ = x.shape
        q, gate = self.q_proj(x).view(b, s, self.h, 2 * self.d).chunk(2, dim=-1)
        q = partial_rope(self.q_norm(q), cos, sin)
        k = partial_rope(self.k_norm(self.k_proj(x).view(b, s, self.hkv, self.d)), cos, sin)
        v = self.v_proj(x).view(b, s, self.hkv, self.d)
        out = attend(q, torch.cat([past_k, k], 1), torch.cat([past_v, v], 1), visible)
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, s, -1))), (k, v)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        la = c.linear
        self.hk, self.hv, self.dk, self.dv, self.kc = (
            la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel)
        self.conv_dim = la.conv_dim
        self.in_proj_qkv = nn.Linear(c.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kc, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, c.hidden_size, bias=False)

    def forward(self, x, conv_window, state):
        """x [B,S,H] (S <= gdn.CHUNK) on top of the committed (conv window, state)."""
        b, s, _ = x.shape
        mixed = self.in_proj_qkv(x)  # B S C: what the conv window keeps
        z = self.in_proj_z(x).view(b, s, self.hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x))
        a = self.in_proj_a(x).float() + self.dt_bias
        softplus = torch.where(a > 20, a, torch.log1p(torch.exp(torch.clamp(a, max=20.0))))  # F.softplus
        g = -torch.exp(self.A_log.float()) * softplus  # B S Hv, log decay
        # causal depthwise conv over [window ; new] as Kc shifted multiply-adds (no Conv op)
        seq = torch.cat([conv_window, mixed], 1)
        w = self.conv1d.weight[:, 0]  # C Kc
        conv = sum(seq[:, i : i + s] * w[:, i] for i in range(self.kc))
        q, k, v = F.silu(conv).split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], -1)
        q = gdn.l2norm(q.reshape(b, s, self.hk, self.dk).float()) * self.dk**-0.5
        k = gdn.l2norm(k.reshape(b, s, self.hk, self.dk).float())
        v = v.reshape(b, s, self.hv, self.dv).float()
        rep = self.hv // self.hk  # value head h reads key head h // rep
        heads = lambda t: t.repeat_interleave(rep, dim=2).transpose(1, 2)  # noqa: E731  B H S D
        out, u = gdn.chunk(heads(q), heads(k), v.transpose(1, 2), g.transpose(1, 2), beta.float().transpose(1, 2),
                           state.float())
        out = self.norm(out.transpose(1, 2).to(x.dtype), z)
        return self.out_proj(out.reshape(b, s, -1)), (mixed, k.to(x.dtype), u.transpose(1, 2), g)

    def commit(self, conv_window, state, new, n: int):
        """(conv window, state) after the first n of the new positions."""
        mixed, k, u, g = new
        window = torch.cat([conv_window, mixed[:, :n]], 1)[:, -(self.kc - 1):]
        k = k[:, :n].repeat_interleave(self.hv // self.hk, dim=2)
        return window, gdn.commit(state, k, u[:, :n], g[:, :n])


class HybridLayer(nn.Module):
    def __init__(self, c: TargetConfig, kind: str, i: int):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = GatedAttention(c)
        self.mlp = mlp_for(c, i)  # dense, or Qwen3.5-MoE / Qwen3-Next's experts + shared expert (models/moe.py)
        self.input_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, past, visible):
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            a, new = self.linear_attn(h, past[0], past[1])
        else:
            a, new = self.self_attn(h, cos, sin, past[0], past[1], visible)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), new


class HybridBody(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(c, t, i) for i, t in enumerate(c.layer_types))
        self.norm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)


class HybridCache:
    """Per layer: static K/V buffers [B,max_len,Hkv,D] (attention) or the committed
    (conv window, recurrent state) (linear attention); `append(new, n)` commits n positions."""

    def __init__(self, model: "HybridTarget", max_len: int, batch: int = 1):
        c, w = model.config, model.lm_head.weight
        self.model, self.length, self.layers, self.pending = model, 0, [], None
        for layer in model.model.layers:
            if layer.kind == "linear_attention":
                la = layer.linear_attn
                self.layers.append([w.new_zeros(batch, la.kc - 1, la.conv_dim),
                                    torch.zeros(batch, la.hv, la.dk, la.dv)])
            else:
                self.layers.append([w.new_zeros(batch, max_len, c.num_kv_heads, c.head_dim) for _ in range(2)])

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(a, b) if layer.kind == "linear_attention" else (a[:, : self.length], b[:, : self.length])
                for layer, (a, b) in zip(self.model.model.layers, self.layers)]

    def commit(self, n: int) -> None:
        """Keep n positions of the last forward run on this cache (as models/kvcache.py)."""
        new, self.pending = self.pending, None
        self.append(new, n)

    def append(self, new: list[tuple], n: int | None = None) -> None:
        n = new[0][0].shape[1] if n is None else n
        max_len = next((a.shape[1] for layer, (a, _) in zip(self.model.model.layers, self.layers)
                        if layer.kind != "linear_attention"), None)
        if max_len is not None and self.length + n > max_len:
            raise DFlashError(f"KV cache overflow: {self.length + n} positions > max context {max_len}")
        for layer, buf, upd in zip(self.model.model.layers, self.layers, new):
            if layer.kind == "linear_attention":
                buf[0], buf[1] = layer.linear_attn.commit(buf[0], buf[1], upd, n)
            else:
                buf[0][:, self.length : self.length + n] = upd[0][:, :n]
                buf[1][:, self.length : self.length + n] = upd[1][:, :n]
        self.length += n


class HybridTarget(nn.Module):
    def __init__(self, config: TargetConfig, tap_ids: list[int] = ()):
        super().__init__()
        self.config = config
        self.tap_ids = list(tap_ids)
        self.model = HybridBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", config.rope.inv_freq(config.rotary_dim), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def new_cache(self, max_len: int, batch: int = 1) -> HybridCache:
        return HybridCache(self, max_len, batch)

    def empty_kv(self, batch: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.new_cache(0, batch).view()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: list):
        """-> logits [B,S,V] (fp32), taps [B,S,T*H], per layer the new positions' K/V or GDN tuple.

        S > gdn.CHUNK is split into chunks here (the exported graph takes one chunk per call).
        """
        if isinstance(past, HybridCache):  # the oracle's style: forward on the cache, then commit(n)
            logits, taps, new = self(input_ids, position_ids, past.view())
            past.pending = new
            return logits, taps, new
        s = input_ids.shape[1]
        if s > gdn.CHUNK:
            return self._chunked(input_ids, position_ids, past)
        x, taps, new = self.hidden(input_ids, position_ids, past)
        return self.logits(x), taps, new

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x).float()

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: list,
               past_lengths: torch.Tensor | None = None):
        """One chunk through the stack: last hidden state (after the final norm), taps, new
        K/V or GDN tuples. `past_lengths` [B]: each row's valid attention past (a ragged batch)."""
        s = input_ids.shape[1]
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, x.dtype, self.config.rope.attention_factor)
        p = next((kv[0].shape[1] for layer, kv in zip(self.model.layers, past) if layer.kind != "linear_attention"), 0)
        visible = causal_visible(p, s, past_lengths, x.device)
        outs, new = {}, []
        for i, layer in enumerate(self.model.layers):
            x, upd = layer(x, cos, sin, past[i], visible)
            new.append(upd)
            outs[i] = x
        x = self.model.norm(x)
        outs[len(self.model.layers) - 1] = x  # transformers' last hidden_states entry is after the norm
        taps = torch.cat([outs[i] for i in self.tap_ids], dim=-1) if self.tap_ids else x[..., :0]
        return x, taps, new

    def _chunked(self, input_ids, position_ids, past):
        cache = HybridCache(self, 0)
        cache.layers = [list(kv) for kv in past]  # attention past grows by concatenation here
        logits, taps, news = [], [], []
        for a in range(0, input_ids.shape[1], gdn.CHUNK):
            lg, tp, new = self(input_ids[:, a : a + gdn.CHUNK], position_ids[:, a : a + gdn.CHUNK], cache.layers)
            for layer, buf, upd in zip(self.model.layers, cache.layers, new):
                if layer.kind == "linear_attention":
                    buf[0], buf[1] = layer.linear_attn.commit(buf[0], buf[1], upd, upd[0].shape[1])
                else:
                    buf[0], buf[1] = torch.cat([buf[0], upd[0]], 1), torch.cat([buf[1], upd[1]], 1)
            logits.append(lg), taps.append(tp), news.append(new)
        # linear layers: the per-position tuples are exact across chunks (gdn.commit), so concatenate
        merged = [tuple(torch.cat([n[i][j] for n in news], 1) for j in range(len(news[0][i])))
                  for i in range(len(self.model.layers))]
        return torch.cat(logits, 1), torch.cat(taps, 1), merged

    @classmethod
    def from_pretrained(cls, directory: str | Path, tap_ids: list[int] = (), dtype: torch.dtype = torch.float32):
        config = TargetConfig.load(directory)
        with torch.device("meta"):
            model = cls(config, tap_ids)
        where = f"target {directory}"
        state = language_model_state(load_state_dict(directory, "target"), directory)
        state = fuse_experts(split_qkvz(state, config, where), config, where)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        strict_load(model, state, where, dtype, tied=tied)
        model.inv_freq = config.rope.inv_freq(config.rotary_dim)
        for layer in model.model.layers:  # transformers keeps the DeltaNet's decay parameters in fp32 math
            if layer.kind == "linear_attention":
                la = layer.linear_attn
                la.A_log.data, la.dt_bias.data = la.A_log.float(), la.dt_bias.float()
        return model.eval()


def language_model_state(state: dict[str, torch.Tensor], directory) -> dict[str, torch.Tensor]:
    """The text model's tensors under transformers' Qwen3_5ForCausalLM names.

    ConditionalGeneration checkpoints nest them under `model.language_model.`; their vision
    tower (`model.visual.*`) and any multi-token-prediction head (`mtp.*`) are dropped with a note.
    """
    out, skipped = {}, {"model.visual.": 0, "mtp.": 0}
    for name, t in state.items():
        prefix = next((p for p in skipped if name.startswith(p)), None)
        if prefix:
            skipped[prefix] += 1
            continue
        out[name.replace("model.language_model.", "model.", 1)] = t
    notes = [f"{n} {p}* tensors" for p, n in skipped.items() if n]
    if notes:
        print(f"note: target {directory}: ignoring {' and '.join(notes)} (only the language model is used)",
              file=sys.stderr)
    return out


def split_qkvz(state: dict[str, torch.Tensor], c: TargetConfig, where: str) -> dict[str, torch.Tensor]:
    """Qwen3-Next's fused DeltaNet projections -> Qwen3.5's (the same math, other row order).

    `in_proj_qkvz` holds, per key head, [q (dk), k (dk), v (rep*dv), z (rep*dv)] rows and
    `in_proj_ba` per key head [b (rep), a (rep)] (rep = value heads per key head); Qwen3.5
    keeps q, k, v of all heads in one matrix and z, b, a apart, value head h = key head h // rep
    either way. A pure permutation of rows: nothing is recomputed."""
    la = c.linear
    if la is None:
        return state
    hk, dk, dv, rep = la.num_key_heads, la.key_head_dim, la.value_head_dim, la.num_value_heads // la.num_key_heads
    for name in [n for n in state if n.endswith(".linear_attn.in_proj_qkvz.weight")]:
        prefix = name[: -len("in_proj_qkvz.weight")]
        w, ba = state.pop(name), state.pop(prefix + "in_proj_ba.weight", None)
        want = (hk * (2 * dk + 2 * rep * dv), c.hidden_size)
        if ba is None or tuple(w.shape) != want or tuple(ba.shape) != (hk * 2 * rep, c.hidden_size):
            got = "missing" if ba is None else f"{list(w.shape)} and {list(ba.shape)}"
            raise DFlashError(f"{where}: {prefix}in_proj_qkvz / in_proj_ba are {got}, but the config's linear "
                              f"attention dims say {list(want)} and {[hk * 2 * rep, c.hidden_size]}")
        q, k, v, z = w.view(hk, -1, c.hidden_size).split([dk, dk, rep * dv, rep * dv], dim=1)
        b, a = ba.view(hk, 2 * rep, c.hidden_size).split([rep, rep], dim=1)
        rows = lambda t: t.reshape(-1, c.hidden_size)  # noqa: E731
        state[prefix + "in_proj_qkv.weight"] = torch.cat([rows(q), rows(k), rows(v)], 0)
        state[prefix + "in_proj_z.weight"], state[prefix + "in_proj_b.weight"] = rows(z), rows(b)
        state[prefix + "in_proj_a.weight"] = rows(a)
    return state
