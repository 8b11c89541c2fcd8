"""What a training run caches under --work, each keyed by exactly what it depends on.

- continuations (train/data.py shards): the target, the training prompts, the generation
  settings and precision. The held-out split never depends on --eval-prompts, so evaluation
  settings never invalidate training data.
- target features (the tapped hidden states of every continuation): the continuations, the tap
  layers and the generation precision. Captured while the target generates (train/data.py), or,
  for continuations that came from the cache without them, computed once per sequence the first
  time a step uses it; kept in memory and on disk (bf16), so a step runs only the drafter.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..runtime.errors import DFlashError
from . import data as D


def key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def progress(console, name: str, total: int):
    """A rich progress bar over generation batches with a tokens/s column, and its update."""
    p = Progress(TextColumn(f"[bold]{name}"), BarColumn(), TextColumn("{task.completed}/{task.total} batches"),
                 TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)
    task = p.add_task(name, total=total, tps="-")
    t0, made = time.time(), [0]

    def update(i, n, new):
        made[0] += new
        p.update(task, completed=i, tps=f"{made[0] / max(time.time() - t0, 1e-9):.0f}")
    return p, update


def split_prompts(cfg, tok) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(training prompt ids, held-out prompt ids, training texts). 5% of --data is always held
    out (so --eval-prompts never changes the training set); --eval-prompts replaces it for evaluation."""
    texts = D.read_prompts(list(cfg.data), seed=cfg.seed)
    random.Random(cfg.seed).shuffle(texts)
    n_eval = max(4, len(texts) // 20)
    if len(texts) <= n_eval:
        raise DFlashError(f"only {len(texts)} prompts in --data; give more data (at least {n_eval + 1} chunks)")
    texts, eval_texts = texts[n_eval:], texts[:n_eval]
    if cfg.eval_prompts:
        eval_texts = D.read_prompts([cfg.eval_prompts], seed=cfg.seed)
    ids = [e.ids for e in tok.encode_batch(texts[: cfg.sequences])]
    eval_ids = [p for p in (e.ids[-cfg.prompt_max_tokens :] for e in tok.encode_batch(eval_texts)) if p]
    if not eval_ids:
        raise DFlashError("no non-empty held-out prompts")
    return ids, eval_ids, texts[: cfg.sequences]


def gen_dirs(cfg, work: Path, gen_precision: str) -> tuple[Path, Path]:
    """(training, held-out) continuation folders, keyed by the target and the generation settings."""
    fp = D.target_fingerprint(Path(cfg.target_dir))
    train = work / f"gen-{key(fp, cfg.gen_tokens, cfg.gen_batch, cfg.sample_prefix, cfg.prompt_max_tokens, cfg.seed, gen_precision)}"
    held = work / f"eval-{key(fp, cfg.gen_tokens, cfg.gen_batch, cfg.prompt_max_tokens, cfg.seed, gen_precision)}"
    return train, held


class FeatureCache:
    """The target's taps per shard row, computed on first use (a row at a time), then reused.

    In memory as bf16 [rows, T, taps*H] per shard; `save` writes the shards that gained rows.
    `limit_bytes` bounds the whole cache: beyond it rows are computed per step and not kept.
    """

    def __init__(self, folder: Path, target, bf16: bool, limit_bytes: float):
        self.folder, self.target, self.bf16, self.limit = folder, target, bf16, limit_bytes
        self.mem: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dirty: set[str] = set()
        self.bytes = 0
        self.captured = self.computed = self.reused = 0

    def _slot(self, name: str, shard) -> tuple[torch.Tensor, torch.Tensor] | None:
        if name not in self.mem:
            path = self.folder / f"{name}.pt"
            if path.is_file():
                d = torch.load(path)
                self.mem[name] = (d["taps"], d["have"])
            else:
                n, t = shard.tokens.shape
                width = len(self.target.tap_ids) * self.target.config.hidden_size
                size = n * t * width * 2
                if self.bytes + size > self.limit:
                    return None
                self.mem[name] = (torch.zeros(n, t, width, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bool))
            self.bytes += self.mem[name][0].numel() * 2
        return self.mem[name]

    @torch.no_grad()
    def _compute(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        pos = torch.arange(t)[None].expand(b, t)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            return self.target(tokens, pos, self.target.empty_kv(b))[1]

    def put(self, name: str, taps: torch.Tensor, save: bool = True) -> None:
        """All rows of a shard, captured during generation: kept (within the limit) and written now
        (`save`; a shard cut short by the time limit is not cached, nor are its features)."""
        if name in self.mem or self.bytes + taps.numel() * 2 > self.limit:
            return
        self.mem[name] = (taps.to(torch.bfloat16), torch.ones(taps.shape[0], dtype=torch.bool))
        self.captured += taps.shape[0]
        self.bytes += taps.numel() * 2
        if save:
            self.dirty.add(name)
            self.save()

    def get(self, name: str, shard, rows: torch.Tensor) -> torch.Tensor:
        """Taps [len(rows), T, taps*H] of `shard.tokens[rows]`."""
        slot = self._slot(name, shard)
        if slot is None:
            self.computed += len(rows)
            return self._compute(shard.tokens[rows])
        taps, have = slot
        miss = rows[~have[rows]]
        if len(miss):
            taps[miss] = self._compute(shard.tokens[miss]).to(torch.bfloat16)
            have[miss] = True
            self.dirty.add(name)
        self.computed += len(miss)
        self.reused += len(rows) - len(miss)
        return taps[rows]

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for name in sorted(self.dirty):
            tmp = self.folder / f"{name}.tmp"
            torch.save({"taps": self.mem[name][0], "have": self.mem[name][1]}, tmp)
            tmp.replace(self.folder / f"{name}.pt")
        self.dirty.clear()
