"""The engine of `serve --max-batch N`: every running request is a row of one batched loop.

One thread runs the runtime's loop (runtime/loop.py `stream_batch`) over a backend loaded
for N rows. At each round boundary the loop asks `_poll` for waiting requests to fill its
free rows (FIFO; the thread sleeps while nothing runs and nothing waits) and `_drop`
whether a running row should leave (cancelled, or ended on a stop string): a disconnected
client frees its row before the next round. Each round advances every row at once: one
drafter call and one verify call for all running rows (calls carry only those).

Isolation: each row has its own caches, lengths, sampling seed and stops; a request is
checked before it joins (a bad one fails alone, never the batch), and the loop's greedy
rows equal their batch-1 output whatever else runs (tests/test_batch.py, tests/test_serve.py).
Prompt-prefix reuse (runtime/prefix.py): a row that leaves parks its caches' valid prefix
(a copy: its slot goes straight to the next request), and a request whose prompt starts
with a parked sequence gets it copied into its row and prefills only the rest. Up to
`max_batch` sequences are kept, within half the memory left after loading.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace

from ..runtime import prefix
from ..runtime.errors import DFlashError
from ..runtime.loop import BatchStats, Generation, Request, stream_batch
from ..runtime.memory import available_memory
from ..runtime.logprobs import check_logprobs
from ..runtime.sampling import check_request
from .jobs import EngineBase, Job, Metrics, QueueFull, Slot, Unavailable, _emit


class _Joined(dict):
    """The loop's `outs`: Generation by the loop's request index, removed when the request
    ends (a list would keep every request's record for the life of the server)."""

    n = 0

    def append(self, g: Generation) -> None:
        self[self.n] = g
        self.n += 1


class BatchEngine(EngineBase):
    """`max_batch` rows of one backend, one loop thread; the app sees the same interface as the slots' Engine."""

    def __init__(self, backend, text, model: str, max_queue: int, verify=None, control=None):
        self.manifest, self.backend, self.max_batch = backend.manifest, backend, backend.max_batch
        self.verify, self.control = verify, control  # control: the speculation controller (None: always draft)
        self.text, self.model, self.max_queue = text, model, max_queue
        self.metrics = Metrics(model, self.manifest.block_size, backend.max_batch)
        self.slots = [Slot(i, backend) for i in range(backend.max_batch)]  # a row each (health, gauges, header)
        self.waiting: deque[Job] = deque()
        self.lock = threading.Lock()
        self.more = threading.Condition(self.lock)
        self.stopping = False
        self.jobs: dict[int, Job] = {}  # the loop's request index -> job, while it runs
        self.gens = _Joined()
        self.leaving: set[int] = set()  # ended on a stop string: out at the next boundary
        self.stats = BatchStats()
        self._seen = (0, 0)  # (rounds, busy rows) of stats already observed
        free = available_memory()
        self.prefixes = prefix.PrefixCache(backend, backend.max_batch if prefix.supported(backend) else 0,
                                           free // 2 if free is not None else 1 << 30)
        self.threads = [threading.Thread(target=self._serve, name="dflash-batch", daemon=True)]
        self.threads[0].start()

    def submit(self, job: Job) -> None:
        """Queue `job` for the next round boundary; QueueFull when the rows and the queue are full."""
        with self.lock:
            if self.stopping:
                raise Unavailable("the server is shutting down")
            free = sum(s.job is None for s in self.slots)
            if len(self.waiting) >= free + self.max_queue:
                raise QueueFull(f"all {len(self.slots)} batch rows are busy and {len(self.waiting) - free} requests "
                                f"are waiting (--max-queue {self.max_queue}); retry later")
            self.waiting.append(job)
            self._gauges()
            self.more.notify()

    def cancel_all(self) -> None:
        super().cancel_all()
        with self.lock:
            self.more.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        self.cancel_all()
        self.threads[0].join(timeout)
        self.backend.close()

    # -- the loop thread -------------------------------------------------------------------

    def _serve(self) -> None:
        while not self.stopping:
            self.jobs, self.gens, self.leaving, self.stats = {}, _Joined(), set(), BatchStats()
            self._seen = (0, 0)
            try:
                for index, new in stream_batch(self.backend, (), draft=self.has_drafter, verify=self.verify,
                                               outs=self.gens, stats=self.stats, poll=self._poll, drop=self._drop,
                                               control=self.control):
                    self._round(index, new)
            except Exception as e:  # a bug, not bad input (requests are checked before they join): report, go on
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                for index, job in list(self.jobs.items()):
                    self._free(job)
                    _emit(job, ("error", f"generation failed: {msg}"))
                self.backend.reset()
                self.prefixes.kept.clear()

    def _poll(self, free: int, idle: bool) -> list[Request]:
        """Up to `free` waiting requests (FIFO); blocks while nothing runs and nothing waits."""
        given = []
        with self.lock:
            while idle and not self.waiting and not self.stopping:
                self.more.wait()
            while self.waiting and len(given) < free and not self.stopping:
                job = self.waiting.popleft()
                if job.cancelled.is_set():
                    continue
                p = job.request
                echo = job.logprobs is not None and job.logprobs.echo  # scores every prompt position: no reuse
                hook = self.prefixes.hook(p.prompt, p.speculative, job.cache_prompt and not echo)
                q = replace(p, reuse=hook.reuse, prefix=hook)
                try:  # the loop's own checks, before the row joins: a bad one fails alone, never the batch
                    check_request(q.prompt, q.max_new_tokens, self.manifest.vocab_size, self.backend.max_len)
                    check_logprobs(q.logprobs, self.manifest, q.reuse)
                except DFlashError as e:
                    _emit(job, ("error", f"generation failed: {e}"))
                    continue
                self.jobs[self.gens.n + len(given)] = job
                self._assign(next(s for s in self.slots if s.job is None), job)
                given.append(q)
            self._gauges()
        return given

    def _assign(self, slot: Slot, job: Job) -> None:  # under the lock; no thread to wake
        job.slot, slot.job = slot.index, job
        self.metrics.queue.labels(**self.metrics.labels).observe(time.perf_counter() - job.submitted)

    def _drop(self, index: int) -> bool:
        if index in self.leaving:
            self.leaving.discard(index)
            return True
        job = self.jobs[index]
        if job.cancelled.is_set():
            self._end(index, "cancelled")
            return True
        return False

    def _round(self, index: int, new: list[int]) -> None:
        """One row's tokens of a round (or its first token, from its prefill)."""
        job, g, mt = self.jobs[index], self.gens[index], self.metrics
        rounds, busy = self.stats.rounds, self.stats.busy_rows
        if rounds != self._seen[0]:  # the first row reported of a new round: how many rows it ran
            mt.rows.labels(**mt.labels).observe(busy - self._seen[1])
            self._seen = (rounds, busy)
        self._timed(job, len(new))
        if g.acceptance_lengths and job.request.speculative:
            mt.round(len(new), self.manifest.block_size, g.drafted[-1])
        delta = job.text.push(new) if job.text is not None else ""
        finish = None
        if job.text is not None and job.text.stopped:  # a stop string: not the round's tokens after it
            new = new[: len(new) - len(g.tokens) + len(job.text.tokens)]
            finish = "stop"
            if not g.finished:
                self.leaving.add(index)
        _emit(job, ("round", new, delta))
        if finish is None and g.finished:
            finish = "stop" if g.stopped else "length"
        if finish is not None:
            self._end(index, finish)

    def _end(self, index: int, finish: str) -> None:
        job, g = self.jobs.pop(index), self.gens.pop(index)
        self._free(job)
        self._ended(job, g, finish)

    def _free(self, job: Job) -> None:
        with self.lock:
            if job.slot is not None and self.slots[job.slot].job is job:
                self.slots[job.slot].job = None
            self._gauges()
