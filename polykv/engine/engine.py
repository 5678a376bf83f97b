"""Continuous batching over shared documents.

One engine thread owns the model. Callers (the asyncio server, the benchmark, tests) talk to it
through thread-safe queues only:

* :meth:`Engine.submit` queues a :class:`GenerationRequest` and returns a :class:`RequestHandle`;
  the handle streams :class:`Event` objects (``token`` deltas, then one ``done`` or ``error``), as
  an async iterator (``async for ev in handle``) or a blocking one (``handle.iter_sync()``).
* :meth:`Engine.call` runs a function on the engine thread between steps (document add/remove,
  memory reports, save) and returns a ``concurrent.futures.Future``.

The loop, per iteration: run queued calls; drop cancelled requests; admit waiting requests (at most
``max_prefill_per_step`` requests and ``prefill_token_budget`` prompt tokens per iteration, so
prefill of newcomers interleaves with decode of the running ones instead of stalling it) into the AgentBatch of their document (one batch per document, opened on demand,
closed when empty; requests without a document go to a dense batch); then step every batch in turn,
sample one token per agent with its own sampler, stream it, and retire agents that hit eos, a stop
string or ``max_tokens``. Requests join and leave between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .dense import DenseBatch
from .sampling import Sampler, SamplingParams, StopChecker

__all__ = ["Engine", "EngineClosedError", "Event", "GenerationRequest", "KVBudgetExceeded", "QueueFullError",
           "RequestHandle"]

log = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """The engine is shutting down or has stopped."""


class QueueFullError(RuntimeError):
    """Too many requests waiting; retry later."""


class KVBudgetExceeded(MemoryError):
    """Admitting this request (or adding this document) would exceed the pool's KV byte budget."""


@dataclass
class Event:
    kind: str  # "token" | "done" | "error"
    text: str = ""
    token_id: int | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    error: BaseException | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    document: Any = None  # a pool document id, or None for a plain request
    request_id: str = ""


class RequestHandle:
    """Output side of one request. Events are delivered thread-safely from the engine thread."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self._loop = loop
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._q: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self.finished = threading.Event()
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None

    # engine side -------------------------------------------------------------------------------
    def _put(self, ev: Event) -> None:
        if ev.kind == "token" and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if ev.kind in ("done", "error"):
            self.finished.set()
        if self._aq is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
            except RuntimeError:  # loop closed: nobody listens any more
                self._cancel.set()
        else:
            self._q.put(ev)

    # client side -------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step (client went away)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        if self._aq is None:
            raise RuntimeError("handle was created without an event loop; use iter_sync()")
        while True:
            ev = await self._aq.get()
            yield ev
            if ev.kind in ("done", "error"):
                return

    def iter_sync(self, timeout: float | None = None):
        while True:
            ev = self._q.get(timeout=timeout)
            yield ev
            if ev.kind in ("done", "error"):
                return

    async def result(self) -> tuple[str, str, dict]:
        """Collect a whole answer: (text, finish_reason, usage). Raises the request's error."""
        parts: list[str] = []
        async for ev in self:
            done = _fold_event(ev, parts)
            if done is not None:
                return done
        raise EngineClosedError("stream ended without a result")

    def result_sync(self, timeout: float | None = None) -> tuple[str, str, dict]:
        parts: list[str] = []
        for ev in self.iter_sync(timeout):
            done = _fold_event(ev, parts)
            if done is not None:
                return done
        raise EngineClosedError("stream ended without a result")


def _fold_event(ev, parts: list[str]) -> tuple[str, str, dict] | None:
    """Accumulate one stream event: token text into `parts`; the final (text, finish_reason, usage)
    on the closing event; raises the request's error."""
    if ev.kind == "token":
        parts.append(ev.text)
        return None
    if ev.kind == "error":
        raise ev.error
    return "".join(parts), ev.finish_reason, ev.usage


