"""FastAPI application: documents, OpenAI-compatible completions over shared prefixes, metrics, status.

    app = create_app(pool)            # or create_app(engine)
    uvicorn.run(app, host="127.0.0.1", port=8000)

All model work runs on the engine thread (`polykv.engine.Engine`); handlers only validate, tokenize,
submit and stream. Every bad input is a 4xx in OpenAI's error shape; errors of one request never
touch another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from ..engine import Engine, EngineClosedError, GenerationRequest, KVBudgetExceeded, QueueFullError, SamplingParams
from .errors import APIError, install_error_handlers
from .metrics import Metrics
from .schemas import ChatRequest, CompletionRequest, DocumentRequest, message_text

__all__ = ["ServerState", "create_app"]

log = logging.getLogger("polykv.server")

_STATIC = Path(__file__).parent / "static"


class DocumentInUse(Exception):
    pass


def _is_budget_error(exc: BaseException) -> bool:
    name = type(exc).__name__.lower()
    return isinstance(exc, MemoryError) or "budget" in name or "capacity" in name


def _is_unknown_doc(exc: BaseException) -> bool:
    name = type(exc).__name__.lower()
    return (isinstance(exc, KeyError) or ("unknown" in name and "doc" in name) or "notfound" in name
            or "unknown document" in str(exc).lower())


class ServerState:
    """Everything the handlers share. Document metadata is mirrored here (updated on the engine
    thread's results) so lookups never wait for a model step."""

    def __init__(self, engine: Engine, *, model_name: str, k: str | None, v: str | None,
                 store: str | None, max_tokens_cap: int, context_length: int | None,
                 retry_after_s: int = 2):
        self.engine = engine
        self.pool = engine.pool
        self.tok = engine.tok
        self.model_name = model_name
        self.model_names = {model_name, "polykv"}
        self.k, self.v = k, v
        self.store = store
        self.retry_after_s = retry_after_s
        cfg = getattr(engine.model, "config", None)
        ctx = context_length or getattr(cfg, "max_position_embeddings", None) or 2048
        self.context_length = int(ctx)
        self.max_tokens_cap = min(int(max_tokens_cap), self.context_length)
        self.started = time.time()
        self.docs: dict[str, dict] = {}
        self._mem: dict = {}
        self._mem_at = 0.0
        self._mem_fut = None
        self._tok_hist: list[tuple[float, int]] = []
        self.metrics = Metrics(self)

    # --- documents --------------------------------------------------------------------------
    def doc_info(self, handle, name_hint: str | None = None) -> dict:
        """Normalize the pool's view of one document to {id, name, tokens, bytes}."""
        row = None
        docs_fn = getattr(self.pool, "documents", None)
        if docs_fn is not None:
            for d in docs_fn():
                did = d.get("id") if isinstance(d, dict) else getattr(d, "id", None)
                if did == handle or did == getattr(handle, "id", object()) or str(did) == str(handle):
                    row = d
                    break
        src = row if row is not None else handle

        def get(*names, default=None):
            for n in names:
                if isinstance(src, dict) and n in src:
                    return src[n]
                if not isinstance(src, dict) and hasattr(src, n):
                    val = getattr(src, n)
                    return val() if callable(val) else val
            return default

        did = get("id", default=handle)
        return {
            "id": str(did),
            "name": get("name", default=None) or name_hint or str(did),
            "tokens": int(get("tokens", "length", "n_tokens", "doc_tokens", default=0) or 0),
            "bytes": int(get("bytes", "nbytes", "kv_bytes", default=0) or 0),
            "_handle": handle if not isinstance(handle, dict) else did,
        }

    def refresh_docs(self) -> None:
        """Engine thread: rebuild the mirror from pool.documents()."""
        docs: dict[str, dict] = {}
        for d in (self.pool.documents() if self.pool is not None and hasattr(self.pool, "documents") else []):
            did = d.get("id") if isinstance(d, dict) else getattr(d, "id", d)
            info = self.doc_info(did)
            old = self.docs.get(info["id"])
            if old is not None:
                info["_handle"] = old["_handle"]
            docs[info["id"]] = info
        self.docs = docs

    def public_doc(self, info: dict) -> dict:
        out = {k: v for k, v in info.items() if not k.startswith("_")}
        out["object"] = "document"
        out["agents"] = self.engine.users_of(info["_handle"])
        return out

    def save_store(self) -> None:
        """Engine thread: persist the pool when a store directory is configured."""
        if self.store and hasattr(self.pool, "save"):
            self.pool.save(self.store)

    # --- memory -----------------------------------------------------------------------------
    def memory_sync(self) -> dict:
        rep = {}
        if self.pool is not None and hasattr(self.pool, "memory_report"):
            rep = dict(self.pool.memory_report())
        shared = _first(rep, "kv_bytes_shared", "shared_bytes", "bytes_shared", "total_bytes")
        naive = _first(rep, "kv_bytes_naive_f16", "naive_bytes", "kv_bytes_naive", "bytes_naive_f16")
        rep.setdefault("kv_bytes_shared", shared or 0)
        rep.setdefault("kv_bytes_naive_f16", naive or 0)
        self._agent_memory(rep)
        rep["ratio"] = round(rep["kv_bytes_naive_f16"] / rep["kv_bytes_shared"], 3) if rep["kv_bytes_shared"] else None
        return _jsonable(rep)

    def _agent_memory(self, rep: dict) -> None:
        """Naive bytes with the agents live now: every agent would hold its own f16 copy of its
        document (the per-document f16 bytes are the pool's measured figure); a document without
        agents counts once. `ratio_live` compares that with shared prefixes + private suffixes."""
        by_doc = self.engine.agents_by_document()
        docs = getattr(self.pool, "_docs", None)
        total, known = 0, False
        for info in self.docs.values():
            d = docs.get(info["_handle"]) if isinstance(docs, dict) else None
            per = getattr(d, "naive_f16_bytes", None) if d is not None else None
            if isinstance(per, int) and getattr(d, "resident", True):
                known = True
                total += per * max(1, by_doc.get(info["_handle"], 0))
        rep.setdefault("kv_bytes_agents", 0)
        rep["kv_bytes_naive_f16_agents"] = total if known else rep.get("kv_bytes_naive_f16", 0)
        used = rep.get("kv_bytes_shared", 0) + rep.get("kv_bytes_agents", 0)
        rep["ratio_live"] = round(rep["kv_bytes_naive_f16_agents"] / used, 3) if used else None
        rep["live_agents"] = self.engine.live_agents()

    async def memory(self, max_age: float = 1.0, wait: float = 1.0) -> dict:
        """The pool's memory report, refreshed on the engine thread at most every `max_age` s.
        Waits at most `wait` s for a refresh (a long model step delays it); otherwise answers with
        the last report while the refresh completes in the background."""
        if time.monotonic() - self._mem_at > max_age:
            fut = self._mem_fut
            if fut is None or fut.done():
                fut = self._mem_fut = self.engine.call(self.memory_sync)

                def store(f):
                    if not f.cancelled() and f.exception() is None:
                        self._mem, self._mem_at = f.result(), time.monotonic()

                fut.add_done_callback(store)
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), wait)
            except Exception as exc:  # slow step or engine stopped: keep the last report
                log.debug("memory report not ready: %s", exc)
        return self._mem

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        self._tok_hist.append((now, self.engine.tokens_generated))
        self._tok_hist = [(t, n) for t, n in self._tok_hist if now - t <= 10.0]
        (t0, n0), (t1, n1) = self._tok_hist[0], self._tok_hist[-1]
        return round((n1 - n0) / (t1 - t0), 2) if t1 > t0 else 0.0

    async def status(self) -> dict:
        mem = await self.memory()
        eng = self.engine
        return {
            "model": self.model_name, "k": self.k, "v": self.v,
            "uptime_s": round(time.time() - self.started, 1),
            "engine_running": eng.running,
            "documents": [self.public_doc(d) for d in self.docs.values()],
            "live_agents": eng.live_agents(), "waiting": eng.waiting(),
            "agents": eng.live_requests()[:100],
            "memory": mem,
            "totals": {"requests_finished": eng.requests_finished, "tokens_generated": eng.tokens_generated,
                       "steps": eng.steps, "last_step_ms": round(eng.last_step_s * 1000, 2),
                       "tokens_per_s": self.tokens_per_s()},
        }


