"""Files the user cannot read: one `error:` line and exit 2 from every command, never a traceback.

Each command meets an artifact file it may not read, a directory where a file should be, and
a binary file where text should be. The tests run as root, whom `chmod 000` does not stop: the
unreadable case then also drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the effective
capabilities of this thread while the command runs (`unreadable`), so the kernel refuses the open
exactly as it does for any other user; the capabilities come back afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from runtime_cases import CASES, artifact
from test_runtime_cli import char_tokenizer

from dflash_export.cli import cli
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime import files, manifest as M

DAC = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (linux/capability.h)


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextlib.contextmanager
def _without_dac_override():
    """Root without the capabilities that let it read any file (this thread's effective set only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _Header(0x20080522, 0), (_Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip("capget failed: cannot make a file unreadable to root here")
    saved = data[0].effective
    data[0].effective &= ~DAC
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip("capset failed: cannot make a file unreadable to root here")
    try:
        yield
    finally:
        data[0].effective = saved
        libc.capset(ctypes.byref(header), data)


@contextlib.contextmanager
def unreadable(path: Path):
    """`path` unreadable by this process, as `chmod 000` makes it for a user who does not own it."""
    mode = path.stat().st_mode
    path.chmod(0)
    try:
        with _without_dac_override() if os.geteuid() == 0 else contextlib.nullcontext():
            with pytest.raises(PermissionError):  # the premise: the kernel refuses it now
                open(path, "rb").close()
            yield
    finally:
        path.chmod(mode)


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_line(r, *words):
    assert r.exit_code == 2, (r.exit_code, r.output)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in r.output, r.output
    for w in words:
        assert w in last, last


def tokenized_copy(out):
    """A copy at `out` of a small cached export, with a character-level tokenizer."""
    shutil.copytree(artifact(CASES["qwen2"])[2], out)
    char_tokenizer(out / "tokenizer.json")
    m = M.load_manifest(out, verify=False)
    m.tokenizer = True
    M.write_manifest(out, m)
    return out


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """A copy of a small cached export, with a tokenizer, that the tests break and repair."""
    return tokenized_copy(tmp_path_factory.mktemp("files") / "art")


def test_the_reader_names_each_cause(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "bin").write_bytes(b"\x00\xff\xfe\x80 not text")
    (tmp_path / "ok.txt").write_text("fine\n")
    for name, cause in (("dir", "a directory, not a file"), ("missing", "no such file"), ("bin", "not UTF-8 text, byte 0xff")):
        with pytest.raises(DFlashError, match=cause):
            files.read_text(tmp_path / name, "fix it", "--x ")
    with pytest.raises(DFlashError, match="a directory"):
        files.readable(tmp_path / "dir")
    with unreadable(tmp_path / "ok.txt"):
        with pytest.raises(DFlashError, match=r"ok.txt: unreadable \(permission denied"):
            files.read_text(tmp_path / "ok.txt")
        with pytest.raises(DFlashError, match="permission denied"):
            files.readable(tmp_path / "ok.txt")
    assert files.read_text(tmp_path / "ok.txt") == "fine\n"


COMMANDS = {  # each command over the artifact, as cheap as it runs
    "generate": ["generate", "{art}", "--prompt-ids", "1,2", "--max-new-tokens", "2"],
    "info": ["info", "{art}"],
    "bench": ["bench", "{art}", "--max-new-tokens", "2", "--threads", "1", "--warmup", "0", "--off-domain", "0"],
    "check": ["check", "{art}", "--num-prompts", "0"],  # the hashes are verified before any source loads
    "serve": ["serve", "{art}", "--port", "0"],  # refused before it binds
}
FILES = ["target.data", "draft_block.onnx", "tokenizer.json"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", FILES)
def test_an_unreadable_artifact_file_is_one_line(art, command, name):
    args = [a.format(art=art) for a in COMMANDS[command]]
    with unreadable(art / name):
        assert_one_line(run(*args), f"{name}: unreadable (permission denied")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_directory_in_place_of_an_artifact_file_is_one_line(art, command):
    args = [a.format(art=art) for a in COMMANDS[command]]
    data = art / "draft_context.data"
    kept = data.with_name("kept")
    data.rename(kept)
    data.mkdir()
    try:
        assert_one_line(run(*args), "draft_context.data", "a directory, not a file")
    finally:
        data.rmdir()
        kept.rename(data)


@pytest.mark.parametrize("command", ["generate", "bench", "check", "demo"])
def test_bad_prompts_files_are_one_line(art, tmp_path, command):
    """--prompts: a binary file, a directory, a missing file, JSONL without prompts."""
    (tmp_path / "p.bin").write_bytes(bytes(range(128, 256)))
    (tmp_path / "p.dir").mkdir()
    (tmp_path / "p.jsonl").write_text('{"text": "no prompt field"}\n')
    (tmp_path / "p.txt").write_text("1,2,3\n")
    base = {"generate": ["generate", art, "--max-new-tokens", "2"], "bench": ["bench", art, "--max-new-tokens", "2"],
            "check": ["check", art], "demo": ["demo", "--out", tmp_path / "demo-out"]}[command]
    for name, cause in (("p.bin", "not UTF-8 text"), ("p.dir", "a directory, not a file"), ("missing", "no such file"),
                        ("p.jsonl", 'needs a "prompt" string')):
        assert_one_line(run(*base, "--prompts", tmp_path / name), f"--prompts {tmp_path / name}", cause)
    if command != "demo":
        with unreadable(tmp_path / "p.txt"):
            assert_one_line(run(*base, "--prompts", tmp_path / "p.txt"), "permission denied")
    assert not (tmp_path / "demo-out").exists()


def test_bad_files_in_the_manifest_and_beside_it(art):
    """runtime.json (read beside the manifest, not listed in it) as a directory."""
    cfg = art / "runtime.json"
    cfg.mkdir()
    try:
        assert_one_line(run(*COMMANDS["generate"][:1], art, "--prompt-ids", "1", "--max-new-tokens", "1"),
                        "runtime.json: unreadable (a directory")
    finally:
        cfg.rmdir()


def test_serve_files(art, tmp_path):
    """--chat-template and --api-key-file: binary, a directory, unreadable; refused before the server binds."""
    (tmp_path / "t.bin").write_bytes(b"\xff" * 8)
    (tmp_path / "key").write_text("secret\n")
    for flag in ("--chat-template", "--api-key-file"):
        assert_one_line(run("serve", art, flag, tmp_path / "t.bin"), flag, "not UTF-8 text")
        assert_one_line(run("serve", art, flag, tmp_path), flag, "a directory, not a file")
        with unreadable(tmp_path / "key"):
            assert_one_line(run("serve", art, flag, tmp_path / "key"), flag, "permission denied")
