"""The server's engine: generation slots over one loaded model, a FIFO queue, metrics.

Each slot is a thread with its own backend fork: its own KV buffers and IO bindings over
the one set of ONNX Runtime sessions (one copy of the weights; ORT runs a session from
several threads, and releases the GIL while it runs). A request goes to a free slot,
preferring the one whose cached sequence shares the longest prefix with its prompt
(llama.cpp's `cache_prompt`: only the new part is prefilled); otherwise it waits FIFO, up
to `max_queue` requests, after which `submit` refuses it (the app answers 429).

Nothing here knows HTTP or asyncio: a Job reports through its `emit` callback, called
from the slot's thread with ("round", tokens, text), then ("end", finish, Generation, text)
or ("error", message). `cancel` stops a job within one round.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..runtime.errors import DFlashError
from ..runtime.load import open_artifact
from ..runtime.loop import Generation, stream
from . import text as text_module
from .text import TextStream


class QueueFull(Exception):
    pass


class Unavailable(Exception):
    pass


@dataclass
class Params:
    """What a request asks the loop for (already validated by the app)."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's eos ids
    stop: tuple[str, ...] = ()
    speculative: bool = True
    cache_prompt: bool = True


@dataclass
class Job:
    params: Params
    emit: Callable[[tuple], None]
    text: TextStream | None = None
    submitted: float = field(default_factory=time.perf_counter)
    slot: int | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)


