"""`dflash-export info` and the manifest's format version: what an artifact is, at a glance,
and a clear refusal of a format this version does not know."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from runtime_cases import CASES, artifact

from dflash_export.cli import cli
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.ort.backend import OrtBackend


@pytest.fixture(scope="module")
def out():
    return artifact(CASES["qwen3"])[2]


def test_info_text_and_json(out):
    r = CliRunner().invoke(cli, ["info", str(out)])
    assert r.exit_code == 0, r.output
    m = M.load_manifest(out)
    assert f"format version {C.FORMAT_VERSION}" in r.output and "hashes   verified" in r.output
    assert f"block size {m.block_size}, max context {m.max_context}" in r.output
    for g in C.GRAPHS.values():
        assert g.file in r.output
    assert f"past_key.{{i}}           [past, batch, {m.target_kv_heads}, {m.target_head_dim}] float32  i < {m.target_layers}" in r.output

    d = json.loads(CliRunner().invoke(cli, ["info", str(out), "--json", "--no-verify"]).output)
    assert d["format_version"] == C.FORMAT_VERSION and d["hashes"] == "not checked"
    assert d["dtype"] == m.dtype and d["block_size"] == m.block_size and d["drafter"]["layers"] == m.draft_layers
    for g in C.GRAPHS:  # the contract's I/O, as the graph files have them
        assert [t["name"] for t in d["graphs"][g]["inputs"]] == [t.name for t in m.graphs[g].inputs]
        assert [t["name"] for t in d["graphs"][g]["outputs"]] == [t.name for t in m.graphs[g].outputs]
        for t, spec in zip(d["graphs"][g]["inputs"] + d["graphs"][g]["outputs"], m.graphs[g].inputs + m.graphs[g].outputs):
            assert t["shape"] == spec.shape and t["dtype"] == spec.dtype
    assert d["total_bytes"] == sum((out / f).stat().st_size for f in m.files)


def test_info_reports_a_hash_mismatch(out, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    with open(bad / "draft_block.data", "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    r = CliRunner().invoke(cli, ["info", str(bad)])
    assert r.exit_code == 2 and "hashes   MISMATCH" in r.output
    assert r.output.strip().splitlines()[-1].startswith("error: ") and "draft_block.data does not match" in r.output


@pytest.mark.parametrize("version, hint", [(C.FORMAT_VERSION + 1, "upgrade dflash-export"), (1, "re-export"), ("x", "re-export")])
def test_unknown_format_versions_are_refused_in_one_line(out, tmp_path, version, hint):
    bad = tmp_path / "v"
    shutil.copytree(out, bad)
    raw = json.loads((bad / C.MANIFEST).read_text())
    raw["format_version"] = version
    (bad / C.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match=f"format version {version!r}.*reads version {C.FORMAT_VERSION} only.*{hint}"):
        OrtBackend(bad)
    r = CliRunner().invoke(cli, ["info", str(bad)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and hint in r.output


def test_manifests_from_before_the_optional_fields_load_with_their_defaults(out, tmp_path):
    """Fields added without a version change (contract.FORMAT_VERSION) default to what exports
    did before them; a field this version does not know is refused in one line (upgrade)."""
    old = tmp_path / "old"
    shutil.copytree(out, old)
    raw = json.loads((old / C.MANIFEST).read_text())
    optional = ("attention", "engines", "quantization", "target_layer_types", "linear", "draft_vocab")
    assert [raw[k] for k in optional] == ["standard", None, None, [], None, None]  # a plain float export
    (old / C.MANIFEST).write_text(json.dumps({k: v for k, v in raw.items() if k not in optional}))
    assert M.load_manifest(old) == M.load_manifest(out) and C.flavour(M.load_manifest(old)) == "standard"
    (old / C.MANIFEST).write_text(json.dumps(raw | {"kv_cache_dtype": "int8"}))
    with pytest.raises(DFlashError, match="manifest fields kv_cache_dtype are unknown.*upgrade dflash-export"):
        M.load_manifest(old)
    r = CliRunner().invoke(cli, ["info", str(old)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "upgrade dflash-export" in r.output


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe binary", b"[1, 2]"])
def test_unreadable_manifests_and_runtime_json_are_one_line(out, tmp_path, content):
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / C.MANIFEST).write_bytes(content)
    r = CliRunner().invoke(cli, ["info", str(bad)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "manifest.json" in r.output, r.output
    shutil.copyfile(out / C.MANIFEST, bad / C.MANIFEST)
    (bad / C.RUNTIME).write_bytes(content)
    r = CliRunner().invoke(cli, ["generate", str(bad), "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "runtime.json" in r.output, r.output


def test_info_reports_the_calibrated_policy(out, tmp_path):
    """`info` says what runtime.json chose: not calibrated, or per device the threads, the
    verify policy and what `--speculation auto` does with the calibrated costs (a MoE-like
    table where every verify costs more than the tokens it can emit: plain steps)."""
    from dflash_export.runtime.settings import Settings, VerifyPolicy, save_settings

    art = tmp_path / "art"
    shutil.copytree(out, art)
    r = CliRunner().invoke(cli, ["info", str(art), "--no-verify"])
    assert r.exit_code == 0 and "runtime  not calibrated" in r.output, r.output
    k = M.load_manifest(art).block_size
    moe = {"rows": [1], "step_ms": [1.0], "verify_ms": [[1.0 + 1.4 * (s - 1) for s in range(1, k + 1)]],
           "draft_ms": [0.2], "context_ms": [0.05]}
    save_settings(art, "ort:cpu", Settings(threads=2, verify=VerifyPolicy(0.1, 2), costs=moe))
    r = CliRunner().invoke(cli, ["info", str(art), "--no-verify"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("runtime  ort:cpu"))
    assert "threads 2" in line and "theta 0.1" in line and "calibrated costs" in line and "plain steps" in line, line
    assert "spin" not in line
    save_settings(art, "ort:cpu", Settings(threads=2, spin=True, verify=VerifyPolicy(0.1, 2), costs=moe))
    r = CliRunner().invoke(cli, ["info", str(art), "--no-verify"])
    assert "threads 2, workers spin" in next(x for x in r.output.splitlines() if x.startswith("runtime  ort:cpu"))
    d = json.loads(CliRunner().invoke(cli, ["info", str(art), "--json", "--no-verify"]).output)
    assert d["runtime"]["ort:cpu"]["spin"] is True and d["runtime"]["ort:cpu"]["spin_us"] is None
    save_settings(art, "ort:cpu", Settings(threads=2, spin=True, spin_us=50, verify=VerifyPolicy(0.1, 2), costs=moe))
    r = CliRunner().invoke(cli, ["info", str(art), "--no-verify"])
    assert "threads 2, workers spin up to 50 us" in next(x for x in r.output.splitlines() if x.startswith("runtime  ort:cpu"))
    assert json.loads(CliRunner().invoke(cli, ["info", str(art), "--json", "--no-verify"]).output)["runtime"]["ort:cpu"]["spin_us"] == 50
    policy = d["runtime"]["ort:cpu"]["auto_policy"][0]
    assert policy["longest_paying"] is None and policy["break_even"]["2"] > 2


def test_info_names_a_mixture_of_experts_target_as_such(out):
    """A target with experts is a mixture of experts, not "dense mixture-of-experts"; hybrids say both."""
    from dflash_export.cli.info import attention_kinds

    m = M.load_manifest(out)
    assert attention_kinds(m)["family"] == "dense"
    m.moe = {"experts": 4, "top_k": 2, "activation": "swiglu", "path": "op"}
    assert attention_kinds(m)["family"] == "mixture-of-experts"
    m.target_layer_types = [C.LINEAR] + [C.ATTENTION] * (m.target_layers - 1)
    assert attention_kinds(m)["family"] == "hybrid mixture-of-experts"


def test_info_says_how_much_memory_a_run_needs(out):
    """Weights once (each graph's own file and data), a shared weight once per graph that packs it,
    the embedding table not at all (read in place), the KV cache at max context, all printed."""
    from dflash_export.runtime import memory

    m = M.load_manifest(out)
    d = json.loads(CliRunner().invoke(cli, ["info", str(out), "--json", "--no-verify"]).output)["memory"]
    spec, plain = d["speculative"], d["plain"]
    size = lambda f: (out / f).stat().st_size if (out / f).is_file() else 0  # noqa: E731
    own = size(m.graphs[C.TARGET].file) + size(m.graphs[C.TARGET].file.replace(".onnx", ".data"))
    packed = {(t.file, t.offset): t.length for n, t in m.shared.items()
              if C.TARGET in t.graphs and not n.startswith("embed_tokens")}
    assert m.shared and plain["weights"] == int((own + sum(packed.values())) * memory.PACKING)
    assert spec["weights"] > plain["weights"] and spec["kv_cache"] > plain["kv_cache"]
    assert plain["kv_cache"] == m.max_context * memory.cache_bytes_per_position(m, drafter=False)
    assert spec["total"] == spec["weights"] + spec["kv_cache"] + spec["work"] + spec["runtime"]
    text = CliRunner().invoke(cli, ["info", str(out), "--no-verify"]).output
    assert f"memory   a run needs about {memory.human(spec['total'])} ({memory.human(plain['total'])} without" in text
