"""Training data for a drafter: prompts -> the target's own continuations, cached in shards.

The target continues each prompt greedily (optionally after a short sampled prefix, for
diversity), in batched passes over a static KV cache (models/kvcache.py); every batch is
saved as a shard on disk as soon as it is made, so an interrupted run resumes from there.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from torch.nn import functional as F

from ..models.layers import rope_cos_sin
from ..runtime.errors import DFlashError


def read_prompts(paths: list[str | Path], chunk_chars: tuple[int, int] = (200, 600), seed: int = 0) -> list[str]:
    """Prompts from JSONL files (`prompt` or `text` field) or plain text files (line-bounded chunks)."""
    rng = random.Random(seed)
    out: list[str] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise DFlashError(f"data file {p} does not exist")
        text = p.read_text(encoding="utf-8", errors="replace")
        if p.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    out.append(row["prompt"] if "prompt" in row else row["text"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DFlashError(f"{p}:{n}: not a JSON object with a 'prompt' or 'text' field") from None
        else:
            lines = text.splitlines(keepends=True)
            i = 0
            while i < len(lines):
                j, size, want = i, 0, rng.randint(*chunk_chars)
                while j < len(lines) and size < want:
                    size += len(lines[j])
                    j += 1
                if "".join(lines[i:j]).strip():
                    out.append("".join(lines[i:j]))
                i = j
    out = [s for s in out if s.strip()]
    if not out:
        raise DFlashError(f"no prompts found in {', '.join(map(str, paths))}")
    return out


@dataclass
class Shard:
    """Sequences generated together: equal length, greedy from index `start` on."""

    tokens: torch.Tensor  # [B, T] int64: prompt + continuation
    start: int  # first greedy-generated position (anchors are >= start - 1)
    length: torch.Tensor  # [B] valid length (cut after the first stop token)
    taps: torch.Tensor | None = None  # [B, T, taps*H] bf16: the target's features, captured while generating


@torch.inference_mode()
def continue_batch(
    target,
    prompts: torch.Tensor,
    new_tokens: int,
    sample_prefix: int = 0,
    temperature: float = 1.0,
    stop_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    bf16: bool = False,
    deadline: float = 0.0,
) -> Shard:
    """Batched continuation [B, P] -> [B, P + new]: `sample_prefix` sampled tokens, then greedy.
    With a `deadline` (time.time()), stops there: fewer new tokens (at least 16).

    fp32 by default: the labels are then the greedy tokens the fp32 target picks at inference.
    `bf16` (autocast) flips a few near-ties, and is worth it only where it is much faster.
    The target's taps at every position come along (`Shard.taps`, bf16), so training never runs
    the target again: one more step feeds the last token to get its features too.
    """
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return _continue(target, prompts, new_tokens, sample_prefix, temperature, stop_ids, generator, deadline)


class _HeadMajorCache:
    """Static K/V buffers [B, Hkv, max_len, D] per layer, the layout attention reads without a copy.

    `Target.hidden` over a KVCache (sequence-major, the runtime's layout) copies each layer's
    whole K and V into this layout at every step: at batch 64 that was a quarter of generation.
    """

    def __init__(self, target, batch: int, max_len: int):
        c = target.config
        shape = (batch, c.num_kv_heads, max_len, c.head_dim)
        # under bf16 autocast attention reads bf16 anyway: keep the cache in it (no conversion per step)
        dt = torch.bfloat16 if torch.is_autocast_enabled("cpu") else next(target.parameters()).dtype
        self.kv = [(torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)) for _ in range(c.num_layers)]
        self.length = 0

    def commit(self, n: int) -> None:
        self.length += n


def _hidden(target, ids: torch.Tensor, pos: torch.Tensor, cache: _HeadMajorCache):
    """`Target.hidden` on a head-major cache (SDPA): -> (last hidden state, taps); writes the new K/V."""
    b, s = ids.shape
    p, end = cache.length, cache.length + s
    x = target.embed(ids)
    cos, sin = rope_cos_sin(pos, target.inv_freq, x.dtype, target.config.rope.attention_factor)
    outs = {}
    for i, layer in enumerate(target.model.layers):
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
        kc, vc = cache.kv[i]
        kc[:, :, p:end] = k.transpose(1, 2)
        vc[:, :, p:end] = v.transpose(1, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2).to(kc.dtype), kc[:, :, :end], vc[:, :, :end],
                                           is_causal=s > 1, enable_gqa=True)  # s > 1 only as the prefill (p = 0)
        x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        outs[i] = x
    return target.final(outs)


def _continue(target, prompts, new_tokens, sample_prefix, temperature, stop_ids, generator, deadline) -> Shard:
    b, p = prompts.shape
    hybrid = hasattr(target, "new_cache")  # K/V plus committed DeltaNet states (models/qwen35.py)
    cache = target.new_cache(p + new_tokens + 1, batch=b) if hybrid else _HeadMajorCache(target, b, p + new_tokens + 1)
    ids, pos = prompts, torch.arange(p)[None].expand(b, p)
    out, feats = [prompts], []
    for i in range(new_tokens + 1):
        final = i == new_tokens or (deadline > 0 and i >= min(new_tokens, 16) and time.time() > deadline)
        if hybrid:
            logits, taps, _ = target(ids, pos, cache)
            last = logits[:, -1]
        else:
            x, taps = _hidden(target, ids, pos, cache)
            last = None if final else target.logits(x[:, -1])  # only the last position's logits: [B, V]
        feats.append(taps.to(torch.bfloat16))
        cache.commit(ids.shape[1])
        if final:
            break
        length = cache.length
        if i < sample_prefix:
            ids = torch.multinomial(torch.softmax(last.float() / temperature, -1), 1, generator=generator)
        else:
            ids = last.argmax(-1, keepdim=True)
        out.append(ids)
        pos = torch.full((b, 1), length, dtype=torch.long)
    tokens = torch.cat(out, 1)
    length_t = torch.full((b,), tokens.shape[1], dtype=torch.long)
    if stop_ids:
        gen = tokens[:, p:]
        hit = torch.isin(gen, torch.tensor(stop_ids))
        first = torch.where(hit.any(1), hit.float().argmax(1), torch.full((b,), gen.shape[1]))
        length_t = torch.minimum(length_t, p + first + 1)
    return Shard(tokens, p + sample_prefix, length_t, torch.cat(feats, 1))


def target_fingerprint(target_dir: Path) -> str:
    """Changes when the target's weights or config change (cache key)."""
    h = hashlib.sha256()
    for f in sorted(target_dir.glob("*.safetensors")) + [target_dir / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def bucket_batches(prompt_ids: list[list[int]], batch: int, min_len: int, max_len: int, seed: int) -> list[torch.Tensor]:
    """Group prompts of similar token length; cut each batch (from the left) to its shortest."""
    rows = [ids[-max_len:] for ids in prompt_ids if len(ids) >= min_len]
    rows.sort(key=len)
    batches = []
    for i in range(0, len(rows), batch):
        group = rows[i : i + batch]
        n = min(len(r) for r in group)
        batches.append(torch.tensor([r[len(r) - n :] for r in group]))
    random.Random(seed).shuffle(batches)
    return batches


def shard_name(i: int, prompts: torch.Tensor) -> str:
    """A shard's cache name: its index (seeds and sampling depend on it) and its prompts."""
    return f"shard-{i:05d}-{hashlib.sha256(prompts.numpy().tobytes()).hexdigest()[:10]}"


def generate_shards(
    target,
    batches: list[torch.Tensor],
    cache_dir: Path,
    new_tokens: int,
    sample_prefix: int,
    stop_ids: tuple[int, ...],
    seed: int,
    progress=None,
    seconds: float = 0.0,
    bf16: bool = False,
    on_features=None,
) -> tuple[list[Shard], list[str], int]:
    """One shard per prompt batch, each saved as it is made; existing shards are reused.

    A shard's file is named by its batch's content and index (the folder by the settings), so
    any run whose prompts batch the same way finds it. With `seconds` > 0, stops making new
    shards once that much time has passed (at least one), and cuts the batch under way short at
    that time (such a shard is used but not cached). `on_features(name, taps, complete)` receives
    each new shard's captured features (they depend on the tap layers too, so they are kept
    elsewhere: train/cache.py). -> (shards without their taps, their names, number made now).
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    shards, names, made_now = [], [], 0
    t0 = time.time()
    for i, prompts in enumerate(batches):
        name = shard_name(i, prompts)
        path = cache_dir / f"{name}.pt"
        if seconds and shards and time.time() - t0 > seconds and not path.is_file():
            break
        made = 0
        if path.is_file():
            d = torch.load(path)
            shards.append(Shard(d["tokens"], d["start"], d["length"]))
        else:
            g = torch.Generator().manual_seed(seed * 100003 + i)
            sp = sample_prefix if i % 2 else 0  # half the shards pure greedy, half sampled-then-greedy
            s = continue_batch(target, prompts, new_tokens, sp, stop_ids=stop_ids, generator=g, bf16=bf16,
                               deadline=t0 + seconds if seconds else 0.0)
            complete = s.tokens.shape[1] == prompts.shape[1] + new_tokens
            if complete:
                tmp = path.with_suffix(".tmp")
                torch.save({"tokens": s.tokens, "start": s.start, "length": s.length}, tmp)
                tmp.replace(path)
            else:
                name += "-partial"
            if on_features is not None:
                on_features(name, s.taps, complete)
            shards.append(Shard(s.tokens, s.start, s.length))
            made = int(s.tokens.shape[0] * new_tokens)
            made_now += 1
        names.append(name)
        if progress is not None:
            progress(i + 1, len(batches), made)  # tokens/s counts generated tokens, not cache hits
    return shards, names, made_now


def default_taps(num_layers: int) -> list[int]:
    """Up to 5 layers spread over [1, L-2] (an early, some middle, a late one)."""
    if num_layers < 3:
        return list(range(num_layers))
    hi = num_layers - 2
    n = min(5, hi)
    return sorted({round(1 + i * (hi - 1) / max(n - 1, 1)) for i in range(n)})


def load_tokenizer(target_dir: Path):
    path = target_dir / "tokenizer.json"
    if not path.is_file():
        raise DFlashError(f"target {target_dir} has no tokenizer.json; train-draft needs it to tokenize --data")
    return Tokenizer.from_file(str(path))


def resolve_mask_id(target_dir: Path, tok, override: int | None, vocab: int) -> int:
    """--mask-token-id, else the tokenizer's mask token (tokenizer_config.json `mask_token`, or `<|mask|>`)."""
    if override is None:
        name = None
        cfg = target_dir / "tokenizer_config.json"
        if cfg.is_file():
            m = json.loads(cfg.read_text()).get("mask_token")
            name = m.get("content") if isinstance(m, dict) else m
        override = tok.token_to_id(name or "<|mask|>")
        if override is None:
            raise DFlashError(f"target {target_dir}: the tokenizer has no mask token; pass --mask-token-id ID "
                              "(a token id the target never produces, e.g. a reserved special token)")
    if not 0 <= override < vocab:
        raise DFlashError(f"mask token id {override} is outside the target's vocabulary [0, {vocab})")
    return int(override)
