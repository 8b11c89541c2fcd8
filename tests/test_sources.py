"""Models by Hugging Face id and revision, offline against a hub cache built on disk (nothing
here may reach the network: hub_cache.offline_hub makes any connection fail): resolution,
the one-line refusals, the manifest's record of each source (info shows it, check finds the
pair by it and warns when files changed), and a speculators-format drafter exported by id
with the same outputs as its z-lab original (check against the z-lab drafter)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from hub_cache import offline_hub, put
from runtime_cases import _bias_target
from safetensors.torch import load_file, save_file
from speculators_format import to_speculators

from dflash_export.export import sources as S
from dflash_export.cli import cli
from dflash_export.runtime import manifest as M
from dflash_export.models.tiny import make_drafter, make_target

IDS = np.array(sorted({7, 96, *range(0, 40, 2)}))  # the speculators drafter's draft vocabulary (22 of 97)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """An offline hub cache holding a tiny target, a z-lab drafter at two commits (v1, main), its
    speculators conversion with a reduced vocabulary, and repositories that are not drafters;
    and the pair exported through the CLI by id: `--draft acme/tiny-speculator --draft-revision v1`."""
    root = tmp_path_factory.mktemp("hub")
    src = root / "src"
    make_target(src / "t", "qwen3", layers=2, vocab=97, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    _bias_target(src / "t", 2.0)  # the target favours token 7: drafts are accepted
    make_drafter(src / "z", src / "t", block_size=4, mask_token_id=95, target_layer_ids=[0])
    make_drafter(src / "z2", src / "t", block_size=4, mask_token_id=95, target_layer_ids=[0], seed=1)
    to_speculators(src / "z", src / "t", src / "s", ids=IDS)
    (src / "gguf").mkdir()
    (src / "gguf" / "model.gguf").write_bytes(b"GGUF")
    to_speculators(src / "z", src / "t", src / "eagle", config_only=True)
    cfg = json.loads((src / "eagle" / "config.json").read_text())
    (src / "eagle" / "config.json").write_text(json.dumps({**cfg, "speculators_model_type": "eagle3"}))
    with offline_hub(root / "hf") as cache:
        commits = {
            "target": put(cache, "acme/tiny", src / "t"),
            "v1": put(cache, "acme/tiny-dflash", src / "z", refs=("v1",)),
            "main": put(cache, "acme/tiny-dflash", src / "z2", refs=("main",)),
            "spec": put(cache, "acme/tiny-speculator", src / "s", refs=("main", "v1")),
        }
        put(cache, "acme/gguf-only", src / "gguf")
        put(cache, "acme/eagle", src / "eagle")
        r = CliRunner().invoke(cli, ["export", "--target", "acme/tiny", "--draft", "acme/tiny-speculator",
                                     "--draft-revision", "v1", "--out", str(root / "art"), "--max-context", "64", "--quiet"])
        assert r.exit_code == 0, r.output
        yield root, cache, commits


def test_ids_and_revisions_resolve_offline(hub, tmp_path, monkeypatch):
    root, cache, c = hub
    assert S.resolve("acme/tiny-dflash").commit == c["main"]
    for spec, rev in (("acme/tiny-dflash@v1", None), ("acme/tiny-dflash", "v1"), (f"acme/tiny-dflash@{c['v1']}", None)):
        s = S.resolve(spec, rev, "drafter")
        assert (s.repo_id, s.commit, s.path.name) == ("acme/tiny-dflash", c["v1"], c["v1"])
        assert s.label == f"acme/tiny-dflash@{c['v1'][:12]}"
    rec = S.resolve("acme/tiny-dflash@v1").record()
    digest = hashlib.sha256((root / "src" / "z" / "model.safetensors").read_bytes()).hexdigest()
    assert rec == {"id": "acme/tiny-dflash", "path": None, "revision": "v1", "commit": c["v1"],
                   "files": {"model.safetensors": digest}}
    monkeypatch.chdir(tmp_path)  # a local directory of the same name wins over the id
    shutil.copytree(root / "src" / "z", tmp_path / "acme" / "tiny-dflash")
    s = S.resolve("acme/tiny-dflash")
    assert s.repo_id is None and s.path.resolve() == (tmp_path / "acme" / "tiny-dflash").resolve()
    snap = cache / "models--acme--tiny-dflash" / "snapshots" / c["v1"]  # a directory in the cache keeps its id
    assert (S.resolve(snap).repo_id, S.resolve(snap).commit) == ("acme/tiny-dflash", c["v1"])


@pytest.mark.parametrize("args,words", [
    (["--draft", "acme/missing"], ["drafter acme/missing: acme/missing is not in the local Hugging Face cache",
                                   "`hf download acme/missing`", "or unset HF_HUB_OFFLINE"]),
    (["--draft", "acme/tiny-dflash@v9"], ["revision 'v9' of acme/tiny-dflash is not in the local Hugging Face cache",
                                          "(cached: main, v1, ", "`hf download acme/tiny-dflash --revision v9`"]),
    (["--draft", "acme/tiny-dflash@v1", "--draft-revision", "main"], ["names revision v1 but --revision says main"]),
    (["--draft", "SRC/z", "--draft-revision", "v1"], ["--revision v1 is for Hugging Face ids", "is a local directory"]),
    (["--draft", "./acme/nowhere"], ["drafter directory ./acme/nowhere does not exist"]),
    (["--draft", "acme/gguf-only"], ["drafter acme/gguf-only has no config.json (it has model.gguf)"]),
    (["--draft", "acme/tiny"], ["is a language model (a target?), not a DFlash drafter"]),
    (["--draft", "acme/eagle"], ["is a speculators 'eagle3' speculator, not a DFlash drafter"]),
    (["--target", "acme/tiny-speculator"], ["is a DFlash drafter (DFlashSpeculator), not a target: pass it as --draft"]),
])
def test_bad_ids_are_one_line_and_write_nothing(hub, tmp_path, args, words):
    root, cache, _ = hub
    args = [a.replace("SRC", str(root / "src")) for a in args]
    full = ["export", *(["--target", "acme/tiny"] if "--target" not in args else []),
            *(["--draft", "acme/tiny-speculator"] if "--draft" not in args else []), *args, "--out", str(tmp_path / "out")]
    with offline_hub(root / "hf"):
        r = CliRunner().invoke(cli, full)
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    for w in words:
        assert w in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("edit,words", [
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 5]), "target_layer_ids [5] are outside the target's 2 layers"),
    (lambda c: c.update(hidden_size=48), "hidden_size 48 does not match the target's 32"),
    (lambda c: c.update(vocab_size=120), "vocab_size 120 does not match the target's 97"),
    (lambda c: c.update(block_size=8192), "block_size 8192 exceeds the target's context (max_position_embeddings 4096)"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[1, 9]), "target_layer_ids [8] are outside the target's 2 layers "
                                                              "(made for acme/tiny)"),
])
def test_a_drafter_that_does_not_fit_is_refused_naming_its_revision(hub, tmp_path, edit, words):
    """Refused from the configs, before a weight is read or anything traced (the repositories
    here hold a config.json only), in one line naming the drafter's id and commit."""
    root, cache, _ = hub
    speculators = "aux" in words or "made for" in words
    d = tmp_path / "bad"
    d.mkdir()
    cfg = json.loads((root / "src" / ("s" if speculators else "z") / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with offline_hub(root / "hf"):
        commit = put(cache, "acme/bad", d, refs=("v2",))
        r = CliRunner().invoke(cli, ["export", "--target", "acme/tiny", "--draft", "acme/bad@v2", "--out", str(tmp_path / "o")])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith(f"error: drafter acme/bad@{commit[:12]}: ") and words in lines[0], lines[0]
    assert not (tmp_path / "o").exists()


def test_the_manifest_records_where_the_pair_came_from(hub):
    root, _, c = hub
    m = M.load_manifest(root / "art")
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert m.sources["target"] == {"id": "acme/tiny", "path": None, "revision": None, "commit": c["target"],
                                   "files": {"model.safetensors": sha(root / "src" / "t" / "model.safetensors")}}
    assert m.sources["draft"] == {"id": "acme/tiny-speculator", "path": None, "revision": "v1", "commit": c["spec"],
                                  "files": {"model.safetensors": sha(root / "src" / "s" / "model.safetensors")}}
    r = CliRunner().invoke(cli, ["info", str(root / "art")])
    assert r.exit_code == 0, r.output
    assert f"from     drafter acme/tiny-speculator at commit {c['spec']}, revision v1; model.safetensors sha256 " \
           f"{m.sources['draft']['files']['model.safetensors'][:12]}" in r.output
    assert f"from     target acme/tiny at commit {c['target']}; model.safetensors sha256" in r.output
    assert json.loads(CliRunner().invoke(cli, ["info", str(root / "art"), "--json"]).output)["sources"] == m.sources
    old = json.loads((root / "art" / "manifest.json").read_text())  # a manifest from before sources were recorded
    old.pop("sources")
    assert M.Manifest.from_dict(old).sources is None


def test_speculators_export_has_the_zlab_drafters_outputs(hub):
    """The speculators drafter's export, checked graph by graph and end to end against the z-lab
    drafter it was converted from (scoring the same draft vocabulary): within fp32 tolerance,
    token- and acceptance-identical; then `check` alone finds the recorded pair by id and commit."""
    root, _, _ = hub
    m = M.load_manifest(root / "art")
    assert m.draft_vocab["ids"] == IDS.tolist() and "speculators d2t" in m.draft_vocab["source"]
    with offline_hub(root / "hf"):
        r = CliRunner().invoke(cli, ["check", str(root / "art"), "--draft", str(root / "src" / "z"), "--num-prompts", "6",
                                     "--json"])
        assert r.exit_code == 0, r.output
        report = json.loads(r.stdout)
        assert report["passed"] and report["draft_vocab"] == len(IDS)
        assert report["end_to_end"]["identical"] == report["end_to_end"]["acceptance_identical"] == 6
        assert sum(report["end_to_end"]["acceptance_histogram"][1:]) > 0, "some drafts are accepted"
        assert any("draft" in w and "no longer match" in w for w in report["warnings"])  # not the recorded drafter
        r = CliRunner().invoke(cli, ["check", str(root / "art"), "--num-prompts", "2"])
        assert r.exit_code == 0 and "PASSED" in r.output and "warning" not in r.output, r.output


def test_check_warns_when_a_directory_no_longer_matches(hub, tmp_path):
    """The same tensors saved again (other metadata): parity still passes, and check says the
    weight file is not the one the export recorded."""
    root, cache, c = hub
    local = tmp_path / "t"
    shutil.copytree(cache / "models--acme--tiny" / "snapshots" / c["target"], local, symlinks=False)
    (local / "model.safetensors").unlink()
    save_file(load_file(root / "src" / "t" / "model.safetensors"), str(local / "model.safetensors"),
              metadata={"format": "pt", "note": "saved again"})
    with offline_hub(root / "hf"):
        r = CliRunner().invoke(cli, ["check", str(root / "art"), "--target", str(local), "--num-prompts", "0"])
    assert r.exit_code == 0, r.output
    assert re.search(rf"warning: target {re.escape(str(local))}: model.safetensors no longer match the export's record",
                     " ".join(r.output.split())), r.output
    r = CliRunner().invoke(cli, ["check", str(root / "art"), "--revision", "v1"])
    assert r.exit_code == 2 and r.stderr == "error: --revision needs --target\n", r.output


def test_train_draft_takes_an_id_too(hub, tmp_path):
    root, _, _ = hub
    with offline_hub(root / "hf"):
        r = CliRunner().invoke(cli, ["train-draft", "--target", "acme/missing@v3", "--out", str(tmp_path / "d"),
                                     "--data", str(tmp_path / "x.txt"), "--steps", "1"])
    assert r.exit_code == 2 and r.stderr.startswith("error: target acme/missing@v3: acme/missing is not in the local "
                                                    "Hugging Face cache"), r.output
    assert "`hf download acme/missing --revision v3`" in r.stderr and not (tmp_path / "d").exists()


@pytest.mark.parametrize("kind,words", [
    ("RevisionNotFoundError", "revision 'v9' does not exist in acme/x (a branch, tag or commit on the Hub)"),
    ("GatedRepoError", "is gated: accept its terms on huggingface.co and log in"),
    ("RepositoryNotFoundError", "no such local directory, and no such repository on the Hugging Face Hub"),
    ("IncompleteSnapshotError", "the cached copy in"),
    ("ConnectError", "could not be fetched from the Hugging Face Hub (ConnectError: boom)"),
])
def test_online_hub_failures_say_what_to_do(kind, words):
    """The hub's exceptions (matched by class name: their modules moved across huggingface_hub
    versions) as one line each; a class of that name stands in for the online failure."""
    e = type(kind, (Exception,), {})("boom\nsecond line")
    line = S.hub_message(e, "drafter acme/x@v9", "acme/x", "v9", "`hf download acme/x --revision v9`")
    assert words in line and "\n" not in line, line
