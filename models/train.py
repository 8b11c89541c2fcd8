"""Training a DFlash drafter against a frozen target (the library behind `train-draft`).

Data: prompts -> the target's own continuations (greedy; optionally a short sampled prefix
first, for diversity), generated in batched passes and cached on disk in shards.

One training step takes a few sequences of equal length and, for each:
- runs the frozen target once to get its taps at every position;
- runs the drafter's context projection once over the whole sequence (`context_kv`);
- picks many random anchors `a` in the greedy part; each block `[tok[a], MASK, ...]` at
  positions `a..a+K-1` attends to context positions `< a` (the anchor's own features
  do not exist yet at inference) plus its whole block, non-causally;
- the labels are the target's continuation `tok[a+1..a+K-1]`, weighted per position
  by `w_k = exp(-(k-1)/gamma)`: early positions matter most, since one miss ends the round.

The drafter borrows the target's embedding and LM head; both stay frozen.
Only real speculative decoding on held-out prompts (`real_tau`) measures the result;
teacher-forced accuracy per block position is reported beside it as a diagnostic.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from ..runtime.errors import DFlashError
from .generate import autoregressive_generate, speculative_generate
from .layers import apply_rope, attend, rope_cos_sin

# -- data ------------------------------------------------------------------------------


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


def _fast_forward(target, ids: torch.Tensor, pos: torch.Tensor, kc: list, vc: list, length: int) -> torch.Tensor:
    """Target forward over new tokens, writing K/V in place into [B, Hkv, max_len, D] buffers.

    Same math as `Target.forward` (last position's logits only), without re-concatenating
    the cache or repeating K/V per query group at every step: batched generation is
    memory-bound on those copies on CPU.
    """
    x = target.embed(ids)
    b, s, _ = x.shape
    cos, sin = rope_cos_sin(pos, target.inv_freq, x.dtype)
    end = length + s
    visible = torch.arange(end)[None, :] <= (length + torch.arange(s))[:, None]
    for i, layer in enumerate(target.model.layers):
        a = layer.self_attn
        q, k, v = a.qkv(layer.input_layernorm(x), cos, sin)
        kc[i][:, :, length:end] = k.transpose(1, 2)
        vc[i][:, :, length:end] = v.transpose(1, 2)
        g = a.h // a.hkv
        qg = q.view(b, s, a.hkv, g, a.d).permute(0, 2, 3, 1, 4).reshape(b, a.hkv, g * s, a.d)
        scores = qg @ kc[i][:, :, :end].transpose(2, 3) * (a.d**-0.5)  # [B, Hkv, G*S, end]
        scores = scores.view(b, a.hkv, g, s, end).masked_fill(~visible, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), -1).to(x.dtype).view(b, a.hkv, g * s, end)
        out = (probs @ vc[i][:, :, :end]).view(b, a.hkv, g, s, a.d).permute(0, 3, 1, 2, 4).reshape(b, s, a.h * a.d)
        x = x + a.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return target.lm_head(target.model.norm(x[:, -1])).float()


@torch.inference_mode()
def continue_batch(
    target,
    prompts: torch.Tensor,
    new_tokens: int,
    sample_prefix: int = 0,
    temperature: float = 1.0,
    stop_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> Shard:
    """Batched continuation [B, P] -> [B, P + new] in fp32: `sample_prefix` sampled tokens, then greedy.

    fp32: the labels must be the greedy tokens the fp32 target picks at inference (bf16
    flips near-ties, and was no faster here for batched 1-token steps).
    """
    b, p = prompts.shape
    c = target.config
    total = p + new_tokens
    kc = [torch.zeros(b, c.num_kv_heads, total, c.head_dim) for _ in range(c.num_layers)]
    vc = [torch.zeros(b, c.num_kv_heads, total, c.head_dim) for _ in range(c.num_layers)]
    ids, pos, length = prompts, torch.arange(p)[None].expand(b, p), 0
    out = [prompts]
    for i in range(new_tokens):
        last = _fast_forward(target, ids, pos, kc, vc, length)
        length += ids.shape[1]
        if i < sample_prefix:
            ids = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator)
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
    return Shard(tokens, p + sample_prefix, length_t)


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
) -> list[Shard]:
    """One shard per prompt batch, each saved as it is made; existing shards are reused.

    With `seconds` > 0, stops making new shards once that much time has passed (at least one).
    """
    import time

    cache_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    t0 = time.time()
    for i, prompts in enumerate(batches):
        path = cache_dir / f"shard-{i:05d}.pt"
        if seconds and shards and time.time() - t0 > seconds and not path.is_file():
            break
        made = 0
        if path.is_file():
            d = torch.load(path)
            shards.append(Shard(d["tokens"], d["start"], d["length"]))
        else:
            g = torch.Generator().manual_seed(seed * 100003 + i)
            sp = sample_prefix if i % 2 else 0  # half the shards pure greedy, half sampled-then-greedy
            s = continue_batch(target, prompts, new_tokens, sp, stop_ids=stop_ids, generator=g)
            tmp = path.with_suffix(".tmp")
            torch.save({"tokens": s.tokens, "start": s.start, "length": s.length}, tmp)
            tmp.replace(path)
            shards.append(s)
            made = int(s.tokens.shape[0] * new_tokens)
        if progress is not None:
            progress(i + 1, len(batches), made)  # tokens/s counts generated tokens, not cache hits
    return shards


# -- the training forward --------------------------------------------------------------


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for the K-1 predicted positions k = 1..K-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def context_visible(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[N, 1, C+K] bool: context positions strictly before each anchor, and the whole block."""
    ctx = torch.arange(context_len)[None, :] < anchors[:, None]
    blk = torch.ones(len(anchors), block_size, dtype=torch.bool)
    return torch.cat([ctx, blk], 1)[:, None, :]


def block_logits(drafter, target, ctx_kv, seq_index: torch.Tensor, block_ids: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Draft logits [N, K-1, V] for N blocks, block i over context `ctx_kv[seq_index[i]]` before anchor i.

    The same computation as `Drafter.block` + `draft_logits` at inference, with a per-block
    context mask instead of a per-block context cache.
    """
    n, k = block_ids.shape
    x = target.embed(block_ids)
    positions = anchors[:, None] + torch.arange(k)[None]
    cos, sin = rope_cos_sin(positions, drafter.inv_freq, x.dtype)
    visible = context_visible(anchors, ctx_kv[0][0].shape[1], k)
    for j, layer in enumerate(drafter.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(a.q_norm(a.q_proj(h).view(n, k, a.h, a.d)), cos, sin)
        kb, vb = a.kv(h, cos, sin)
        keys = torch.cat([ctx_kv[j][0][seq_index].to(kb.dtype), kb], 1)
        values = torch.cat([ctx_kv[j][1][seq_index].to(vb.dtype), vb], 1)
        x = x + a.o_proj(attend(q, keys, values, visible))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return target.lm_head(drafter.norm(x)[:, 1:]).float()


def sample_anchors(shard: Shard, rows: torch.Tensor, per_seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_index [N], anchors [N]): `per_seq` anchors per row, in [start-1, length-2]."""
    lo = max(shard.start - 1, 0)
    seq_index, anchors = [], []
    for r, row in enumerate(rows.tolist()):
        hi = int(shard.length[row]) - 2  # at least one label after the anchor
        if hi < lo:
            continue
        a = torch.randint(lo, hi + 1, (per_seq,), generator=gen)
        seq_index.append(torch.full((per_seq,), r))
        anchors.append(a)
    if not anchors:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(seq_index), torch.cat(anchors)


def block_batch(tokens: torch.Tensor, length: torch.Tensor, seq_index: torch.Tensor, anchors: torch.Tensor,
                block_size: int, mask_token_id: int):
    """Block ids [N,K] = [anchor, MASK...], labels [N,K-1], valid [N,K-1] (inside the sequence)."""
    k = block_size
    offs = anchors[:, None] + torch.arange(1, k)[None]
    valid = offs < length[seq_index][:, None]
    labels = tokens[seq_index[:, None], offs.clamp(max=tokens.shape[1] - 1)]
    block = torch.full((len(anchors), k), mask_token_id, dtype=torch.long)
    block[:, 0] = tokens[seq_index, anchors]
    return block, labels, valid


def draft_step(target, drafter, tokens: torch.Tensor, length: torch.Tensor, seq_index: torch.Tensor,
               anchors: torch.Tensor, block_size: int, mask_token_id: int, weights: torch.Tensor,
               autocast: bool = True):
    """-> (weighted loss, correct [N,K-1] bool, valid [N,K-1] bool) for blocks at `anchors`."""
    b, t = tokens.shape
    pos = torch.arange(t)[None].expand(b, t)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            _, taps, _ = target(tokens, pos, target.empty_kv(b))  # once per sequence
        ctx_kv = drafter.context_kv(taps, pos)  # once per sequence, shared by all its blocks
        block, labels, valid = block_batch(tokens, length, seq_index, anchors, block_size, mask_token_id)
        logits = block_logits(drafter, target, ctx_kv, seq_index, block, anchors)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
    w = weights[None, :] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    return loss, logits.argmax(-1) == labels, valid


def accepted_prefix(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per block: the number of leading correct drafts (a teacher-forced acceptance length - 1)."""
    ok = (correct & valid).int()
    return ok.cumprod(1).sum(1)


# -- evaluation ------------------------------------------------------------------------


@torch.no_grad()
def teacher_forced(target, drafter, shards: list[Shard], block_size: int, mask_token_id: int,
                   weights: torch.Tensor, per_seq: int = 32, seed: int = 0) -> dict:
    """Held-out teacher-forced loss, accuracy per block position and tau on cached continuations."""
    gen = torch.Generator().manual_seed(seed)
    correct = torch.zeros(block_size - 1)
    count = torch.zeros(block_size - 1)
    losses, prefixes = [], []
    for s in shards:
        rows = torch.arange(s.tokens.shape[0])
        seq_index, anchors = sample_anchors(s, rows, per_seq, gen)
        if len(anchors) == 0:
            continue
        loss, ok, valid = draft_step(target, drafter, s.tokens, s.length, seq_index, anchors, block_size,
                                     mask_token_id, weights)
        losses.append(loss.item())
        correct += (ok & valid).sum(0).float()
        count += valid.sum(0).float()
        full = valid.all(1)  # tau only over blocks that fit inside the sequence
        prefixes.append(accepted_prefix(ok, valid)[full].float())
    acc = (correct / count.clamp(min=1)).tolist()
    pre = torch.cat(prefixes) if prefixes else torch.zeros(1)
    return {"tf_loss": float(np.mean(losses)) if losses else float("nan"),
            "tf_acc": [round(a, 4) for a in acc], "tf_tau": round(1 + pre.mean().item(), 3)}


def real_tau(target, drafter, prompts: list[list[int]], max_new_tokens: int, mask_token_id: int,
             block_size: int, stop_ids: tuple[int, ...] = ()) -> dict:
    """Real speculative decoding (the reference generator, greedy) on held-out prompts."""
    lengths, per_prompt = [], []
    for p in prompts:
        g = speculative_generate(target, drafter, p, max_new_tokens, mask_token_id=mask_token_id,
                                 block_size=block_size, stop_token_ids=stop_ids)
        lengths += g.acceptance_lengths
        per_prompt.append(round(g.tau, 2))
    hist = np.bincount(lengths, minlength=block_size + 1)[1:].tolist() if lengths else []
    return {"real_tau": round(float(np.mean(lengths)), 3) if lengths else 0.0, "rounds": len(lengths),
            "per_prompt_tau": per_prompt, "accept_hist": hist}


# -- schedule and checkpoints ----------------------------------------------------------


@dataclass
class Schedule:
    """Linear warmup, then cosine to 10% over the budget (steps, or seconds when `steps` is 0)."""

    lr: float
    warmup: int = 50
    steps: int = 0
    seconds: float = 0.0

    def fraction(self, step: int, elapsed: float) -> float:
        return step / self.steps if self.steps else elapsed / max(self.seconds, 1e-9)

    def __call__(self, step: int, elapsed: float) -> float:
        f = min(self.fraction(step, elapsed), 1.0)
        return self.lr * min(1.0, (step + 1) / self.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * f)))


@dataclass
class TrainState:
    step: int = 0
    elapsed: float = 0.0
    tokens: int = 0
    log: list = field(default_factory=list)


def save_checkpoint(path: Path, drafter, opt, state: TrainState, gen: torch.Generator) -> None:
    """Everything to resume, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"drafter": drafter.state_dict(), "opt": opt.state_dict(), "step": state.step,
                "elapsed": state.elapsed, "tokens": state.tokens, "log": state.log,
                "gen": gen.get_state(), "config": drafter.config.raw}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path, drafter, opt, gen: torch.Generator) -> TrainState:
    d = torch.load(path, weights_only=False)
    if d["config"] != drafter.config.raw:
        raise DFlashError(f"checkpoint {path} was made with another drafter config; drop --resume or use the same options")
    drafter.load_state_dict(d["drafter"])
    opt.load_state_dict(d["opt"])
    gen.set_state(d["gen"])
    return TrainState(d["step"], d["elapsed"], d["tokens"], d["log"])
