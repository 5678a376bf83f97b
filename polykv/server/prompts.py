"""Request text -> token ids (plain, over a document, chat). Blocking: the routes run these on a
worker thread (`ServerState.in_thread`), never on the event loop. Chat rendering and the split of a
conversation at a document's place live in `polykv.hf.chat` (shared with the pool)."""

from __future__ import annotations

from ..hf.chat import ChatTemplateError, conversation_ids
from .errors import APIError

__all__ = ["chat_ids", "chat_suffix_ids", "suffix_ids"]


def suffix_ids(state, handle, text: str) -> list[int]:
    """An agent's own tokens after the document: the pool's convention when it has one (a chat
    document's question continues its user turn and the turn is closed), plain tokens otherwise.
    A document removed meanwhile raises the pool's UnknownDocumentError (a 404)."""
    fn = getattr(state.pool, "prompt_ids", None)
    if fn is not None:
        return [int(t) for t in fn(handle, text)]
    return state.encode(text)


def chat_suffix_ids(state, handle, msgs: list[dict]) -> list[int]:
    """Chat over a document: the pool's convention when it has one (over a chat document, the
    conversation rendered after the document's place, system messages folded into the first user
    turn: `polykv.hf.chat.conversation_tail`), else the whole rendered conversation."""
    fn = getattr(state.pool, "prompt_ids", None)
    try:
        return [int(t) for t in fn(handle, msgs)] if fn is not None else conversation_ids(state.tok, msgs)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_value") from exc


def chat_ids(tok, msgs: list[dict]) -> list[int]:
    """A conversation without a document (`polykv.hf.chat.conversation_ids`)."""
    try:
        return conversation_ids(tok, msgs)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
