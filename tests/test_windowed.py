"""gpt-oss and Gemma 4 targets (models/windowed.py): sliding and full attention layers, the
sliding layers' rings (runtime/window.py), and the families' own attention.

References: transformers' own GptOssForCausalLM / Gemma4ForCausalLM (logits, taps, greedy
`generate`) and the official z-lab `dflash_generate` with its own DFlashDraftModel over the
same drafter files (tokens and rounds). The tiny pairs (tests/runtime_cases.py WINDOWED_CASES)
have a window of 4, so every prompt wraps the rings, and a biased target, so rounds accept
some drafts and roll the rest back.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch
import transformers

from runtime_cases import WINDOWED_CASES, artifact, prompts

from dflash_export.cli.info import describe
from dflash_export.errors import DFlashError
from dflash_export.export.check import run_check
from dflash_export.export.trt_build import build_plan
from dflash_export.models import Target, TargetConfig
from dflash_export.runtime import contract as C
from dflash_export.runtime.loop import Request, generate, generate_batch
from dflash_export.runtime.manifest import load_manifest
from dflash_export.runtime.memory import cache_bytes_per_position, ring_bytes
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.window import WindowRings
from dflash_export.testing import hf_model, make_target

SW, FA = "sliding_attention", "full_attention"
TARGETS = {  # family features a test pair does not cover: a longer window, Gemma's double-wide shared MLPs
    "gpt_oss": dict(layer_types=[SW, FA, SW, FA, SW], window=5),
    "gemma4": dict(layer_types=[SW, SW, FA, SW, FA, SW], window=3,
                   extra=dict(num_kv_shared_layers=2, hidden_size_per_layer_input=8, use_double_wide_mlp=True)),
}


@pytest.mark.parametrize("arch", list(TARGETS))
def test_targets_match_transformers(tmp_path, arch):
    """Logits and every tap against transformers, in one pass and position by position on the cache."""
    d = make_target(tmp_path, arch, layers=len(TARGETS[arch]["layer_types"]), hidden=32, **TARGETS[arch])
    hf = hf_model(d)
    ours = Target.from_pretrained(d, list(range(hf.config.num_hidden_layers)))
    ids = torch.randint(0, 99, (1, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True, use_cache=False)
        taps = torch.cat(ref.hidden_states[1:], -1)
        logits, got, _ = ours(ids, torch.arange(15)[None], ours.empty_kv())
        cache, steps = ours.new_cache(15), []
        for a, b in ((0, 6), *((j, j + 1) for j in range(6, 15))):  # prefill, then steps past the window
            steps.append(ours(ids[:, a:b], torch.arange(a, b)[None], cache)[0])
            cache.commit(b - a)
    scale = taps.abs().max()
    assert (got - taps).abs().max() <= 1e-5 * scale, (got - taps).abs().max()
    for mine in (logits, torch.cat(steps, 1)):
        assert (mine - ref.logits).abs().max() < 1e-4


def test_yarn_dense_target_matches_transformers(tmp_path):
    """YaRN on a Qwen3 target (its attention factor scales cos and sin, so the scores by its square)."""
    make_target(tmp_path, "qwen3", layers=2, hidden=32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                              "original_max_position_embeddings": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert TargetConfig.load(tmp_path).rope.attention_factor > 1.1
    ids = torch.randint(0, 99, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf_model(tmp_path)(ids, use_cache=False).logits
        ours = Target.from_pretrained(tmp_path)
        got = ours(ids, torch.arange(40)[None], ours.empty_kv())[0]
    assert (got - ref).abs().max() < 1e-4


@pytest.fixture(scope="module", params=list(WINDOWED_CASES))
def pair(request):
    return request.param, artifact(WINDOWED_CASES[request.param])


def test_check_passes_with_wrapped_rings(pair):
    """Every graph in every regime (a past beyond the window included), ragged rows, and end to end."""
    _, (t, d, out) = pair
    report = run_check(out, t, d, prompts=3, max_new_tokens=16, progress=False)
    assert report.passed, report.summary()
    assert any("rings wrapped" in r.case for r in report.rows)


def test_greedy_equals_official_and_transformers(pair, monkeypatch):
    """Token for token transformers' greedy `generate`; round for round the official z-lab loop over
    transformers' target (its cache crops sliding layers itself) with its own drafter class."""
    from dflash import model as dm

    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # its stats sync CUDA; no GPU here
    name, (t, d, out) = pair
    hf = hf_model(t)
    official = dm.DFlashDraftModel.from_pretrained(str(d), dtype=torch.float32).eval()
    backend, accepted = OrtBackend(out), []
    for prompt in prompts(3, 100, seed=4):
        n = 20
        ours = generate(backend, prompt, n, stop_token_ids=())
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        ref = dm.dflash_generate(official, hf, torch.tensor([prompt]), n, None, return_stats=True)
        assert ours.tokens == plain[0, len(prompt):].tolist() == ref.output_ids[0, len(prompt):].tolist(), name
        assert ours.acceptance_lengths == ref.acceptance_lengths, name
        accepted += ours.acceptance_lengths
    assert 1 < np.mean(accepted) < WINDOWED_CASES[name].block, accepted  # drafts accepted and rolled back


