"""OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions (plus polykv's `document`:
the request continues a shared document). Handlers validate, tokenize (on a worker thread), submit to
the engine and stream its events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from ...engine import GenerationRequest, SamplingParams
from ..errors import TYPED, APIError, request_id, to_api_error
from ..prompts import chat_ids, chat_suffix_ids, suffix_ids
from ..schemas import ChatRequest, CompletionRequest, message_text
from ..state import ServerState, get_state
from .documents import lookup

__all__ = ["router"]

router = APIRouter(tags=["openai"])


@router.get("/v1/models")
async def list_models(state: ServerState = Depends(get_state)):
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                        "owned_by": "polykv"}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(get_state)):
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt", code="unsupported_value")
        p = p[0]
    if isinstance(p, str):
        if not p:
            ids = []
        elif body.document is not None:
            handle = lookup(state, body.document)["_handle"]
            ids = await _tokenize(state, suffix_ids, state, handle, p)
        else:
            ids = await state.in_thread(state.encode, p, True)
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
    return await _generate(state, request, body, ids, chat=False, default_max=16)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, state: ServerState = Depends(get_state)):
    if body.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
    msgs = [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m)}
            for m in body.messages]
    if body.document is not None:
        ids = await _tokenize(state, chat_suffix_ids, state, lookup(state, body.document)["_handle"], msgs)
    else:
        ids = await state.in_thread(chat_ids, state.tok, msgs)
    if body.max_completion_tokens is not None and body.max_tokens is None:
        body.max_tokens = body.max_completion_tokens
    return await _generate(state, request, body, ids, chat=True, default_max=256)


async def _tokenize(state: ServerState, fn, *args) -> list[int]:
    """Tokenize over a document on a worker thread; the document may vanish meanwhile (404)."""
    try:
        return await state.in_thread(fn, *args)
    except TYPED as exc:
        raise to_api_error(exc, None, param="document") from exc


def _check(state: ServerState, body, ids: list[int], chat: bool, default_max: int) -> tuple:
    """Validate a request against the served model; (document handle, its tokens, SamplingParams)."""
    if body.model is not None and body.model not in state.model_names:
        raise APIError(404, f"The model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    if body.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
    doc_handle, doc_tokens = None, 0
    if body.document is not None:
        info = lookup(state, body.document)
        doc_handle, doc_tokens = info["_handle"], info["tokens"]
    elif not ids:
        raise APIError(400, "prompt is empty (and no document given)", param="prompt", code="invalid_value")
    if body.document is not None and not ids:
        raise APIError(400, "prompt is empty: a request over a document needs at least one token of its own",
                       param="prompt" if not chat else "messages", code="invalid_value")
    ctx = state.context_length
    used = doc_tokens + len(ids)
    if used >= ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens; the request has {used} "
                            f"(document {doc_tokens} + prompt {len(ids)})",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max, ctx - used)
    if max_tokens <= 0:
        raise APIError(400, f"max_tokens must be at least 1 (got {max_tokens})", param="max_tokens",
                       code="invalid_value")
    if max_tokens > state.max_tokens_cap:
        raise APIError(400, f"max_tokens must be at most {state.max_tokens_cap} (got {max_tokens})",
                       param="max_tokens", code="invalid_value")
    if used + max_tokens > ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens; {used} in the request + "
                            f"{max_tokens} max_tokens exceed it", param="max_tokens", code="context_length_exceeded")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", param="stop", code="invalid_value")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    params = SamplingParams(max_tokens=int(max_tokens), temperature=temperature, top_p=top_p,
                            top_k=body.top_k or None, seed=body.seed, stop=stop, ignore_eos=bool(body.ignore_eos))
    return doc_handle, doc_tokens, params


def _usage(usage: dict, doc_tokens: int) -> dict:
    """The engine's usage (the request's own prompt) in OpenAI's terms: the shared document's tokens
    are prompt tokens too, served from the cache (`prompt_tokens_details.cached_tokens`)."""
    out = dict(usage, prompt_tokens=usage["prompt_tokens"] + doc_tokens,
               total_tokens=usage["total_tokens"] + doc_tokens)
    out["prompt_tokens_details"] = {"cached_tokens": doc_tokens}
    return out


def _speculative(body):
    """The request's SpecConfig: its `speculative` field, else the server default
    ($POLYKV_SPECULATIVE, set by `polykv serve --speculative`). Speculation drafts from the
    document: the default leaves requests without one alone; a request that asks for it without
    one is refused (as is an invalid object, with or without a document)."""
    import os

    from ...spec import METHODS, SpecConfig

    raw, asked = body.speculative, body.speculative is not None
    if raw is None:
        raw = os.environ.get("POLYKV_SPECULATIVE") or None
    if raw is None:
        return None
    method = raw.get("method") if isinstance(raw, dict) else raw.partition(":")[0]
    served = [m for m in METHODS if m != "draft_model"]  # a draft model is a Python object, not JSON
    model_asked = method == "draft_model" or (isinstance(raw, dict) and "draft_model" in raw)
    if model_asked or (method and method not in served):
        what = "the draft_model method is not available over HTTP" if model_asked else \
            f"unknown speculative method {method!r}"
        raise APIError(400, f"speculative: {what}; methods: {', '.join(served)}", param="speculative",
                       code="invalid_value")
    try:
        config = SpecConfig.parse(raw)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"speculative: {exc}", param="speculative", code="invalid_value") from None
    if body.document is None:
        if asked and config is not None:
            raise APIError(400, "speculative decoding drafts from a shared document: give `document` with it "
                                "(or leave `speculative` out)", param="speculative", code="invalid_value")
        return None
    return config


async def _generate(state: ServerState, request: Request, body, ids: list[int], *, chat: bool, default_max: int):
    doc_handle, doc_tokens, params = _check(state, body, ids, chat, default_max)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    reqid = request_id(request)
    req = GenerationRequest(ids, params, document=doc_handle, request_id=rid, speculative=_speculative(body))
    try:
        handle = state.engine.submit(req, loop=asyncio.get_running_loop())
    except TYPED as exc:  # queue full, engine closed, invalid parameters
        raise to_api_error(exc, reqid) from exc
    state.metrics.prompt_tokens.inc(len(ids))
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # wait for the first event so admission errors (budget, unknown doc) are real HTTP errors
        first = await _next_event(handle, request)
        if first is None:
            return Response(status_code=499)
        if first.kind == "error":
            raise to_api_error(first.error, reqid, param="document")
        return StreamingResponse(_sse(state, handle, first, rid, reqid, created, chat, include_usage, doc_tokens),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, reason, usage = await _collect(handle, request, reqid)
    state.metrics.completion_tokens.inc(usage["completion_tokens"])
    usage = _usage(usage, doc_tokens)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": state.model_name,
            "system_fingerprint": None, "choices": [choice], "usage": usage}


async def _next_event(handle, request: Request):
    """Next event of the handle; None (and the request cancelled) if the client went away."""
    get = asyncio.ensure_future(handle.next_event())
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


async def _collect(handle, request: Request, reqid: str | None):
    parts = []
    checked = time.monotonic()
    try:
        while True:
            ev = await _next_event(handle, request)
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
                raise to_api_error(ev.error, reqid, param="document")
            else:
                return "".join(parts), _reason(ev.finish_reason), ev.usage
    finally:
        if not handle.finished.is_set():
            handle.cancel()


async def _sse(state: ServerState, handle, first, rid: str, reqid: str | None, created: int, chat: bool,
               include_usage: bool, doc_tokens: int):
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
                yield "data: " + json.dumps(to_api_error(ev.error, reqid).body()) + "\n\n"
                break
            else:
                state.metrics.completion_tokens.inc(ev.usage["completion_tokens"])
                yield chunk(text=None if chat else "", reason=_reason(ev.finish_reason))
                if include_usage:
                    yield chunk(empty=True, usage=_usage(ev.usage, doc_tokens))
                break
            ev = await handle.next_event()
        yield "data: [DONE]\n\n"
    finally:
        if not handle.finished.is_set():
            handle.cancel()  # client went away mid-stream: drop the agent at the next step


def _reason(r: str | None) -> str:
    return "stop" if r == "cancelled" else (r or "stop")
