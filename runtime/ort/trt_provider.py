"""ONNX Runtime's TensorRT execution provider: the engines' profiles (runtime/profiles.py) as its options,
one profile per graph, and its engine cache outside the exported directory."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .. import contract as C
from ..manifest import Manifest
from ..profiles import Profile, check_precision, profiles, resolve_limits


def default_cache_dir(manifest: Manifest) -> Path:
    """Engine/timing cache of ORT's TensorRT provider: outside the exported directory.

    The exported directory is hash-verified (load_manifest refuses unlisted files), so the
    provider's cache lives under ~/.cache (or $DFLASH_TRT_CACHE), one folder per artifact.
    """
    base = Path(os.environ.get("DFLASH_TRT_CACHE") or Path.home() / ".cache" / "dflash-export" / "ort-trt")
    key = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(manifest.files.items())).encode()).hexdigest()[:16]
    return base / key


def _shape_str(shape: tuple) -> str:
    return "x".join(str(int(d)) for d in shape)


def ort_trt_provider_options(
    manifest: Manifest,
    graph: str,
    *,
    precision: str | None = None,
    max_context: int | None = None,
    max_prompt: int | None = None,
    cache_dir: str | Path | None = None,
    workspace_gb: float = 4.0,
    device_id: int = 0,
) -> dict:
    """Provider options for `TensorrtExecutionProvider` on one graph, from the manifest.

    ORT gets one explicit profile per graph (its options take min/opt/max per input): for
    the target the union of verify and prefill, with opt at the verify shape (the hot path).
    No trt_fp16_enable/trt_bf16_enable: those are weak typing, gone in TensorRT 11; the
    graph's own types decide. Engine and timing caches live in `cache_dir` (not in OUT).
    """
    check_precision(manifest.dtype, precision)
    limits = resolve_limits(manifest, max_context, max_prompt)
    union = {}
    for p in profiles(limits)[graph]:
        for role, (a, b, c) in p.ranges.items():
            a0, b0, c0 = union.get(role, (a, b, c))
            union[role] = (min(a, a0), b0, max(c, c0))  # opt of the first (verify) profile
    shapes = Profile("ort", union).shapes(manifest, graph)
    dynamic = [t.name for t in C.io(graph, manifest)[0] if any(r in C.DYNAMIC for r in t.dims)]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(manifest)
    opts = {
        "device_id": device_id,
        "trt_max_workspace_size": int(workspace_gb * (1 << 30)),
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(cache),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(cache),
    }
    if dynamic:
        for key, i in (("trt_profile_min_shapes", 0), ("trt_profile_opt_shapes", 1), ("trt_profile_max_shapes", 2)):
            opts[key] = ",".join(f"{n}:{_shape_str(shapes[n][i])}" for n in dynamic)
    return opts
