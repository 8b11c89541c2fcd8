"""Where a model comes from: a local directory, or a Hugging Face id at a revision.

`--target` / `--draft` take either. A directory that exists always wins; anything else
shaped like `org/name[@revision]` is resolved by huggingface_hub's `snapshot_download`, the
library users already have: its cache (HF_HOME, HF_HUB_CACHE), HF_HUB_OFFLINE, the token
from the usual places and its progress bars all behave as in transformers or vLLM. Only the
files an export reads are fetched (configs, safetensors, tokenizer). Written by hand, not
found in a library: the one-line messages for the hub's exceptions, and the manifest's
record of each model (id, asked revision, resolved commit, sha256 of the weight files), so
an artifact says which revision of a drafter it was built from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import
from ..runtime.manifest import sha256_file

hub = lazy_import("huggingface_hub")  # only when an id is resolved
hub_constants = lazy_import("huggingface_hub.constants")

# what export, check and train-draft read from a checkpoint (export/save.py copies the tokenizer files)
PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model"]
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name (single-name legacy ids read as directories)
COMMIT = re.compile(r"[0-9a-f]{40}")
CACHED = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")


@dataclass
class Source:
    """A model's files on this machine and where they came from."""

    path: Path  # the directory holding config.json and the weights
    repo_id: str | None = None  # a Hugging Face id (also for a directory inside the hub cache)
    revision: str | None = None  # the revision asked for (None: the default branch)
    commit: str | None = None  # the commit it resolved to

    @property
    def label(self) -> str:
        """How messages name it: `org/name@<commit>` for hub models, else the directory."""
        if self.repo_id is None:
            return str(self.path)
        return f"{self.repo_id}@{(self.commit or self.revision or 'main')[:12]}"

    def record(self) -> dict:
        """The manifest's record: id (or directory), revision, commit, sha256 of the weight files."""
        return {"id": self.repo_id, "path": None if self.repo_id else str(self.path.absolute()),
                "revision": self.revision, "commit": self.commit, "files": weight_hashes(self.path)}


def resolve(spec: str | Path | Source, revision: str | None = None, what: str = "model") -> Source:
    """A directory (which always wins) or `org/name[@revision]` -> its Source, fetched if needed."""
    if isinstance(spec, Source):
        return spec
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if revision is not None:
            raise DFlashError(f"--revision {revision} is for Hugging Face ids; {what} {text} is a local directory")
        return local(path)
    repo_id, _, rev = text.partition("@")
    if rev and revision and rev != revision:
        raise DFlashError(f"{what} {text} names revision {rev} but --revision says {revision}; give it once")
    rev = rev or revision
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1 or not REPO_ID.fullmatch(repo_id):
        raise DFlashError(f"{what} directory {text} does not exist (nor is it a Hugging Face id, org/name[@revision])")
    return download(repo_id, rev, what)


def local(path: Path) -> Source:
    """A directory; one inside the hub cache (.../models--org--name/snapshots/<commit>) keeps its id and commit."""
    m = CACHED.search(path.absolute().as_posix())
    if m:
        return Source(path, f"{m['org']}/{m['name']}", None, m["commit"])
    return Source(path)


def download(repo_id: str, revision: str | None, what: str) -> Source:
    """snapshot_download of the files an export reads; every hub failure becomes one line that says what to do."""
    name = f"{what} {repo_id}" + (f"@{revision}" if revision else "")
    fetch = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision else "`")
    try:
        folder = hub.snapshot_download(repo_id, revision=revision, allow_patterns=PATTERNS)
    except Exception as e:  # the hub's exception classes vary across versions: matched by name below
        raise DFlashError(hub_message(e, name, repo_id, revision, fetch)) from None
    path = Path(folder)
    commit = path.name if COMMIT.fullmatch(path.name) else None
    if not (path / "config.json").is_file():
        have = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise DFlashError(f"{name} has no config.json{' (it has ' + ', '.join(have[:5]) + ')' if have else ''}: "
                          "not a Hugging Face transformers checkpoint (safetensors + config.json)")
    return Source(path, repo_id, revision, commit)


