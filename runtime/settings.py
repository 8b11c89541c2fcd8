"""Measured runtime choices of one exported directory: `runtime.json` beside the manifest.

The graphs say what to compute; this file says how fast to run them on a given machine:
intra-op threads (per graph), ORT spinning, the prefill chunk and the adaptive verify
policy, as `bench --calibrate` measured them. It is allowed in the directory but not hashed (contract.RUNTIME), so
calibrating never touches a graph hash. One entry per device key ("ort:cpu", "ort:cuda",
"trt"), so one artifact can carry the choices of several devices.

Defaults without a calibration never make things slower than the measured alternatives on
a shared 2-vCPU machine (docs/results.md, docs/performance.md): spinning off, the full block, and 1 thread for
small graphs (hidden < 1024), where a second thread only adds synchronisation, else one
thread per CPU (real-size graphs are memory-bound and gain from it).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .contract import RUNTIME
from .controller import Costs

from .errors import DFlashError
from .files import read_json
from .manifest import Manifest
from .options import option

RUNTIME_FORMAT = "dflash-export-runtime"
WIDE = 1024  # hidden size from which graphs are memory-bound enough to gain from more threads
DEFAULT_CHUNK = 256  # prefill positions per target call when nothing was calibrated


@dataclass
class VerifyPolicy:
    """Verify 1 + (leading drafts whose cumulative top-1 probability >= theta) positions,
    at least `min_len`; theta 0 verifies the whole block. Lossless for any values: the
    target still decides every emitted token, fewer positions only end a round earlier."""

    theta: float = 0.0
    min_len: int = 1

    def length(self, conf: np.ndarray | None, s_max: int) -> int:
        if self.theta <= 0 or conf is None or s_max <= 1:
            return s_max
        confident = int((np.cumprod(conf[: s_max - 1]) >= self.theta).sum())  # cumprod never grows
        return min(s_max, max(self.min_len, 1 + confident))


FULL = VerifyPolicy()


def pad_verify(lens: np.ndarray, room) -> int:
    """The verify length S of a batched call (its longest row's), after each row with room[b] > 0
    was let verify up to S (at most room[b] positions): the padding of a shorter row is computed
    anyway, so verifying drafts there is free and can only accept more. Lossless; room 0 for
    rows whose output depends on their verify length (rejection sampling) and plain rows."""
    S = int(max(lens))  # a batch's few rows: the builtin is several times numpy's reduction
    for b, r in enumerate(room):
        if r > 0:
            lens[b] = max(lens[b], min(S, r))
    return S


def policy_json(policy: VerifyPolicy | None) -> dict | str:
    """The policy as reports and JSON outputs record it: "full" or {"theta": .., "min_len": ..}."""
    return "full" if policy is None else asdict(policy)


def describe_policy(policy: VerifyPolicy | None) -> str:
    """The policy for people: "full block", or "confident prefix (theta 0.05, at least 3)"."""
    if policy is None or policy.theta <= 0:
        return "full block"
    return f"confident prefix (theta {policy.theta:g}, at least {policy.min_len})"


@dataclass
class Settings:
    threads: int | None = None  # intra-op threads of every graph (None: default_threads)
    spin: bool = False  # ORT intra-op spinning (on costs ~2x on shared vCPUs)
    # while spinning, how long an idle worker spins before it blocks (ORT's session.intra_op.spin_duration_us);
    # None: ORT's own spinning, unbounded in time. Bounded, a worker preempted on a shared vCPU gives it back sooner
    spin_us: int | None = None
    verify: VerifyPolicy | None = None  # None: the whole block
    measured: dict = field(default_factory=dict)  # what the calibration saw, for the record
    # per graph counts over `threads` ({"target": 2, "draft_block": 1, ...}): the target is
    # memory-bound at real sizes, the drafter's small graphs may not gain from a second thread
    graph_threads: dict[str, int] = field(default_factory=dict)
    prefill_chunk: int | None = None  # positions per prefill call (None: DEFAULT_CHUNK)
    # the speculation controller's cost model (runtime/controller.py Costs.from_json: ms by rows and verify
    # length); {}: not calibrated (files written before it), the controller's default model
    costs: dict = field(default_factory=dict)

    def ort_kwargs(self) -> dict:
        """What OrtBackend takes of these settings."""
        return {"threads": self.threads, "graph_threads": dict(self.graph_threads), "spin": self.spin,
                "spin_us": self.spin_us, "max_chunk": self.prefill_chunk or DEFAULT_CHUNK}


def device_key(backend: str, provider: str = "cpu") -> str:
    return "trt" if backend == "trt" else f"ort:{provider}"


def default_threads(manifest: Manifest) -> int:
    """Threads when nothing was calibrated: 1 for small graphs, else every CPU."""
    return 1 if manifest.hidden_size < WIDE else max(1, os.cpu_count() or 1)


def _read(root: Path) -> dict:
    path = Path(root) / RUNTIME
    raw = read_json(path, "delete it or rerun `dflash-export bench --calibrate`")
    if path.is_file() and not (isinstance(raw, dict) and raw.get("format") == RUNTIME_FORMAT
                               and isinstance(raw.get("devices"), dict)):
        raise DFlashError(f"{path}: not a {RUNTIME_FORMAT} file; delete it or rerun `dflash-export bench --calibrate`")
    return raw


def calibrated_devices(root: str | Path) -> list[str]:
    """The device keys runtime.json holds settings for (none: not calibrated)."""
    return sorted(_read(Path(root)).get("devices", {}))


def load_settings(root: str | Path, key: str) -> Settings:
    """The calibrated settings for device `key`, or the defaults (all None / off)."""
    entry = _read(Path(root)).get("devices", {}).get(key)
    if entry is None:
        return Settings()
    try:
        v = entry.get("verify")
        s = Settings(threads=entry.get("threads"), spin=bool(entry.get("spin", False)), spin_us=entry.get("spin_us"),
                     verify=VerifyPolicy(float(v["theta"]), int(v["min_len"])) if v else None,
                     measured=entry.get("measured", {}), graph_threads=dict(entry.get("graph_threads") or {}),
                     prefill_chunk=entry.get("prefill_chunk"), costs=dict(entry.get("costs") or {}))
        if s.costs:
            Costs.from_json(s.costs)  # checked here: a bad file is one line at load, not an error mid-run
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise DFlashError(f"{Path(root) / RUNTIME}: malformed entry {key!r} ({e}); rerun `dflash-export bench --calibrate`") from None
    counts = {"threads": s.threads, "prefill_chunk": s.prefill_chunk, "spin_us": s.spin_us, **{f"graph_threads.{g}": n for g, n in s.graph_threads.items()}}
    for what, n in counts.items():
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise DFlashError(f"{Path(root) / RUNTIME}: {what} must be a positive integer (got {n!r}); "
                              "rerun `dflash-export bench --calibrate`")
    return s


def save_settings(root: str | Path, key: str, settings: Settings) -> Path:
    """Write (atomically) the entry for `key`, keeping other devices' entries."""
    root = Path(root)
    raw = _read(root) or {"format": RUNTIME_FORMAT, "version": 1, "devices": {}}
    raw["devices"][key] = asdict(settings)
    path, tmp = root / RUNTIME, root / (RUNTIME + ".tmp")
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    os.replace(tmp, path)
    return path


BACKENDS = ("ort", "trt")
VERIFY = ("auto", "full")
SPECULATION = ("auto", "always", "never")


@dataclass(kw_only=True)
class RunOptions:
    """How a command runs an exported directory, as the user gave it: the options `generate`,
    `bench`, `demo` and `serve` share, declared once (cli/options.py makes them options) and
    checked once, when the record is made. `resolve` turns them into the run's Settings:
    these over runtime.json's calibrated values over the defaults (None: not given)."""

    backend: str = option("ort", "ort: ONNX Runtime (see --provider); trt: the TensorRT engines of `dflash-export build`.",
                          choices=BACKENDS, show_default=True)
    provider: str = option("cpu", "ONNX Runtime execution provider: cpu | cuda | tensorrt.", show_default=True)
    threads: int | None = option(None, "ONNX Runtime intra-op threads of every graph (default: runtime.json's calibrated "
                                       "count, else 1 for small models and one per CPU from hidden size 1024).", type=int)
    spin: bool | None = option(None, "Let ORT's idle threads spin [default: as `bench --calibrate` measured (it tries "
                                     "both), else off: spinning made calls ~2x slower on shared vCPUs].",
                               opt="--spin/--no-spin")
    verify: str = option("auto", "auto: verify the drafter's confident prefix as runtime.json's calibrated policy says "
                                 "(the full block when there is none); full: always the whole block.",
                         choices=VERIFY, show_default=True)
    speculation: str = option("auto", "auto: draft while it pays (recent acceptance against runtime.json's calibrated "
                                      "costs), else plain steps that probe now and then; always: draft every round; "
                                      "never: plain decoding of the target.", choices=SPECULATION, show_default=True)

    def __post_init__(self):
        for name, value, allowed in (("--backend", self.backend, BACKENDS), ("--verify", self.verify, VERIFY),
                                     ("--speculation", self.speculation, SPECULATION)):
            if value not in allowed:
                raise DFlashError(f"{name} must be one of {', '.join(allowed)} (got {value!r})")
        if self.threads is not None and self.threads < 1:
            raise DFlashError(f"--threads must be >= 1 (got {self.threads})")

    @property
    def device(self) -> str:
        """runtime.json's key for this backend and provider."""
        return device_key(self.backend, self.provider)


def resolve(root: str | Path, manifest: Manifest, run: RunOptions) -> Settings:
    """What one run uses: the given options over the calibrated file over the defaults
    (`threads` given: every graph runs with it, the calibrated per-graph counts are ignored)."""
    s = load_settings(root, run.device)
    return Settings(
        threads=run.threads or s.threads or default_threads(manifest),
        spin=s.spin if run.spin is None else run.spin,
        spin_us=s.spin_us,  # the calibrated bound, also under an explicit --spin
        verify=s.verify if run.verify == "auto" else None,
        measured=s.measured,
        graph_threads={} if run.threads else s.graph_threads,
        prefill_chunk=s.prefill_chunk,
        costs=s.costs,
    )
