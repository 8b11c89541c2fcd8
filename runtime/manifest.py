"""The manifest: what `manifest.json` says about an exported directory, and its file hashes.

The graphs' I/O contract is `runtime/contract.py`; this module reads and writes the record of
one export of it (dims, dtype, shared weights, quantization, hybrid layers, format version).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .files import read_json, readable, unreadable
from .contract import ATTENTION_FLAVOURS, FORMAT, FORMAT_VERSION, LINEAR, MANIFEST, RUNTIME
from .errors import DFlashError


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32", "float16", "bfloat16"
    shape: list  # ints for static dims, strings for named dynamic dims


@dataclass
class GraphSpec:
    """A graph's I/O as written in its ONNX file (named dynamic dims as strings)."""

    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


@dataclass
class SharedTensor:
    """Where one weight stored once for several graphs lives: bytes [offset, offset+length) of `file`."""

    file: str
    offset: int
    length: int
    dtype: str  # numpy dtype name ("bfloat16": stored as 2-byte words)
    shape: list[int]
    graphs: list[str]  # the graphs holding an initializer of this name


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
    shared: dict[str, SharedTensor] = field(default_factory=dict)  # initializer name -> its bytes
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    tokenizer: bool = False
    attention: str = "standard"  # "standard" | "ort" (see the module docstring)
    engines: dict | None = None  # TensorRT build record (export/trt_build.py), absent until built
    # weight-only quantization (export/quantize.py): {"scheme", "bits", "block_size", "symmetric", "draft",
    # "lm_head", "accuracy_level", "method", "weights": {graph: [quantized weight names]}}; None: float weights
    quantization: dict | None = None
    # hybrid targets only: per target layer "full_attention" | "linear_attention", and the Gated
    # DeltaNet dims {conv_kernel, conv_dim, k_heads, v_heads, k_dim, v_dim, max_seq}
    target_layer_types: list[str] = field(default_factory=list)
    linear: dict | None = None
    # sliding-window targets (gpt-oss, Gemma 4; contract.window): {"family", "window", "ring", "kv_heads",
    # "head_dim" (the sliding layers' K/V), "kv_source" (per layer: whose K/V it reads), "sinks",
    # "final_logit_softcapping", "rope" (per layer type)}; target_layer_types then lists sliding/full per layer
    windowed: dict | None = None
    draft_vocab: dict | None = None  # reduced draft vocabulary: {"size": N, "source": ...}; None: full
    # DFlash 2 drafters: the candidate selector {"top_k", "rank", "conv_kernel", "conv_group"} (draft_block
    # then also returns draft_candidates / draft_scores, contract.SELECTOR_OUTPUTS); None: DFlash 1
    selector: dict | None = None
    # drafters whose layers all slide: the context cache is a ring of this many slots (the window), slot =
    # position mod draft_ring, and draft_block finds each slot's position from ctx_lengths; None: slot = position
    draft_ring: int | None = None
    # mixture-of-experts targets: how the target graph runs the experts and the routing, {"path": "op" (ONNX
    # Runtime's com.microsoft::MoE) | "standard" (gathered experts in ai.onnx ops), "experts", "top_k",
    # "expert_size", "shared_expert_size", "norm_topk_prob", "layers": the MoE layers, "activation": "swiglu" |
    # "geglu"}; None: a dense target
    moe: dict | None = None
    # the graphs take ragged batches (contract.RAGGED: per-row lengths, position-major caches,
    # logits_index); False for older exports, which run batch 1 only
    ragged: bool = False
    # draft_block takes draft_index (contract.DRAFT_INDEX: its head scores only the drafts a verify uses);
    # False for older exports and DFlash 2 drafters, whose head scores every draft position
    draft_index: bool = False
    # the ort flavour's target verifies rows of different lengths in one call: its
    # GroupQueryAttention takes each row's count of new tokens (query_seqlens, derived in the
    # graph from seqlens_k and position_ids, contract.row_counts); False for older exports,
    # whose rows verifying several tokens run one call each
    row_counts: bool = False
    # the ort flavour's cache quantized (export --kv-cache int8, contract.kv_cache): {"dtype": "int8",
    # "scales": "per-channel", "margin", "calibration": {...}}; the scales themselves are constants of
    # target.onnx (GroupQueryAttention's k_scale / v_scale); None: the cache is in the model dtype
    kv_cache: dict | None = None
    # where the pair came from (export/sources.py): {"target": rec, "draft": rec}, rec = {"id" (a Hugging Face id or
    # None), "path" (a local directory, when no id), "revision" (asked), "commit" (resolved), "files": {weight
    # file: sha256}}; None for exports made before it was recorded
    sources: dict | None = None
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def is_linear(self, i: int) -> bool:
        return bool(self.target_layer_types) and self.target_layer_types[i] == LINEAR

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in range(self.target_layers) if self.is_linear(i)]

    @property
    def rows_vary(self) -> list[str]:
        """What in the target gives a position other last bits alone (a plain step) than inside a
        verify block (measured: export/check_invariance.py, tests/test_lossless.py). ONNX Runtime's
        MoE op, and QMoE with fp32 activations (int4 experts below accuracy level 4), multiply each
        expert's weights by the tokens routed to it, so how many rows each GEMM gets changes with the
        call (QMoE with int8 activations gave a row the same bits either way); the delta rule computes a
        step and a chunk in different orders; ONNX Runtime's GroupQueryAttention (the ort flavour) over
        an fp32 cache computes one query row another way than several (measured at head_dim 16-128;
        over the int8 cache it gave a row the same bits). Where a target has one, speculative == plain
        holds except at near-ties of the top two logits (docs/quantization.md)."""
        q = self.quantization or {}
        int8_experts = bool(q.get("experts")) and (q.get("accuracy_level") == 4 or q.get("scheme") == "int8")
        moe_op = (self.moe or {}).get("path") == "op" and not int8_experts
        gqa = self.attention == "ort" and (self.kv_cache or {}).get("dtype") != "int8"
        return [w for w, has in (("ONNX Runtime's MoE op experts (--moe op, fp32 activations)", moe_op),
                                 ("GroupQueryAttention over an fp32 cache (--attention ort)", gqa),
                                 ("linear-attention layers", bool(self.linear_layers))) if has]

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
        d["shared"] = {k: SharedTensor(**t) for k, t in d.get("shared", {}).items()}
        return cls(**d)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    except OSError as e:
        raise unreadable(path, e, "make it readable or re-export the directory") from None
    return h.hexdigest()


