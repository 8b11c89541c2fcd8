"""Measurements that choose runtime settings (`bench --calibrate`) and report costs (`bench --context`).

- `thread_candidates`: the intra-op thread counts worth trying on this machine.
- `choose_policy`: the adaptive verify policy that maximises tokens per second, replaying
  full-block rounds (drafter confidences + acceptance) against the measured cost curve. A
  policy is kept only if it beats the full block by more than `MARGIN`, so where verify
  cost is flat in its length (a GPU) the full block stays.
- `step_ms_by_context`: a 1-token step after a prefix of each given length.
- `choose_count`: the thread count of the speculative loop (fewer unless more pay).
- `choose_spin`: whether ONNX Runtime's idle workers spin, and for how long (SPIN_US), per thread
  count (only where it pays).
- `graph_ms` / `choose_threads`: each graph's call of a speculative round at every thread
  count (interleaved), and the count each graph runs fastest with (target and drafter differ
  at real sizes).
- `prefill_ms` / `choose_chunk`: the time to first token of a 512-token prompt per prefill
  chunk, and the fastest chunk.
- `host_ms`: ms of the loop's own work per drafted and per plain round (outside the graph
  calls), measured in the loop's rounds: the rest of the cost model.
- `round_costs`: ms of a plain step, a verify of each length, a draft and a context update
  at each batch size, each call where a round runs it (right after the other model's call):
  the speculation controller's cost model (runtime/controller.py) and the verify policy's.
- `calibrate`: the driver: all of the above on one directory, written to its runtime.json.
All of it runs through the Backend interface: any backend, no torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from . import contract as C
from .backend import Backend
from .contract import DRAFT_BLOCK, DRAFT_CONTEXT, TARGET
from .controller import Controller, Costs
from .errors import DFlashError
from .loop import Request, generate, generate_batch
from .load import open_backend
from .measure import measure_many, rate
from .settings import FULL, RunOptions, Settings, VerifyPolicy, device_key, policy_json, save_settings

THETAS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)
MIN_LENS = (1, 2, 3, 4, 6)
MARGIN = 0.02  # a policy must beat the full block by 2% in the replay to be chosen
THREAD_MARGIN = 0.05  # more threads for a graph only when they save 5% of its call
TTFT_TOKENS = 512  # the prompt whose time to first token `bench` reports and the chunk is chosen on
CHUNKS = (64, 128, 256, 512)  # prefill chunks tried (those the backend takes)


def thread_candidates() -> list[int]:
    n = os.cpu_count() or 1
    return sorted({1, n} | {2**i for i in range(1, 8) if 2**i < n})


def _prefill(backend: Backend, ids: list[int]) -> None:
    backend.reset()
    for i in range(0, len(ids), backend.max_chunk):
        chunk = ids[i : i + backend.max_chunk]
        backend.target(np.asarray(chunk, np.int64))
        backend.commit(len(chunk))


def _median_ms(samples: list[float]) -> float:
    return float(np.median(samples)) * 1e3


def replay(rounds: list[tuple[np.ndarray, int]], policy: VerifyPolicy, costs_ms: list[float], draft_ms: float):
    """(tokens per ms, mean verify length) if `policy` had cut these full-block rounds:
    a round verifying s positions emits min(accepted, s - 1) + 1 tokens."""
    k = len(costs_ms)
    emitted = spent = verified = 0.0
    for conf, accepted in rounds:
        s = policy.length(conf, k)
        emitted += min(accepted, s - 1) + 1
        spent += draft_ms + costs_ms[s - 1]
        verified += s
    return emitted / spent, verified / len(rounds)


def choose_policy(rounds, costs_ms: list[float], draft_ms: float) -> tuple[VerifyPolicy | None, list[dict]]:
    """The best policy of the grid in the replay (None: the full block), and the grid's table."""
    if not rounds:
        raise DFlashError("calibration saw no speculative rounds; use longer --max-new-tokens")
    full_rate, full_len = replay(rounds, FULL, costs_ms, draft_ms)
    table, best, best_rate = [], None, full_rate * (1 + MARGIN)
    for theta in THETAS[1:]:
        for min_len in MIN_LENS:
            p = VerifyPolicy(theta, min_len)
            rate, mean_len = replay(rounds, p, costs_ms, draft_ms)
            table.append({"theta": theta, "min_len": min_len, "relative_rate": rate / full_rate, "mean_verify_len": mean_len})
            if rate > best_rate:
                best, best_rate = p, rate
    table.insert(0, {"theta": 0.0, "min_len": len(costs_ms), "relative_rate": 1.0, "mean_verify_len": full_len})
    return best, table


