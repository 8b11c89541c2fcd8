"""The artifact contract between `export/` and `runtime/`: graph files, tensor names, manifest.

Everything a runtime needs to know about an exported directory is here, in one place.

    target.onnx         prefill and verify share one graph (dynamic S)
      in   input_ids            [batch, seq]                    int64
           position_ids         [batch, seq]                    int64
           past_key.{i}         [batch, past, kv_heads, head_dim]   dtype   (i < target layers)
           past_value.{i}       [batch, past, kv_heads, head_dim]   dtype
      out  logits               [batch, seq, vocab]             float32
           next_ids             [batch, seq]                    int64   (in-graph argmax)
           taps                 [batch, seq, taps*hidden]       dtype   (decoder layer outputs,
                                                                          target_layer_ids order)
           new_key.{i}          [batch, seq, kv_heads, head_dim]   dtype   (only the new positions)
           new_value.{i}        [batch, seq, kv_heads, head_dim]   dtype

    draft_context.onnx  projects newly accepted target features into drafter K/V (dynamic C)
      in   taps                 [batch, ctx, taps*hidden]       dtype
           ctx_position_ids     [batch, ctx]                    int64
      out  ctx_key.{j}          [batch, ctx, d_kv_heads, d_head_dim]  dtype  (j < drafter layers)
           ctx_value.{j}        [batch, ctx, d_kv_heads, d_head_dim]  dtype

    draft_block.onnx    one denoising pass over the block (static K)
      in   block_ids            [batch, K]                      int64   ([anchor, mask, ..., mask])
           block_position_ids   [batch, K]                      int64
           past_ctx_key.{j}     [batch, past_ctx, d_kv_heads, d_head_dim]  dtype
           past_ctx_value.{j}   [batch, past_ctx, d_kv_heads, d_head_dim]  dtype
      out  draft_ids            [batch, K-1]                    int64   (in-graph argmax)
           draft_logits         [batch, K-1, vocab]             float32

The drafter's context cache holds every position before the anchor, so `past_ctx` equals
the anchor's position. Embedding and LM head are initializers with the same names in
target.onnx and draft_block.onnx (`SHARED_INITIALIZERS`), stored once on disk in
`shared.data` (external data; each graph's other weights are in `<graph>.data`). With tied
embeddings both names are present and point at the same bytes of `shared.data`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import DFlashError

FORMAT = "dflash-export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

TARGET = "target"
DRAFT_CONTEXT = "draft_context"
DRAFT_BLOCK = "draft_block"
GRAPH_FILES = {TARGET: "target.onnx", DRAFT_CONTEXT: "draft_context.onnx", DRAFT_BLOCK: "draft_block.onnx"}

SHARED_INITIALIZERS = ("embed_tokens.weight", "lm_head.weight")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


def past_key(i: int) -> str:
    return f"past_key.{i}"


def past_value(i: int) -> str:
    return f"past_value.{i}"


def new_key(i: int) -> str:
    return f"new_key.{i}"


def new_value(i: int) -> str:
    return f"new_value.{i}"


def ctx_key(j: int) -> str:
    return f"ctx_key.{j}"


def ctx_value(j: int) -> str:
    return f"ctx_value.{j}"


def past_ctx_key(j: int) -> str:
    return f"past_ctx_key.{j}"


def past_ctx_value(j: int) -> str:
    return f"past_ctx_value.{j}"


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32", "float16", "bfloat16"
    shape: list  # ints for static dims, strings for named dynamic dims


@dataclass
class GraphSpec:
    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


@dataclass
class Manifest:
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    dtype: str  # "fp32" | "fp16" | "bf16"
    vocab_size: int
    max_context: int
    hidden_size: int
    target_layers: int
    target_kv_heads: int
    target_head_dim: int
    draft_layers: int
    draft_kv_heads: int
    draft_head_dim: int
    architecture: str
    eos_token_ids: list[int]
    opset: int
    graphs: dict[str, GraphSpec]
    tools: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    tokenizer: bool = False
    engines: dict | None = None  # TensorRT build record (export/trt_build.py), absent until built
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        d = dict(d)
        d["graphs"] = {
            k: GraphSpec(
                file=g["file"],
                inputs=[TensorSpec(**t) for t in g["inputs"]],
                outputs=[TensorSpec(**t) for t in g["outputs"]],
            )
            for k, g in d["graphs"].items()
        }
        return cls(**d)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_files(root: Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest itself, by relative posix path."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(root).as_posix()] = sha256_file(p)
    return out


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Hash every file, then write manifest.json atomically."""
    manifest.files = hash_files(root)
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, root / MANIFEST)


def load_manifest(root: str | Path, verify: bool = True) -> Manifest:
    """Read and (by default) verify an exported directory; refuse anything inconsistent."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise DFlashError(f"{root}: not a directory; pass the --out directory of `dflash-export export`")
    if not path.is_file():
        raise DFlashError(f"{root}: no {MANIFEST}; this is not an exported directory (run `dflash-export export`)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DFlashError(f"{path}: unreadable manifest ({e}); re-export the directory") from None
    if raw.get("format") != FORMAT:
        raise DFlashError(f"{path}: not a {FORMAT} manifest")
    if raw.get("format_version") != FORMAT_VERSION:
        raise DFlashError(
            f"{path}: format version {raw.get('format_version')} but this runtime reads {FORMAT_VERSION}; "
            "re-export with this version of dflash-export"
        )
    try:
        manifest = Manifest.from_dict(raw)
    except (TypeError, KeyError) as e:
        raise DFlashError(f"{path}: malformed manifest ({e}); re-export the directory") from None
    if verify:
        verify_files(root, manifest)
    return manifest


def verify_files(root: Path, manifest: Manifest) -> None:
    for rel, digest in manifest.files.items():
        p = root / rel
        if not p.is_file():
            raise DFlashError(f"{root}: {rel} is listed in the manifest but missing; re-export the directory")
        if sha256_file(p) != digest:
            raise DFlashError(
                f"{root}: {rel} does not match its sha256 in the manifest (modified or corrupt); re-export the directory"
            )
    listed = set(manifest.files)
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and p.name != MANIFEST and rel not in listed:
            raise DFlashError(f"{root}: {rel} is not listed in the manifest; remove it or re-export the directory")
