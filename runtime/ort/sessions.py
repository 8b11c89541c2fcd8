"""ONNX Runtime's side of a loaded directory: the sessions of its graphs and the shared weights
they read, built once and read-only afterwards (so several sequences, `OrtBackend.fork`, run
on one copy).

The weights several graphs hold (embedding and LM head; the drafter's K/V projections)
are memory-mapped once from shared.data, where the manifest's `shared` table says they
are, and handed to every session whose graph holds them with `add_initializer`: one copy
in memory, used in place by all. The embedding is read in place; the LM head
is prepacked per session (one packed copy each, the fast path; a tied head is read
transposed from the table: those sessions skip constant folding so that ORT packs it
straight from the table instead of also keeping a folded transposed copy, see
docs/performance.md, "Memory"); `low_memory=True` turns prepacking off too so the one copy is all
there is, at the price of slower GEMMs (docs/runtime.md).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import onnxruntime as ort

from .. import contract as C, manifest as M
from ..errors import DFlashError
from ..shared import shared_weights, tied_head_graphs
from .trt_provider import ort_trt_provider_options

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def load_hint(first: str) -> str:
    """What to do about an ONNX Runtime load failure, from its first line; nothing when the cause is unclear."""
    if any(k in first for k in ("INVALID_PROTOBUF", "NO_SUCHFILE", "external data", "INVALID_GRAPH")):
        return " (the file is damaged or incomplete: re-export the directory)"
    if any(k in first for k in ("NOT_IMPLEMENTED", "Could not find an implementation", "opset")):
        return " (this onnxruntime cannot run an op of the graph: install the version `dflash-export info` lists)"
    return ""


def available_providers() -> list[str]:
    have = set(ort.get_available_providers())
    return [k for k, v in PROVIDERS.items() if v in have]


def resolve_provider(name: str) -> str:
    """'cpu' | 'cuda' -> the ORT provider name, or a one-line error listing what exists."""
    have = ", ".join(available_providers())
    if name not in PROVIDERS:
        raise DFlashError(f"unknown provider {name!r}; available: {have}")
    if PROVIDERS[name] not in ort.get_available_providers():
        raise DFlashError(
            f"provider {name!r} is not available in this onnxruntime {ort.__version__} (available: {have}); "
            "for cuda install the gpu extra (onnxruntime-gpu)"
        )
    return PROVIDERS[name]


class Sessions:
    """The graphs' InferenceSessions over one directory, with the shared weights added in place.

    `max_chunk` may come out smaller than asked: TensorRT's execution provider builds its
    profiles for at most max_context - block_size prompt positions.
    """

    def __init__(self, directory: Path, manifest: M.Manifest, provider: str, *, max_chunk: int, device: str,
                 threads: int | None, graph_threads: dict[str, int], spin: bool, drafter: bool, low_memory: bool,
                 release_mapped: bool, spin_us: int | None = None):
        self.directory, self.manifest, self.provider, self.max_chunk = directory, manifest, provider, max_chunk
        self.threads, self.spin, self.low_memory = threads, spin, low_memory  # threads None: ORT's default (one per core)
        self.spin_us = spin_us  # spinning's bound in microseconds (None: ORT's own)
        self.graph_threads = dict(graph_threads)  # per graph counts over `threads` (runtime.json)
        M.check_readable(directory, manifest)  # ONNX Runtime opens them itself: one line here, not its traceback
        # one copy of the shared weights, used in place by every session whose graph holds them
        self.shared = shared_weights(directory, manifest)
        self._shared_ov = {n: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, t) for n, (a, t) in self.shared.items()}
        self.tied_head_graphs = tied_head_graphs(manifest, self.shared) if device == "cpu" else set()
        self.sessions: dict[str, ort.InferenceSession] = {}
        for graph in (C.TARGET, C.DRAFT_CONTEXT, C.DRAFT_BLOCK) if drafter else (C.TARGET,):
            self.sessions[graph] = self._session(graph)
            if release_mapped:  # before the next session adds its own memory to the peak
                self._release_mapped(last=graph == C.DRAFT_BLOCK or not drafter)

    def _release_mapped(self, last: bool) -> None:
        """Drop the pages of shared.data that building a session read (ORT prepacks the LM
        head into its own buffer; the mapped original stays resident, a second copy in RSS).
        The mapping stays valid. Once the last session is built, the mapping is marked random
        access and the file's pages leave the page cache, so that the embedding's Gather
        faults back a page per row it reads: otherwise each fault maps the large page-cache
        folio around it (the build read the file sequentially), and a 512-token prompt of
        random ids pulled 315 MB back in. Copy-on-write pages are never written: nothing is lost."""
        arrays = [a for a, _ in self.shared.values()]
        maps = {id(m): m for m in (getattr(a, "_mmap", None) for a in arrays) if m is not None}
        for m in maps.values():
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):  # Linux/macOS; elsewhere a no-op
                m.madvise(mmap.MADV_DONTNEED)
                if last and hasattr(mmap, "MADV_RANDOM"):
                    m.madvise(mmap.MADV_RANDOM)
        files = {str(f) for f in (getattr(a, "filename", None) for a in arrays) if f}
        for f in files if last and hasattr(os, "posix_fadvise") else ():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages only: a hint, never a loss
            finally:
                os.close(fd)

    def _session(self, graph: str) -> ort.InferenceSession:
        opts = ort.SessionOptions()
        threads = self.graph_threads.get(graph, self.threads)
        if threads:
            opts.intra_op_num_threads = threads
        # spinning workers burn the other vCPU between calls: ~2x slower calls on shared machines
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spin else "0")
        if self.spin:  # spin within a call only: each graph's session has its own pool, and pools left
            # spinning after their call took the vCPU the next graph's workers needed (docs/performance.md)
            opts.add_session_config_entry("session.force_spinning_stop", "1")
            if self.spin_us:  # an idle worker blocks after this long (docs/performance.md, "Threads and spinning")
                opts.add_session_config_entry("session.intra_op.spin_duration_us", str(self.spin_us))
        path = self.directory / self.manifest.graphs[graph].file
        for name, t in self.manifest.shared.items():
            if graph in t.graphs:
                opts.add_initializer(name, self._shared_ov[name])
        kwargs = {}
        if self.low_memory:  # no per-session transposed/prepacked LM head: one copy, slower GEMMs
            opts.add_session_config_entry("session.disable_prepacking", "1")
            kwargs["disabled_optimizers"] = ["ConstantFolding"]
        elif graph in self.tied_head_graphs:
            # Transpose(table) + MatMul: folded, ORT keeps the transposed copy beside the packed
            # one; unfolded it fuses into FusedMatMul(transB=1), packed from the table: one copy
            kwargs["disabled_optimizers"] = ["ConstantFolding"]
        if self.provider == PROVIDERS["tensorrt"] and C.flavour(self.manifest) == "ort":
            raise DFlashError(f"{self.directory} was exported with --attention ort (com.microsoft "
                              "GroupQueryAttention), which TensorRT cannot run; re-export with --attention standard")
        try:
            providers = [self.provider]
            if self.provider == PROVIDERS["tensorrt"]:  # explicit profiles + engine cache outside OUT (runtime/ort/trt_provider.py)
                m = self.manifest
                self.max_chunk = min(self.max_chunk, m.max_context - m.block_size)  # the profile's longest prefill
                opts_trt = ort_trt_provider_options(m, graph, max_prompt=self.max_chunk)
                providers = [(self.provider, opts_trt), PROVIDERS["cuda"]]
            return ort.InferenceSession(str(path), opts, providers=providers, **kwargs)
        except Exception as e:  # ORT raises its own types; one line for the user
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if self.manifest.dtype == "bf16" and self.provider == PROVIDERS["cpu"]:
                raise DFlashError(f"{path}: ONNX Runtime's CPU provider cannot run bf16 graphs; use "
                                  "--provider cuda or the TensorRT backend, or export with --dtype fp16/fp32") from None
            raise DFlashError(f"{path}: onnxruntime {ort.__version__} with {self.provider} cannot load the {graph} "
                              f"graph: {first}{load_hint(first)}") from None