def _first(d: dict, *keys):
    for k in keys:
        if isinstance(d.get(k), (int, float)):
            return d[k]
    return None


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        if isinstance(x, dict):
            return {str(k): _jsonable(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_jsonable(v) for v in x]
        if hasattr(x, "item"):
            return x.item()
        return str(x)


# --------------------------------------------------------------------------------------------
# app
# --------------------------------------------------------------------------------------------


def create_app(engine_or_pool, tok=None, *, model_name: str = "smollm2-135m", k: str | None = None,
               v: str | None = None, store: str | None = None, max_tokens_cap: int = 4096,
               context_length: int | None = None, engine_kwargs: dict | None = None) -> FastAPI:
    """Build the HTTP app around an Engine (or a pool, for which an Engine is made).

    The engine is started here and shut down (thread joined) when the app's lifespan ends.
    """
    if isinstance(engine_or_pool, Engine):
        engine = engine_or_pool
    else:
        engine = Engine(engine_or_pool, tok=tok, **(engine_kwargs or {}))
    k = k or getattr(engine.pool, "k", None) or getattr(engine.pool, "k_type", None)
    v = v or getattr(engine.pool, "v", None) or getattr(engine.pool, "v_type", None)
    state = ServerState(engine, model_name=model_name, k=k if isinstance(k, str) else None,
                        v=v if isinstance(v, str) else None, store=store, max_tokens_cap=max_tokens_cap,
                        context_length=context_length)
    prev_on_step = engine.on_step

    def on_step(dt: float, n: int) -> None:
        state.metrics.step_seconds.observe(dt)
        if prev_on_step is not None:
            prev_on_step(dt, n)

    engine.on_step = on_step
    engine.start()
    engine.call(state.refresh_docs).result(timeout=120)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="polykv", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions over shared, compressed document prefixes.")
    app.state.polykv = state
    install_error_handlers(app)
    state.metrics.install(app)

    async def on_engine(fn, *args, timeout: float = 600.0):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(engine.call(fn, *args)), timeout)
        except EngineClosedError:
            raise APIError(503, "server is shutting down", code="shutting_down")

    def lookup(doc_id: str, param: str = "document") -> dict:
        info = state.docs.get(doc_id)
        if info is None:
            raise APIError(404, f"Unknown document {doc_id!r}", param=param, code="document_not_found")
        return info

    # ---------------------------------------------------------------- documents
    @app.post("/v1/documents", tags=["documents"])
    async def add_document(body: DocumentRequest):
        ids = state.tok(body.text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise APIError(400, "document text tokenizes to nothing", param="text", code="empty_document")
        if len(ids) >= state.context_length:
            raise APIError(400, f"document has {len(ids)} tokens; the model's context is {state.context_length}",
                           param="text", code="context_length_exceeded")

        def add():
            known = {str(d["id"]) if isinstance(d, dict) else str(getattr(d, "id", d))
                     for d in (state.pool.documents() if hasattr(state.pool, "documents") else [])}
            with warnings.catch_warnings():  # "over budget" is answered with a 429 below
                warnings.filterwarnings("ignore", message=".*budget.*")
                handle = state.pool.add_document(body.text, name=body.name)
            budget = getattr(state.pool, "budget_bytes", None)
            if budget is not None and state.memory_sync().get("kv_bytes_shared", 0) > budget:
                if str(handle) not in known:  # roll back: nothing else could be evicted to make room
                    with contextlib.suppress(Exception):
                        state.pool.remove_document(handle)
                raise KVBudgetExceeded(f"document needs more KV memory than budget_bytes={budget} allows "
                                       f"while the other documents are in use")
            info = state.doc_info(handle, body.name)
            info["_handle"] = handle
            state.docs[info["id"]] = info
            state.save_store()
            return info

        try:
            info = await on_engine(add)
        except APIError:
            raise
        except Exception as exc:
            raise _map_exc(exc, state, param="text")
        return state.public_doc(info)

    @app.get("/v1/documents", tags=["documents"])
    async def list_documents():
        return {"object": "list", "data": [state.public_doc(d) for d in state.docs.values()]}

    @app.get("/v1/documents/{doc_id}", tags=["documents"])
    async def get_document(doc_id: str):
        return state.public_doc(lookup(doc_id, "doc_id"))

    @app.delete("/v1/documents/{doc_id}", tags=["documents"])
    async def delete_document(doc_id: str):
        info = lookup(doc_id, "doc_id")

        def remove():
            if engine.users_of(info["_handle"]) > 0:
                raise DocumentInUse()
            state.pool.remove_document(info["_handle"])
            state.docs.pop(doc_id, None)
            state.save_store()

        try:
            await on_engine(remove)
        except DocumentInUse:
            raise APIError(409, f"document {doc_id!r} is in use by {engine.users_of(info['_handle'])} request(s)",
                           param="doc_id", code="document_in_use")
        except APIError:
            raise
        except Exception as exc:
            if "use" in str(exc).lower() or "busy" in type(exc).__name__.lower() or "InUse" in type(exc).__name__:
                raise APIError(409, f"document {doc_id!r} is in use", param="doc_id", code="document_in_use")
            raise _map_exc(exc, state, param="doc_id")
        return {"id": doc_id, "object": "document", "deleted": True}

    # ---------------------------------------------------------------- completions
    @app.get("/v1/models", tags=["openai"])
    async def list_models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "polykv"}]}

    @app.post("/v1/completions", tags=["openai"])
    async def completions(body: CompletionRequest, request: Request):
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt",
                               code="unsupported_value")
            p = p[0]
        if isinstance(p, str):
            if not p:
                ids = []
            elif body.document is not None:
                ids = _suffix_ids(state, lookup(body.document)["_handle"], p)
            else:
                ids = state.tok(p)["input_ids"]
        else:
            vocab = len(state.tok)
            if any(t < 0 or t >= vocab for t in p):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
            ids = list(p)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
        return await _run(request, body, ids, chat=False, default_max=16)

    @app.post("/v1/chat/completions", tags=["openai"])
    async def chat_completions(body: ChatRequest, request: Request):
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m)}
                for m in body.messages]
        if body.document is not None:
            ids = _chat_suffix_ids(state, lookup(body.document)["_handle"], msgs)
        else:
            ids = _chat_ids(state.tok, msgs)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        return await _run(request, body, ids, chat=True, default_max=256)

    async def _run(request: Request, body, ids: list[int], *, chat: bool, default_max: int):
        if body.model is not None and body.model not in state.model_names:
            raise APIError(404, f"The model {body.model!r} does not exist; this server serves "
                                f"{state.model_name!r}", param="model", code="model_not_found")
        if body.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
        doc_handle, doc_tokens = None, 0
        if body.document is not None:
            info = lookup(body.document)
            doc_handle, doc_tokens = info["_handle"], info["tokens"]
        elif not ids:
            raise APIError(400, "prompt is empty (and no document given)", param="prompt", code="invalid_value")
        if body.document is not None and not ids:
            raise APIError(400, "prompt is empty: a request over a document needs at least one token of its own",
                           param="prompt" if not chat else "messages", code="invalid_value")
        used = doc_tokens + len(ids)
        if used >= state.context_length:
            raise APIError(400, f"This model's maximum context length is {state.context_length} tokens; the "
                                f"request has {used} (document {doc_tokens} + prompt {len(ids)})",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        max_tokens = body.max_tokens
        mt_param = "max_tokens"
        if max_tokens is None:
            max_tokens = min(default_max, state.context_length - used)
        if max_tokens <= 0:
            raise APIError(400, f"max_tokens must be at least 1 (got {max_tokens})", param=mt_param,
                           code="invalid_value")
        if max_tokens > state.max_tokens_cap:
            raise APIError(400, f"max_tokens must be at most {state.max_tokens_cap} (got {max_tokens})",
                           param=mt_param, code="invalid_value")
        if used + max_tokens > state.context_length:
            raise APIError(400, f"This model's maximum context length is {state.context_length} tokens; "
                                f"{used} in the request + {max_tokens} max_tokens exceed it",
                           param=mt_param, code="context_length_exceeded")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must not be empty", param="stop", code="invalid_value")
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        top_p = 1.0 if body.top_p is None else float(body.top_p)
        if top_p == 0.0:
            temperature, top_p = 0.0, 1.0
        params = SamplingParams(max_tokens=int(max_tokens), temperature=temperature, top_p=top_p,
                                top_k=body.top_k or None, seed=body.seed, stop=stop,
                                ignore_eos=bool(body.ignore_eos))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        req = GenerationRequest(ids, params, document=doc_handle, request_id=rid)
        try:
            handle = engine.submit(req, loop=asyncio.get_running_loop())
        except QueueFullError as exc:
            raise APIError(429, f"server busy: {exc}", code="queue_full",
                           headers={"Retry-After": str(state.retry_after_s)})
        except EngineClosedError:
            raise APIError(503, "server is shutting down", code="shutting_down")
        state.metrics.prompt_tokens.inc(len(ids))
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            # wait for the first event so admission errors (budget, unknown doc) are real HTTP errors
            first = await _first_event(handle, request)
            if first is None:
                return Response(status_code=499)
            if first.kind == "error":
                raise _map_exc(first.error, state, param="document")
            return StreamingResponse(_sse(handle, first, rid, created, chat, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, reason, usage = await _collect(handle, request)
        state.metrics.completion_tokens.inc(usage["completion_tokens"])
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": state.model_name,
                "system_fingerprint": None, "choices": [choice], "usage": usage}

    async def _first_event(handle, request: Request):
        """Next event of the handle; None (and the request cancelled) if the client went away."""
        get = asyncio.ensure_future(handle._aq.get())
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=0.5)
                if done:
                    return get.result()
                if await request.is_disconnected():
                    handle.cancel()
                    return None
        finally:
            if not get.done():
                get.cancel()

    async def _collect(handle, request: Request):
        parts = []
        checked = time.monotonic()
        try:
            while True:
                ev = await _first_event(handle, request)
                if ev is not None and time.monotonic() - checked > 0.5:
                    # events may flow without pause: look for a disconnect between them too
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        handle.cancel()
                        ev = None
                if ev is None:
                    raise APIError(400, "client disconnected", code="client_disconnected")
                if ev.kind == "token":
                    parts.append(ev.text)
                elif ev.kind == "error":
                    raise _map_exc(ev.error, state, param="document")
                else:
                    return "".join(parts), _reason(ev.finish_reason), ev.usage
        finally:
            if not handle.finished.is_set():
                handle.cancel()

    async def _sse(handle, first, rid, created, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text=None, reason=None, role=False, usage=None, empty=False):
            if empty:
                choices = []
            elif chat:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
            else:
                choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]
            d = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                 "system_fingerprint": None, "choices": choices}
            if usage is not None or include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        try:
            if chat:
                yield chunk(text="", role=True)
            ev = first
            while True:
                if ev.kind == "token":
                    yield chunk(text=ev.text)
                elif ev.kind == "error":
                    err = _map_exc(ev.error, state)
                    yield "data: " + json.dumps({"error": {"message": err.message, "type": err.type,
                                                           "param": err.param, "code": err.code}}) + "\n\n"
                    break
                else:
                    state.metrics.completion_tokens.inc(ev.usage["completion_tokens"])
                    yield chunk(text=None if chat else "", reason=_reason(ev.finish_reason))
                    if include_usage:
                        yield chunk(empty=True, usage=ev.usage)
                    break
                ev = await handle._aq.get()
            yield "data: [DONE]\n\n"
        finally:
            if not handle.finished.is_set():
                handle.cancel()  # client went away mid-stream: drop the agent at the next step

    # ---------------------------------------------------------------- ops
    @app.get("/health", tags=["ops"])
    async def health():
        ok = engine.running
        body = {"status": "ok" if ok else "stopping", "model": state.model_name,
                "live_agents": engine.live_agents(), "documents": len(state.docs)}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/status", tags=["ops"])
    async def status():
        return await state.status()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse((_STATIC / "status.html").read_text(encoding="utf-8"))

    return app


