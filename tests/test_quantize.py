"""Weight-only int4/int8 artifacts (export --quantize, dflash-export quantize; export/quantize.py).

The float exports are runtime_cases' cached pairs (Qwen3 biased target + 2-layer drafter,
block 8; Llama with tied embeddings, block 4; Qwen2 + 3-layer drafter, block 16; Qwen3
2-layer, block 16), so the only added cost is quantizing, checking and decoding. One more
tiny pair goes through `export --quantize` itself.
"""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from runtime_cases import CASES, artifact, prompts

from dflash_export.cli import cli
from dflash_export.export import accuracy_level as AL
from dflash_export.export.check import TOLERANCE, run_check
from dflash_export.export.quantize import QuantOptions, default_block_size, quantize_artifact
from dflash_export.export.validate import lint
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.names import names_of
from dflash_export.runtime.loop import generate
from dflash_export.runtime.ort.backend import OrtBackend

# (case, options): int4 target+drafter; tied Llama with int4 layers and an int8 LM head and
# lookup (--quant-head-bits 8; one packed table read by both); Qwen2 int4 asymmetric, block 16, target + LM head + its
# own lookup table; an unbiased Qwen3, block 16, int8 asymmetric block 64 everywhere but the lookup.
# Accuracy level 0 (fp32 activations): the dequantized parity is then held to fp32 tolerances.
PLANS = {
    "qwen3": QuantOptions("int4", 32, True, draft=True, accuracy_level=0),
    # int4 layers, the tied head and its lookup at 8 bits (--quant-head-bits 8)
    "llama": QuantOptions("int4", 32, True, draft=True, lm_head=True, accuracy_level=0, embedding=True, head_bits=8),
    "qwen2": QuantOptions("int4", 16, False, lm_head=True, accuracy_level=0, embedding=True),
    "qwen3-b16": QuantOptions("int8", 64, False, draft=True, lm_head=True, accuracy_level=0),
}
PROMPTS = 20  # runtime speculative == plain, per plan
CHECK_PROMPTS = 10  # `check` end to end, per plan: each also runs the PyTorch oracle (the slow part)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (name, options, target dir, draft dir, float export, quantized export), built once."""
    cache = {}

    def get(name):
        if name not in cache:
            q = PLANS[name]
            tdir, ddir, src = artifact(CASES[name])
            out = tmp_path_factory.mktemp("quant") / name
            if name in ("qwen2", "llama"):  # through the CLI
                flags = {"--quant-asymmetric": not q.symmetric, "--quantize-draft": q.draft, "--quantize-lm-head": q.lm_head,
                         "--quantize-embedding": q.embedding}
                args = ["quantize", str(src), "--out", str(out), "--quantize", q.scheme, "--quant-block-size",
                        str(q.block_size), *(f for f, on in flags.items() if on), "--quant-accuracy-level", "0", "--quiet"]
                r = CliRunner().invoke(cli, args + (["--quant-head-bits", str(q.head_bits)] if q.head_bits else []))
                assert r.exit_code == 0, r.output
            else:
                quantize_artifact(src, out, q, progress=False)
            cache[name] = name, q, tdir, ddir, src, out
        return cache[name]

    return get


@pytest.fixture(params=list(PLANS))
def quantized(request, made):
    return made(request.param)


def graph(out, name):
    return onnx.load(str(out / C.GRAPH_FILES[name]), load_external_data=False)


def test_linear_weights_are_stored_as_the_matmul_reads_them():
    """Float export: every linear weight is a constant MatMul input ([in, out]); only a tied
    LM head still reads the lookup table through Transpose (one copy of those bytes)."""
    for name in ("qwen3", "llama"):
        _, _, out = artifact(CASES[name])
        for g in C.GRAPH_FILES:
            m = graph(out, g)
            inits = {t.name for t in m.graph.initializer}
            transposed = [n.input[0] for n in m.graph.node if n.op_type == "Transpose" and n.input[0] in inits]
            assert transposed == ([C.SHARED_INITIALIZERS[1]] if name == "llama" and g != C.DRAFT_CONTEXT else []), (name, g)
            assert any(n.op_type == "MatMul" and n.input[1] in inits for n in m.graph.node)


