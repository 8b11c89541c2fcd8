"""A tiny target with a character-level tokenizer (reserving <|mask|>), for training tests."""

from __future__ import annotations

import json
import string
from pathlib import Path

from dflash_export.models.tiny import make_target


def make_tokenized_target(directory: str | Path, vocab: int = 101, **kwargs) -> Path:
    """dflash_export.models.tiny's random Qwen3 target plus tokenizer.json: <|endoftext|> 0, <|mask|> 1, then characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    d = make_target(directory, vocab=vocab, **kwargs)
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"][: vocab - 3]
    table = {"<|endoftext|>": 0, "<|mask|>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>", "<|mask|>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "mask_token": "<|mask|>"}))
    return d


SAMPLE = '''def add(a, b):
    """Return the sum."""
    return a + b


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5
'''
