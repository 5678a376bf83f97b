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
choose one token per agent with its own parameters and seed, stream it, and retire agents that hit
eos, a stop string or ``max_tokens``. Requests join and leave between steps.

Token choice: a batch with a device path (``set_sampling`` + ``step_tokens``: AgentBatch) chooses
every agent's token, greedy or sampled, where the logits are, in one vectorised call per forward
(`polykv.generation.choose_tokens`), with one device-to-host copy of the ids per step; each request's
parameters and seed are written to the batch once, at admission. Other batches (DenseBatch) return
logits and each request's `Sampler` draws the same way on the host. A request's draws depend only on
(its seed, its token index, the vocabulary id): a seeded request gives the same tokens whatever runs
beside it; an unseeded one gets a seed drawn once at admission.

Pipelined decode (``Engine(pipelined=True)``, the default; POLYKV_ENGINE_PIPELINED=0 turns it off):
a device-path batch without speculation steps one step ahead, as `SharedKVPool.generate` does
(`AgentBatch.step_tokens_ahead`, docs/pool.md): each iteration launches its step t+1 — step t's
chosen ids fed back on the device, plus the prompt prefill of requests admitted since — and only
then reads step t's ids and applies the per-request rules to them (`_step_ahead`). A request ending
by ``max_tokens`` on its token in flight leaves the batch before the launch; one ending on a token
of step t (eos, a stop string), cancelled or failed, has been fed into step t+1 already: it is
removed and that step's token for it is never read or emitted. The events of every request equal
the synchronous loop's (tests/engine/test_pipelined.py). Speculating batches (drafts depend on the
ids just read), batches without a device path (DenseBatch) and ``pipelined=False`` run the
synchronous ``step_tokens`` + ``feed`` loop; a pipelined batch that a speculating request joins
reads its step in flight and goes on synchronously. Except in a speculating batch's plain
stretches: when its width planner decides the next steps plain before drafting
(`Speculator.plain_next`: backed off, or measuring T(0)), the batch decodes pipelined as a plain one
while the planner approves each next step, then reads its step in flight and drafts again — as
`SharedKVPool.generate` does; the stretches' periods are the planner's plain step time T(0).
``on_step`` / ``last_step_s`` of a pipelined batch: once per step read, the seconds spent launching
the next step and waiting for this one's ids (with one batch and a device running ahead: the step's
period, not one step's device time).

Speculative decoding (``GenerationRequest.speculative``, a `polykv.spec.SpecConfig`; documents only):
the batch's `Speculator` (one per document batch, over the pool's n-gram index and outputs tree of the
document) drafts after each fed token, every agent cut to the one width its `WidthPlanner` finds worth
the batch step (`Speculator.propose_all`, as `SharedKVPool.generate`); a step with drafts runs `AgentBatch.step_verify` and
every emitted token of an agent goes through the same eos / stop / max_tokens rules, in order. Tokens
are the ones plain decoding gives (`polykv.spec.verify`); ``usage["speculative"]`` reports the
request's drafted / accepted tokens and verify steps.

Failures stay with the request that caused them:

