"""A Hugging Face hub cache built on disk, in the layout huggingface_hub reads offline.

`<cache>/models--org--name/blobs/<sha256>` hold the bytes, `snapshots/<commit>/<file>` link
to them and `refs/<branch or tag>` hold a commit: what `snapshot_download` leaves behind.
`offline_hub` points huggingface_hub at such a cache with HF_HUB_OFFLINE set and makes any
network connection fail, so a test that resolves ids proves it needs none.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
from pathlib import Path

import pytest


def put(cache: Path, repo_id: str, directory: Path, refs: tuple[str, ...] = ("main",), commit: str | None = None) -> str:
    """Store `directory`'s files as one commit of `repo_id` (refs point at it) -> the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in Path(directory).rglob("*") if p.is_file())
    commit = commit or hashlib.sha1(repo_id.encode() + b"".join(p.read_bytes() for p in files)).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for p in files:
        data = p.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            shutil.copyfile(p, blob)
        link = snap / p.relative_to(directory)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return commit


@contextlib.contextmanager
def offline_hub(root: Path):
    """huggingface_hub offline on the cache `root`/hub (HF_HOME `root`), the network unreachable."""
    import huggingface_hub.constants as hc

    cache = Path(root) / "hub"
    cache.mkdir(parents=True, exist_ok=True)

    def refuse(*args, **kwargs):
        raise AssertionError(f"a test tried to reach the network: {args}")

    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"HF_HOME": str(root), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}.items():
            mp.setenv(k, v)
        mp.setattr(hc, "HF_HUB_CACHE", str(cache))  # read when huggingface_hub was imported
        mp.setattr(hc, "HF_HUB_OFFLINE", True)
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket, "create_connection", refuse)
        yield cache