def hash_files(root: Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest itself, by relative posix path."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.relative_to(root).as_posix() not in (MANIFEST, RUNTIME):
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
    if not path.exists():
        raise DFlashError(f"{root}: no {MANIFEST}; this is not an exported directory (run `dflash-export export`)")
    raw = read_json(path, "re-export the directory")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DFlashError(f"{path}: not a {FORMAT} manifest")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise DFlashError(
            f"{path}: manifest format version {version!r}, but this dflash-export reads version {FORMAT_VERSION} only; "
            + ("upgrade dflash-export to read it" if newer else "re-export the directory with this dflash-export")
        )
    unknown = sorted(set(raw) - {f.name for f in fields(Manifest)})
    if unknown:
        raise DFlashError(f"{path}: manifest fields {', '.join(unknown)} are unknown to this dflash-export "
                          "(written by a newer one); upgrade dflash-export or re-export the directory")
    try:
        manifest = Manifest.from_dict(raw)
    except (TypeError, KeyError) as e:
        raise DFlashError(f"{path}: malformed manifest ({e}); re-export the directory") from None
    if manifest.attention not in ATTENTION_FLAVOURS:
        raise DFlashError(f"{path}: attention flavour {manifest.attention!r} is unknown to this dflash-export "
                          f"(it reads {', '.join(ATTENTION_FLAVOURS)}); upgrade dflash-export or re-export the directory")
    if verify:
        verify_files(root, manifest)
    return manifest


def check_readable(root: Path, manifest: Manifest) -> None:
    """Open every file of the manifest once (no hashing): for readers that skip `verify_files`
    and hand the paths to ONNX Runtime, which would fail without saying why."""
    for rel in manifest.files:
        readable(Path(root) / rel, "make it readable or re-export the directory")


def verify_files(root: Path, manifest: Manifest) -> None:
    for rel, digest in manifest.files.items():
        p = root / rel
        if not p.exists():
            raise DFlashError(f"{root}: {rel} is listed in the manifest but missing; re-export the directory")
        if sha256_file(p) != digest:
            raise DFlashError(
                f"{root}: {rel} does not match its sha256 in the manifest (modified or corrupt); re-export the directory"
            )
    listed = set(manifest.files)
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in (MANIFEST, RUNTIME) and rel not in listed:
            raise DFlashError(f"{root}: {rel} is not listed in the manifest; remove it or re-export the directory")