class _Live:
    """Engine-thread state of one running request."""

    __slots__ = ("handle", "sampler", "stop", "tokens", "text_sent", "key", "aid", "eos")

    def __init__(self, handle: RequestHandle, key, aid, eos: set[int]):
        p = handle.request.params
        self.handle = handle
        self.sampler = Sampler(p)
        self.stop = StopChecker(p.stop)
        self.tokens: list[int] = []
        self.text_sent = 0  # characters of the decoded text already passed to the stop checker
        self.key = key
        self.aid = aid
        self.eos = eos


_PLAIN = ("plain",)  # batch key of requests without a document


class Engine:
    """Continuous-batching scheduler over a pool of shared documents.

    ``pool``: anything with ``open_batch(doc) -> AgentBatch`` (SharedKVPool, DensePool); may be None
    for plain requests only. ``model``/``tok`` default to ``pool.model``/``pool.tok``.
    ``on_step(seconds, n_agents)`` is called after every batch step (metrics).
    """

    def __init__(self, pool=None, model=None, tok=None, *, max_agents: int = 64,
                 max_prefill_per_step: int = 32, prefill_token_budget: int = 2048, max_waiting: int = 1024,
                 on_step: Callable[[float, int], None] | None = None,
                 plain_batch_factory: Callable[[], Any] | None = None, num_threads: int | None = None):
        self.pool = pool
        self.model = model if model is not None else getattr(pool, "model", None)
        self.tok = tok if tok is not None else getattr(pool, "tok", None)
        if self.model is None or self.tok is None:
            raise ValueError("Engine needs a model and a tokenizer (directly or through the pool)")
        self.max_agents = max_agents
        self.max_prefill_per_step = max_prefill_per_step
        self.prefill_token_budget = prefill_token_budget
        self.num_threads = num_threads
        self.max_waiting = max_waiting
        self.on_step = on_step
        self._plain_factory = plain_batch_factory or (lambda: DenseBatch(self.model))
        self.eos_ids = _eos_ids(self.model, self.tok)

        self._inbox: queue.Queue = queue.Queue()  # ("submit", handle) | ("call", fn, fut) | ("wake",)
        self._waiting: deque[RequestHandle] = deque()
        self._batches: dict[Any, Any] = {}
        self._live: dict[tuple, _Live] = {}  # (key, aid) -> state
        self._doc_users: dict[Any, int] = {}  # document -> live+waiting requests
        self._users_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        # counters (written by the engine thread, read anywhere)
        self.steps = 0
        self.tokens_generated = 0
        self.requests_finished = 0
        self.last_step_s = 0.0

    # ------------------------------------------------------------------------------------------
    # lifecycle
    # ------------------------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="polykv-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop, fail pending requests with EngineClosedError, close batches, join."""
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # pragma: no cover
                log.warning("polykv engine thread did not stop within %s s", timeout)
        self._drain_closed()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------------------------------
    # client API (any thread)
    # ------------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        if self._stop.is_set() or self._thread is None:
            raise EngineClosedError("engine is not running")
        request.params.validate()
        if not request.request_id:
            request.request_id = f"req-{next(self._ids)}"
        if self._inbox.qsize() + len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests already waiting")
        handle = RequestHandle(request, loop)
        self._add_user(request.document, +1)
        self._inbox.put(("submit", handle))
        return handle

    def call(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        """Run ``fn(*args, **kwargs)`` on the engine thread between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set() or self._thread is None or not self._thread.is_alive():
            fut.set_exception(EngineClosedError("engine is not running"))
            return fut
        self._inbox.put(("call", fn, args, kwargs, fut))
        return fut

    def users_of(self, document) -> int:
        """Requests (waiting or running) that use ``document``."""
        with self._users_lock:
            return self._doc_users.get(document, 0)

    def live_agents(self) -> int:
        return len(self._live)

    def waiting(self) -> int:
        return len(self._waiting) + self._inbox.qsize()

    def agents_by_document(self) -> dict:
        out: dict = {}
        for (key, _aid) in list(self._live):
            if key is not _PLAIN:
                out[key] = out.get(key, 0) + 1
        return out

    def live_requests(self) -> list[dict]:
        now = time.perf_counter()
        rows = []
        for st in list(self._live.values()):
            r = st.handle.request
            doc = r.document
            if doc is not None and not isinstance(doc, (str, int)):
                doc = str(getattr(doc, "id", doc))
            rows.append({"id": r.request_id, "document": doc, "prompt_tokens": len(r.prompt_ids),
                         "generated": len(st.tokens), "max_tokens": r.params.max_tokens,
                         "age_s": round(now - st.handle.submitted_at, 3)})
        return rows

    # ------------------------------------------------------------------------------------------
    # engine thread
    # ------------------------------------------------------------------------------------------
    def _add_user(self, doc, delta: int) -> None:
        if doc is None:
            return
        with self._users_lock:
            n = self._doc_users.get(doc, 0) + delta
            if n > 0:
                self._doc_users[doc] = n
            else:
                self._doc_users.pop(doc, None)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.num_threads:
            # process-wide intra-op threads; on an oversubscribed CPU fewer threads avoid OpenMP
            # spin-waiting (measured: 32-agent SmolLM2 decode step 0.37 s with 1 thread vs 1-8 s with 2)
            torch.set_num_threads(int(self.num_threads))
        try:
            while not self._stop.is_set():
                idle = not self._live and not self._waiting
                self._process_inbox(block=idle)
                if self._stop.is_set():
                    break
                self._reap_cancelled()
                self._admit()
                self._step_all()
        except BaseException as exc:  # pragma: no cover - keep clients from hanging forever
            log.exception("polykv engine loop crashed")
            self._fail_all(exc)
        finally:
            self._stop.set()
            self._drain_closed()

    def _process_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = item[0]
            if kind == "submit":
                self._waiting.append(item[1])
            elif kind == "call":
                _, fn, args, kwargs, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args, **kwargs))
                    except BaseException as exc:
                        fut.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _finish(self, st: _Live | None, handle: RequestHandle, ev: Event) -> None:
        if st is not None:
            self._live.pop((st.key, st.aid), None)
            batch = self._batches.get(st.key)
            if batch is not None:
                try:
                    batch.remove(st.aid)
                except Exception:  # pragma: no cover
                    log.exception("removing agent %s failed", st.aid)
        self._add_user(handle.request.document, -1)
        if ev.kind == "done":
            self.requests_finished += 1
        handle._put(ev)

    def _reap_cancelled(self) -> None:
        if self._waiting:
            keep = deque()
            for h in self._waiting:
                if h.cancelled:
                    self._finish(None, h, Event("done", finish_reason="cancelled", usage=_usage(h, 0)))
                else:
                    keep.append(h)
            self._waiting = keep
        for st in [s for s in self._live.values() if s.handle.cancelled]:
            self._finish(st, st.handle, Event("done", finish_reason="cancelled",
                                              usage=_usage(st.handle, len(st.tokens))))
        self._close_empty()

    def _close_empty(self) -> None:
        for key in [k for k, b in self._batches.items() if len(b) == 0]:
            batch = self._batches.pop(key)
            try:
                batch.close()
            except Exception:  # pragma: no cover
                log.exception("closing batch failed")

    def _admit(self) -> None:
        n = 0
        budget = self.prefill_token_budget
        while self._waiting and n < self.max_prefill_per_step and len(self._live) < self.max_agents:
            req = self._waiting[0].request
            if n and len(req.prompt_ids) > budget:
                break  # prefill token budget of this step spent; the rest joins next step
            h = self._waiting.popleft()
            budget -= len(req.prompt_ids)
            key = _PLAIN if req.document is None else req.document
            try:
                batch = self._batches.get(key)
                if batch is None:
                    if key is _PLAIN:
                        batch = self._plain_factory()
                    else:
                        if self.pool is None:
                            raise KeyError(req.document)
                        batch = self._open_batch(req.document)
                    self._batches[key] = batch
                aid = batch.add(list(req.prompt_ids))
            except Exception as exc:
                self._finish(None, h, Event("error", error=exc))
                self._close_empty()
                continue
            self._live[(key, aid)] = _Live(h, key, aid, set() if req.params.ignore_eos else self.eos_ids)
            n += 1

    def _open_batch(self, document):
        """pool.open_batch, turning the pool's "over budget" warning (every other document in use,
        nothing left to evict) into KVBudgetExceeded so the request is refused, not over-committed."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch = self.pool.open_batch(document)
        over = [w for w in caught if "budget" in str(w.message).lower()]
        for w in caught:
            if w not in over:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if over:
            batch.close()
            raise KVBudgetExceeded(str(over[0].message))
        return batch

    def _step_all(self) -> None:
        for key in list(self._batches):
            batch = self._batches.get(key)
            if batch is None or len(batch) == 0:
                continue
            t0 = time.perf_counter()
            try:
                logits = batch.step()
            except Exception as exc:
                log.exception("step of batch %r failed", key)
                for st in [s for s in self._live.values() if s.key == key]:
                    self._finish(st, st.handle, Event("error", error=exc))
                self._close_empty()
                continue
            dt = time.perf_counter() - t0
            self.steps += 1
            self.last_step_s = dt
            if self.on_step is not None:
                try:
                    self.on_step(dt, len(logits))
                except Exception:  # pragma: no cover
                    pass
            feed: dict = {}
            for aid, lg in logits.items():
                st = self._live.get((key, aid))
                if st is None:
                    continue
                if st.handle.cancelled:
                    self._finish(st, st.handle, Event("done", finish_reason="cancelled",
                                                      usage=_usage(st.handle, len(st.tokens))))
                    continue
                tok = st.sampler(lg)
                if self._advance(st, tok):
                    feed[aid] = tok
            if feed:
                batch.feed(feed)
        self._close_empty()

    def _advance(self, st: _Live, tok: int) -> bool:
        """Record one sampled token; stream text; return True while the request goes on."""
        p = st.handle.request.params
        self.tokens_generated += 1
        if tok in st.eos:
            self._done(st, "stop", count=len(st.tokens) + 1)
            return False
        st.tokens.append(tok)
        text = self.tok.decode(st.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") and len(st.tokens) < p.max_tokens:
            new = ""  # incomplete UTF-8 sequence: wait for the next token
        else:
            new = text[st.text_sent:]
            st.text_sent = len(text)
        emit, stopped = st.stop.push(new) if new else ("", False)
        if emit:
            st.handle._put(Event("token", text=emit, token_id=tok))
        if stopped:
            self._done(st, "stop")
            return False
        if len(st.tokens) >= p.max_tokens:
            rest = st.stop.flush()
            if rest:
                st.handle._put(Event("token", text=rest))
            self._done(st, "length")
            return False
        return True

    def _done(self, st: _Live, reason: str, count: int | None = None) -> None:
        if reason == "stop" and not st.stop.stopped:
            rest = st.stop.flush()
            if rest:
                st.handle._put(Event("token", text=rest))
        n = len(st.tokens) if count is None else count
        self._finish(st, st.handle, Event("done", finish_reason=reason, usage=_usage(st.handle, n)))

    def _fail_all(self, exc: BaseException) -> None:
        for st in list(self._live.values()):
            self._finish(st, st.handle, Event("error", error=exc))
        while self._waiting:
            h = self._waiting.popleft()
            self._finish(None, h, Event("error", error=exc))

    def _drain_closed(self) -> None:
        """After the loop ended: fail everything still queued, close batches (idempotent)."""
        err = EngineClosedError("engine shut down")
        if self._thread is not None and self._thread.is_alive() and threading.current_thread() is not self._thread:
            return  # still running (join timed out); the thread cleans up itself
        self._fail_all(err)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "submit":
                self._finish(None, item[1], Event("error", error=err))
            elif item[0] == "call":
                fut = item[4]
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(err)
        for key in list(self._batches):
            try:
                self._batches.pop(key).close()
            except Exception:  # pragma: no cover
                pass


def _usage(handle: RequestHandle, completion_tokens: int) -> dict:
    pt = len(handle.request.prompt_ids)
    return {"prompt_tokens": pt, "completion_tokens": completion_tokens, "total_tokens": pt + completion_tokens}


def _eos_ids(model, tok) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(getattr(model, "config", None), "eos_token_id", None),
                getattr(tok, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src if isinstance(x, int))
    return ids
