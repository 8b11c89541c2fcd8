"""check's PyTorch reference at real size: the source modules with their large weights read
when the module that owns them runs and dropped when it returns.

A Qwen3-8B target is 32 GB of fp32 weights, and a quantized artifact's reference needs its
dequantized twin too: check could not hold either on the 16 GB machines the artifact is for.
Here every module owning a matrix (each Linear, the embedding, the LM head, a layer's
experts) keeps a placeholder of its shape and dtype between calls (one element of storage,
broadcast); a forward pre-hook reads it from the checkpoint (or dequantizes it from the
artifact, `overrides`) in the reference dtype, a forward hook frees it. Vectors (norms,
biases; the graphs' wrappers read norm weights directly) stay loaded. The outputs are
the whole-model reference's, bit for bit (same weights, same ops; tests/test_layerwise.py),
for the price of reading the weights once per forward; the memory beyond the graphs is about
one matrix.

Dense targets (Llama / Qwen2 / Qwen3, tied or not), Qwen3-MoE targets (experts stacked per
layer as they are read) and every drafter family; other targets (hybrid, windowed) load whole.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import
from .. import models as reference
from ..models import dflash2
from ..models.checkpoint import experts_on_meta
from ..models.config import TargetConfig
from ..models.moe import fuse_experts
from ..runtime import contract as C
from . import stream

safetensors = lazy_import("safetensors")

EVERYTHING = re.compile(r".")  # experts_on_meta's pattern: no tensor read while the skeleton is built


@dataclass
class Stats:
    """Bytes of lazy weights loaded now and at most (the tests' proof that one module's are held at a time)."""
    live: int = 0
    peak: int = 0
    loads: int = 0
    largest_module: int = 0  # bytes of the largest module's lazy weights


@dataclass
class Source:
    """Where lazy weights come from: a checkpoint's tensors by key, stacked into experts where
    the model fuses them (`fuse`), or `overrides` (name -> a function returning {name: array},
    one function may give several names: a QMoE node's experts)."""
    directory: Path
    what: str
    fuse: Callable[[dict], dict] = lambda state: state
    aliases: dict[str, str] = field(default_factory=dict)  # parameter name -> checkpoint key (a tied head)
    overrides: dict[str, Callable[[], dict[str, np.ndarray]]] = field(default_factory=dict)

    def __post_init__(self):
        """Where each tensor lies (the headers only). Read with plain file reads, not safetensors'
        mmap: mapped pages count in the process's RSS for as long as the file stays open (a 6-layer,
        hidden-4096 check peaked at 9.3 GB RSS that way, the whole checkpoint's pages)."""
        self.handles: dict[str, stream.Entry] = stream.checkpoint_entries(self.directory, self.what)

    def keys_for(self, prefix: str, names: list[str]) -> list[str]:
        """The checkpoint keys the module `prefix` reads for its parameters `names`."""
        keys = [k for k in self.handles if k.startswith(prefix + ".")]
        return keys + [self.aliases[n] for n in names if n in self.aliases]

    def read(self, keys: list[str], names: list[str], dtype: torch.dtype, overrides: bool = True) -> dict[str, torch.Tensor]:
        out, parts = {}, {}
        for n in names if overrides else ():
            if n in self.overrides:
                parts.setdefault(self.overrides[n], []).append(n)
        for part, wanted in parts.items():
            arrays = part()
            out.update({n: torch.from_numpy(arrays[n]).to(dtype) for n in wanted})
        rest = [n for n in names if n not in out]
        if rest:
            state = {k: read_tensor(self.handles[k]) for k in keys}
            state.update({n: state[self.aliases[n]] for n in rest if n in self.aliases})
            state = self.fuse(state)
            out.update({n: state[n].to(dtype) for n in rest})
        return out


def read_tensor(e: stream.Entry) -> torch.Tensor:
    """One checkpoint tensor by a plain read (F32, F16 and BF16 as float32; others through safetensors),
    its pages then dropped from the page cache (read once: a check would otherwise fill the
    memory limit with the checkpoint's pages)."""
    if e.dtype in stream._NP:
        out = torch.from_numpy(stream.read_rows(e))
    else:
        with safetensors.safe_open(str(e.path), framework="pt") as f:
            out = f.get_tensor(e.key)
    if hasattr(os, "posix_fadvise"):
        fd = os.open(e.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, e.start, out.numel() * out.element_size(), os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return out


def _placeholder(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros((), dtype=dtype).expand(*shape), requires_grad=False)


class Layerwise:
    """The lazy modules of one model (the target or the drafter) and their loading."""

    def __init__(self, model: nn.Module, source: Source, dtype: torch.dtype, stats: Stats):
        self.source, self.dtype, self.stats = source, dtype, stats
        self.lazy: dict[nn.Module, tuple[str, list[str], list[str], list[str]]] = {}  # module -> (name, attrs, names, keys)
        fill_small(model, source, dtype)
        for prefix, module in model.named_modules():
            attrs = [a for a, p in module.named_parameters(recurse=False) if p.device.type == "meta"]
            if attrs:
                full = [f"{prefix}.{a}" if prefix else a for a in attrs]
                self.lazy[module] = (prefix, attrs, full, source.keys_for(prefix, full))
                size = sum(getattr(module, a).numel() for a in attrs) * _itemsize(dtype)
                stats.largest_module = max(stats.largest_module, size)
        for module, (_, attrs, _, _) in self.lazy.items():
            for a in attrs:  # a tied head becomes its own placeholder: it loads under its own name (aliases)
                setattr(module, a, _placeholder(getattr(module, a).shape, dtype))
            module.register_forward_pre_hook(lambda m, args: self.load(m))
            module.register_forward_hook(lambda m, args, out: self.free(m), always_call=True)
        model.layerwise = self  # check's note: what was read per call, and the most held at once
        for name, t in model.named_buffers():
            if t is not None and t.device.type == "meta":
                raise DFlashError(f"{source.what} {source.directory}: buffer {name} was not read; check this model "
                                  "with --reference whole")

    def load(self, module: nn.Module) -> None:
        prefix, names, full, keys = self.lazy[module]
        got = self.source.read(keys, full, self.dtype)
        for a, n in zip(names, full):
            want = getattr(module, a).shape
            if tuple(got[n].shape) != tuple(want):
                raise DFlashError(f"{self.source.what} {self.source.directory}: {n} is {list(got[n].shape)}, "
                                  f"the model has {list(want)}")
            setattr(module, a, nn.Parameter(got[n], requires_grad=False))
            self.stats.live += got[n].numel() * got[n].element_size()
        self.stats.peak = max(self.stats.peak, self.stats.live)
        self.stats.loads += 1

    def free(self, module: nn.Module) -> None:
        for a in self.lazy[module][1]:
            p = getattr(module, a)
            if p.untyped_storage().nbytes() > p.element_size():  # loaded (not the placeholder)
                self.stats.live -= p.numel() * p.element_size()
                setattr(module, a, _placeholder(p.shape, self.dtype))

    @contextlib.contextmanager
    def loaded(self, module: nn.Module):
        """Within: `module`'s weights are real (code that reads a weight outside a forward)."""
        self.load(module)
        try:
            yield module
        finally:
            self.free(module)


def weight_bytes(directory, dtype: torch.dtype) -> int:
    """Bytes a checkpoint's tensors take in `dtype` (from the safetensors headers; nothing read)."""
    entries = stream.checkpoint_entries(directory, "checkpoint").values()
    return sum(int(np.prod(e.shape, dtype=np.int64)) for e in entries) * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fill_small(model: nn.Module, source: Source, dtype: torch.dtype) -> None:
    """Read the vectors (norms, biases) the skeleton left unread, for good."""
    for prefix, module in model.named_modules():
        for a, p in list(module.named_parameters(recurse=False)):
            if p.device.type == "meta" and p.dim() < 2:
                n = f"{prefix}.{a}" if prefix else a
                got = source.read(source.keys_for(prefix, [n]), [n], dtype)[n]
                setattr(module, a, nn.Parameter(got, requires_grad=False))


# the drafter's tensors its skeleton leaves unread: the layers and the taps' projection (a speculators
# drafter's head, vocabulary map and copies of the target's tensors are read: its loader checks them)
DRAFT_LAZY = re.compile(r"(?:^|\.)layers\.\d+\.|(?:^|\.)fc\.")


@dataclass
class Pair:
    """A target and drafter read layer at a time, and what they hold."""
    target: nn.Module
    drafter: nn.Module
    target_weights: Layerwise
    draft_weights: Layerwise
    stats: Stats


def supported(target_dir) -> str | None:
    """Why the layer-at-a-time reference cannot read this target (None: it can)."""
    c = TargetConfig.load(target_dir)
    if c.hybrid or c.windowed:
        return f"{c.architecture} targets (hybrid or windowed layers) are read whole"
    return None


def load_pair(target_dir, draft_dir, dtype: torch.dtype, draft_config, vocab_ids: torch.Tensor | None = None,
              dequantized: dict | None = None, where: str = "drafter") -> Pair:
    """The source pair with its large weights read per call, attached (models/drafter.py) and
    scoring `vocab_ids` (a reduced draft vocabulary, unless the drafter carries its own).
    `dequantized` (graph -> {name: part}, quantize.dequantizers): the weights the quantized
    graphs multiply by replace the checkpoint's, by quantize.dequantized_sources' rules (the
    table and head are the target's; a reduced head starts from the float rows)."""
    why = supported(target_dir)
    if why:
        raise DFlashError(f"the layer-at-a-time reference: {why}; check with --reference whole")
    with experts_on_meta(DRAFT_LAZY):
        drafter = dflash2.load_drafter(draft_dir, dtype, config=draft_config)
    with experts_on_meta(EVERYTHING):
        target = reference.Target.from_pretrained(target_dir, drafter.config.target_layer_ids, dtype)
    tc = target.config
    embed, head = C.SHARED_INITIALIZERS
    t_over, d_over, own_head = {}, {}, None
    for graph, parts in (dequantized or {}).items():
        for name, part in parts.items():
            if name == embed:
                t_over["model.embed_tokens.weight"] = lambda part=part: {"model.embed_tokens.weight": part()[embed]}
            elif name == head and graph != C.TARGET and head not in dequantized.get(C.TARGET, {}):
                own_head = part  # --draft-only: the drafter's own head
            elif name == head or graph == C.TARGET:
                t_over[name] = part
            else:
                d_over[name] = part
    aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tc.tie_word_embeddings else {}
    tsrc = Source(Path(target_dir), "target", lambda s: fuse_experts(s, tc, f"target {target_dir}"), aliases, t_over)
    dsrc = Source(Path(draft_dir), "drafter", overrides={n: p for n, p in d_over.items() if n != "vocab_head"})
    stats = Stats()
    pair = Pair(target, drafter, Layerwise(target, tsrc, dtype, stats), Layerwise(drafter, dsrc, dtype, stats), stats)
    float_of = lambda n: tsrc.read(tsrc.keys_for(n.rsplit(".", 1)[0], [n]), [n], dtype, overrides=False)[n]  # noqa: E731
    if drafter.borrowed:  # a speculators drafter's copies of the target's tensors, checked against the float ones
        theirs = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
        drafter.attach(SimpleNamespace(model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=float_of(
            theirs["embed_tokens.weight"]))), lm_head=SimpleNamespace(weight=float_of("lm_head.weight"))), where)
    if vocab_ids is not None and drafter.vocab_ids is None:  # not its own (a speculators drafter's d2t)
        drafter.set_draft_vocab(vocab_ids, float_of("lm_head.weight"))
    if "vocab_head" in d_over:
        drafter.vocab_head = torch.from_numpy(d_over["vocab_head"]()["vocab_head"]).to(dtype)
    if own_head is not None:
        drafter.vocab_head = torch.from_numpy(own_head()[head]).to(dtype)
    unknown = [n for n in (*t_over, *dsrc.overrides) if not any(n in full for _, _, full, _ in
                                                                (*pair.target_weights.lazy.values(),
                                                                 *pair.draft_weights.lazy.values()))]
    if unknown:
        raise DFlashError(f"{unknown[0]} is not a weight the layer-at-a-time reference reads; check with --reference whole")
    return pair