class Metrics:
    """Prometheus metrics named after vLLM's (`vllm:` -> `dflash:`), in a registry of their own."""

    def __init__(self, model: str, block_size: int, max_batch: int = 1):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # no *_created series (process-wide; vLLM does the same)

        self.registry = r = CollectorRegistry()
        lb = ["model_name"]
        self.labels = {"model_name": model}

        def counter(name, doc, extra=()):
            return Counter(f"dflash:{name}", doc, lb + list(extra), registry=r)

        self.drafts = counter("spec_decode_num_drafts", "Speculative rounds (one drafter block each).")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed (block size - 1 per round).")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.")
        self.per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position in the block.",
                               ["position"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = counter("prompt_tokens_cached", "Prompt tokens found in a slot's cache (not prefilled).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.running = Gauge("dflash:num_requests_running", "Requests in a slot.", lb, registry=r)
        self.waiting = Gauge("dflash:num_requests_waiting", "Requests waiting for a slot.", lb, registry=r)
        buckets = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
        self.ttft = Histogram("dflash:time_to_first_token_seconds", "Time to first token (queue + prefill).", lb,
                              buckets=buckets, registry=r)
        self.e2e = Histogram("dflash:e2e_request_latency_seconds", "End-to-end request latency.", lb,
                             buckets=buckets, registry=r)
        self.queue = Histogram("dflash:request_queue_time_seconds", "Time a request waited for a slot or batch row.",
                               lb, buckets=buckets, registry=r)
        self.rows = Histogram("dflash:batch_rows_per_round", "Rows generating in each round of the batched loop "
                              "(--max-batch; occupancy = rows / max_batch).", lb,
                              buckets=tuple(range(1, max_batch + 1)), registry=r)
        info = Gauge("dflash:replica_info", "The replica these metrics describe (HOST/PID; Ray: HOST@NODE/PID).",
                     lb + ["replica"], registry=r)
        info.labels(replica=f"{NODE}/{os.getpid()}", **self.labels).set(1)
        for m in (self.drafts, self.draft_tokens, self.accepted, self.prompt_tokens, self.cached_tokens,
                  self.generation_tokens, self.running, self.waiting):
            m.labels(**self.labels)  # present from the start, at 0
        for i in range(block_size - 1):
            self.per_pos.labels(position=str(i), **self.labels)

    def round(self, produced: int, block_size: int) -> None:
        """One speculative round that emitted `produced` tokens (accepted drafts + the target's own)."""
        self.drafts.labels(**self.labels).inc()
        self.draft_tokens.labels(**self.labels).inc(block_size - 1)
        self.accepted.labels(**self.labels).inc(produced - 1)
        for i in range(produced - 1):
            self.per_pos.labels(position=str(i), **self.labels).inc()


NODE = socket.gethostname()  # a Ray replica sets HOST@NODE_ID (several Ray nodes may share a host)


def replica(slot: int | str = "-") -> str:
    """HOST/PID/SLOT for the x-dflash-replica header (the pid read per call: forks and Ray workers differ)."""
    return f"{NODE}/{os.getpid()}/{slot}"


class Slot:
    def __init__(self, index: int, backend):
        self.index, self.backend = index, backend
        self.seq: list[int] = []  # the tokens whose K/V the target cache holds, by position
        self.job: Job | None = None
        self.wake = threading.Event()

    def reusable(self, prompt: list[int], speculative: bool) -> int:
        """How many prompt tokens this slot's caches already hold (at most all but the last)."""
        n, limit = 0, min(len(self.seq), len(prompt) - 1)
        while n < limit and self.seq[n] == prompt[n]:
            n += 1
        n = min(n, self.backend.context_len) if speculative else n
        return self.backend.reusable(n)  # hybrid targets: their recurrent state keeps all or nothing


class Engine:
    """`slots` backends over one model; see the module docstring."""

    def __init__(self, backends: list, text, model: str, max_queue: int, verify=None):
        self.manifest = backends[0].manifest
        self.verify = verify  # the adaptive verify policy (None: the whole block)
        self.text, self.model, self.max_queue = text, model, max_queue
        self.metrics = Metrics(model, self.manifest.block_size)
        self.slots = [Slot(i, b) for i, b in enumerate(backends)]
        self.waiting: deque[Job] = deque()
        self.lock = threading.Lock()
        self.stopping = False
        self.threads = [threading.Thread(target=self._worker, args=(s,), name=f"dflash-slot-{s.index}", daemon=True)
                        for s in self.slots]
        for t in self.threads:
            t.start()

    @property
    def max_len(self) -> int:
        return self.slots[0].backend.max_len

    max_batch = 1  # rows per round (serve/batch.py); slots run a loop each

    @property
    def has_drafter(self) -> bool:
        return getattr(self.slots[0].backend, "has_drafter", True)

    def idle_slots(self) -> int:
        with self.lock:
            return sum(s.job is None for s in self.slots)

    def submit(self, job: Job) -> None:
        """Start `job` in a free slot or queue it; QueueFull / Unavailable when it cannot wait."""
        with self.lock:
            if self.stopping:
                raise Unavailable("the server is shutting down")
            free = [s for s in self.slots if s.job is None]
            if free and not self.waiting:
                p = job.params
                slot = max(free, key=lambda s: s.reusable(p.prompt, p.speculative) if p.cache_prompt else 0)
                self._assign(slot, job)
                return
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests are waiting "
                                f"(--max-queue {self.max_queue}); retry later")
            self.waiting.append(job)
            self._gauges()

    def cancel(self, job: Job) -> None:
        """Stop `job`: dropped from the queue, or stopped by its slot within one round."""
        with self.lock:
            job.cancelled.set()
            if job in self.waiting:
                self.waiting.remove(job)
                self._gauges()
                job.emit(("end", "cancelled", None, ""))

    def cancel_all(self) -> None:
        """Refuse new work and cancel what is queued or running (the end of a graceful shutdown)."""
        with self.lock:
            self.stopping = True
            jobs = list(self.waiting) + [s.job for s in self.slots if s.job is not None]
        for j in jobs:
            self.cancel(j)

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new work, cancel what is queued or running, wait for the slots (bounded)."""
        self.cancel_all()
        for s in self.slots:
            s.wake.set()
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        for s in self.slots:
            s.backend.close()

    # -- the slot threads ------------------------------------------------------------------

    def _assign(self, slot: Slot, job: Job) -> None:  # under the lock
        job.slot, slot.job = slot.index, job
        self.metrics.queue.labels(**self.metrics.labels).observe(time.perf_counter() - job.submitted)
        self._gauges()
        slot.wake.set()

    def _gauges(self) -> None:
        labels = self.metrics.labels
        self.metrics.running.labels(**labels).set(sum(s.job is not None for s in self.slots))
        self.metrics.waiting.labels(**labels).set(len(self.waiting))

    def _worker(self, slot: Slot) -> None:
        while True:
            slot.wake.wait()
            slot.wake.clear()
            if self.stopping and slot.job is None:
                return
            job = slot.job
            if job is None:
                continue
            try:
                self._run(slot, job)
            except Exception as e:  # a bug, not bad input (the app validated it): report, keep serving
                slot.seq = []
                traceback.print_exc()  # the server's log: what a bug report needs
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _emit(job, ("error", f"generation failed: {msg}"))
            with self.lock:
                slot.job = None
                while self.waiting and not self.stopping:
                    nxt = self.waiting.popleft()
                    if not nxt.cancelled.is_set():
                        self._assign(slot, nxt)
                        break
                self._gauges()
            if self.stopping and slot.job is None:
                return

    def _run(self, slot: Slot, job: Job) -> None:
        p, b, mt = job.params, slot.backend, self.metrics
        if job.cancelled.is_set():
            _emit(job, ("end", "cancelled", None, ""))
            return
        if p.speculative and not self.has_drafter:
            raise DFlashError("this server was started without the drafter")
        reuse = slot.reusable(p.prompt, p.speculative) if p.cache_prompt else 0
        stop = tuple(dict.fromkeys(list(self.manifest.eos_token_ids) + list(p.stop_token_ids)))
        g = Generation()
        rounds = stream(b, p.prompt, p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                        seed=p.seed, stop_token_ids=stop, draft=p.speculative, reuse=reuse, verify=self.verify, out=g)
        slot.seq = []  # the caches change from here on
        finish, k = "length", self.manifest.block_size
        try:
            for i, new in enumerate(rounds):
                if i == 0:
                    mt.ttft.labels(**mt.labels).observe(time.perf_counter() - job.submitted)
                elif p.speculative:
                    mt.round(len(new), k)
                delta = job.text.push(new) if job.text is not None else ""
                if job.text is not None and job.text.stopped:  # a stop string: not the round's tokens after it
                    new = new[: len(new) - len(g.tokens) + len(job.text.tokens)]
                    finish = "stop"
                _emit(job, ("round", new, delta))
                if finish == "stop":
                    break
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
            else:
                finish = "stop" if g.stopped else "length"
        finally:
            rounds.close()
            slot.seq = (p.prompt + g.tokens)[: b.target_len]
        self._ended(job, g, finish)

    def _ended(self, job: Job, g: Generation, finish: str) -> None:
        """The request's counters and its end event (a stop string: only the tokens before it count)."""
        mt = self.metrics
        if job.text is not None and job.text.stopped:  # usage, timings, metrics: the kept tokens
            del g.tokens[len(job.text.tokens):]
        tail = job.text.finish() if job.text is not None else ""
        mt.prompt_tokens.labels(**mt.labels).inc(len(job.params.prompt))
        mt.cached_tokens.labels(**mt.labels).inc(g.reused)
        mt.generation_tokens.labels(**mt.labels).inc(len(g.tokens))
        mt.success.labels(finished_reason=finish, **mt.labels).inc()
        mt.e2e.labels(**mt.labels).observe(time.perf_counter() - job.submitted)
        _emit(job, ("end", finish, g, tail))


def _emit(job: Job, event: tuple) -> None:
    try:
        job.emit(event)
    except RuntimeError:  # the receiving event loop is gone (shutdown): nobody to tell
        pass


def load_engine(directory, *, slots: int = 1, model: str, max_queue: int = 16, backend: str = "ort",
                provider: str = "cpu", threads: int | None = None, spin: bool | None = None, verify: str = "auto",
                drafter: bool = True, chat_template: str | None = None, max_batch: int = 1) -> Engine:
    """Load the model once: `max_batch` > 1 rows of one batched loop (serve/batch.py), or
    `slots` sequences forked from it (weights shared), each its own loop. Threads (per
    graph), spinning, the prefill chunk and the verify policy resolve as in generate/bench
    (runtime/settings.py)."""
    if slots < 1:
        raise DFlashError(f"--slots must be >= 1 (got {slots})")
    if max_queue < 0:
        raise DFlashError(f"--max-queue must be >= 0 (got {max_queue})")
    if max_batch < 1:
        raise DFlashError(f"--max-batch must be >= 1 (got {max_batch})")
    if max_batch > 1 and slots > 1:
        raise DFlashError(f"give --max-batch {max_batch} or --slots {slots}, not both")
    if max_batch > 1 and backend != "ort":
        raise DFlashError(f"--max-batch {max_batch} needs --backend ort (the TensorRT backend runs one row here); "
                          "use --max-batch 1")
    text = text_module.Text(directory, chat_template)
    first, cfg = open_artifact(directory, backend=backend, provider=provider, drafter=drafter, threads=threads, spin=spin,
                               verify=verify, max_batch=max_batch)
    if max_batch > 1:
        from .batch import BatchEngine

        return BatchEngine(first, text, model, max_queue, cfg.verify)
    if slots > 1 and not hasattr(first, "fork"):
        raise DFlashError(f"--slots {slots} needs a backend that shares its weights between sequences "
                          "(--backend ort); with this backend use --slots 1")
    backends = [first] + [first.fork() for _ in range(slots - 1)]
    return Engine(backends, text, model, max_queue, cfg.verify)
