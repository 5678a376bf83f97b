"""Request text -> token ids (plain, over a document, chat). Blocking: the routes run these on a
worker thread (`ServerState.in_thread`), never on the event loop."""

from __future__ import annotations

from .errors import APIError

__all__ = ["chat_ids", "chat_suffix_ids", "suffix_ids"]

_SENTINEL = "\u2063POLYKV\u2063SUFFIX\u2063"


def _doc_is_chat(pool, handle) -> bool:
    docs = getattr(pool, "_docs", None)
    d = docs.get(handle) if isinstance(docs, dict) else None
    return bool(getattr(d, "chat", False))


def suffix_ids(state, handle, text: str) -> list[int]:
    """An agent's own tokens after the document: the pool's convention when it has one (a chat
    document's question continues its user turn and the turn is closed), plain tokens otherwise.
    A document removed meanwhile raises the pool's UnknownDocumentError (a 404)."""
    fn = getattr(state.pool, "prompt_ids", None)
    if fn is not None:
        return [int(t) for t in fn(handle, text)]
    return state.encode(text)


def chat_suffix_ids(state, handle, msgs: list[dict]) -> list[int]:
    """Chat over a document. A chat document is the opening of the first user turn, so the request's
    conversation is rendered with the document's place marked, and the suffix is everything after
    it: system messages are folded into that first user turn (the prefix's system part is fixed)."""
    tok = state.tok
    if not (_doc_is_chat(state.pool, handle) and getattr(tok, "chat_template", None)):
        return chat_ids(tok, msgs)
    system = [m["content"] for m in msgs if m["role"] == "system"]
    rest = [m for m in msgs if m["role"] != "system"]
    if not rest or rest[0]["role"] != "user":
        rest = [{"role": "user", "content": ""}] + rest
    first = "\n\n".join(system + [rest[0]["content"]])
    conv = [{"role": "user", "content": _SENTINEL + first}] + rest[1:]
    rendered = _apply_template(tok, conv, tokenize=False)
    i = rendered.find(_SENTINEL)
    if i < 0:
        raise APIError(400, "the chat template altered the conversation", param="messages", code="invalid_value")
    return tok(rendered[i + len(_SENTINEL):], add_special_tokens=False)["input_ids"]


def chat_ids(tok, msgs: list[dict]) -> list[int]:
    if getattr(tok, "chat_template", None):
        out = _apply_template(tok, msgs, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
    return tok(text, add_special_tokens=False)["input_ids"]


def _apply_template(tok, conv: list[dict], tokenize: bool):
    """The tokenizer's chat template. A template that refuses the conversation (templates raise
    jinja's TemplateError, e.g. for roles out of order) is a 400; anything else is a bug."""
    from jinja2 import TemplateError

    try:
        return tok.apply_chat_template(conv, tokenize=tokenize, add_generation_prompt=True)
    except TemplateError as exc:
        raise APIError(400, f"could not apply the chat template: {exc}", param="messages",
                       code="invalid_value") from exc