def test_batched_rows_equal_each_alone(pair):
    """Three rows of different lengths in one batch (the rings per row, all bound at once) decode
    exactly as each prompt alone."""
    _, (_, _, out) = pair
    ps = prompts(3, 100, seed=5)
    alone = [generate(OrtBackend(out), p, 16, stop_token_ids=()).tokens for p in ps]
    gens, _ = generate_batch(OrtBackend(out, max_batch=3), [Request(p, 16, stop_token_ids=()) for p in ps])
    assert [g.tokens for g in gens] == alone


def test_rings_keep_committed_positions_only(pair):
    """A call's new K/V reach a ring only when committed: a rejected draft never overwrites a slot
    the window still needs, and a long chunk leaves its last `ring` positions."""
    _, (_, _, out) = pair
    m = load_manifest(out)
    rings = WindowRings(m, max_chunk=16, max_batch=2)
    R, i = rings.ring, rings.layers[0]
    key, new = f"past_key.{i}", f"new_key.{i}"
    lengths = np.array([0, 0])

    def call(rows, seq, start, keep):
        rings.layout(len(rows), seq)
        view = rings.view(new)
        for r, b in enumerate(rows):
            view[r] = (start[r] + np.arange(seq))[:, None, None]  # every value: its position
        rings.commit_rows(rows, keep, lengths)
        lengths[rows] += keep

    call([0, 1], 9, [0, 0], [9, 3])  # a chunk longer than the ring; a row that keeps 3 of 9
    call([0, 1], 4, [9, 3], [1, 4])  # a verify of 4 that keeps 1, one that keeps all
    for b, n in enumerate(lengths):
        held = rings.buf[key][b, :, 0, 0]
        for s in range(min(n, R)):
            assert held[s] == n - 1 - (n - 1 - s) % R  # slot s: the newest committed position = s mod ring


def test_ring_memory_is_flat_in_the_context(pair):
    """The sliding layers' rings do not grow with max context; the full layers' caches do."""
    _, (_, _, out) = pair
    m = load_manifest(out)
    small, large = (dataclasses.replace(m, max_context=n) for n in (512, 8192))
    assert WindowRings(small, 16).nbytes() == WindowRings(large, 16).nbytes() > 0
    assert ring_bytes(small) == ring_bytes(large) > 0
    full = C.layer_kinds(C.TARGET, m).count(C.ATTENTION)
    assert cache_bytes_per_position(m, drafter=False) == 2 * full * m.target_kv_heads * m.target_head_dim * 4


def test_info_names_the_family_and_its_attention(pair):
    name, (_, _, out) = pair
    t = describe(out, verify=False)["target"]
    kinds = t["attention_kinds"]
    assert t["family"] == name and set(kinds) == {SW, FA}
    assert kinds[SW]["cache"] == "ring of 4 slots" and kinds[SW]["window"] == 4
    if name == "gemma4":  # layers 2 and 3 read layers 0 and 1's K/V; full layers have their own shape
        assert t["kv_shared"] == {2: 0, 3: 1} and kinds[FA]["head_dim"] == 2 * kinds[SW]["head_dim"]
        assert t["final_logit_softcapping"] == 30.0
    else:
        assert t["sinks"] and kinds[SW]["rope"] == "yarn"


