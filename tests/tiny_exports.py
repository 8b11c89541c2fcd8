"""Tiny exports for the tests: a pair exported end to end, and how far its taps are from transformers'."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash_export.export.artifact import export_artifact
from dflash_export.models.tiny import hf_model, make_drafter, make_target
from dflash_export.runtime.ort.backend import OrtBackend


def exported_taps_error(out: str | Path, target_dir: str | Path, n: int = 9, seed: int = 0) -> float:
    """Max abs error of the exported target's taps (run by the ORT backend) against
    transformers' own `output_hidden_states[i + 1]` for every tap id of the artifact."""
    be = OrtBackend(out, verify=False)
    ids = torch.randint(0, be.manifest.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hs = hf_model(target_dir)(ids, output_hidden_states=True, use_cache=False).hidden_states
    ref = torch.cat([hs[i + 1] for i in be.manifest.target_layer_ids], -1)[0].numpy()
    be.target(ids[0].numpy())
    return float(np.abs(be.taps[0, :n] - ref).max())


def export_tiny_pair(root: str | Path, block_size: int, max_context: int, dtype: str = "fp32") -> Path:
    """A 2-layer, 32-wide target + 1-layer drafter under root/{t,d}, exported to root/out."""
    root = Path(root)
    make_target(root / "t", layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    make_drafter(root / "d", root / "t", layers=1, block_size=block_size)
    export_artifact(root / "t", root / "d", root / "out", dtype=dtype, max_context=max_context, progress=False)
    return root / "out"