def step_ms_by_context(backend: Backend, contexts: list[int], repeats: int = 30, seed: int = 0) -> dict[str, float]:
    """{context: ms of a 1-token target step after that many positions} (median of repeats)."""
    m = backend.manifest
    need = max(contexts) + m.block_size
    if need > backend.max_len:
        raise DFlashError(f"--context {max(contexts)} needs an export with --max-context >= {need} "
                          f"(context + block size); this one holds {backend.max_len}")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, m.vocab_size - 2, max(contexts)).tolist()
    out = {}
    for c in contexts:
        _prefill(backend, prefix[:c])
        tok = np.asarray(prefix[c - 1 : c], np.int64)
        times = []
        for _ in range(3 + repeats):
            t0 = time.perf_counter()
            backend.target(tok)
            times.append(time.perf_counter() - t0)
            backend.commit(0)
        out[str(c)] = _median_ms(times[3:])
    backend.reset()
    return out


def graph_ms(backend: Backend, prompt: list[int], repeats: int = 8) -> dict[str, float]:
    """{graph: median ms of its call in a speculative round} after `prompt`: the target over
    the block (verify), draft_context of one position, draft_block; one position committed per
    repeat (the rest of the verify rolled back), as a round that accepts nothing."""
    return graph_ms_by({0: backend}, prompt, repeats)[0]


def graph_ms_by(backends: dict, prompt: list[int], repeats: int = 8) -> dict:
    """{label: graph_ms} of several backends of one export (e.g. thread counts), their rounds
    interleaved so that a change in the machine's load hits every label alike (measured one
    label after the other, a burst of load on a shared machine decided the thread count)."""
    first = next(iter(backends.values()))
    k = first.manifest.block_size
    repeats = max(1, min(repeats, first.max_len - len(prompt) - k - 1))
    for be in backends.values():
        generate(be, prompt, 1)  # prefill target and drafter context
    ids = np.asarray((prompt * k)[:k], np.int64)
    times = {label: {TARGET: [], DRAFT_CONTEXT: [], DRAFT_BLOCK: []} for label in backends}
    for _ in range(1 + repeats):  # the first round warms the shapes up
        for label, backend in backends.items():
            t0 = time.perf_counter()
            backend.target(ids)
            t1 = time.perf_counter()
            backend.commit(1)
            backend.draft_context(1)
            t2 = time.perf_counter()
            backend.draft_block(int(ids[0]))
            t3 = time.perf_counter()
            for g, t in ((TARGET, t1 - t0), (DRAFT_CONTEXT, t2 - t1), (DRAFT_BLOCK, t3 - t2)):
                times[label][g].append(t)
    for be in backends.values():
        be.reset()
    return {label: {g: _median_ms(ts[1:]) for g, ts in by.items()} for label, by in times.items()}


COST_ROWS = (1, 2, 4)  # batch sizes whose round costs are measured (the controller interpolates between them)


def _fill_rows(backend: Backend, prompt: list[int], rows: int) -> None:
    """Rows 0..rows-1 each hold `prompt` in both caches (prefilled one row at a time, as the loop joins rows)."""
    backend.reset()
    backend.set_width(0)
    for slot in range(rows):
        backend.set_width(slot + 1)
        n = len(prompt)
        backend.target_rows([slot], np.asarray(prompt, np.int64)[None], [n], np.array([[n - 1]]))
        backend.commit_rows([slot], [n])
        backend.draft_context_rows([slot], [n])


