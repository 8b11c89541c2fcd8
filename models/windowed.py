"""gpt-oss and Gemma 4 targets: decoders whose layers are sliding-window or full attention.

Same contract as `Target` (one forward for prefill chunks, steps and verifies; taps; only the
new positions' K/V come back), with what these families add (config.Windowed):

- per layer kind (`sliding_attention` / `full_attention`) its own K/V shape, RoPE and window;
  a sliding layer's query sees the keys within `window` positions, its own included;
- gpt-oss: q/k/v/o biases, YaRN RoPE with its attention factor, attention sinks (a learned
  per-head logit in the softmax's denominator), and a mixture-of-experts MLP (models/gpt_oss.py);
- Gemma 4 (models/gemma4.py): embeddings times sqrt(hidden), q/k/v RMSNorms, scores not scaled,
  partial "proportional" RoPE on full layers, V = K's projection on full layers (k_eq_v), layers
  that attend to an earlier layer's K/V (KV sharing: no cache of their own), per-layer input
  embeddings, four norms per layer and a learned layer scalar, logits soft-capped.

The past of a layer is (k, v) [B, P, Hkv, D] of its kind, or None for a KV-sharing layer.
`slots` gives, per kind, the position each past slot holds ([B, P], < 0: empty): a prefix
(slot = position) and the runtime's ring of a sliding layer (position t in slot t mod ring,
runtime/window.py) are read the same way, and masks come from positions
(layers.position_visible), never from slot indices.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .checkpoint import strict_load
from .config import TargetConfig
from .kvcache import KVCache
from .layers import apply_rope, attend, position_visible, rope_cos_sin

SLIDING, FULL = "sliding_attention", "full_attention"


class Norm(nn.Module):
    """RMSNorm computed in fp32 and scaled there (Gemma 4's and gpt-oss's own order); `scale`
    False: no weight (Gemma 4's value norm and router norm)."""

    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # the form ORT fuses
        return (h * self.weight.float() if self.weight is not None else h).to(x.dtype)


class WindowAttention(nn.Module):
    """One layer's attention, of its kind; a KV-sharing layer has only its queries and output."""

    def __init__(self, c: TargetConfig, kind: str, shared: bool):
        super().__init__()
        w, k = c.windowed, c.windowed.kinds[kind]
        self.h, self.hkv, self.d, self.window = c.num_heads, k.num_kv_heads, k.head_dim, k.window
        self.scale = w.attention_scale
        gemma = w.family == "gemma4"
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=c.qkv_bias)
        if not shared:
            self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
            if not (w.k_eq_v and kind == FULL):
                self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=c.o_bias)
        if gemma:
            self.q_norm = Norm(self.d, c.rms_norm_eps)
            if not shared:
                self.k_norm = Norm(self.d, c.rms_norm_eps)
                self.v_norm = Norm(self.d, c.rms_norm_eps, scale=False)
        if w.sinks:
            self.sinks = nn.Parameter(torch.zeros(self.h))
        self.shared, self.gemma = shared, gemma

    def project(self, x, cos, sin):
        """Queries [B,S,H,D] and, unless KV-sharing, this step's keys/values [B,S,Hkv,D]."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.h, self.d)
        q = apply_rope(self.q_norm(q) if self.gemma else q, cos, sin)
        if self.shared:
            return q, None
        k = self.k_proj(x).view(b, s, self.hkv, self.d)
        v = self.v_proj(x).view(b, s, self.hkv, self.d) if hasattr(self, "v_proj") else k  # k_eq_v: the raw K
        if self.gemma:
            k, v = self.k_norm(k), self.v_norm(v)
        return q, (apply_rope(k, cos, sin), v)

    def out(self, q, keys, values, visible):
        sinks = self.sinks if hasattr(self, "sinks") else None
        return self.o_proj(attend(q, keys, values, visible, self.scale, sinks))


class WindowCache(KVCache):
    """The oracle's cache: a static buffer per layer that keeps K/V, in that layer's shape
    (KV-sharing layers: None); written by index and committed as models/kvcache.py."""

    def __init__(self, model: "WindowedTarget", max_len: int, batch: int = 1):
        dtype = model.lm_head.weight.dtype
        self.k, self.v = [], []
        for shape in model.kv_shapes():
            for buf in (self.k, self.v):
                buf.append(None if shape is None else torch.zeros(batch, max_len, *shape, dtype=dtype))
        self.length = 0

    def append(self, new) -> None:
        for layer, kv in enumerate(new):
            if kv is not None:
                self.update(layer, *kv)
        self.commit(next(kv for kv in new if kv is not None)[0].shape[1])

    def view(self):
        return [None if k is None else (k[:, : self.length], v[:, : self.length]) for k, v in zip(self.k, self.v)]


class WindowedTarget(nn.Module):
    """The stack, the embedding and the head; each family's layers are its own modules
    (models/gpt_oss.py, models/gemma4.py): `layer(x, attention, extra)` with
    `attention(h) -> attention output` built here, where the caches and masks are."""

    def __init__(self, config: TargetConfig, tap_ids: list[int], body: nn.Module):
        super().__init__()
        self.config = config
        self.tap_ids = list(tap_ids)
        w = config.windowed
        self.kinds = config.layer_types
        self.kv_source = w.kv_source
        for kind, k in w.kinds.items():  # per kind: its frequencies; YaRN's factor scales cos and sin
            self.register_buffer(f"inv_freq_{kind}", k.rope.inv_freq(k.head_dim), persistent=False)
        self.model = body  # the family's embedding, layers and final norm
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- what the export wrappers, the oracle and the runtime's checks read ------------------

    def kv_shapes(self) -> list[tuple[int, int] | None]:
        """Per layer (Hkv, D) of the K/V it keeps, None for a KV-sharing layer."""
        w = self.config.windowed
        return [None if self.kv_source[i] != i else (w.kinds[t].num_kv_heads, w.kinds[t].head_dim)
                for i, t in enumerate(self.kinds)]

    def new_cache(self, max_len: int, batch: int = 1) -> WindowCache:
        return WindowCache(self, max_len, batch)

    def empty_kv(self, batch: int = 1) -> list:
        return self.new_cache(0, batch).view()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The raw table lookup (the drafter's block embedding, as z-lab reads the target's table:
        Gemma 4's sqrt(hidden) is the target's own, applied in `hidden`)."""
        return self.model.embed_tokens(ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x).float()
        cap = self.config.windowed.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past):
        """-> logits [B,S,V] (fp32), taps [B,S,T*H], per layer new K/V [B,S,Hkv,D] (None: KV-sharing).
        `past`: a WindowCache (written by index, then commit) or a list of batch-major prefixes."""
        x, taps, new = self.hidden(input_ids, position_ids, past)
        return self.logits(x), taps, new

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past, slots: dict | None = None):
        """The decoder stack: last hidden state (after the final norm), taps, new K/V.

        `slots`: per kind, the position of each past slot [B, P] (< 0: empty); None: the past
        is a prefix of every row (slot = position)."""
        cache = past if isinstance(past, WindowCache) else None
        if cache is None:
            p = {self.kinds[i]: kv[0].shape[1] for i, kv in enumerate(past) if kv is not None}
        b = input_ids.shape[0]
        if slots is None:
            n = cache.length if cache else 0
            slots = {t: torch.arange(n if cache else p[t], device=input_ids.device).expand(b, -1) for t in set(self.kinds)}
        x = self.embed(input_ids)
        w = self.config.windowed
        if w.embed_scale != 1.0:  # in the model dtype, as transformers' scaled embedding
            x = x * torch.tensor(w.embed_scale, dtype=x.dtype)
        extra = self.layer_inputs(input_ids, x)
        rope, visible = {}, {}
        for kind, k in w.kinds.items():
            rope[kind] = rope_cos_sin(position_ids, getattr(self, f"inv_freq_{kind}"), x.dtype, k.rope.attention_factor)
            keys = torch.cat([slots[kind], position_ids], 1)
            visible[kind] = position_visible(position_ids, keys, k.window)
        joined, new, outs = {}, [], {}
        for i, layer in enumerate(self.model.layers):
            kind, attn = self.kinds[i], layer.self_attn

            def attention(h, i=i, kind=kind, attn=attn):
                q, kv = attn.project(h, *rope[kind])
                if kv is not None:
                    k, v = kv
                    if cache:
                        joined[i] = cache.update(i, k, v)
                    else:
                        joined[i] = (torch.cat([past[i][0], k], 1), torch.cat([past[i][1], v], 1))
                    new.append((k, v))
                else:
                    new.append(None)
                return attn.out(q, *joined[self.kv_source[i]], visible[kind])

            x = outs[i] = layer(x, attention, None if extra is None else extra[:, :, i])
        last = len(self.model.layers) - 1
        x = outs[last] = self.model.norm(outs[last])  # transformers' last hidden_states entry is after the norm
        taps = torch.cat([outs[i] for i in self.tap_ids], dim=-1) if self.tap_ids else x[..., :0]
        return x, taps, new

    def layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Per-layer extra inputs [B,S,L,...] (Gemma 4's per-layer embeddings); None: none."""
        return None

    # -- loading -----------------------------------------------------------------------------

    def set_frequencies(self) -> None:
        """The RoPE buffers (meta-initialised modules get them after loading)."""
        for kind, k in self.config.windowed.kinds.items():
            setattr(self, f"inv_freq_{kind}", k.rope.inv_freq(k.head_dim))

    def load(self, state: dict, directory, dtype: torch.dtype) -> "WindowedTarget":
        """The family's state (its names already ours) into the module, strictly; a tied head's
        copy dropped; then the RoPE buffers. Returns the module in eval mode."""
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        for name in tied:
            state.pop(name, None)
        strict_load(self, state, f"target {directory}", dtype, tied=tied)
        self.set_frequencies()
        return self.eval()


def drop_unused(state: dict, prefixes: tuple[str, ...], directory, why: str) -> dict:
    """`state` without the tensors under `prefixes`, with one note of what was dropped."""
    kept = {k: v for k, v in state.items() if not k.startswith(prefixes)}
    if len(kept) != len(state):
        print(f"note: target {directory}: ignoring {len(state) - len(kept)} tensors ({why})", file=sys.stderr)
    return kept