* A batch whose step (``step()``, ``step_tokens()``, a pipelined launch or read of ids) raises is
  not stepped again (it may hold half-applied state: some agents' inputs consumed, others not). Its
  agents move to a new batch of the same document, each re-added with its whole history (prompt +
  tokens so far) and stepped alone: an agent whose input fails fails alone, with its own error; the
  others go on (their next token comes from a recomputed suffix; a pipelined batch's step in flight
  is dropped unread and recomputed this way). One step failure costs one forward per agent of that
  batch, once.
* Sampling, detokenizing and stop checks run per agent: an error there fails that agent only.
* Anything else that escapes an iteration of the loop is caught by a supervisor, which fails the
  running requests (their batches cannot be trusted), keeps the waiting ones, and restarts the loop
  (``Engine.restarts``; back-off when it keeps failing). The engine stops only on ``shutdown()``.

Admission control: with a pool ``budget_bytes``, a request is refused with
:class:`~polykv.errors.BudgetExceededError` when, after it is added to its batch, the measured KV
bytes held (the pool's documents + live agent storage, ``memory_report()["kv_bytes_shared"] +
["kv_bytes_agents"]``, + the dense plain batch) + what its batch's suffix pages may still grow by
before every agent of the batch, this one included, holds its prompt, ``max_tokens`` and a verify
step's drafts (`AgentBatch.growth_bytes`: pages held cost nothing more) exceed the budget. So
running agents are never cut and their pages never take a document batch over the budget.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import BudgetExceededError, EngineClosedError, InvalidRequestError, QueueFullError, UnknownDocumentError
from ..generation import Sampler, SamplingParams, StopChecker, stop_token_ids
from .dense import DenseBatch

__all__ = ["Engine", "EngineClosedError", "Event", "GenerationRequest", "KVBudgetExceeded", "QueueFullError",
           "RequestHandle"]

log = logging.getLogger(__name__)

KVBudgetExceeded = BudgetExceededError  # the engine's older name


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
    speculative: Any = None  # a polykv.spec.SpecConfig (document requests), or None


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

    async def next_event(self) -> Event:
        """The next event (async handles, i.e. submitted with a loop)."""
        if self._aq is None:
            raise RuntimeError("handle was created without an event loop; use iter_sync()")
        return await self._aq.get()

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        while True:
            ev = await self.next_event()
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

    __slots__ = ("handle", "sampler", "stop", "tokens", "text_sent", "key", "aid", "eos", "spec", "drafted", "left")

    def __init__(self, handle: RequestHandle, key, aid, eos: frozenset[int]):
        p = handle.request.params
        self.handle = handle
        self.sampler = Sampler(p)
        self.stop = StopChecker(p.stop)
        self.tokens: list[int] = []
        self.text_sent = 0  # characters of the decoded text already passed to the stop checker
        self.key = key
        self.aid = aid
        self.eos = eos
        self.spec = None  # {"drafted", "accepted", "steps"} while the request speculates
        self.drafted = 0  # drafts queued for its next step
        self.left = False  # pipelined: removed from its batch already (its token in flight is its last)


_PLAIN = ("plain",)  # batch key of requests without a document


def _rows_at_most(req: GenerationRequest) -> int:
    """Suffix rows a request's agent may hold: its prompt, its answer and, speculating, the drafts
    of a verify step."""
    spec = req.speculative
    return len(req.prompt_ids) + req.params.max_tokens + (spec.num_draft_tokens if spec is not None else 0)


class Engine:
    """Continuous-batching scheduler over a pool of shared documents.

    ``pool``: anything with ``open_batch(doc) -> AgentBatch`` (SharedKVPool, DensePool); may be None
    for plain requests only. ``model``/``tok`` default to ``pool.model``/``pool.tok``.
    ``on_step(seconds, n_agents)`` is called after every batch step (metrics; a pipelined batch: once
    per step whose ids were read, see `_step_ahead`). ``pipelined`` (default: on unless the
    environment sets POLYKV_ENGINE_PIPELINED=0): plain device-path batches decode one step ahead
    (`AgentBatch.step_tokens_ahead`); False keeps the synchronous ``step_tokens`` + ``feed`` loop.
    """

    def __init__(self, pool=None, model=None, tok=None, *, max_agents: int = 64,
                 max_prefill_per_step: int = 32, prefill_token_budget: int = 2048, max_waiting: int = 1024,
                 on_step: Callable[[float, int], None] | None = None,
                 plain_batch_factory: Callable[[], Any] | None = None, num_threads: int | None = None,
                 pipelined: bool | None = None):
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
        self.eos_ids = stop_token_ids(self.tok, self.model)
        if pipelined is None:
            pipelined = os.environ.get("POLYKV_ENGINE_PIPELINED", "1") != "0"
        self.pipelined = bool(pipelined)

        self._inbox: queue.Queue = queue.Queue()  # ("submit", handle) | ("call", fn, fut) | ("wake",)
        self._waiting: deque[RequestHandle] = deque()
        self._batches: dict[Any, Any] = {}
        self._specs: dict[Any, Any] = {}  # document -> polykv.spec.Speculator of its batch
        # pipelined batches: key -> (PendingTokens of the step in flight, seconds of its launch when
        # no step was read with it: reported with its read)
        self._ahead: dict[Any, tuple[Any, float]] = {}
        # speculating batches: key -> seconds of the host work that prepared the next step (`_apply`
        # after the last: rules, record, drafting, feed), timed with that step (spec/adaptive.py)
        self._prep: dict[Any, float] = {}
        # speculating batches in a plain stretch (their planner decided the next steps plain before
        # drafting: `Speculator.plain_next`), pipelined as plain batches are -> whether the launch after
        # the first is approved already; `_clean`: the step in flight captured no graph and
        # prefilled no prompt (its period is a plain step time of the planner)
        self._stretch: dict[Any, bool] = {}
        self._clean: dict[Any, bool] = {}
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
        self.step_failures = 0  # batch steps that raised (each followed by isolation)
        self.restarts = 0  # loop iterations that failed and were restarted by the supervisor

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
        """Queue a request. Raises EngineClosedError, InvalidRequestError (bad parameters, an empty
        prompt without a document) or QueueFullError; later errors arrive as an ``error`` event."""
        if self._stop.is_set() or self._thread is None:
            raise EngineClosedError("engine is not running")
        request.params.validate()
        if not request.prompt_ids and request.document is None:
            raise InvalidRequestError("a request without a document needs a non-empty prompt")
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

    def kv_usage(self) -> tuple[int, int | None]:
        """(measured KV bytes held against the GPU budget, the pool's budget_bytes or None). Engine
        thread (``call``).

        Held = what the pool's GPU budget bounds (``memory_report()["gpu_tier_bytes"]``: GPU-tier
        documents, live agent storage, stream buffers — host-tier documents do not count; a pool
        without tiers: ``kv_bytes_shared + kv_bytes_agents``) + the dense batch of plain requests."""
        budget = getattr(self.pool, "budget_bytes", None)
        used = 0
        report = getattr(self.pool, "memory_report", None)
        if report is not None:
            rep = report()
            if rep.get("gpu_tier_bytes") is not None:
                used += int(rep["gpu_tier_bytes"])
            else:
                used += int(rep.get("kv_bytes_shared") or 0) + int(rep.get("kv_bytes_agents") or 0)
        plain = self._batches.get(_PLAIN)
        if plain is not None and hasattr(plain, "kv_bytes"):
            used += int(plain.kv_bytes())
        return used, (int(budget) if budget is not None else None)

    def check_budget(self, what: str = "this request", extra: int = 0) -> None:
        """Raise BudgetExceededError when the measured KV bytes held, + `extra` bytes about to be
        allocated, exceed the pool's budget."""
        if getattr(self.pool, "budget_bytes", None) is None:
            return
        used, budget = self.kv_usage()
        used += int(extra)
        if budget is not None and used > budget:
            raise BudgetExceededError(f"{what} would hold {used} bytes of KV memory; budget_bytes={budget} "
                                      f"(documents + live agents + its own suffix pages)", used=used, budget=budget)

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
        """Supervisor: runs loop iterations until shutdown; an iteration that raises fails the
        running requests and the loop goes on (see module doc)."""
        torch.set_grad_enabled(False)
        if self.num_threads:
            # process-wide intra-op threads; on an oversubscribed CPU fewer threads avoid OpenMP
            # spin-waiting (measured: 32-agent SmolLM2 decode step 0.37 s with 1 thread vs 1-8 s with 2)
            torch.set_num_threads(int(self.num_threads))
        failures = 0  # consecutive failed iterations
        try:
            while not self._stop.is_set():
                try:
                    self._iteration()
                    failures = 0
                except Exception as exc:
                    failures += 1
                    self.restarts += 1
                    log.exception("polykv engine loop failed (restart %d); failing its %d running request(s)",
                                  self.restarts, len(self._live))
                    self._reset_running(exc)
                    if failures > 1:  # keeps failing without a request to blame: back off
                        self._stop.wait(min(0.05 * 2 ** (failures - 2), 2.0))
        except BaseException as exc:  # pragma: no cover - KeyboardInterrupt / SystemExit on this thread
            log.exception("polykv engine loop stopped")
            self._fail_all(exc)
        finally:
            self._stop.set()
            self._drain_closed()

    def _iteration(self) -> None:
        idle = not self._live and not self._waiting
        self._process_inbox(block=idle)
        if self._stop.is_set():
            return
        self._reap_cancelled()
        self._admit()
        self._step_all()

    def _reset_running(self, exc: BaseException) -> None:
        """After a failed iteration: fail the running requests, close every batch (their state may be
        half-updated). Waiting requests and queued calls stay."""
        for st in list(self._live.values()):
            self._live.pop((st.key, st.aid), None)
            self._add_user(st.handle.request.document, -1)
            st.handle._put(Event("error", error=exc))
        self._ahead.clear()
        self._stretch.clear()
        for key in list(self._batches):
            self._close_batch(self._batches.pop(key))

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
            spec = self._specs.get(st.key)
            if spec is not None:
                spec.remove(st.aid)
            batch = self._batches.get(st.key)
            if batch is not None and not st.left:
                try:
                    batch.remove(st.aid)
                except Exception:  # pragma: no cover
                    log.exception("removing agent %s failed", st.aid)
        self._add_user(handle.request.document, -1)
        if ev.kind == "done":
            self.requests_finished += 1
        handle._put(ev)

    def _fail(self, st: _Live, exc: BaseException) -> None:
        self._finish(st, st.handle, Event("error", error=exc))

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

    def _close_batch(self, batch) -> None:
        try:
            batch.close()
        except Exception:  # pragma: no cover
            log.exception("closing batch failed")

    def _close_empty(self) -> None:
        for key in [k for k, b in self._batches.items() if len(b) == 0]:
            self._close_batch(self._batches.pop(key))
            self._specs.pop(key, None)
            self._prep.pop(key, None)
            self._stretch.pop(key, None)
            self._ahead.pop(key, None)  # its ids in flight belong to agents gone

    def _new_batch(self, key):
        if key is _PLAIN:
            return self._plain_factory()
        if self.pool is None:
            raise UnknownDocumentError(f"unknown document {key!r}: the engine has no pool", key)
        return self.pool.open_batch(key)

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
            aid = None
            try:
                batch = self._batches.get(key)
                if batch is None:
                    batch = self._batches[key] = self._new_batch(key)
                aid = batch.add(list(req.prompt_ids))
                # suffix pages are taken step by step: count the most that the batch's agents, this one
                # included, may hold before they finish
                grow = getattr(batch, "growth_bytes", None)
                rows = [_rows_at_most(s.handle.request) for (k, _), s in self._live.items() if k == key]
                self.check_budget(extra=grow(rows + [_rows_at_most(req)]) if grow else 0)
                st = _Live(h, key, aid, frozenset() if req.params.ignore_eos else self.eos_ids)
                _set_sampling(batch, aid, st)
                if req.speculative is not None and key is not _PLAIN and hasattr(batch, "step_verify"):
                    self._speculator(key).add(aid, list(req.prompt_ids), req.speculative)
                    if hasattr(batch, "expect_drafts"):  # every verify width captured up front
                        batch.expect_drafts(req.speculative.num_draft_tokens)
                    st.spec = {"drafted": 0, "accepted": 0, "steps": 0}
            except Exception as exc:
                if aid is not None:
                    try:
                        self._batches[key].remove(aid)
                    except Exception:  # pragma: no cover
                        log.exception("removing refused agent %s failed", aid)
                self._finish(None, h, Event("error", error=exc))
                self._close_empty()
                continue
            self._live[(key, aid)] = st
            n += 1

    def _speculator(self, key):
        spec = self._specs.get(key)
        if spec is None:
            from ..spec import Speculator

            sources = getattr(self.pool, "spec_sources", None)
            index, tree = sources(key) if sources is not None else (None, None)
            dev = getattr(getattr(self.pool, "device", None), "type", "cpu")
            spec = self._specs[key] = Speculator(index, tree, dev)
        return spec

    def _step_all(self) -> None:
        for key in list(self._batches):
            batch = self._batches.get(key)
            if batch is None or len(batch) == 0:
                continue
            if self._pipelines(key, batch):
                self._step_ahead(key, batch)
                continue
            if key in self._ahead:  # a speculating request joined: read the step in flight, then go on synchronously
                batch = self._drain_ahead(key, batch)
                if batch is None or len(batch) == 0:
                    continue
            spec = self._specs.get(key)
            prep = self._prep.pop(key, 0.0)
            if spec is not None:  # a decode step (no prompt prefilled in it) prices draft columns
                mine = [st for (k, _), st in self._live.items() if k == key]
                timed = all(st.tokens for st in mine)
                width = max((st.drafted for st in mine), default=0)
            t0 = time.perf_counter()
            try:
                logits = self._step_batch(key, batch)
            except Exception as exc:
                self._step_failed(key, exc)
                logits = self._isolate(key, batch)
                batch = self._batches.get(key)
                if batch is None:
                    continue
            t1 = time.perf_counter()
            dt = t1 - t0
            # the step's whole host + device time, its preparation in; a plain step of a batch that
            # can pipeline is timed in its stretches only (T(0): what not speculating costs there)
            if spec is not None and timed and (width > 0 or not self._can_pipeline(batch)):
                spec.observe_step(width, prep + dt, agents=len(logits))
            self._stepped(dt, len(logits))
            self._apply(key, batch, logits)
            if key in self._specs:
                self._prep[key] = time.perf_counter() - t1
        self._close_empty()

    def _apply(self, key, batch, logits: dict) -> None:
        """The synchronous loop after a step: each agent's output through `_take`, the tokens of those
        going on fed to `batch`, then the next drafts of speculating agents."""
        feed: dict = {}
        limits: dict = {}  # speculating agents: drafts they may still use
        spec = self._specs.get(key)
        for aid, lg in logits.items():
            st = self._live.get((key, aid))
            if st is None:
                continue
            last = self._take(st, lg, spec)
            if last is not None:
                feed[aid] = last
                if spec is not None and aid in spec:
                    limits[aid] = st.handle.request.params.max_tokens - len(st.tokens) - 1
        self._feed(key, batch, feed)
        if limits:
            self._draft(key, batch, spec, {a: n for a, n in limits.items() if a in feed}, len(feed))

    def _draft(self, key, batch, spec, limits: dict, agents: int) -> None:
        """The next step's drafts of the speculating agents in `limits` ({aid: drafts it may still
        use}; their last token is pending in `batch`), cut to one width for the batch step
        (`Speculator.propose_all`, as pool.generate) and queued. None (a plain step) that the planner
        also approves the step after: the batch enters a plain stretch (`_stretch`) and decodes
        pipelined from its next iteration, as `SharedKVPool.generate` does."""
        drafts: dict = {}
        try:
            drafts = spec.propose_all(limits, agents=agents)
        except Exception:  # pragma: no cover - drafts are optional: go on without them
            log.exception("drafting failed")
        drafts = {a: d for a, d in drafts.items() if d and a in limits}
        if drafts:
            try:
                batch.feed_drafts(drafts)
                for a, d in drafts.items():
                    self._live[(key, a)].drafted = len(d)
            except Exception:  # pragma: no cover - drafts are optional: go on without them
                log.exception("queueing drafts failed")
        elif self._can_pipeline(batch) and spec.plain_next({a: n - 1 for a, n in limits.items()}, agents):
            self._stretch[key] = True

    def _take(self, st: _Live, lg, spec) -> int | None:
        """One agent's output of a step (a token id, a list of them from `step_verify`, or logits to
        draw from on the host) through cancellation, eos / stop / max_tokens (`_advance`) and the
        speculation counters. Returns the token to feed when the request goes on, else None (it has
        finished or failed: `_finish` took it out of its batch)."""
        if st.handle.cancelled:
            self._finish(st, st.handle, Event("done", finish_reason="cancelled",
                                              usage=_usage(st.handle, len(st.tokens), st)))
            return None
        try:
            if isinstance(lg, list):  # step_verify: accepted drafts + the next token
                emitted = lg
            elif isinstance(lg, int):
                emitted = [lg]
            else:  # a batch without a device path: draw on the host
                st.sampler.index = len(st.tokens)
                emitted = [st.sampler(lg)]
            if st.spec is not None and st.drafted:
                st.spec["drafted"] += st.drafted
                st.spec["accepted"] += len(emitted) - 1
                st.spec["steps"] += 1
            if spec is not None and st.aid in spec:
                spec.record(st.aid, emitted, st.drafted)
            st.drafted = 0
            for tok in emitted:
                if not self._advance(st, tok):
                    return None
            return emitted[-1]
        except Exception as exc:  # this agent's sampling / detokenizing / stop check
            log.exception("request %s failed after a step", st.handle.request.request_id)
            self._fail(st, exc)
            return None

    def _stepped(self, dt: float, n: int) -> None:
        self.steps += 1
        self.last_step_s = dt
        if self.on_step is not None:
            try:
                self.on_step(dt, n)
            except Exception:  # pragma: no cover
                log.exception("on_step callback failed")

    def _step_failed(self, key, exc: BaseException) -> None:
        self.step_failures += 1
        log.warning("step of batch %r failed (%s: %s); isolating the failing agent(s)",
                    key, type(exc).__name__, exc)

    def _can_pipeline(self, batch) -> bool:
        """A pipelined engine and a device-path batch with `step_tokens_ahead`."""
        return self.pipelined and _device_path(batch) and hasattr(batch, "step_tokens_ahead")

    def _pipelines(self, key, batch) -> bool:
        """Whether `batch` decodes one step ahead (`_can_pipeline`): without speculation (drafts
        depend on the ids just read) or in a speculating batch's plain stretch."""
        return (key not in self._specs or key in self._stretch) and self._can_pipeline(batch)

    def _step_ahead(self, key, batch) -> None:
        """One iteration of a pipelined batch (`AgentBatch.step_tokens_ahead`, as
        `SharedKVPool.generate`): agents whose token in flight (step t) is their last by count leave
        the batch; step t+1 is launched — the decode of the others, fed step t's ids on the device,
        and the prompt prefill of requests admitted since — then step t's ids are read and go through
        the same per-agent rules as a synchronous step (`_take`). An agent that ends on a token of
        step t (eos, a stop string), is cancelled or fails, has been fed into step t+1 already: it is
        removed from the batch and its token of step t+1 is never read or emitted.

        Timing: ``on_step(dt, n)`` / ``last_step_s`` once per step read: dt = seconds this iteration
        spent launching step t+1 and waiting for step t's ids (+ the launch of step t when it was
        the batch's first, read with nothing); n = agents of step t. With one batch and a device
        that runs ahead this is the step's period, not the device time of one step.

        A launch or read that raises is a failed step: the step in flight is dropped unread and the
        batch's agents are isolated (`_isolate`: re-added with their history, stepped alone,
        synchronously; the batch pipelines again from its next iteration)."""
        ahead, spent = self._ahead.pop(key, (None, 0.0))
        spec = self._specs.get(key) if key in self._stretch else None  # a speculating batch's plain stretch
        t0 = time.perf_counter()
        if ahead is not None:
            for aid in ahead.agents:
                st = self._live.get((key, aid))
                if st is not None and not st.left and len(st.tokens) + 1 >= st.handle.request.params.max_tokens:
                    batch.remove(aid)  # leaves before the launch: nothing of step t+1 is spent on it
                    st.left = True
        launch = len(batch) > 0
        if launch and spec is not None and ahead is not None:  # the stretch goes on while the planner says plain
            approved, self._stretch[key] = self._stretch[key], False
            launch = approved or spec.plain_next(self._stretch_limits(key, batch, ahead), len(batch))
        try:
            captures = getattr(batch, "graph_captures", 0)
            nxt = batch.step_tokens_ahead() if launch else None
            clean = (spec is not None and nxt is not None and getattr(batch, "graph_captures", 0) == captures
                     and all(self._live[(key, a)].tokens for a in nxt.agents if (key, a) in self._live))
            chosen = ahead.result() if ahead is not None else None
        except Exception as exc:
            self._recover(key, batch, exc, spent + time.perf_counter() - t0)
            return
        t_read = time.perf_counter()
        dt = spent + t_read - t0
        if chosen is not None:
            if spec is not None and self._clean.get(key) and (nxt is None or clean):
                spec.observe_step(0, dt, agents=len(chosen))  # T(0): a pipelined step's period
            self._stepped(dt, len(chosen))
            for aid in ahead.agents:
                st = self._live.get((key, aid))
                if st is not None:  # else cancelled or failed since the launch: its token is dropped
                    self._take(st, chosen[aid], spec)  # fed already (on the device): nothing to feed
            dt = 0.0
        if nxt is not None:
            self._ahead[key] = (nxt, dt)
            self._clean[key] = clean
        elif spec is not None:  # the stretch ends: the tokens just read are pending; draft after them
            del self._stretch[key]
            self._clean.pop(key, None)
            limits = {a: n + 1 for a, n in self._stretch_limits(key, batch, ahead).items()} if ahead is not None else {}
            if limits and key in self._specs:
                self._draft(key, batch, spec, limits, len(batch))
            self._prep[key] = time.perf_counter() - t_read

    def _stretch_limits(self, key, batch, ahead) -> dict:
        """{aid: drafts it may use after its token in flight} of the speculating agents of the step
        in flight `ahead` still in `batch` (max_tokens - tokens so far - the one in flight - the one
        every step emits)."""
        spec = self._specs.get(key)
        out = {}
        for aid in ahead.agents:
            st = self._live.get((key, aid))
            if st is not None and not st.left and spec is not None and aid in spec and aid in batch:
                out[aid] = st.handle.request.params.max_tokens - len(st.tokens) - 2
        return out

    def _recover(self, key, batch, exc: BaseException, spent: float):
        """A pipelined launch or read raised: its step in flight (popped from `_ahead`) is dropped
        unread; `_isolate` re-adds the agents with their history and steps them alone (synchronously),
        and their tokens are applied and fed. Returns the batch that replaced `batch` (or None)."""
        t0 = time.perf_counter()
        self._step_failed(key, exc)
        out = self._isolate(key, batch)
        batch = self._batches.get(key)
        self._stepped(spent + time.perf_counter() - t0, len(out))
        if batch is not None:
            self._apply(key, batch, out)
        return batch

    def _drain_ahead(self, key, batch):
        """A pipelined batch goes synchronous (a speculating request joined it): read its step in
        flight and apply it; its ids become the agents' pending tokens (`PendingTokens.result`), as
        a synchronous `feed` leaves them. Returns the batch to step (None when it was lost)."""
        ahead, spent = self._ahead.pop(key)
        t0 = time.perf_counter()
        try:
            chosen = ahead.result()
        except Exception as exc:
            return self._recover(key, batch, exc, spent + time.perf_counter() - t0)
        self._stepped(spent + time.perf_counter() - t0, len(chosen))
        for aid in ahead.agents:
            st = self._live.get((key, aid))
            if st is not None:
                self._take(st, chosen[aid], None)
        return batch

    def _step_batch(self, key, batch) -> dict:
        """One step of a batch: {aid: token id} chosen on the batch's device (`AgentBatch.step_tokens`
        with the rows `_set_sampling` gave it: one copy of the ids, no logits on the host), or
        {aid: logits} from a batch without a device path (each request's `Sampler` draws)."""
        if hasattr(batch, "step_verify") and key in self._specs:
            return batch.step_verify()
        if _device_path(batch):
            return batch.step_tokens()
        return batch.step()

    def _feed(self, key, batch, feed: dict) -> None:
        if not feed:
            return
        try:
            batch.feed(feed)
        except Exception:  # feed one by one: fail only the agents the batch refuses
            for aid, tok in feed.items():
                st = self._live.get((key, aid))
                try:
                    batch.feed({aid: tok})
                except Exception as exc:
                    log.exception("feeding agent %s failed", aid)
                    if st is not None:
                        self._fail(st, exc)

    def _isolate(self, key, failed) -> dict:
        """``failed.step()`` raised. Move its agents to a new batch one at a time, each re-added with
        its history and stepped alone; fail those whose own step fails. Returns their tokens or
        logits (`_step_batch`)."""
        lives = [st for st in self._live.values() if st.key == key]
        try:
            batch = self._new_batch(key)  # before closing the failed one: the document stays held
        except Exception as exc:
            log.exception("cannot reopen a batch for %r; failing its %d request(s)", key, len(lives))
            for st in lives:
                self._live.pop((key, st.aid), None)
                self._add_user(st.handle.request.document, -1)
                st.handle._put(Event("error", error=exc))
            self._close_batch(self._batches.pop(key))
            return {}
        for st in lives:
            self._live.pop((key, st.aid), None)
            st.spec, st.drafted, st.left = None, 0, False  # re-added agents go on without speculation
        self._specs.pop(key, None)
        self._stretch.pop(key, None)
        self._batches[key] = batch
        self._close_batch(failed)
        out: dict = {}
        for st in lives:
            st.aid = None
            if st.handle.cancelled:  # gone anyway: no forward for it
                self._finish(None, st.handle, Event("done", finish_reason="cancelled",
                                                    usage=_usage(st.handle, len(st.tokens))))
                continue
            try:
                st.aid = batch.add(list(st.handle.request.prompt_ids) + st.tokens)
                self._live[(key, st.aid)] = st
                _set_sampling(batch, st.aid, st)  # continues its stream at token len(st.tokens)
                out[st.aid] = self._step_batch(key, batch)[st.aid]  # only this agent has input pending
            except Exception as exc:
                log.warning("request %s fails on its own (%s: %s)", st.handle.request.request_id,
                            type(exc).__name__, exc)
                if st.aid is None:
                    self._finish(None, st.handle, Event("error", error=exc))
                else:
                    self._fail(st, exc)
        return out

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
        self._finish(st, st.handle, Event("done", finish_reason=reason, usage=_usage(st.handle, n, st)))

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
        self._ahead.clear()
        for key in list(self._batches):
            try:
                self._batches.pop(key).close()
            except Exception:  # pragma: no cover
                pass


def _device_path(batch) -> bool:
    """Whether `batch` chooses tokens on its device with per-agent parameters."""
    return hasattr(batch, "step_tokens") and hasattr(batch, "set_sampling")


def _set_sampling(batch, aid, st: _Live) -> None:
    """Give a device-path batch the request's parameters, seed and next token index (= tokens it
    has drawn, so a re-added agent continues its stream)."""
    if _device_path(batch):
        p, s = st.sampler.params, st.sampler
        batch.set_sampling(aid, p.temperature, p.top_p, p.top_k or 0, s.seed, start=len(st.tokens))


def _usage(handle: RequestHandle, completion_tokens: int, st: _Live | None = None) -> dict:
    pt = len(handle.request.prompt_ids)
    out = {"prompt_tokens": pt, "completion_tokens": completion_tokens, "total_tokens": pt + completion_tokens}
    if st is not None and st.spec is not None:
        sp = st.spec
        out["speculative"] = dict(sp, method=handle.request.speculative.method,
                                  acceptance=sp["accepted"] / sp["drafted"] if sp["drafted"] else 0.0)
    return out