def _reason(r: str | None) -> str:
    return "stop" if r == "cancelled" else (r or "stop")


def _map_exc(exc: BaseException, state: ServerState, param: str | None = None) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineClosedError):
        return APIError(503, "server is shutting down", code="shutting_down")
    if isinstance(exc, QueueFullError):
        return APIError(429, f"server busy: {exc}", code="queue_full",
                        headers={"Retry-After": str(state.retry_after_s)})
    if _is_budget_error(exc):
        return APIError(429, f"KV memory budget exceeded: {exc}", code="kv_budget_exceeded",
                        headers={"Retry-After": str(state.retry_after_s)})
    if _is_unknown_doc(exc):
        return APIError(404, f"Unknown document: {exc}", param=param, code="document_not_found")
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc) or type(exc).__name__, param=param, code="invalid_value")
    log.error("request failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


_SENTINEL = "\u2063POLYKV\u2063SUFFIX\u2063"


def _doc_is_chat(state: ServerState, handle) -> bool:
    docs = getattr(state.pool, "_docs", None)
    d = docs.get(handle) if isinstance(docs, dict) else None
    return bool(getattr(d, "chat", False))


def _suffix_ids(state: ServerState, handle, text: str) -> list[int]:
    """An agent's own tokens after the document: the pool's convention when it has one (a chat
    document's question continues its user turn and the turn is closed), plain tokens otherwise."""
    fn = getattr(state.pool, "prompt_ids", None)
    if fn is not None:
        try:
            return [int(t) for t in fn(handle, text)]
        except (KeyError, LookupError) as exc:
            raise APIError(404, f"Unknown document {handle!r}", param="document", code="document_not_found") from exc
    return state.tok(text, add_special_tokens=False)["input_ids"]


def _chat_suffix_ids(state: ServerState, handle, msgs: list[dict]) -> list[int]:
    """Chat over a document. A chat document is the opening of the first user turn, so the request's
    conversation is rendered with the document's place marked, and the suffix is everything after
    it: system messages are folded into that first user turn (the prefix's system part is fixed)."""
    tok = state.tok
    if not (_doc_is_chat(state, handle) and getattr(tok, "chat_template", None)):
        return _chat_ids(tok, msgs)
    system = [m["content"] for m in msgs if m["role"] == "system"]
    rest = [m for m in msgs if m["role"] != "system"]
    if not rest or rest[0]["role"] != "user":
        rest = [{"role": "user", "content": ""}] + rest
    first = "\n\n".join(system + [rest[0]["content"]])
    conv = [{"role": "user", "content": _SENTINEL + first}] + rest[1:]
    try:
        rendered = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise APIError(400, f"could not apply the chat template: {exc}", param="messages", code="invalid_value")
    i = rendered.find(_SENTINEL)
    if i < 0:
        raise APIError(400, "the chat template altered the conversation", param="messages", code="invalid_value")
    return tok(rendered[i + len(_SENTINEL):], add_special_tokens=False)["input_ids"]


def _chat_ids(tok, msgs: list[dict]) -> list[int]:
    if getattr(tok, "chat_template", None):
        try:
            out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "input_ids"):
                out = out["input_ids"]
            return [int(t) for t in out]
        except Exception as exc:
            raise APIError(400, f"could not apply the chat template: {exc}", param="messages",
                           code="invalid_value")
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
    return tok(text, add_special_tokens=False)["input_ids"]


def _unused(_: Any) -> None:
    pass
