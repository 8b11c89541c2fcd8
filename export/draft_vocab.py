"""A reduced draft vocabulary: the N target tokens the drafter's head scores (`export --draft-vocab N`).

At the Qwen3-0.6B shape the drafter's LM head over 15 block positions and 152k tokens is
~90% of a draft. Scoring only the N most frequent tokens (a gathered [N, H] slice of the
head, stored once in draft_block.data) cuts that cost by V/N; the block graph maps its
argmax back to target ids. Lossless: the target verifies every draft, so a token outside
the N only ends a round early, it never changes the output.

The counts come from `--draft-vocab-data FILE...`:
- `*.pt` / a directory of them: `train-draft`'s cached generations (`shard-*.pt`: the
  target's own greedy continuations, the best estimate of what the drafter must propose);
- `*.jsonl`: a `tokens` (or `ids`) list of target ids per line, or a `text` / `prompt`
  field tokenized with the target's tokenizer;
- any other file: plain text, tokenized with the target's tokenizer.
Without data the fallback is the N lowest ids: BPE vocabularies (GPT-2, Llama, Qwen) are
built merge by merge, so low ids are the bytes and the earliest, most frequent merges.
The stop tokens are always kept (a draft can end the text).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..runtime.errors import DFlashError
from ..runtime.files import read_bytes, readable
from ..runtime.lazy import lazy_import

torch = lazy_import("torch")  # on first use (runtime/lazy.py)

FALLBACK = "fallback: the lowest ids (BPE merge order) plus the stop tokens"


def _ids_from_shards(paths: list[Path], counts: np.ndarray) -> None:
    for p in paths:
        try:
            s = torch.load(p, map_location="cpu", weights_only=True)
            tokens, start, length = s["tokens"], int(s["start"]), s["length"]
        except Exception as e:  # torch raises many types for a bad file
            raise DFlashError(f"--draft-vocab-data {p}: not a train-draft shard ({type(e).__name__}); "
                              "pass shard-*.pt files, a .jsonl or a text file") from None
        for row, n in zip(tokens, length.tolist()):
            _add(counts, row[start:n].numpy(), p)


def _add(counts: np.ndarray, ids, source) -> None:
    ids = np.asarray(ids, dtype=np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= counts.size):
        raise DFlashError(f"--draft-vocab-data {source}: token id {int(ids.max())} is outside the target's "
                          f"vocabulary [0, {counts.size}); was it made for another model?")
    counts += np.bincount(ids, minlength=counts.size)


def _tokenizer(target_dir: Path, source: Path):
    f = Path(target_dir) / "tokenizer.json"
    if not f.is_file():
        raise DFlashError(f"--draft-vocab-data {source} is text, but the target has no tokenizer.json to "
                          "tokenize it; pass token ids (.jsonl with a 'tokens' list, or train-draft shards)")
    return Tokenizer.from_file(str(readable(f)))


def count_tokens(files: list[str | Path], target_dir: str | Path, vocab_size: int) -> tuple[np.ndarray, str]:
    """Token counts over the data files -> (counts [V], a one-line description of the source)."""
    counts = np.zeros(vocab_size, np.int64)
    tok = None
    names = []
    for p in map(Path, files):
        if p.is_dir():
            shards = sorted(p.rglob("shard-*.pt"))
            if not shards:
                raise DFlashError(f"--draft-vocab-data {p}: a directory without train-draft shards (shard-*.pt)")
            _ids_from_shards(shards, counts)
        elif not p.is_file():
            raise DFlashError(f"--draft-vocab-data {p} does not exist")
        elif p.suffix == ".pt":
            _ids_from_shards([p], counts)
        elif p.suffix == ".jsonl":
            for n, line in enumerate(read_bytes(p, what="--draft-vocab-data ").decode("utf-8", errors="replace").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    ids = row.get("tokens", row.get("ids"))
                    text = None if ids is not None else row.get("text", row.get("prompt"))
                except (json.JSONDecodeError, AttributeError):
                    row, ids, text = None, None, None
                if ids is None and not isinstance(text, str):
                    raise DFlashError(f"--draft-vocab-data {p}:{n}: not a JSON object with a 'tokens' list "
                                      "or a 'text' field")
                if ids is None:
                    tok = tok or _tokenizer(target_dir, p)
                    ids = tok.encode(text).ids
                try:
                    _add(counts, ids, f"{p}:{n}")
                except (TypeError, ValueError):
                    raise DFlashError(f"--draft-vocab-data {p}:{n}: 'tokens' must be a list of integer ids") from None
        else:
            tok = tok or _tokenizer(target_dir, p)
            _add(counts, tok.encode(read_bytes(p, what="--draft-vocab-data ").decode("utf-8", errors="replace")).ids, p)
        names.append(p.name)
    total = int(counts.sum())
    if total == 0:
        raise DFlashError(f"--draft-vocab-data {', '.join(map(str, files))}: no tokens found")
    return counts, f"data: {total} tokens ({int((counts > 0).sum())} distinct) from {', '.join(names)}"


def choose(n: int, vocab_size: int, keep: list[int], counts: np.ndarray | None = None) -> np.ndarray:
    """The N ids, ascending: `keep` (stop tokens), then the most frequent (ties: lower id),
    then the lowest ids not yet chosen when the data has fewer than N distinct tokens."""
    keep = sorted({int(k) for k in keep if 0 <= int(k) < vocab_size})
    if not len(keep) < n < vocab_size:
        raise DFlashError(f"--draft-vocab {n} must be between {len(keep) + 1} and {vocab_size - 1} "
                          f"(the target's vocabulary is {vocab_size}; leave --draft-vocab out for all of it)")
    order = np.arange(vocab_size) if counts is None else np.lexsort((np.arange(vocab_size), -counts))
    if counts is not None:  # seen tokens by count, then unseen ones by id (the fallback order)
        order = np.concatenate([order[counts[order] > 0], order[counts[order] == 0]])
    chosen = dict.fromkeys(keep)
    for i in order:
        if len(chosen) >= n:
            break
        chosen.setdefault(int(i))
    return np.array(sorted(chosen), np.int64)


def coverage(ids: np.ndarray, counts: np.ndarray | None) -> float | None:
    """Share of the data's tokens inside the chosen ids (None without data)."""
    if counts is None:
        return None
    return float(counts[ids].sum() / max(1, counts.sum()))