def test_unsupported_variants_are_one_line_errors(pair, tmp_path):
    name, (t, _, out) = pair
    for model_type, arch in (("deepseek_v3", "DeepseekV3ForCausalLM"), ("kimi_k25", "Kimi_K25ForConditionalGeneration")):
        with pytest.raises(DFlashError, match=r"multi-head latent attention \(MLA.*group-limited expert routing") as e:
            TargetConfig.from_dict({"architectures": [arch], "model_type": model_type})
        assert "\n" not in str(e.value)
    with pytest.raises(DFlashError, match="TensorRT engines for .* are not built in this version"):
        build_plan(load_manifest(out))
    if name == "gemma4":
        cfg = json.loads((t / "config.json").read_text())
        with pytest.raises(DFlashError, match="use_bidirectional_attention='all'"):
            TargetConfig.from_dict({**cfg, "use_bidirectional_attention": "all"})


# harmony-format turns (gpt-oss's chat format) with the Jinja its template relies on: a macro, a
# namespace, strftime_now, raise_exception, tojson (written here for the test, not the released file)
HARMONY = """{%- macro header() -%}You are a model.\\nCurrent date: {{ strftime_now("%Y-%m-%d") }}\\n
{%- endmacro -%}
<|start|>system<|message|>{{ header() }}<|end|>
{%- set seen = namespace(user=false) -%}
{%- for m in messages -%}
{%- if m.role not in ("system", "developer", "user", "assistant") %}{{ raise_exception("unknown role") }}{% endif -%}
{%- if m.role == "user" %}{% set seen.user = true %}{% endif -%}
<|start|>{{ m.role }}<|message|>{{ m.content if m.content is string else m.content | tojson }}<|end|>
{%- endfor -%}
{%- if add_generation_prompt and seen.user %}<|start|>assistant{% endif -%}"""


def test_served_chat_renders_the_checkpoint_template(tmp_path):
    """A template saved as transformers 5 saves it (chat_template.jinja) travels with the export and
    renders as transformers renders it; two chats served at once by the batched engine answer what
    offline decoding of the rendered prompts gives."""
    import asyncio
    import shutil

    from test_runtime_cli import char_tokenizer
    from test_serve import _call

    from dflash_export.runtime import manifest as M
    from dflash_export.serve.app import ServeOptions, create_app
    from dflash_export.serve.engine import load_engine
    from dflash_export.serve.text import Text

    art = tmp_path / "art"
    shutil.copytree(artifact(WINDOWED_CASES["gpt_oss"])[2], art)
    char_tokenizer(art / "tokenizer.json")
    (art / "chat_template.jinja").write_text(HARMONY)
    m = M.load_manifest(art, verify=False)
    m.tokenizer = True
    M.write_manifest(art, m)
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
             [{"role": "user", "content": "count: 1 2 3"}]]
    text = Text(art)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(art / "tokenizer.json"))
    hf.chat_template = HARMONY
    rendered = [text.render(c) for c in chats]
    assert rendered == [hf.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    assert rendered[0].startswith("<|start|>system<|message|>You are a model.") and rendered[0].endswith("<|start|>assistant")
    backend = OrtBackend(art)
    offline = [text.decode(generate(backend, text.encode(r), 10, stop_token_ids=()).tokens) for r in rendered]
    engine = load_engine(art, model="m", max_batch=2)
    app = create_app(ServeOptions(art), engine=engine)

    async def both():
        return await asyncio.gather(*(_call(app, "POST", "/v1/chat/completions", json.dumps(
            {"messages": c, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).encode()) for c in chats))
    try:
        answers = asyncio.run(asyncio.wait_for(both(), 120))
    finally:
        engine.close()
    assert [a[0] for a in answers] == [200, 200], answers
    assert [a[1]["choices"][0]["message"]["content"] for a in answers] == offline
