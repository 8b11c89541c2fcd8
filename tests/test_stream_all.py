"""Every weight streamed from the checkpoint at export (export/stream.py), on tiny dense pairs.

- the streamed export writes the same graphs, byte for byte, as loading the float model does
  (fp32 from a bf16 checkpoint, and int4 with the tied head and the drafter quantized: the
  codes and scales ONNX Runtime's quantizer makes);
- nothing of the checkpoint is held: every parameter the graphs were traced on is a one-element
  placeholder, and a child process exporting a checkpoint of 87 MB of bf16 (173 MB of fp32
  weights) peaks below what loading it takes by most of those;
- the room check reads a cgroup's limit (v1 and v2, fake trees) and says what the streamed
  export needs: about its largest tensor plus the graphs.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_export.runtime.errors import DFlashError
from dflash_export.export import artifact, stream
from dflash_export.export.quantize import QuantOptions
from dflash_export.runtime import memory
from dflash_export.models.tiny import make_drafter, make_target

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("same_export", ROOT / "tools" / "same_export.py")
same_export = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(same_export)


def _bf16(d: Path) -> Path:
    for f in d.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, str(f), metadata={"format": "pt"})
    return d


def _identical(a: Path, b: Path) -> None:
    for g in ("target", "draft_context", "draft_block"):
        diff = same_export.differences(same_export.graph(a, g), same_export.graph(b, g))
        assert not diff, (g, diff)


@pytest.mark.parametrize("arch,kw", [
    ("qwen3", dict(dtype="fp32")),
    ("llama", dict(attention="ort", quantize=QuantOptions("int4", 32, lm_head=True, draft=True, accuracy_level=4))),
])
def test_streamed_export_is_the_in_memory_one_and_holds_no_weight(tmp_path, monkeypatch, arch, kw):
    t = _bf16(make_target(tmp_path / "t", arch, seed=1, layers=3))  # llama: tied embeddings
    d = _bf16(make_drafter(tmp_path / "d", t, seed=2))
    held = []
    trace = artifact.trace_graphs

    def tracing(target, drafter, *a, **k):  # what the graphs are traced on
        held.extend(p.untyped_storage().nbytes() for m in (target, drafter) for p in m.parameters())
        return trace(target, drafter, *a, **k)

    monkeypatch.setattr(artifact, "trace_graphs", tracing)
    artifact.export_artifact(t, d, tmp_path / "streamed", progress=False, **kw)
    assert held and max(held) <= 4, max(held)  # one element each: nothing of the checkpoint loaded
    monkeypatch.setattr(artifact, "streams_all", lambda *a: False)
    artifact.export_artifact(t, d, tmp_path / "loaded", progress=False, **kw)
    _identical(tmp_path / "streamed", tmp_path / "loaded")


CHILD = textwrap.dedent("""
    import json, sys
    from dflash_export.export import artifact
    if sys.argv[3] == "loaded":
        artifact.streams_all = lambda *a: False
    def status(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
    import torch, onnx, onnxruntime, onnxscript  # noqa: F401  (their memory is not the export's)
    before = status("VmRSS")
    artifact.export_artifact(sys.argv[1] + "/t", sys.argv[1] + "/d", sys.argv[2], progress=False, room_check=False)
    # VmHWM, not ru_maxrss: after fork + exec that starts at the parent's peak (pytest's, with torch loaded)
    print(json.dumps({"before": before, "peak": status("VmHWM")}))
""")


def test_streamed_export_peaks_below_the_weights(tmp_path):
    """87 MB of bf16 weights (173 MB exported as fp32): loading the model (the path streaming
    replaced) peaks higher than the streamed export by most of the fp32 weights; the streamed
    one holds the graphs and its largest tensor (here the 41 MB bf16 LM head, read to be
    transposed) besides."""
    t = _bf16(make_target(tmp_path / "t", "qwen3", seed=1, layers=1, hidden=512, heads=4, kv_heads=2, head_dim=128,
                          intermediate=1024, vocab=40000))
    make_drafter(tmp_path / "d", t, seed=2)
    weights = 4 * artifact.checkpoint_elements(t)
    assert weights > 150e6, weights
    grown = {}
    for how in ("streamed", "loaded"):
        out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(tmp_path / how), how],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        grown[how] = r["peak"] - r["before"]
    # both trace the same graphs (~130 MB here, whatever the weights); loading adds the weights
    assert grown["loaded"] - grown["streamed"] > 0.6 * weights, (grown, weights)
    _identical(tmp_path / "streamed", tmp_path / "loaded")


def _tree(root: Path, cgroup: str, files: dict[str, str], avail_kb: int = 20_000_000) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal: 30000000 kB\nMemAvailable: {avail_kb} kB\n")
    (root / "proc/self/cgroup").write_text(cgroup)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_available_memory_reads_cgroup_limits(tmp_path):
    """v2: memory.max less memory.current, the tightest up the tree; v1: memory.limit_in_bytes less
    memory.usage_in_bytes of the memory controller's path ('no limit', 2^63, is none); none set: MemAvailable."""
    v2 = _tree(tmp_path / "v2", "0::/box/job\n", {
        "sys/fs/cgroup/box/memory.max": str(16 << 30), "sys/fs/cgroup/box/memory.current": str(1 << 30),
        "sys/fs/cgroup/box/job/memory.max": "max", "sys/fs/cgroup/box/job/memory.current": str(1 << 30)})
    assert memory.available_memory(v2) == 15 << 30
    v1 = _tree(tmp_path / "v1", "5:cpu:/\n4:memory:/x\n0::/\n", {
        "sys/fs/cgroup/memory/x/memory.limit_in_bytes": str(16 << 30),
        "sys/fs/cgroup/memory/x/memory.usage_in_bytes": str(4 << 30),
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(20 << 30)})
    assert memory.available_memory(v1) == 12 << 30
    none = _tree(tmp_path / "none", "0::/\n", {"sys/fs/cgroup/memory.max": "max", "sys/fs/cgroup/memory.current": "1"})
    assert memory.available_memory(none) == 20_000_000 * 1024


def test_room_check_of_a_streamed_export(tmp_path, monkeypatch):
    """Qwen3-8B's shape in bf16: an fp32 export holds about the LM head (read whole in bf16 to
    be transposed: 1.2 GB; the embedding streams in chunks) plus the graphs, not its 33 GB of
    weights, and int4 the same (a quantized MLP weight's two fp32 copies are 0.4 GB); it
    writes the artifact (33 GB fp32, about 8.6 GB for int4 with the head and embedding in fp32)."""
    E = stream.Entry
    entries = [E(Path("x"), "model.embed_tokens.weight", "BF16", (151936, 4096), 0),
               E(Path("x"), "lm_head.weight", "BF16", (151936, 4096), 0)]
    for i in range(36):
        entries += [E(Path("x"), f"model.layers.{i}.mlp.{p}.weight", "BF16", (12288, 4096), 0) for p in ("gate_proj", "up_proj")]
        entries += [E(Path("x"), f"model.layers.{i}.mlp.down_proj.weight", "BF16", (4096, 12288), 0)]
        entries += [E(Path("x"), f"model.layers.{i}.self_attn.{p}.weight", "BF16", s, 0)
                    for p, s in (("q_proj", (4096, 4096)), ("k_proj", (1024, 4096)), ("v_proj", (1024, 4096)),
                                 ("o_proj", (4096, 4096)))]
    need, disk, largest = artifact.stream_room(entries, "fp32", None)
    assert largest == "lm_head.weight" and 2.7e9 < need < 2.8e9, (need, largest)
    assert 32e9 < disk < 33e9, disk
    need4, disk4, largest4 = artifact.stream_room(entries, "fp32", QuantOptions("int4", 128))
    assert (need4, largest4) == (need, largest)
    assert 8e9 < disk4 < 9e9, disk4  # the embedding and head stay fp32: 5 GB of it
    monkeypatch.setattr(artifact, "available_memory", lambda: 2 * 10**9)
    with pytest.raises(DFlashError, match=r"needs about 2.7 GB of memory \(lm_head.weight read whole, "):
        artifact.check_stream_room(need, disk, largest, tmp_path, "fp32", None)
    monkeypatch.setattr(artifact, "available_memory", lambda: 16 * 10**9)
    monkeypatch.setattr(artifact.shutil, "disk_usage", lambda p: type("U", (), {"free": 20 * 10**9})())
    with pytest.raises(DFlashError, match="writes about 32.* --quantize int4"):
        artifact.check_stream_room(need, disk, largest, tmp_path, "fp32", None)
    artifact.check_stream_room(need, disk4, largest, tmp_path, "fp32", QuantOptions("int4", 128))


def test_kill_9_mid_quantize_leaves_only_what_the_next_run_removes(tmp_path):
    """An `export --quantize int4` killed (-9) while it writes the quantized artifact leaves its two
    staging folders beside --out (the float export's stand-ins, the quantized one's partial files)
    and nothing else; the next export to the same --out removes both (runtime/outdir.py)."""
    import os
    import signal
    import time

    from dflash_export.runtime.outdir import clean_stale

    t = make_target(tmp_path / "t", "qwen3", seed=1, layers=2)
    d = make_drafter(tmp_path / "d", t, seed=2)
    work = tmp_path / "w"
    work.mkdir()
    exe = Path(sys.executable).with_name("dflash-export")
    p = subprocess.Popen([str(exe), "export", "--target", str(t), "--draft", str(d), "--out", str(work / "art"),
                          "--quantize", "int4", "--quant-accuracy-level", "4", "--quiet"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and p.poll() is None:
        if any(work.glob(".art.partial-q*/*.data")):
            break
        time.sleep(0.05)
    assert p.poll() is None, "the export ended before its quantized files were being written"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    left = sorted(x.name for x in work.iterdir())
    assert left and all(x.startswith(".art.partial") for x in left), left
    assert sorted(x.name for x in clean_stale(work / "art")) == left
    assert not any(work.iterdir())
