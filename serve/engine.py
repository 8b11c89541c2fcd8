"""The server's engine: generation slots over one loaded model and a FIFO queue (metrics: serve/jobs.py).

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

import threading
import time
import traceback
from collections import deque
from dataclasses import replace

from ..runtime.controller import controller_for
from ..runtime.errors import DFlashError
from ..runtime.load import open_artifact
from ..runtime.loop import Generation, stream_batch
from . import formats, text as text_module
from .batch import BatchEngine
from .jobs import EngineBase, Job, Metrics, QueueFull, Slot, Unavailable, _emit
from .options import ServeOptions


class Engine(EngineBase):
    """`slots` backends over one model; see the module docstring."""

    def __init__(self, backends: list, text, model: str, max_queue: int, verify=None, control=None):
        self.manifest = backends[0].manifest
        self.verify = verify  # the adaptive verify policy (None: the whole block)
        self.text, self.model, self.max_queue = text, model, max_queue
        self.metrics = Metrics(model, self.manifest.block_size)
        # a controller per slot: each times its own loop's rounds (runtime/controller.py `_clock`), and
        # the slots' threads decide at once
        self.slots = [Slot(i, b, None if control is None else replace(control, measured={}, _last=()))
                      for i, b in enumerate(backends)]
        self.waiting: deque[Job] = deque()
        self.lock = threading.Lock()
        self.stopping = False
        self.threads = [threading.Thread(target=self._worker, args=(s,), name=f"dflash-slot-{s.index}", daemon=True)
                        for s in self.slots]
        for t in self.threads:
            t.start()




    def submit(self, job: Job) -> None:
        """Start `job` in a free slot or queue it; QueueFull / Unavailable when it cannot wait."""
        with self.lock:
            if self.stopping:
                raise Unavailable("the server is shutting down")
            free = [s for s in self.slots if s.job is None]
            if free and not self.waiting:
                q = job.request
                slot = max(free, key=lambda s: s.reusable(q.prompt, q.speculative) if job.cache_prompt else 0)
                self._assign(slot, job)
                return
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests are waiting "
                                f"(--max-queue {self.max_queue}); retry later")
            self.waiting.append(job)
            self._gauges()



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
        b, mt = slot.backend, self.metrics
        if job.cancelled.is_set():
            _emit(job, ("end", "cancelled", None, ""))
            return
        echo = job.logprobs is not None and job.logprobs.echo  # scores every prompt position: no reuse
        p = job.request
        reuse = slot.reusable(p.prompt, p.speculative) if job.cache_prompt and not echo else 0
        q = replace(p, reuse=reuse)
        outs: list[Generation] = []
        rounds = stream_batch(b, [q], batch=1, draft=self.has_drafter, verify=self.verify, outs=outs,
                              control=slot.control)
        slot.seq = []  # the caches change from here on
        finish, k, g = "length", self.manifest.block_size, Generation()
        try:
            for i, (_, new) in enumerate(rounds):
                g = outs[0]
                self._timed(job, len(new))
                if i and p.speculative:
                    mt.round(len(new), k, g.drafted[-1])
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


def load_engine(options: ServeOptions) -> Engine:
    """Load the model once: `max_batch` > 1 rows of one batched loop (serve/batch.py; ONNX Runtime
    on CPU, or TensorRT engines built with `build --max-batch`), or `slots` sequences forked
    from it (weights shared), each its own loop. Threads (per
    graph), spinning, the prefill chunk and the verify policy resolve as in generate/bench
    (runtime/settings.py); `speculation` auto: the controller decides per round (runtime/controller.py)."""
    o = options  # its bounds were checked when it was made (serve/options.py)
    if o.max_batch > 1 and o.slots > 1:
        raise DFlashError(f"give --max-batch {o.max_batch} or --slots {o.slots}, not both")
    text = text_module.Text(o.directory, o.chat_template)
    first, cfg = open_artifact(o.directory, o, drafter=o.speculative, max_batch=o.max_batch, settings=o.settings)
    control = controller_for(o.speculation, cfg.costs, first.manifest.block_size) if o.speculative else None
    text.format = formats.detect(text.template_source, first.manifest.architecture, o.tool_format)
    if o.max_batch > 1:
        return BatchEngine(first, text, o.model, o.max_queue, cfg.verify, control)
    if o.slots > 1 and not first.forks:
        raise DFlashError(f"--slots {o.slots} needs a backend that shares its weights between sequences "
                          "(--backend ort); with this backend use --slots 1")
    backends = [first] + [first.fork() for _ in range(o.slots - 1)]
    return Engine(backends, text, o.model, o.max_queue, cfg.verify, control)
