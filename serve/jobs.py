"""What the engines share: a request (Job, around the loop's own Request), the metrics, the slots or rows they run in,
the queue's errors, the replica's name, and the base of both engines (EngineBase).

Nothing here knows HTTP or asyncio: a Job reports through its `emit` callback, called from
an engine's thread with ("round", tokens, text), then ("end", finish, Generation, text) or
("error", message).
"""

from __future__ import annotations

import functools

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..runtime.lazy import lazy_import
from ..runtime.loop import Generation, Request
from .grammar import Grammars
from .text import TextStream

prometheus = lazy_import("prometheus_client")  # the serve extra, when a server starts (runtime/lazy.py)


class QueueFull(Exception):
    pass


class Unavailable(Exception):
    pass


@dataclass
class Job:
    """One choice of an API request in an engine: the loop's Request as validation made it
    (serve/validate.py; the engine adds only its prompt reuse), and how it reports."""

    request: Request
    emit: Callable[[tuple], None]
    text: TextStream | None = None  # its streamed text, which finds the stop strings
    cache_prompt: bool = True
    submitted: float = field(default_factory=time.perf_counter)
    slot: int | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    first: float = 0.0  # when its first token was reported (perf_counter)
    last: float = 0.0  # when its last round was reported

    @property
    def logprobs(self):  # the target's log-probabilities, recorded by the loop when asked
        return self.request.logprobs


class Metrics:
    """Prometheus metrics named after vLLM's (`vllm:` -> `dflash:`), in a registry of their own."""

    def __init__(self, model: str, block_size: int, max_batch: int = 1):
        Counter, Gauge, Histogram = prometheus.Counter, prometheus.Gauge, prometheus.Histogram
        prometheus.disable_created_metrics()  # no *_created series (process-wide; vLLM does the same)

        self.registry = r = prometheus.CollectorRegistry()
        lb = ["model_name"]
        self.labels = {"model_name": model}

        def counter(name, doc, extra=()):
            return Counter(f"dflash:{name}", doc, lb + list(extra), registry=r)

        self.drafts = counter("spec_decode_num_drafts", "Speculative rounds (one drafter block each).")
        self.modes = counter("speculation_rounds", "Rounds of speculative requests by kind: drafted, or plain steps "
                             "(the speculation controller's choice), counted per request.", ["mode"])
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
        itl = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5)
        self.itl = Histogram("dflash:inter_token_latency_seconds", "Time per generated token after the first: a "
                             "speculative round that emits n tokens in t seconds (t from the request's previous "
                             "round) observes t/n, n times.", lb, buckets=itl, registry=r)
        self.tpot = Histogram("dflash:request_time_per_output_token_seconds", "Per finished request: the time from "
                              "its first token to its last over its tokens after the first.", lb, buckets=itl,
                              registry=r)
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
        for mode in ("drafted", "plain"):
            self.modes.labels(mode=mode, **self.labels)

    def round(self, produced: int, block_size: int, drafted: bool = True) -> None:
        """One round of a speculative request that emitted `produced` tokens (accepted drafts + the
        target's own); `drafted` False: a plain step the controller chose (no draft counted)."""
        self.modes.labels(mode="drafted" if drafted else "plain", **self.labels).inc()
        if not drafted:
            return
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
    def __init__(self, index: int, backend, control=None):
        self.index, self.backend = index, backend
        self.control = control  # its speculation controller (runtime/controller.py; None: always draft)
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


class EngineBase:
    """What every engine shares (slots: serve/engine.py `Engine`; batch rows: serve/batch.py
    `BatchEngine`): the queue, the rows or slots, cancellation, gauges and the end of a request.
    A subclass sets manifest, text, model, max_queue, metrics, slots, waiting, lock, stopping."""

    max_batch = 1  # rows per round (serve/batch.py); slots run a loop each

    @property
    def max_len(self) -> int:
        return self.slots[0].backend.max_len

    @property
    def room(self) -> int:
        """Requests the server holds at once: generating, plus waiting (the most one API request may ask for)."""
        return len(self.slots) + self.max_queue

    @property
    def has_drafter(self) -> bool:
        return self.slots[0].backend.has_drafter

    @functools.cached_property
    def grammars(self):
        """The grammar compiler of constrained requests (serve/grammar.py), made on the first one."""
        return Grammars(self.text.tokenizer, self.manifest.vocab_size, tuple(self.manifest.eos_token_ids))

    def idle_slots(self) -> int:
        with self.lock:
            return sum(s.job is None for s in self.slots)

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

    def _gauges(self) -> None:
        labels = self.metrics.labels
        self.metrics.running.labels(**labels).set(sum(s.job is not None for s in self.slots))
        self.metrics.waiting.labels(**labels).set(len(self.waiting))

    def _timed(self, job: Job, produced: int) -> None:
        """A round of `job` that produced tokens (its first: the prefill's): the latency histograms."""
        now, mt = time.perf_counter(), self.metrics
        if not job.first:
            job.first = job.last = now
            mt.ttft.labels(**mt.labels).observe(now - job.submitted)
            return
        per, itl = (now - job.last) / max(produced, 1), mt.itl.labels(**mt.labels)
        for _ in range(produced):
            itl.observe(per)
        job.last = now

    def _ended(self, job: Job, g: Generation, finish: str) -> None:
        """The request's counters and its end event (a stop string: only the tokens before it count)."""
        mt = self.metrics
        if job.text is not None and job.text.stopped:  # usage, timings, metrics: the kept tokens
            del g.tokens[len(job.text.tokens):]
        tail = job.text.finish() if job.text is not None else ""
        mt.prompt_tokens.labels(**mt.labels).inc(len(job.request.prompt))
        mt.cached_tokens.labels(**mt.labels).inc(g.reused)
        mt.generation_tokens.labels(**mt.labels).inc(len(g.tokens))
        mt.success.labels(finished_reason=finish, **mt.labels).inc()
        mt.e2e.labels(**mt.labels).observe(time.perf_counter() - job.submitted)
        if len(g.tokens) > 1 and job.last > job.first:
            mt.tpot.labels(**mt.labels).observe((job.last - job.first) / (len(g.tokens) - 1))
        _emit(job, ("end", finish, g, tail))


def _emit(job: Job, event: tuple) -> None:
    try:
        job.emit(event)
    except RuntimeError:  # the receiving event loop is gone (shutdown): nobody to tell
        pass
