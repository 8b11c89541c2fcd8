"""The ORT backend and the speculative loop against the PyTorch oracle, on one exported pair.

The pair (runtime_cases.CASES["qwen3"]) has a biased target, so the random drafter gets
real acceptance: the round-by-round comparison with the oracle covers accepted drafts,
rollback and bonus tokens, not only rejections.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
import torch
from runtime_cases import CASES, artifact, prompts

from dflash_export.models import Drafter, Target, autoregressive_generate, speculative_generate
from dflash_export.models.draft_config import DraftConfig
from dflash_export.runtime import contract as C
from dflash_export.runtime.names import names_of
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.loop import Generation, generate, stream
from dflash_export.runtime.ort.backend import OrtBackend, resolve_provider
from dflash_export.runtime.sampling import Sampling


@pytest.fixture(scope="module")
def pair():
    tdir, ddir, out = artifact(CASES["qwen3"])
    dc = DraftConfig.load(ddir)
    target = Target.from_pretrained(tdir, dc.target_layer_ids)
    drafter = Drafter.from_pretrained(ddir)
    return target, drafter, out


@pytest.fixture(scope="module")
def backend(pair):
    return OrtBackend(pair[2])


def oracle(pair, backend, prompt, n, **kw):
    m = backend.manifest
    kw.setdefault("stop_token_ids", tuple(m.eos_token_ids))
    return speculative_generate(pair[0], pair[1], prompt, n, mask_token_id=m.mask_token_id,
                                block_size=m.block_size, max_context=m.max_context, **kw)


def test_greedy_matches_oracle_round_for_round(pair, backend):
    accepted_more_than_one = 0
    for prompt in prompts(8, backend.manifest.vocab_size, seed=1):
        g = generate(backend, prompt, 48)
        o = oracle(pair, backend, prompt, 48)
        assert g.tokens == o.tokens
        assert g.acceptance_lengths == o.acceptance_lengths
        assert g.stopped == o.stopped
        assert len(g.tokens) == 1 + sum(g.acceptance_lengths)
        accepted_more_than_one += sum(a > 1 for a in g.acceptance_lengths)
    assert accepted_more_than_one > 0, "the biased pair should accept drafts somewhere"


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8), (0.5, 5, 0.9)])
def test_sampling_matches_oracle_stream(pair, backend, temperature, top_k, top_p):
    for seed, prompt in enumerate(prompts(3, backend.manifest.vocab_size, seed=2)):
        kw = dict(sampling=Sampling(temperature, top_k, top_p, seed))
        g = generate(backend, prompt, 32, **kw)
        o = oracle(pair, backend, prompt, 32, **kw)
        assert g.tokens == o.tokens and g.acceptance_lengths == o.acceptance_lengths
        assert generate(backend, prompt, 32, **kw).tokens == g.tokens  # deterministic given the seed


def test_autoregressive_mode_matches_oracle(pair, backend):
    m = backend.manifest
    for i, prompt in enumerate(prompts(3, m.vocab_size, seed=3)):
        for kw in (dict(), dict(sampling=Sampling(0.9, top_k=10, seed=i))):
            g = generate(backend, prompt, 24, draft=False, **kw)
            o = autoregressive_generate(pair[0], prompt, 24, stop_token_ids=tuple(m.eos_token_ids), **kw)
            assert g.tokens == o.tokens
            assert g.acceptance_lengths == [1] * (len(g.tokens) - 1)
        assert generate(backend, prompt, 24, draft=False).tokens == generate(backend, prompt, 24).tokens


def test_chunked_prefill_is_identical(backend):
    prompt = prompts(1, backend.manifest.vocab_size, seed=4)[0] * 3  # ~a hundred tokens
    whole = generate(backend, prompt, 30)
    for chunk in (1, 7, 32):
        g = generate(backend, prompt, 30, prefill_chunk=chunk)
        assert g.tokens == whole.tokens and g.acceptance_lengths == whole.acceptance_lengths
    sampled = [generate(backend, prompt, 20, sampling=Sampling(1.0, seed=5), prefill_chunk=c).tokens for c in (5, 256)]
    assert sampled[0] == sampled[1]


def test_stop_tokens_and_limits(pair, backend):
    prompt = prompts(1, backend.manifest.vocab_size, seed=6)[0]
    free = generate(backend, prompt, 40, stop_token_ids=())
    stop = free.tokens[5]
    g = generate(backend, prompt, 40, stop_token_ids=(stop,))
    assert g.stopped and g.tokens == free.tokens[: free.tokens.index(stop) + 1]
    assert g.tokens == oracle(pair, backend, prompt, 40, stop_token_ids=(stop,)).tokens
    for n in (1, 2, 9):  # the max_length cut inside a round
        g = generate(backend, prompt, n, stop_token_ids=())
        assert len(g.tokens) == n and g.tokens == free.tokens[:n]
        assert g.acceptance_lengths == oracle(pair, backend, prompt, n, stop_token_ids=()).acceptance_lengths


def test_generation_up_to_the_exported_context(pair, backend):
    m = backend.manifest
    prompt = prompts(1, m.vocab_size, seed=7)[0][:10]
    n = m.max_context - len(prompt)
    g = generate(backend, prompt, n, stop_token_ids=())
    assert len(g.tokens) == n
    assert g.tokens == oracle(pair, backend, prompt, n, stop_token_ids=()).tokens
    with pytest.raises(DFlashError, match="exceeds the exported max context"):
        generate(backend, prompt, n + 1)


def test_stream_yields_rounds(backend):
    prompt = prompts(1, backend.manifest.vocab_size, seed=8)[0]
    g = generate(backend, prompt, 40)
    chunks = list(stream(backend, prompt, 40))
    assert [len(c) for c in chunks] == [1] + g.acceptance_lengths
    assert sum(chunks, []) == g.tokens


class SlowBackend:
    """Delegates to a real backend, sleeping a known time in each kind of call."""

    DRAFT, VERIFY = 0.2, 0.01  # per draft_block + draft_context pair / per target call: far apart

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def target_rows(self, *args, **kwargs):  # the loop's calls (runtime/backend.py: rows)
        time.sleep(self.VERIFY)
        return self.inner.target_rows(*args, **kwargs)

    def draft_block_rows(self, *args):
        time.sleep(self.DRAFT / 2)
        return self.inner.draft_block_rows(*args)

    def draft_context_rows(self, *args):
        time.sleep(self.DRAFT / 2)
        return self.inner.draft_context_rows(*args)


def test_time_split_attributes_each_call(backend):
    """Known sleeps in each kind of call land in the right bucket, round by round; time the
    consumer spends between rounds is not counted."""
    slow = SlowBackend(backend)
    prompt = prompts(1, backend.manifest.vocab_size, seed=9)[0]
    g = Generation()
    t0 = time.perf_counter()
    for _ in stream(slow, prompt, 40, out=g, stop_token_ids=()):
        time.sleep(0.02)  # a slow consumer
    wall = time.perf_counter() - t0
    rounds = len(g.acceptance_lengths)
    assert rounds == len(g.round_s) > 3
    assert g.prefill_s >= slow.VERIFY + slow.DRAFT / 2  # one prefill chunk: target + context
    # every round but the last projects its accepted tokens (the last one has no next round)
    for i, (draft, verify, host) in enumerate(g.round_s):
        assert draft >= (slow.DRAFT if i < rounds - 1 else slow.DRAFT / 2), (i, draft)
        # no draft call in the verify bucket, no call in the host bucket (host work is sub-millisecond;
        # the 90 ms margin is for a loaded machine)
        assert slow.VERIFY <= verify < slow.DRAFT / 2, (i, verify)
        assert 0 <= host < slow.DRAFT / 2, (i, host)
    assert g.decode_s >= rounds * (slow.DRAFT / 2 + slow.VERIFY)
    assert g.total_s <= wall - (rounds + 1) * 0.02 + 1e-3  # consumer sleeps excluded
    assert g.tokens_per_second == pytest.approx((len(g.tokens) - 1) / g.decode_s)


def test_unchanged_bindings_are_not_bound_again(pair, backend):
    """On the CPU provider a round binds again only the tensors whose pointer or shape moved
    (positions, cache prefixes), and decodes what binding every tensor every call decodes,
    through verify lengths that vary round by round (the adaptive policy) and prompts of every length."""
    from dflash_export.runtime.settings import VerifyPolicy

    class Counting(dict):
        sets: list = []  # the tensors actually bound, by name

        def __setitem__(self, key, value):
            Counting.sets.append(key[1])
            super().__setitem__(key, value)

    every = OrtBackend(pair[2])
    every._bound = None  # the reference: every tensor bound at every call
    backend._bound, backend.trace = Counting(), []
    try:
        for prompt in prompts(6, backend.manifest.vocab_size, seed=21):
            for verify in (None, VerifyPolicy(0.3, 2)):
                g, ref = generate(backend, prompt, 40, verify=verify), generate(every, prompt, 40, verify=verify)
                assert (g.tokens, g.verify_lengths) == (ref.tokens, ref.verify_lengths)
        Counting.sets, backend.trace = [], []
        g = generate(backend, prompt, 40)  # the same shapes again: the outputs stay bound
        calls = [name for name, _, _ in backend.trace]
        assert len(g.acceptance_lengths) > 3
        for name in (C.DRAFT_IDS, C.DRAFT_CONF, C.BLOCK_IDS, C.NEXT_IDS):  # bound again only where the shape moved
            shapes = [shape for n, _, shape in backend.trace if n == name]
            moved = sum(a != b for a, b in zip(shapes, shapes[1:])) + 1
            assert Counting.sets.count(name) <= moved < len(shapes) / 2, (name, shapes)
        assert 0 < len(Counting.sets) < len(calls)
    finally:
        backend._bound, backend.trace = {}, None
        every.close()


def test_caches_are_bound_in_place_never_copied(pair, backend):
    """Every past_* input is the buffer's own start, every new_* output the slot after the
    valid prefix; buffers keep their addresses; host allocations per round stay tiny."""
    m = backend.manifest
    bufs = {id(b): b.ctypes.data for b in backend.kv + backend.ctx}
    prompt = prompts(1, m.vocab_size, seed=10)[0]
    backend.trace = []
    g = generate(backend, prompt, 60)
    trace, backend.trace = backend.trace, None
    assert {id(b): b.ctypes.data for b in backend.kv + backend.ctx} == bufs

    kv_row = m.target_kv_heads * m.target_head_dim * 4
    ctx_row = m.draft_kv_heads * m.draft_head_dim * 4
    N = names_of(m)
    base = {**{n: backend.kv[2 * i + j].ctypes.data for i in range(m.target_layers)
               for j, n in enumerate((N.past_key[i], N.past_value[i]))},
            **{n: backend.ctx[2 * i + j].ctypes.data for i in range(m.draft_layers)
               for j, n in enumerate((N.past_ctx_key[i], N.past_ctx_value[i]))}}
    out_base = {N.new_key[i]: base[N.past_key[i]] for i in range(m.target_layers)}
    out_base |= {N.new_value[i]: base[N.past_value[i]] for i in range(m.target_layers)}
    out_base |= {N.ctx_key[j]: base[N.past_ctx_key[j]] for j in range(m.draft_layers)}
    out_base |= {N.ctx_value[j]: base[N.past_ctx_value[j]] for j in range(m.draft_layers)}
    calls = 0
    for name, ptr, shape in trace:
        if name in base:  # prefix view: starts at the buffer, P rows long
            assert ptr == base[name]
            calls += 1
        elif name in out_base:  # written in place at the slot after the prefix
            row = ctx_row if name.startswith("ctx_") else kv_row
            assert (ptr - out_base[name]) % row == 0 and (ptr - out_base[name]) // row + shape[1] <= m.max_context
    assert calls == 2 * m.target_layers * len(g.tokens[:-1] and [0] + g.acceptance_lengths) + \
        2 * m.draft_layers * len(g.acceptance_lengths)

    # what the buffers hold is exactly the target's K/V of the final sequence
    seq = prompt + g.tokens[:-1]
    with torch.no_grad():
        _, _, new = pair[0](torch.tensor([seq]), torch.arange(len(seq))[None], pair[0].empty_kv())
    for i, (k, v) in enumerate(new):
        np.testing.assert_allclose(backend.kv[2 * i][0, : len(seq)], k[0].numpy(), atol=1e-4)
        np.testing.assert_allclose(backend.kv[2 * i + 1][0, : len(seq)], v[0].numpy(), atol=1e-4)

    # a round's host allocations do not depend on the context length (no cache copies)
    cache_bytes = sum(b.nbytes for b in backend.kv)
    tracemalloc.start()
    rounds = stream(backend, prompt * 4, 80, stop_token_ids=())
    next(rounds)
    tracemalloc.reset_peak()
    base_mem = tracemalloc.get_traced_memory()[0]
    for _ in rounds:
        pass
    peak = tracemalloc.get_traced_memory()[1] - base_mem
    tracemalloc.stop()
    assert peak < min(64 * 1024, cache_bytes // 8), peak


def _outputs(be):
    be.reset()
    res = be.target(np.array([3, 4, 5, 6]), want_logits=True)
    logits = res.logits.copy()
    be.commit(4)
    be.draft_context(4)
    be.draft_block(9)
    return logits, be._draft_logits.copy()


def test_shared_initializers_are_one_copy_used_by_both_graphs(pair):
    """Both sessions read the arrays we loaded once: change them in memory, both graphs see it."""
    _, _, out = pair
    for low_memory in (False, True):
        be = OrtBackend(out, low_memory=low_memory)
        assert set(C.SHARED_INITIALIZERS) <= set(be.graphs.shared), "the export must name both shared initializers"
        assert not be.graphs.tied_head_graphs  # untied: the head is stored [H, V], nothing to fold
        emb = be.graphs.shared["embed_tokens.weight"][0]
        before = _outputs(be)
        saved = emb.copy()
        emb *= 0.5
        after = _outputs(be)
        assert not np.array_equal(before[0], after[0]) and not np.array_equal(before[1], after[1])
        emb[:] = saved
        assert all(np.array_equal(x, y) for x, y in zip(before, _outputs(be)))
        if low_memory:  # no folded/prepacked copy of the LM head either
            be.graphs.shared["lm_head.weight"][0][:] = 0  # all-zero logits -> argmax 0 in both graphs
            logits, drafts = _outputs(be)
            assert (logits == 0).all() and (drafts == 0).all()
            be.graphs.shared["lm_head.weight"][0][:] = _initializer(out / "target.onnx", "lm_head.weight")
    # the weights mapped through the manifest's table equal what onnx reads from the graphs
    for graph in (C.TARGET, C.DRAFT_BLOCK, C.DRAFT_CONTEXT):
        for name, t in be.manifest.shared.items():
            if graph in t.graphs:
                np.testing.assert_array_equal(_initializer(out / C.GRAPH_FILES[graph], name), be.graphs.shared[name][0])


def _initializer(path, name):
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def test_drafter_kv_projection_is_one_copy_used_by_both_drafter_graphs(pair):
    """The drafter's k_proj is stored once and mapped once: both drafter sessions read it
    (low_memory: without it each session's MatMul prepacks a copy of its own at load, so a
    change to the mapped bytes would not show)."""
    _, _, out = pair
    be = OrtBackend(out, low_memory=True)
    name = "layers.0.self_attn.k_proj.weight"
    assert be.manifest.shared[name].graphs == [C.DRAFT_CONTEXT, C.DRAFT_BLOCK]
    w = be.graphs.shared[name][0]

    def context():
        be.reset()
        be.target(np.array([1, 2, 3]))
        be.commit(3)
        be.draft_context(3)
        return [c[0, :3].copy() for c in be.ctx]

    def block(ctx):  # the block pass over a given context cache
        for buf, c in zip(be.ctx, ctx):
            buf[0, :3] = c
        be.draft_block(4)
        return be._draft_logits.copy()

    ctx0 = context()
    logits0 = block(ctx0)
    saved = w.copy()
    w *= -3.0
    assert not np.array_equal(ctx0[0], context()[0]), "draft_context must read the shared k_proj"
    assert not np.array_equal(logits0, block(ctx0)), "draft_block must read the shared k_proj"
    w[:] = saved
    assert np.array_equal(ctx0[0], context()[0]) and np.array_equal(logits0, block(ctx0))


def test_bad_requests(backend):
    m = backend.manifest
    with pytest.raises(DFlashError, match="empty"):
        generate(backend, [], 5)
    with pytest.raises(DFlashError, match="outside the vocabulary"):
        generate(backend, [1, m.vocab_size], 5)
    with pytest.raises(DFlashError, match="temperature"):
        generate(backend, [1], 5, sampling=Sampling(-1))
    with pytest.raises(DFlashError, match="top-p"):
        generate(backend, [1], 5, sampling=Sampling(1, top_p=0))
    with pytest.raises(DFlashError, match="max context"):
        generate(backend, [1] * (m.max_context + 1), 1)
    with pytest.raises(DFlashError, match="unknown provider 'tpu'; available: cpu"):
        resolve_provider("tpu")


def test_tampered_artifact_is_refused(pair, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(pair[2], out)
    data = out / "shared.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(DFlashError, match="does not match its sha256"):
        OrtBackend(out)


def test_tied_embedding_and_head_are_read_once():
    """A tied model stores both names at the same bytes of shared.data: one array serves both."""
    _, _, out = artifact(CASES["llama"])
    be = OrtBackend(out)
    assert be.graphs.shared["embed_tokens.weight"][0] is be.graphs.shared["lm_head.weight"][0]
    assert len(generate(be, [1, 2, 3], 8, stop_token_ids=()).tokens) == 8