def test_manifest_records_the_quantization(quantized):
    name, q, _, _, src, out = quantized
    m, before = M.load_manifest(out), M.load_manifest(src)
    rec = m.quantization
    assert (rec["scheme"], rec["bits"], rec["block_size"], rec["symmetric"]) == (q.scheme, q.bits, q.block_size, q.symmetric)
    assert (rec["draft"], rec["lm_head"], rec["embedding"]) == (q.draft, q.lm_head, q.embedding) and "MatMulNBits" in rec["method"]
    assert rec["head_bits"] == q.head_bits
    line = next(x for x in CliRunner().invoke(cli, ["info", str(out), "--no-verify"]).output.splitlines() if x.startswith("quant"))
    assert ("LM head (8-bit)" in line and "embedding lookup (8-bit)" in line) == (q.head_bits == 8), line
    assert (rec["accuracy_level"], rec["accuracy_level_from"]) == (0, "flag")
    assert sorted(rec["weights"]) == sorted(set(q.graphs()) | ({C.DRAFT_BLOCK} if q.lm_head or q.embedding else set()))
    for g in C.GRAPH_FILES:
        fp, qm = graph(src, g), graph(out, g)
        inits = {t.name for t in fp.graph.initializer}
        linear = sorted(n.input[1] for n in fp.graph.node if n.op_type == "MatMul" and n.input[1] in inits)
        head = C.SHARED_INITIALIZERS[1]
        expect = [w for w in linear if q.quantizes(g, w)]
        if q.lm_head and name == "llama" and g != C.DRAFT_CONTEXT:
            expect = sorted(expect + [head])  # tied: the head was Transpose(table), now a quantized layout of its own
        lookup = q.embedding and g != C.DRAFT_CONTEXT
        assert rec["weights"].get(g, []) == expect + [C.SHARED_INITIALIZERS[0]] * lookup, g
        nbits = [n for n in qm.graph.node if n.op_type == "MatMulNBits"]
        gathers = [n for n in qm.graph.node if n.op_type == "GatherBlockQuantized"]
        assert len(nbits) == len(expect) and all(n.domain == "com.microsoft" for n in nbits + gathers)
        bits = {n.input[0] if n.op_type == "GatherBlockQuantized" else n.input[1]: a.i
                for n in nbits + gathers for a in n.attribute if a.name == "bits"}
        assert len(gathers) == lookup  # the head and the lookup at --quant-head-bits, the layers at the scheme's
        assert all(b == (q.head().bits if w.startswith(C.SHARED_INITIALIZERS) else q.bits) for w, b in bits.items()), bits
        assert {a.i for n in nbits for a in n.attribute if a.name == "accuracy_level"} == ({0} if nbits else set())
        quant_ops = (("com.microsoft", "MatMulNBits"), ("com.microsoft", "GatherBlockQuantized"))
        assert not lint(qm, quant_ops)  # the export lint allows exactly these ops
        assert bool(lint(qm)) == bool(nbits or gathers)  # ... which the portable lint does not
        if g != C.DRAFT_CONTEXT:  # the graphs with a lookup: a quantized one leaves no float table
            assert lookup == (C.SHARED_INITIALIZERS[0] not in {t.name for t in qm.graph.initializer})
    assert (m.block_size, m.vocab_size, m.dtype) == (before.block_size, before.vocab_size, before.dtype)


