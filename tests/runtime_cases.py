"""Exported tiny artifacts for the runtime tests, cached on disk by content.

Tracing is the slow part (~30 s a pair on these machines), so each (target, drafter,
export settings) case is exported once and kept under DFLASH_TEST_CACHE (default
~/.cache/dflash-export/test-artifacts). The cache key hashes the exporter's and the
reference models' source (models/tiny.py among them), this file and the case's parameters: any change
to what would be exported makes a new entry. load_manifest re-verifies every file hash.

`bias` makes a target with real acceptance: every embedding gets +bias on one feature
and one LM-head row reads it, so the target's greedy output turns repetitive and the
(random) drafter, which shares that embedding and head, often guesses it.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "drafter-configs"  # released drafter configs


@dataclass(frozen=True)
class Case:
    arch: str = "qwen3"
    layers: int = 2
    draft_layers: int = 1
    block: int = 4
    bias: float = 0.0
    tie: bool | None = None
    seed: int = 0
    max_context: int = 256
    hidden: int = 64
    taps: tuple[int, ...] | None = None  # drafter's target_layer_ids (None: the z-lab default)
    sliding: int | None = None  # window of a sliding-attention drafter layer (layer 1, or 0 if alone)
    layer_types: tuple[str, ...] | None = None  # hybrid targets (qwen35): the linear/full pattern
    attention: str = "standard"  # export --attention
    dtype: str = "fp32"  # export --dtype
    moe: str | None = None  # MoE targets (testing.MOE archs): export --moe op | standard
    moe_config: tuple[tuple[str, object], ...] = ()  # expert config overrides (make_target's `moe`)
    released: str | None = None  # a released drafter config (FIXTURES) at this case's sizes (`block`: --block-size,
    # `draft_layers`: its last ones)
    kv_cache: str | None = None  # export --kv-cache (the ort flavour's int8 cache)
    target_extra: tuple = ()  # (key, value) pairs overriding the target's config (testing.make_target's `extra`)

    @property
    def name(self) -> str:
        b = f"-bias{self.bias}" if self.bias else ""
        a = "-ort" if self.attention == "ort" else ""
        d = "" if self.dtype == "fp32" else f"-{self.dtype}"
        r = f"-{self.released.split('-dflash')[0]}" if self.released else ""
        e = f"-moe-{self.moe}" if self.moe else ""
        kv = f"-kv{self.kv_cache}" if self.kv_cache else ""
        return f"{self.arch}-L{self.layers}-D{self.draft_layers}-K{self.block}{b}{a}{d}{r}{e}{kv}"


ORT_CASES = {  # the "ort" attention flavour (contract.TARGET_ORT): tests/test_attention_ort.py
    "qwen3-ort": Case("qwen3", layers=2, draft_layers=1, block=8, bias=2.0, attention="ort"),  # taps: [1], the last
    # head_dim 24: not a multiple of 16, so q/k rotate in the graph, not inside GroupQueryAttention
    "llama-ort": Case("llama", layers=2, draft_layers=1, block=4, tie=True, seed=3, hidden=96, attention="ort"),
}
KV8_CASES = {  # the ort flavour with its int8 cache (export --kv-cache int8): tests/test_kv_int8.py
    # biased towards a few tokens: drafts get accepted (the unbiased llama accepts none)
    "qwen3": Case("qwen3", layers=2, draft_layers=1, block=8, bias=1.0, seed=4, attention="ort", kv_cache="int8"),
    # head_dim 24: q/k rotate in the graph, GroupQueryAttention quantizes them as given
    "llama": Case("llama", layers=2, draft_layers=1, block=4, tie=True, seed=3, hidden=96, attention="ort", kv_cache="int8"),
}
CASES = {  # taps on the target's last layer: qwen3, llama, qwen3-b16 (llama/b16 by the default rule)
    "qwen3": Case("qwen3", layers=3, draft_layers=2, block=8, bias=2.0, taps=(0, 2)),  # real acceptance
    "llama": Case("llama", layers=2, draft_layers=1, block=4, tie=True),  # tied, llama3 rope
    "qwen2": Case("qwen2", layers=3, draft_layers=3, block=16, bias=1.0, seed=1, sliding=6),
    "qwen3-b16": Case("qwen3", layers=2, draft_layers=1, block=16, seed=2),
}
SW, FA = "sliding_attention", "full_attention"
GEMMA4_MOE = (("enable_moe_block", True), ("num_experts", 4), ("top_k_experts", 2), ("moe_intermediate_size", 16))
WINDOWED_CASES = {  # sliding-window targets (window 4: every prompt wraps the rings): tests/test_windowed.py
    # experts on ONNX Runtime's MoE op (the default at fp32); served: room for a chat
    "gpt_oss": Case("gpt_oss", layers=4, draft_layers=1, block=4, bias=1.5, hidden=32),
    # KV sharing (layers 2, 3 read 0, 1), per-layer embeddings, k_eq_v, full layers of their own shape, and
    # 26B-A4B's GeGLU experts beside the dense MLP (standard ops: the only form for GeGLU)
    "gemma4": Case("gemma4", layers=4, draft_layers=1, block=4, bias=1.0, hidden=32, max_context=96,
                   layer_types=(SW, FA, SW, FA),
                   target_extra=(("num_kv_shared_layers", 2), ("hidden_size_per_layer_input", 8), *GEMMA4_MOE)),
}
FP16 = Case("qwen3", layers=1, hidden=32, max_context=64, block=8, dtype="fp16")  # test_export_half, TensorRT lint
TRT_CASES = {  # the TensorRT lint (both) and the stand-in build (fp32-k4, engines at max context 64)
    "fp32-k4": CASES["llama"],
    "fp16-k8": FP16,
}


def _source_digest() -> str:
    h = hashlib.sha256()
    files = sorted((ROOT / "export").glob("*.py")) + sorted((ROOT / "models").glob("*.py"))
    files += [ROOT / "runtime" / "contract.py", Path(__file__)]
    files += sorted(FIXTURES.glob("*.json"))
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def shrink_released(cfg: dict, target_layers: int, hidden: int, vocab: int, layers: int = 3) -> dict:
    """A released drafter config with the same keys and structure at tiny sizes: the target's
    width, vocabulary and depth (explicit tap ids scaled into it, those that coincide in a
    shallow target once; derived ones left to derive), 4 heads (2 KV) of 8, at most its last
    `layers` layers (a sliding/full mix stays), window 3."""
    c = copy.deepcopy(cfg)
    big_layers = c["num_target_layers"]
    c.update(hidden_size=hidden, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_target_layers=target_layers, vocab_size=vocab, num_hidden_layers=min(c["num_hidden_layers"], layers))
    if c.get("layer_types"):
        c["layer_types"] = c["layer_types"][-c["num_hidden_layers"]:]
    if c.get("sliding_window"):
        c["sliding_window"] = 3
    nested = c.get("dflash_config")
    if nested is not None:
        if nested.get("target_layer_ids") is not None:
            scaled = [i * target_layers // big_layers for i in nested["target_layer_ids"]]
            nested["target_layer_ids"] = list(dict.fromkeys(scaled))
        if nested.get("mask_token_id") is not None:
            nested["mask_token_id"] = vocab - 2
    return c


def _released_drafter(case: Case, target_dir: Path, directory: Path) -> int | None:
    """Write case.released's drafter for the target (random weights); -> the --mask-token-id to
    export with (the config's own, or vocab - 3 where it is null, as a user would pass)."""
    import torch

    from dflash_export.models import Drafter, TargetConfig
    from dflash_export.models.draft_config import DraftConfig

    tc = TargetConfig.load(target_dir)
    cfg = shrink_released(json.loads((FIXTURES / case.released).read_text()), tc.num_layers, tc.hidden_size,
                          tc.vocab_size, case.draft_layers)
    torch.manual_seed(case.seed)
    d = Drafter(DraftConfig.from_dict(cfg))
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    d.save_pretrained(directory)
    return None if d.config.mask_token_id is not None else tc.vocab_size - 3


def _bias_target(directory: Path, bias: float, token: int = 7) -> None:
    from dflash_export.models.tiny import hf_model
    import torch

    model = hf_model(directory)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += bias
        model.lm_head.weight[token, 0] += bias
    model.save_pretrained(directory)


STALE_DAYS = 2  # cache entries unused this long are removed (source edits key new ones)


def _prune(cache: Path, keep: Path) -> None:
    """Remove the entries nobody has used for STALE_DAYS (with their lock), and old leftovers of killed runs."""
    cutoff = time.time() - STALE_DAYS * 86400
    for p in cache.iterdir():
        if not p.is_dir() or p == keep:
            continue
        try:
            stale = ((p / "used") if (p / "used").exists() else p).stat().st_mtime < cutoff
        except FileNotFoundError:  # another process removed or replaced it
            continue
        if stale:
            shutil.rmtree(p, ignore_errors=True)
            (cache / f"{p.name}.lock").unlink(missing_ok=True)


def cached(name: str, key: str, build) -> Path:
    """The tests' artifact cache entry `name-<digest of the exporter's source and key>`, made once
    by `build(tmp)` (which leaves tmp/out/manifest.json) and moved into place whole.

    Safe with several test processes (pytest-xdist workers, other checkouts): one file lock
    per entry, so an entry is made by one process while the others wait for it."""
    from filelock import FileLock

    cache = Path(os.environ.get("DFLASH_TEST_CACHE", Path.home() / ".cache/dflash-export/test-artifacts"))
    final = cache / f"{name}-{hashlib.sha256((_source_digest() + key).encode()).hexdigest()[:16]}"
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(cache / f"{final.name}.lock"):
        if not (final / "out" / "manifest.json").is_file():
            tmp = cache / f".{final.name}.{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            build(tmp)
            shutil.rmtree(final, ignore_errors=True)  # a half-written entry of a killed run (no manifest)
            os.replace(tmp, final)
        (final / "used").touch()  # for _prune: entries in use are kept
    return final


@functools.lru_cache(maxsize=None)
def artifact(case: Case) -> tuple[Path, Path, Path]:
    """(target_dir, draft_dir, exported_dir) for `case`, exported once per content."""
    final = cached(case.name, json.dumps(asdict(case), sort_keys=True), lambda tmp: _export(case, tmp))
    _prune(final.parent, final)
    return final / "t", final / "d", final / "out"


def _export(case: Case, tmp: Path) -> None:
    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.manifest import load_manifest
    from dflash_export.models.tiny import make_drafter, make_target

    make_target(tmp / "t", case.arch, seed=case.seed, layers=case.layers, tie=case.tie, hidden=case.hidden,
                layer_types=list(case.layer_types) if case.layer_types else None,
                moe={k: list(v) if isinstance(v, tuple) else v for k, v in case.moe_config} or None,
                **({"extra": dict(case.target_extra)} if case.target_extra else {}))
    if case.bias:
        _bias_target(tmp / "t", case.bias)
    extra = {}
    if case.sliding:
        types = ["full_attention"] * case.draft_layers
        types[min(1, case.draft_layers - 1)] = "sliding_attention"
        extra = dict(layer_types=types, sliding_window=case.sliding)
    mask = None
    if case.released:
        mask = _released_drafter(case, tmp / "t", tmp / "d")
    else:
        make_drafter(tmp / "d", tmp / "t", layers=case.draft_layers, block_size=case.block, seed=case.seed,
                     target_layer_ids=list(case.taps) if case.taps else None, **extra)
    m = export_artifact(tmp / "t", tmp / "d", tmp / "out", max_context=case.max_context, attention=case.attention,
                        dtype=case.dtype, block_size=case.block if case.released else None, mask_token_id=mask,
                        moe=case.moe, kv_cache=case.kv_cache, progress=False)
    assert load_manifest(tmp / "out") == m, "export_artifact returned another manifest than it wrote"


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of varied lengths (1 .. ~40 tokens) that avoid the eos id (vocab - 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 2, int(rng.integers(1, 40))).tolist() for _ in range(n)]