def hub_message(e: Exception, name: str, repo_id: str, revision: str | None, fetch: str) -> str:
    kinds = {c.__name__ for c in type(e).__mro__}
    offline = bool(getattr(hub_constants, "HF_HUB_OFFLINE", False))
    cache = getattr(hub_constants, "HF_HUB_CACHE", "the Hugging Face cache")
    if "RevisionNotFoundError" in kinds:
        return f"{name}: revision {revision!r} does not exist in {repo_id} (a branch, tag or commit on the Hub)"
    if "GatedRepoError" in kinds:
        return f"{name} is gated: accept its terms on huggingface.co and log in (`hf auth login` or HF_TOKEN)"
    if "RepositoryNotFoundError" in kinds:
        return (f"{name}: no such local directory, and no such repository on the Hugging Face Hub (or it is private: "
                "log in with `hf auth login` or set HF_TOKEN)")
    if "HFValidationError" in kinds:
        return f"{name} is not a directory nor a valid Hugging Face id ({str(e).splitlines()[0]})"
    if "IncompleteSnapshotError" in kinds:
        return f"{name}: the cached copy in {cache} is incomplete; complete it with {fetch} (online)"
    if "LocalEntryNotFoundError" in kinds or "OfflineModeIsEnabled" in kinds:
        cached = cached_revisions(repo_id)
        have = f" (cached: {', '.join(cached)})" if cached else ""
        if offline:
            what = f"revision {revision!r} of {repo_id} is" if revision and cached else f"{repo_id} is"
            return (f"{name}: {what} not in the local Hugging Face cache {cache}{have} (nor a local directory) and "
                    f"HF_HUB_OFFLINE is set; "
                    f"fetch it with {fetch} or unset HF_HUB_OFFLINE")
        return (f"{name}: the Hugging Face Hub cannot be reached and it is not in the cache {cache}{have}; "
                f"check the network, or fetch it elsewhere with {fetch} and copy the cache")
    first = (str(e).splitlines() or [type(e).__name__])[0]
    return f"{name}: could not be fetched from the Hugging Face Hub ({type(e).__name__}: {first})"


def cached_revisions(repo_id: str) -> list[str]:
    """The refs (branches, tags) and commits the cache holds for repo_id, for the not-cached message."""
    root = Path(getattr(hub_constants, "HF_HUB_CACHE", "")) / f"models--{repo_id.replace('/', '--')}"
    refs = [p.relative_to(root / "refs").as_posix() for p in (root / "refs").rglob("*") if p.is_file()]
    commits = [p.name[:12] for p in (root / "snapshots").glob("*") if p.is_dir()]
    return sorted(refs) + sorted(commits)


def weight_hashes(directory: Path) -> dict[str, str]:
    """sha256 of a checkpoint's weight files (and its shard index): what an export was made of."""
    files = sorted(Path(directory).glob("*.safetensors")) + sorted(Path(directory).glob("*.safetensors.index.json"))
    return {f.name: sha256_file(f) for f in files}


def differences(recorded: dict | None, source: Source, what: str) -> list[str]:
    """One warning line per way `source` differs from what an export recorded of it (none: it matches)."""
    if not recorded:
        return []
    out = []
    if recorded.get("id") and source.repo_id and recorded["id"] != source.repo_id:
        out.append(f"{what} {source.label} is not {recorded['id']}, which the export was built from")
    elif recorded.get("commit") and source.commit and recorded["commit"] != source.commit:
        out.append(f"{what} {source.label}: the export was built from commit {recorded['commit'][:12]}")
    then, now = recorded.get("files", {}), weight_hashes(source.path)
    changed = sorted(f for f in set(then) | set(now) if then.get(f) != now.get(f))
    if changed:
        out.append(f"{what} {source.label}: {', '.join(changed)} no longer match the export's record "
                   "(changed, added or removed since); the comparison below is against the files there now")
    return out


def spec_of(recorded: dict | None) -> str | None:
    """What to resolve to find a recorded source again: `id@commit`, or its directory."""
    if not recorded:
        return None
    if recorded.get("id"):
        return f"{recorded['id']}@{recorded['commit']}" if recorded.get("commit") else recorded["id"]
    return recorded.get("path")
