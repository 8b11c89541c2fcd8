"""Lossless at temperature 0 on quantized artifacts: speculative greedy == plain greedy, token for
token, because the target gives a position the same logits (bit for bit) alone (a plain step),
inside a verify block and beside other sequences (export/even_rows.py says why they differed).

Wide random models (hidden 1024, vocabulary 8192: near-ties of the argmax are common there),
one layer, three checkpoint seeds, exported once each and cached (tests/runtime_cases.py). Each
plan quantizes one (a weight scheme, an accuracy level, a block size, zero points or not, the
head and lookup, the int8 cache; one plan keeps the fp32 export) and checks:
  1. `check`'s measurement: 8 positions' logits one plain step at a time == the same positions
     as one verify block, bit for bit (export/check_invariance.py), at the default threads;
  2. generate == generate --no-draft on prompts of 1-40 tokens, verifying the whole block and an
     odd number of positions (3) per round, at the plan's thread count (1 or 2);
and batched rows (three prompts of different lengths decoded together) == each alone. Negative
control: the same level-4 artifact without the padding fails the measurement, here and in the
accuracy-level probe. The MoE op with fp32 activations is not row-invariant: the test says so and
checks that the tool says it too (Manifest.rows_vary). About a minute and a half of CPU, most of
it the four exports (cached after the first run).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_export.cli import cli
from dflash_export.export import accuracy_level as AL, even_rows
from dflash_export.export.check_invariance import row_invariance
from dflash_export.export.quantize import QuantOptions, quantize_artifact
from dflash_export.runtime.loop import Request, generate, generate_batch
from dflash_export.runtime.manifest import load_manifest
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import FULL, VerifyPolicy

from runtime_cases import cached, prompts

pytest.importorskip("torch")

WIDE = dict(vocab=8192, hidden=1024, layers=1, heads=8, kv_heads=4, head_dim=128, intermediate=2048)
MODELS = {  # name -> (arch, checkpoint seed, export options); testing.make_target's MoE: 4 experts of width 16, 2 a token
    "qwen3": ("qwen3", 3, {}),
    "qwen3-kv8": ("qwen3", 4, {"attention": "ort", "kv_cache": "int8"}),
    "qwen3-ort": ("qwen3", 4, {"attention": "ort"}),
    "moe-standard": ("qwen3_moe", 5, {"moe": "standard"}),
    "moe-op": ("qwen3_moe", 5, {"moe": "op"}),
}
Q = QuantOptions
PLANS = {  # name -> (model, quantization or None: the float export, threads of the decode comparison)
    "fp32": ("qwen3", None, 2),
    "int4-L4": ("qwen3", Q("int4", 128, True, lm_head=True, embedding=True, accuracy_level=4), 1),
    "int8-L4": ("qwen3", Q("int8", 128, True, lm_head=True, embedding=True, accuracy_level=4), 2),
    "int4-L0": ("qwen3", Q("int4", 128, True, lm_head=True, accuracy_level=0), 2),
    "int8-L0-b64-asym": ("qwen3", Q("int8", 64, False, accuracy_level=0), 1),
    "kv8-int4-L4-b32-asym-head8": ("qwen3-kv8", Q("int4", 32, False, lm_head=True, embedding=True, head_bits=8,
                                                  accuracy_level=4), 2),
    "kv8-int8-L4": ("qwen3-kv8", Q("int8", 128, True, lm_head=True, accuracy_level=4), 1),
    "kv8-int4-L0-b16": ("qwen3-kv8", Q("int4", 16, True, accuracy_level=0), 1),
    "moe-standard-int4-L4": ("moe-standard", Q("int4", 16, True, lm_head=True, accuracy_level=4), 2),  # blocks of the width 16
    "moe-standard-int8-L0": ("moe-standard", Q("int8", 16, True, accuracy_level=0), 1),
    "moe-op-int4-L4": ("moe-op", Q("int4", 16, True, lm_head=True, accuracy_level=4), 1),  # QMoE, int8 activations
    "moe-op-int8-L0": ("moe-op", Q("int8", 16, True, accuracy_level=0), 2),  # QMoE's 8-bit experts: int8 activations
}
PROMPTS, TOKENS = 3, 24
ODD = VerifyPolicy(theta=1.0, min_len=3)  # a random drafter is never that confident: 3 positions a round


def wide(name: str):
    """The float export of MODELS[name], made once per content."""
    arch, seed, export = MODELS[name]

    def build(tmp):
        from dflash_export.export.artifact import export_artifact
        from dflash_export.models.tiny import make_drafter, make_target

        make_target(tmp / "t", arch, seed=seed, **WIDE)
        make_drafter(tmp / "d", tmp / "t", layers=1, block_size=8)
        export_artifact(tmp / "t", tmp / "d", tmp / "out", max_context=128, progress=False, **export)

    return cached(f"wide-{name}", json.dumps([arch, seed, export, WIDE], sort_keys=True), build) / "out"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    made = {}

    def get(model: str, q: QuantOptions, pad: bool = True):
        key = (model, repr(q), pad)
        if key not in made:
            out = tmp_path_factory.mktemp("lossless") / f"{model}-{len(made)}"
            orig = even_rows.pad_file
            even_rows.pad_file = orig if pad else (lambda path: 0)  # the configuration before (negative control)
            try:
                quantize_artifact(wide(model), out, q, progress=False)
            finally:
                even_rows.pad_file = orig
            made[key] = out
        return made[key]

    return get


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_row_is_computed_alike_alone_and_in_a_verify_and_speculative_equals_plain(plan, quantized):
    model, q, threads = PLANS[plan]
    out = wide(model) if q is None else quantized(model, q)
    m = load_manifest(out)
    assert not m.rows_vary
    inv = row_invariance(out, m)
    assert inv["invariant"], inv["block"]
    be = OrtBackend(out, threads=threads)
    try:
        for p in prompts(PROMPTS, m.vocab_size, seed=list(PLANS).index(plan)):
            plain = generate(be, p, TOKENS, draft=False, stop_token_ids=()).tokens
            for verify in (FULL, ODD):
                g = generate(be, p, TOKENS, verify=verify, stop_token_ids=())
                assert any(g.drafted) and g.mean_verify_len > 1  # rounds verified blocks, not plain steps
                assert g.tokens == plain, (plan, p, verify)
    finally:
        be.close()


@pytest.mark.parametrize("plan", ["int4-L4", "int8-L0-b64-asym", "kv8-int4-L4-b32-asym-head8"])
def test_batched_rows_decode_as_alone(plan, quantized):
    """Three prompts of different lengths decoded together (speculatively) give each its plain batch-1 tokens."""
    model, q, threads = PLANS[plan]
    out = quantized(model, q)
    m = load_manifest(out)
    ps = prompts(3, m.vocab_size, seed=50 + list(PLANS).index(plan))
    be = OrtBackend(out, threads=threads, max_batch=3)
    try:
        gens, _ = generate_batch(be, [Request(p, TOKENS, stop_token_ids=()) for p in ps])
    finally:
        be.close()
    one = OrtBackend(out, threads=threads)
    try:
        for p, g in zip(ps, gens):
            assert g.tokens == generate(one, p, TOKENS, draft=False, stop_token_ids=()).tokens, (plan, p)
    finally:
        one.close()


def test_negative_control_the_unpadded_level_4_artifact_fails(quantized):
    """The measurements can fail: the int4 level-4 artifact without even rows gives a lone row
    other bits than the same row in a verify block, `check` fails it and the accuracy-level probe
    marks the level (skipped where this CPU's kernels happen to agree: nothing to control)."""
    model, q, _ = PLANS["int4-L4"]
    bare, padded = quantized(model, q, pad=False), quantized(model, q)
    inv = row_invariance(bare, load_manifest(bare))
    if inv["invariant"]:
        pytest.skip("this CPU's MatMulNBits gives a lone row the same bits as a row in a block")
    assert inv["block"]["rows_differing"] > 0 and inv["block"]["max_abs"] > 0
    assert not _report(inv).passed and _report(row_invariance(padded, load_manifest(padded))).passed
    prompt = np.random.default_rng(0).integers(0, WIDE["vocab"], 12)
    alike = {}
    for name, root in (("bare", bare), ("padded", padded)):
        be = OrtBackend(root, drafter=False)
        try:
            be.reset()
            block = be.target(prompt, want_logits=True).logits.astype(np.float64)
            be.commit(len(prompt))
            alike[name] = AL._rows_alike(be, prompt, block)
        finally:
            be.close()
    assert alike == {"bare": False, "padded": True}
    probe = {"0": {"step_ms": 10.0, "logits_mean_abs_err": 1.0, "rows_alike": True},
             "4": {"step_ms": 2.0, "logits_mean_abs_err": 1.0, "rows_alike": alike["bare"]}}
    assert AL.pick(probe) == 0  # faster and as accurate, but not lossless: not chosen


def test_moe_op_with_fp32_activations_rows_differ_and_the_tool_says_so(quantized):
    """ONNX Runtime's QMoE with fp32 activations (int4 experts at level 0, like the float MoE op)
    multiplies each expert's weights by the tokens routed to it, so a lone row's logits differ from
    its row in a block; padding the call cannot change how tokens are routed. The artifact says so
    (Manifest.rows_vary, read by `check`, `info` and `generate`), and the accuracy-level probe
    prefers level 4, whose rows are alike. If a release of ONNX Runtime makes level 0 invariant,
    this fails: then the caveat can go."""
    out = quantized("moe-op", Q("int4", 16, True, lm_head=True, accuracy_level=0))
    m = load_manifest(out)
    inv = row_invariance(out, m)
    assert not inv["invariant"] and inv["block"]["max_abs"] > 0
    assert m.rows_vary == ["ONNX Runtime's MoE op experts (--moe op, fp32 activations)"]
    runner = CliRunner()
    info = runner.invoke(cli, ["info", str(out), "--no-verify"])
    assert info.exit_code == 0 and "lossless speculative == plain except at near-ties" in info.output, info.output
    gen = runner.invoke(cli, ["generate", str(out), "--prompt-ids", "5,9,13", "--max-new-tokens", "4"])
    assert gen.exit_code == 0 and "note: this target's ONNX Runtime's MoE op experts" in gen.stderr, gen.output
    plain = runner.invoke(cli, ["generate", str(out), "--prompt-ids", "5,9,13", "--max-new-tokens", "4", "--no-draft"])
    assert plain.exit_code == 0 and "note:" not in plain.stderr  # plain decoding is the target's own
    dense = quantized(*PLANS["int4-L4"][:2])
    assert "except at near-ties" not in runner.invoke(cli, ["info", str(dense), "--no-verify"]).output


def _report(inv):
    """A `check` report holding only this measurement (check's rule: the block decides)."""
    from dflash_export.export.check import Report, Row

    return Report("fp32", rows=[Row("target", "-", "logits", 0.0, 0.0, 0.0, None, 1.0, True)],
                  rows_alike=inv | {"enforced": True})


def test_the_ort_flavour_over_an_fp32_cache_is_not_row_invariant_and_says_so():
    """ONNX Runtime's GroupQueryAttention over an fp32 cache computes a lone query row (a plain step)
    another way than the same row among several (a verify block): the tool says so (Manifest.rows_vary,
    read by check, info and generate) instead of promising bit-exact output. Over the int8 cache
    (qwen3-kv8 above) and in standard attention a row's bits are alike. If a release of ONNX Runtime
    makes the fp32 path invariant, this test fails: then drop the entry from rows_vary."""
    out = wide("qwen3-ort")
    m = load_manifest(out)
    inv = row_invariance(out, m)
    assert not inv["invariant"] and inv["block"]["max_abs"] > 0
    assert m.rows_vary == ["GroupQueryAttention over an fp32 cache (--attention ort)"]