def test_shared_tensors_stay_one_copy(quantized):
    """Embedding and (quantized) LM head: same names and the same bytes of shared.data in
    target.onnx and draft_block.onnx (the manifest's shared table); quantized weights are
    external data too, and the runtime maps them."""
    name, q, *_, out = quantized
    m = M.load_manifest(out)

    def external(g):
        loc = {}
        for t in graph(out, g).graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                loc[t.name] = {e.key: e.value for e in t.external_data}
        return loc

    t, b = external(C.TARGET), external(C.DRAFT_BLOCK)
    embed, head = C.SHARED_INITIALIZERS
    heads = [n for n in m.shared if n.startswith(head)]
    tables = [n for n in m.shared if n.startswith(embed)]
    assert (embed in m.shared) != q.embedding and (head in m.shared) != q.lm_head
    hb = q.head().bits
    if q.lm_head:
        assert f"{head}_Q{hb}" in heads
    if q.embedding:
        table, packed = m.shared[f"{embed}_Q{hb}"], m.shared.get(f"{head}_Q{hb}")
        assert table.shape == [m.vocab_size, m.hidden_size * hb // 8]
        # tied (llama): the lookup reads the quantized head's bytes, in its own shape; untied: its own
        assert (table.offset == packed.offset and table.shape != packed.shape) == (name == "llama")
    for n in [*tables, *heads]:
        s = m.shared[n]
        assert sorted(s.graphs) == sorted([C.TARGET, C.DRAFT_BLOCK]), n
        assert t[n]["location"] == b[n]["location"] == "shared.data"
        assert int(t[n]["offset"]) == int(b[n]["offset"]) == s.offset
    assert any(v["location"] == "target.data" for v in t.values())  # the quantized layers' own weights


def test_check_reports_statistics_and_enforces_speculative_equals_plain(quantized):
    """Two references per output: PyTorch with the graphs' dequantized weights (parity, at the
    fp32 tolerance, token-identical end to end) and the float source (quantization error,
    reported without a tolerance); speculative == plain through the quantized graphs."""
    name, q, tdir, ddir, _, out = quantized
    report = run_check(out, tdir, ddir, prompts=CHECK_PROMPTS, progress=False)
    j = json.loads(json.dumps(report.to_json()))
    assert report.passed, j
    assert j["tolerance"] == TOLERANCE and j["quantization"]["scheme"] == q.scheme
    rows = [r for rows in j["graphs"].values() for r in rows]
    cases = {r["case"] for r in j["graphs"]["target"]}
    assert {c for c in cases if not c.startswith("ragged")} == {"prefill P=0 S=7", "step P=9 S=1", f"verify P=9 S={CASES[name].block}"}
    assert len(cases) == 5  # and two rows of a ragged batch (export/check_rows.py)
    assert {r["ref"] for r in rows} == {"dequantized", "float"}
    for r in rows:
        assert r["passed"]
        if r["ref"] == "dequantized":
            assert r["tol"] == (0.0 if r["max"] is None else TOLERANCE)  # ids exact, floats at the fp32 tolerance
            assert r["max"] is None or r["max"] <= TOLERANCE
        else:
            assert r["tol"] is None
            if r["max"] is not None:
                assert 0 < r["max"] < 10 and r["mean"] <= r["p99"] <= r["max"]  # quantization error is there and bounded
    assert all(r["top1"] is not None for r in rows if r["output"] in ("logits", "draft_logits", "next_ids"))
    e = j["end_to_end"]
    assert e["cases"] == CHECK_PROMPTS and e["identical"] == CHECK_PROMPTS  # vs the dequantized oracle
    assert e["speculative_equals_plain"] == CHECK_PROMPTS and not e["plain_failures"]
    assert 0 <= e["agreement_length_min"] <= e["agreement_length_mean"] <= e["max_new_tokens"]


def test_check_fails_when_the_graphs_do_not_compute_their_weights(made, monkeypatch):
    """The dequantized parity can fail: a reference one weight off (as a wrong layout or a
    mis-wired graph would be) fails its rows and the end-to-end identity."""
    from dflash_export.export import quantize as Q

    _, _, tdir, ddir, _, out = made("qwen3")
    real = Q.dequantized_weights

    def off(root):
        w = real(root)
        name = sorted(w[C.TARGET])[0]
        w[C.TARGET][name] = w[C.TARGET][name] * 1.5
        return w

    monkeypatch.setattr(Q, "dequantized_weights", off)
    report = run_check(out, tdir, ddir, prompts=3, progress=False)
    assert not report.passed
    bad = [r for r in report.rows if not r.passed]
    assert bad and all(r.ref == "dequantized" and r.graph == C.TARGET for r in bad)


def test_quantized_lookup_is_read_like_the_head(made):
    """GatherBlockQuantized over MatMulNBits' packed bytes (uint8, `bits` low bits first, zero point
    2^(bits-1) when symmetric) returns the rows of the head's dequantized weight, symmetric (llama,
    int8, tied: the same bytes) and asymmetric (qwen2, int4): ORT's kernel vs dequantize's reading."""
    from onnx import TensorProto, helper

    from dflash_export.export.quantize import dequantized_weights

    for name in ("llama", "qwen2"):
        *_, out = made(name)
        g = graph(out, C.TARGET)
        node = next(n for n in g.graph.node if n.op_type == "GatherBlockQuantized")
        table = dequantized_weights(out)[C.TARGET][C.SHARED_INITIALIZERS[0]]
        if name == "llama":  # tied: the head's own dequantized weight, the same rows
            np.testing.assert_array_equal(table, dequantized_weights(out)[C.TARGET][C.SHARED_INITIALIZERS[1]])
        inits = [t for t in g.graph.initializer if t.name in node.input]
        for t in inits:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                onnx.external_data_helper.load_external_data_for_tensor(t, str(out))
                del t.external_data[:]
                t.data_location = onnx.TensorProto.DEFAULT
        ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [5])
        model = helper.make_model(helper.make_graph([helper.make_node(
            "GatherBlockQuantized", [node.input[0], "ids", *node.input[2:]], ["y"], domain="com.microsoft",
            **{a.name: a.i for a in node.attribute})], "g", [ids], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            inits), opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        import onnxruntime as ort

        rows = np.array([0, 3, 7, table.shape[0] - 1, 3])
        got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": rows})[0]
        np.testing.assert_array_equal(got, table[rows])


def test_tied_lookup_without_the_head_is_refused(made, tmp_path):
    """A tied float head reads the table's own bytes: a quantized lookup beside it would add a copy."""
    _, _, _, _, src, _ = made("llama")
    r = CliRunner().invoke(cli, ["quantize", str(src), "--out", str(tmp_path / "o"), "--quantize", "int8",
                                 "--quantize-embedding"])
    one_line_error(r, "tied", "--quantize-lm-head")
    assert list(tmp_path.iterdir()) == []


def test_accuracy_level_is_measured_and_recorded(made, tmp_path):
    """Without --quant-accuracy-level the level is measured on the artifact (both levels' step time
    and logits vs the float export) and recorded with the probe; every MatMulNBits carries it."""
    _, _, _, _, src, _ = made("qwen3")
    out = tmp_path / "auto"
    quantize_artifact(src, out, QuantOptions("int4", 32, True, draft=True), progress=False)
    rec = M.load_manifest(out).quantization
    probe = rec["accuracy_probe"]
    assert rec["accuracy_level_from"] == "measured" and rec["accuracy_level"] == AL.pick(probe)
    for level in ("0", "4"):
        p = probe[level]
        assert p["step_ms"] > 0 and 0 < p["logits_mean_abs_err"] <= p["logits_max_abs_err"] and 0 <= p["top1_agreement"] <= 1
    levels = {a.i for g in C.GRAPH_FILES for n in graph(out, g).graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {rec["accuracy_level"]}


@pytest.mark.parametrize("scheme,hidden,expert,block", [("int4", 1024, None, 128), ("int4", 896, None, 128),
                                                       ("int4", 64, None, 64), ("int4", 48, None, 16),
                                                       ("int8", 1024, None, 128), ("int8", 96, None, 32),
                                                       ("int4", 2048, 768, 128), ("int4", 2880, 2880, 64),
                                                       ("int8", 2048, 704, 64), ("int4", 64, 24, 16)])
def test_default_block_size(scheme, hidden, expert, block):
    """int4 and int8: blocks of 128 unless the hidden size or an MoE target's expert width
    (Qwen3-30B-A3B 768, gpt-oss 2880, 704) needs smaller ones."""
    assert default_block_size(scheme, hidden, expert) == block


def test_quantize_without_a_block_size_takes_the_default(made, tmp_path):
    """`quantize --quantize int4` with no --quant-block-size writes the default blocks (the tiny
    target's hidden 64 halves int4's 128 to 64), recorded in the manifest and read by every node."""
    _, _, _, _, src, _ = made("qwen3")
    out = tmp_path / "q"
    r = CliRunner().invoke(cli, ["quantize", str(src), "--out", str(out), "--quantize", "int4",
                                 "--quant-accuracy-level", "0", "--quiet"])
    assert r.exit_code == 0, r.output
    expected = default_block_size("int4", M.load_manifest(src).hidden_size)
    assert expected == 64 and M.load_manifest(out).quantization["block_size"] == expected
    blocks = {a.i for n in graph(out, C.TARGET).graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "block_size"}
    assert blocks == {expected}


@pytest.mark.parametrize("ms,err,level", [((10.0, 5.0), (1.0, 1.5), 4), ((10.0, 9.5), (1.0, 1.0), 0),
                                          ((10.0, 5.0), (1.0, 2.5), 0)])
def test_accuracy_level_rule(ms, err, level):
    """Level 4 only when clearly faster and adding at most the weights' own error again."""
    probe = {str(lv): {"step_ms": t, "logits_mean_abs_err": e} for lv, t, e in zip((0, 4), ms, err)}
    assert AL.pick(probe) == level


def test_check_at_accuracy_level_4_reports_without_tolerances(made, tmp_path):
    """Accuracy level 4 quantizes activations too: the dequantized reference is reported,
    not held to fp32 tolerances, and speculative == plain is still enforced."""
    _, _, tdir, ddir, src, _ = made("qwen3")
    out = tmp_path / "a4"
    quantize_artifact(src, out, QuantOptions("int4", 32, True, draft=True, accuracy_level=4), progress=False)
    report = run_check(out, tdir, ddir, prompts=5, progress=False)
    assert report.passed and not report.strict and any("accuracy level 4" in n for n in report.notes)
    effect = report.accuracy  # the activations' rounding alone (vs the graphs' own weights) is measured and nonzero
    assert effect["accuracy_level"] == 4 and 0 < effect["dequantized"]["mean_abs"] and effect["float"]["mean_abs"] > 0
    assert all(r.tol is None for r in report.rows if r.max is not None)
    assert report.end_to_end["speculative_equals_plain"] == 5


def test_runtime_speculative_equals_plain_on_quantized_graphs(quantized):
    """The product path (runtime/, IO binding, shared initializers): greedy speculative ==
    greedy plain decoding of the same quantized graphs, token for token."""
    name, *_, out = quantized
    be = OrtBackend(out)
    rounds = 0
    for i, prompt in enumerate(prompts(PROMPTS, be.manifest.vocab_size, seed=7)):
        n = 16 + 3 * i
        g = generate(be, prompt, n)
        assert g.tokens == generate(be, prompt, n, draft=False).tokens, (name, i)
        rounds += sum(a > 1 for a in g.acceptance_lengths)
    if name == "qwen3":  # biased target: drafts really get accepted, so the comparison means something
        assert rounds > 0


def test_export_quantize_end_to_end(tmp_path):
    """`export --quantize` traces, exports float to a hidden directory, quantizes into --out
    and leaves nothing else behind; the result checks and refuses a TensorRT build."""
    from dflash_export.models.tiny import make_drafter, make_target

    make_target(tmp_path / "t", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    make_drafter(tmp_path / "d", tmp_path / "t", layers=1, block_size=4)
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["export", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--out",
                                 str(out), "--quantize", "int4", "--quantize-draft", "--max-context", "64", "--quiet"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "out", "t"]  # no partial or float directory left
    m = M.load_manifest(out)
    assert m.quantization["scheme"] == "int4" and len(m.quantization["weights"]["draft_block"]) == 7
    r = CliRunner().invoke(cli, ["check", str(out), "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"),
                                 "--num-prompts", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["end_to_end"]["speculative_equals_plain"] == 4


def one_line_error(r, *words):
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output, r.output
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("args,words", [
    (["--quantize", "int3"], ["int3", "'int4', 'int8'", "export --help"]),
    (["--quantize", "int4", "--dtype", "bf16"], ["bf16", "fp32 or fp16"]),
    (["--quantize", "int4", "--quant-block-size", "24"], ["24", "power of two"]),
    (["--quantize-draft"], ["need --quantize"]),
    (["--quant-head-bits", "8"], ["need --quantize"]),
    (["--quantize", "int4", "--quant-head-bits", "8"], ["--quant-head-bits", "--quantize-lm-head"]),
])
def test_bad_export_options_are_one_line_errors(tmp_path, args, words):
    tdir, ddir, _ = artifact(CASES["qwen3"])
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["export", "--target", str(tdir), "--draft", str(ddir), "--out", str(out), *args])
    one_line_error(r, *words)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_requantizing_and_tensorrt_builds_are_refused(made, tmp_path, monkeypatch):
    *_, out = made("qwen3")
    r = CliRunner().invoke(cli, ["quantize", str(out), "--out", str(tmp_path / "again"), "--quantize", "int8"])
    one_line_error(r, "already quantized")
    r = CliRunner().invoke(cli, ["build", str(out), "--dry-run"])  # the TensorRT lint
    one_line_error(r, "quantized", "MatMulNBits", "TensorRT")
    import trt_fake

    trt_fake.install(monkeypatch)  # the real build path, as far as it gets without a GPU
    r = CliRunner().invoke(cli, ["build", str(out)])
    one_line_error(r, "quantized", "without --quantize")
    assert not (out / "engines").exists() and list(tmp_path.iterdir()) == []


def test_quantized_logits_are_close_to_float(made):
    """int8 (block 64, zero points) logits stay within a few percent of the float graph's: the
    weights really are the float weights, rounded."""
    *_, src, out = made("qwen3-b16")
    ids = np.array([[3, 14, 15, 9, 26, 5]], np.int64)
    feeds = {"input_ids": ids, "position_ids": np.arange(6)[None], "past_lengths": np.zeros(1, np.int64),
             "logits_index": np.arange(6)[None]}
    m = M.load_manifest(src)
    N = names_of(m)
    for i in range(m.target_layers):
        for n in (N.past_key[i], N.past_value[i]):
            feeds[n] = np.zeros((0, 1, m.target_kv_heads, m.target_head_dim), np.float32)  # position-major
    from dflash_export.export.validate import ort_session

    ref = ort_session(src / "target.onnx").run(["logits"], feeds)[0]
    got = ort_session(out / "target.onnx").run(["logits"], feeds)[0]
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert 0 < err < 0.05, err  # int8, block 64


def test_a_killed_quantize_leaves_nothing_after_the_next_run(tmp_path):
    """quantize killed with -9 mid-way (no cleanup runs) leaves its staging folder; the next
    quantize to the same --out removes it (runtime/outdir.py owns the names) and publishes."""
    import subprocess
    import sys

    _, _, src = artifact(CASES["qwen3"])
    out = tmp_path / "q"
    args = ["quantize", str(src), "--out", str(out), "--quantize", "int8", "--quiet"]
    code = ("import sys, time\nimport dflash_export.export.quantize as Q\nsave = Q.save_graphs\n"
            "def hold(*a, **k):\n    r = save(*a, **k)\n    print('saved', flush=True)\n    time.sleep(600)\n    return r\n"
            f"Q.save_graphs = hold\nfrom dflash_export.cli import cli\ncli({args!r})\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "saved"  # the graphs are in the staging folder now
    finally:
        p.kill()  # SIGKILL: no except/finally of quantize runs
        p.wait()
    left = list(tmp_path.glob(".q.*"))
    assert [x.name for x in left] == [f".q.partial-q{p.pid}"] and any(left[0].iterdir()) and not out.exists()
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert not list(tmp_path.glob(".q.*")) and M.load_manifest(out, verify=True).quantization["scheme"] == "int8"


@pytest.mark.parametrize("name,scheme", [("qwen3", "int8"), ("llama", "int4")])
def test_draft_only_keeps_the_target_and_its_greedy_output(name, scheme, tmp_path):
    """--draft-only: the drafter's graphs (their LM head included) are quantized, the target's
    files stay byte for byte the float export's, and greedy speculative output through the
    rounded drafter equals the float target's plain greedy output. At accuracy level 0 `check`
    holds the drafter graphs to fp32 parity with their dequantized weights (the tied Llama's
    drafter reads a head of its own) and reports their error against the float source."""
    tdir, ddir, src = artifact(CASES[name])
    out = tmp_path / name
    r = CliRunner().invoke(cli, ["quantize", str(src), "--out", str(out), "--quantize", scheme, "--draft-only",
                                 "--quant-accuracy-level", "0", "--quiet"])
    assert r.exit_code == 0, r.output
    q = M.load_manifest(out).quantization
    assert q["target"] is False and C.TARGET not in q["weights"] and "lm_head.weight" in q["weights"][C.DRAFT_BLOCK]
    assert not [n for n in graph(out, C.TARGET).graph.node if n.op_type == "MatMulNBits"]
    assert (out / "target.onnx").read_bytes() == (src / "target.onnx").read_bytes()
    shown = CliRunner().invoke(cli, ["info", str(out), "--no-verify"])  # what a user reads of it
    assert shown.exit_code == 0 and f"quant    {scheme} weight-only" in shown.output
    assert "the target stays as exported" in shown.output and "accuracy level 0 (flag)" in shown.output
    for loc in {i.external_data[0].value for i in graph(src, C.TARGET).graph.initializer if i.external_data}:
        if loc != "shared.data":
            assert (out / loc).read_bytes() == (src / loc).read_bytes(), loc
    for tname, t in M.load_manifest(src).shared.items():  # shared.data: the target's tensors at the same bytes
        if C.TARGET in t.graphs:
            mine = M.load_manifest(out).shared[tname]
            read = lambda root, s: (root / s.file).read_bytes()[s.offset:s.offset + s.length]  # noqa: E731
            assert (mine.file, mine.offset) == (t.file, t.offset) and read(out, mine) == read(src, t), tname
    fl, dq = OrtBackend(src), OrtBackend(out)
    for i, prompt in enumerate(prompts(8, fl.manifest.vocab_size, seed=11)):
        n = 12 + 3 * i
        assert generate(dq, prompt, n).tokens == generate(fl, prompt, n, draft=False).tokens, (name, i)
    if name == "llama":
        report = run_check(out, tdir, ddir, prompts=3, max_new_tokens=12, progress=False)
        assert report.passed and report.strict, report.notes
        drafted = [r for r in report.rows if r.graph == C.DRAFT_BLOCK and r.max is not None]
        assert {r.ref for r in drafted} == {"dequantized", "float"}
        assert max(r.max for r in drafted if r.ref == "float") > 1e-3  # the rounding is measured, not hidden
        assert report.accuracy["draft_float"]["max_abs"] > 1e-3
        target = [r.max for r in report.rows if r.graph == C.TARGET and r.ref == "float" and r.max is not None]
        assert target and max(target) < TOLERANCE  # the target is the float graph: float noise alone


def test_draft_only_refuses_the_lookup(made, tmp_path):
    *_, src, _ = made("qwen3")
    r = CliRunner().invoke(cli, ["quantize", str(src), "--out", str(tmp_path / "o"), "--quantize", "int8",
                                 "--draft-only", "--quantize-embedding"])
    one_line_error(r, "--draft-only", "lookup")