def round_costs(backend: Backend, prompt: list[int], rows: int, repeats: int = 21) -> dict:
    """ms at `rows` rows after `prompt`: {"step", "verify": [s = 1..K], "draft", "context"}, each
    call timed where a round runs it: a verify right after a draft_block call, the draft right
    after a verify and its context call, the context call right after a verify, a plain step
    right after two plain steps (plain rounds run back to back). On a small model each call
    runs slower right after the other model's (its weights were evicted from the CPU caches:
    ~2x on the demo pair, docs/results.md), so calls repeated back to back under-price a round.
    A pass is K rounds in loop order, round s verifying s positions and keeping one (a round
    that accepts nothing), then three plain steps; passes repeat, each value its 10th
    percentile (on a shared machine the delays other jobs add are what varies; the controller
    needs the calls' ratios). "context" is one draft_context call of one position per row. Where
    draft_block takes draft_index, each round's draft scores s - 1 drafts (at least one), as the
    loop's: "draft" is the call scoring all K - 1, "draft_one" one (the head is linear in the
    drafts it scores)."""
    k = backend.manifest.block_size
    repeats = max(1, min(repeats, (backend.max_len - len(prompt) - k) // (k + 1) - 1))  # a pass keeps k + 1
    _fill_rows(backend, prompt, rows)
    rs = list(range(rows))
    ids = np.tile(np.asarray((prompt * k)[:k], np.int64), (rows, 1))
    one = C.draft_index(backend.manifest) and k > 2
    none, ones = np.zeros(rows, np.int64), np.ones(rows, np.int64)
    times: dict = {s: [] for s in range(1, k + 1)} | {"step": [], "draft": [], "context": []} | (
        {"draft_one": []} if one else {})
    clock, warm = time.perf_counter, {}
    for n in range(1 + repeats):
        warm = {key: len(ts) for key, ts in times.items()} if n == 1 else warm  # the first pass warms the shapes up
        for s in range(1, k + 1):
            t0 = clock()
            backend.draft_block_rows(rs, ids[:, 0], max(1, s - 1))
            t1 = clock()
            backend.target_rows(rs, ids[:, :s], np.full(rows, s), None)
            t2 = clock()
            backend.commit_rows(rs, ones)
            t3 = clock()
            backend.draft_context_rows(rs, ones)
            t4 = clock()
            draft = "draft" if not one or s == k else "draft_one" if s <= 2 else None
            if draft:
                times[draft].append(t1 - t0)
            times[s].append(t2 - t1)
            times["context"].append(t4 - t3)
        for last in (False, False, True):  # plain steps: the first two warm the target up again
            t0 = clock()
            backend.target_rows(rs, ids[:, :1], ones, None)
            t1 = clock()
            backend.commit_rows(rs, ones if last else none)
        times["step"].append(t1 - t0)
        backend.draft_context_rows(rs, ones)  # the drafter's catch-up, as at a drafted round after plain ones
    backend.reset()
    backend.set_width(0)
    med = {key: float(np.percentile(ts[warm[key]:], 10)) * 1e3 for key, ts in times.items()}
    return {"step": med["step"], "verify": [med[s] for s in range(1, k + 1)], "draft": med["draft"],
            "context": med["context"], **({"draft_one": med["draft_one"]} if one else {})}


def host_ms(backend: Backend, prompt: list[int], rows: int, verify: VerifyPolicy | None, new: int = 48) -> dict:
    """ms of the loop's own work per round at `rows` rows, outside its graph calls (Generation.round_s):
    {"host_draft": in a drafted round (every row drafting, `verify`'s lengths: the acceptance, the
    verify lengths, the bookkeeping), "host_plain": in a plain round under `auto` (a controller whose
    drafts cannot pay: its decisions and their skips, the drafter's kept taps), "host_step": in a
    round of plain decoding (no drafter, no controller)}, each the median over the rounds of the
    second of two runs of `prompt` in every row (the first warms up)."""
    k = backend.manifest.block_size
    never = Costs([1], [1.0], [[1.0] * k], [1e9], [0.0])  # no draft pays, no probe can: plain rounds, decided or skipped
    out = {}
    for key, control, draft in (("host_draft", None, True), ("host_plain", Controller(never, k), True),
                                ("host_step", None, False)):
        for _ in range(2):
            gens, _ = generate_batch(backend, [Request(list(prompt), new, stop_token_ids=()) for _ in range(rows)],
                                     batch=rows, verify=verify, control=control, draft=draft)
        g, plain = gens[0], key != "host_draft"
        out[key] = _median_ms([d + h if plain else h for (d, _, h), x in zip(g.round_s, g.drafted) if x != plain] or [0.0])
    backend.reset()
    backend.set_width(0)
    return out


def cost_model(by_rows: dict[int, dict]) -> dict:
    """runtime.json's `costs` (runtime/controller.py Costs.from_json) from round_costs per batch size."""
    rows = sorted(by_rows)
    return {"rows": rows, "step_ms": [by_rows[r]["step"] for r in rows],
            "verify_ms": [by_rows[r]["verify"] for r in rows], "draft_ms": [by_rows[r]["draft"] for r in rows],
            "context_ms": [by_rows[r]["context"] for r in rows],
            **({"draft_one_ms": [by_rows[r]["draft_one"] for r in rows]} if all("draft_one" in by_rows[r] for r in rows)
               else {}),
            **{f"{key}_ms": [by_rows[r][key] for r in rows] for key in ("host_draft", "host_plain", "host_step")
               if all(key in by_rows[r] for r in rows)}}


def fastest(ms_by: dict, margin: float = MARGIN):
    """The smallest key within `margin` of the fastest: fewer threads / smaller chunks when it is a draw."""
    best = min(ms_by.values())
    return min(k for k, v in ms_by.items() if v <= best * (1 + margin))


def choose_count(rates: dict[int, float]) -> int:
    """The thread count of the speculative loop from its tokens/s at each count: the fastest,
    fewer threads unless more are THREAD_MARGIN faster (a tie went to whichever count the
    noise favoured, and a second thread that does not pay only takes a shared core)."""
    return fastest({t: 1 / max(r, 1e-12) for t, r in rates.items()}, THREAD_MARGIN)


SPIN_US = (50, 1000)  # bounded spinning tried by the calibration: microseconds an idle worker spins, then blocks
SPIN_MODES = ((False, None), (True, None)) + tuple((True, us) for us in SPIN_US)  # (spin, spin_us): blocking first


def choose_spin(rates: dict[tuple, float]) -> dict[int, tuple[bool, int | None]]:
    """{thread count: (spin, spin_us)} from the speculative tokens/s at each (count, spin, spin_us)
    (spin_us None: ORT's own spinning, unbounded in time): the first of blocking, bounded
    spinning (shortest first) and full spinning within THREAD_MARGIN of the fastest. A quiet
    machine's idle workers wake in tens of us while a spinning one answers at once, and a
    small model's call has tens of parallel ops; on a shared machine a spinning worker holds
    a vCPU another job needs and is preempted mid-call (measured ~4x slower there:
    docs/results.md), and a bounded spin gives it back sooner: only a measurement can decide."""
    out = {}
    for t in sorted({k[0] for k in rates}):
        mine = {k[1:]: r for k, r in rates.items() if k[0] == t}
        less = {(m[0], m[1] is None, m[1] or 0): m for m in mine}  # ordered by how much it spins
        out[t] = less[fastest({o: 1 / max(mine[m], 1e-12) for o, m in less.items()}, THREAD_MARGIN)]
    return out


def spin_label(threads: int, spin: bool, spin_us: int | None = None) -> str:
    """How runtime.json's `measured` and the log name a (thread count, spin, bound) run: "2", "2 spin", "2 spin 50us"."""
    return f"{threads} spin {spin_us}us" if spin and spin_us else f"{threads} spin" if spin else str(threads)


def describe_spin(spin: bool, spin_us: int | None) -> str:
    """Spinning for people: "off", "on", "on, up to 50 us"."""
    return f"on, up to {spin_us} us" if spin and spin_us else "on" if spin else "off"


def choose_threads(ms_by_threads: dict[int, dict[str, float]]) -> dict[str, int]:
    """{graph: thread count} from graph_ms at each count: each graph's fastest, fewer threads
    unless more are THREAD_MARGIN faster (a thread that barely helps only takes a shared core)."""
    graphs = next(iter(ms_by_threads.values()))
    return {g: fastest({t: ms[g] for t, ms in ms_by_threads.items()}, THREAD_MARGIN) for g in graphs}


def ttft_prompt(backend: Backend, seed: int = 0) -> list[int]:
    """The TTFT prompt: TTFT_TOKENS random ids (fewer when the export's context is shorter)."""
    n = min(TTFT_TOKENS, backend.max_len - 1)
    return np.random.default_rng(seed).integers(0, backend.manifest.vocab_size, n).tolist()


def prefill_ms(backend: Backend, prompt: list[int], chunks: list[int], repeats: int = 2) -> dict[int, float]:
    """{chunk: median ms to the first token of `prompt`} (prefill of target and drafter, as
    `generate` does it), chunks interleaved; each chunk's shapes warmed up first."""
    draft = backend.has_drafter
    for c in chunks:
        generate(backend, prompt[: c + 1], 1, draft=draft, prefill_chunk=c)
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for _ in range(repeats):
        for c in chunks:
            times[c].append(generate(backend, prompt, 1, draft=draft, prefill_chunk=c).prefill_s)
    backend.reset()
    return {c: _median_ms(ts) for c, ts in times.items()}


def chunk_candidates(backend: Backend, prompt_len: int) -> list[int]:
    """The CHUNKS this backend takes (>= the block, <= its max_chunk) that differ on a prompt
    of `prompt_len` (one at least as long as the prompt), or its max_chunk alone."""
    k, top = backend.manifest.block_size, backend.max_chunk
    ok = [c for c in CHUNKS if k <= c <= top]
    return [c for c in ok if c < prompt_len] + [c for c in ok if c >= prompt_len][:1] or [top]


# -- the driver: `bench --calibrate` and `demo` -------------------------------------------


def calibrate(out: Path, run: RunOptions, candidates: list, prompts, max_new_tokens: int, warmup: int,
              log=lambda msg: None) -> dict:
    """Measure the thread counts, spinning, the prefill chunk and the verify policy; write them to runtime.json.

    Threads: the speculative loop (full block) at each candidate count, interleaved, gives
    the count of every graph; then each graph's own call at each count gives the per-graph
    counts (`graph_threads`). Spinning (`spin` None, ONNX Runtime on CPU): every count above
    one runs with idle workers blocking, spinning for each of SPIN_US microseconds and
    spinning without bound, in the same interleaved pass (`choose_spin`). Prefill chunk: the
    time to first token of a 512-token prompt per chunk. Policy: the full-block rounds at the best count (drafter confidences and
    acceptance lengths) replayed against this machine's verify cost per length, as
    `round_costs` times it inside a round. Costs: `round_costs` at each batch size. `run`: the
    command's options (backend, provider, spin: None tries both); its threads are `candidates`.
    """
    backend, provider, spin = run.backend, run.provider, run.spin
    both = spin is None and backend == "ort" and provider == "cpu"
    labels = [(t, *m) for t in candidates for m in (SPIN_MODES if both and t > 1 else ((bool(spin), None),))]

    def open_(t, s, us):
        if backend == "trt":
            return open_backend(out, "trt")
        return open_backend(out, "ort", provider, threads=t, spin=s, spin_us=us, max_chunk=max(CHUNKS))

    every = {label: open_(*label) for label in labels}
    try:
        runs = measure_many(every, prompts, max_new_tokens, warmup)
        by_label = {label: rate(spec) for label, (spec, _) in runs.items()}
        spins = choose_spin(by_label)
        rates = {t: by_label[(t, *m)] for t, m in spins.items()}
        best = choose_count(rates)
        many = [t for t in rates if t > 1]  # the spin a run with --threads N > 1 gets: the best count's, else
        spin, spin_us = spins[best] if best > 1 or not many else spins[max(many, key=rates.get)]  # the fastest N's
        backends = {t: every[(t, *m)] for t, m in spins.items()}
        for label in set(every) - {(t, *m) for t, m in spins.items()}:
            every.pop(label).close()
        be, spec = backends[best], runs[(best, *spins[best])][0]
        if C.DRAFT_CONF not in {t.name for t in be.manifest.graphs[C.DRAFT_BLOCK].outputs}:
            raise DFlashError(f"{out}: draft_block has no draft_conf output (exported by an older version); "
                              "re-export to calibrate adaptive verify")
        log(f"threads: speculative tok/s by count {', '.join(f'{spin_label(*k)}: {r:.0f}' for k, r in by_label.items())}"
            f" -> {best}, spin {describe_spin(spin, spin_us)}")
        by_graph = graph_ms_by(backends, prompts[0]) if backend == "ort" else {}
        graph_threads = choose_threads(by_graph) if len(by_graph) > 1 else {}
        if graph_threads:
            log("threads per graph: " + "; ".join(
                f"{g} {', '.join(f'{t}: {ms[g]:.2f}' for t, ms in by_graph.items())} ms -> {graph_threads[g]}"
                for g in graph_threads))
        long = ttft_prompt(be)
        chunks = prefill_ms(be, long, chunk_candidates(be, len(long)))
        chunk = fastest(chunks)
        log(f"prefill of {len(long)} tokens by chunk: "
            f"{', '.join(f'{c}: {ms:.1f}' for c, ms in chunks.items())} ms -> {chunk}")
        by_rows = {1: round_costs(be, prompts[0], 1)}
        costs = by_rows[1]["verify"]
        rounds = [(c, a - 1) for g in spec for c, a in zip(g.confidences, g.acceptance_lengths)]
        draft_ms = sum(g.draft_s for g in spec) / len(rounds) * 1e3
        policy, table = choose_policy(rounds, costs, draft_ms)
        by_rows[1] |= host_ms(be, prompts[0], 1, policy)
        wide = [r for r in COST_ROWS if r > 1]
        if backend == "ort" and provider == "cpu" and be.manifest.ragged and wide:  # rows > 1: ragged exports on CPU
            many = open_backend(out, "ort", provider, threads=best, graph_threads=graph_threads, spin=spin,
                                spin_us=spin_us, max_chunk=max(CHUNKS), max_batch=max(wide))
            try:
                by_rows |= {r: round_costs(many, prompts[0], r) | host_ms(many, prompts[0], r, policy) for r in wide}
            finally:
                many.close()
        round_model = cost_model(by_rows)
    finally:
        for b in every.values():
            b.close()
    log(f"verify ms by length 1..{len(costs)}: {', '.join(f'{c:.2f}' for c in costs)}; draft {draft_ms:.2f} ms")
    log(f"policy: {policy_json(policy)}")
    log("round costs (ms) by rows: " + "; ".join(
        f"{r}: step {c['step']:.2f}, verify {c['verify'][-1]:.2f}, draft {c['draft']:.2f}"
        + (f" (head over one draft {c['draft_one']:.2f})" if "draft_one" in c else "") + f", context {c['context']:.2f}"
        + f", host drafted {c['host_draft']:.2f} / plain {c['host_plain']:.2f}"
        for r, c in by_rows.items()))
    measured = {"speculative_tokens_per_second_by_threads": {spin_label(*k): r for k, r in by_label.items()},
                "graph_ms_by_threads": {str(t): ms for t, ms in by_graph.items()},
                "prefill_ms_by_chunk": {str(c): ms for c, ms in chunks.items()},
                "verify_ms_by_length": costs, "draft_ms": draft_ms, "rounds": len(rounds),
                "replay": table, "cpu_count": os.cpu_count()}
    settings = Settings(threads=best if backend == "ort" else None, spin=spin, spin_us=spin_us if spin else None,
                        verify=policy, measured=measured, graph_threads=graph_threads, prefill_chunk=chunk,
                        costs=round_model)
    path = save_settings(out, device_key(backend, provider), settings)
    return {"runtime_json": str(path), "threads": settings.threads, "spin": spin, "spin_us": settings.spin_us,
            "graph_threads": graph_threads, "prefill_chunk": chunk, "verify": policy_json(policy), "verify_ms_by_length": costs, "draft_ms": draft_ms,
            "costs": round_model}
