"""Chat templates and documents: a chat document opens the first user turn.

An agent's rendered prompt over a chat document is template(user: doc_text + "\\n\\n" + its own part).
The document's prefix is that rendering up to and including doc_text + "\\n\\n" (tokenized once: the
shared prefix); everything after it — the agent's question or the rest of its conversation, the
close of the turn, the generation prompt — is the agent's suffix. So the prefix is a stable token
prefix of every agent's full prompt by construction.

`split_at_document` is the one place that renders and cuts; the pool uses it for a document's prefix
and the tail that closes a plain question (`document_split`) and for the suffix of a conversation
over a document (`conversation_tail`), which is what the server's chat completions send.
`conversation_ids` is the one rendering of a conversation without a document.
"""

from __future__ import annotations

from ..errors import InvalidRequestError

__all__ = ["SEPARATOR", "ChatTemplateError", "conversation_ids", "conversation_tail", "document_split",
           "has_chat_template", "split_at_document"]

SEPARATOR = "\n\n"
_CUT = "\u2063POLYKV\u2063CUT\u2063"  # invisible separators: no template or text produces this


class ChatTemplateError(InvalidRequestError):
    """The tokenizer's chat template refused the conversation (e.g. roles out of order) or altered
    the message text, so the document's place cannot be found in the rendering."""


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def _apply(tok, messages: list[dict], tokenize: bool):
    from jinja2 import TemplateError

    try:
        return tok.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True)
    except TemplateError as exc:  # templates raise jinja's TemplateError for conversations they refuse
        raise ChatTemplateError(f"could not apply the chat template: {exc}") from exc


def split_at_document(tok, messages: list[dict], document: str = "") -> tuple[str, str]:
    """Render `messages` with the chat template (generation prompt added), `document` opening the
    first user message (a user message is put first when there is none); return (the rendering up
    to the end of `document`, the rest)."""
    msgs = [dict(m) for m in messages]
    first = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
    if first is None:
        msgs.insert(0, {"role": "user", "content": ""})
        first = 0
    msgs[first]["content"] = document + _CUT + msgs[first]["content"]
    rendered = _apply(tok, msgs, tokenize=False)
    i = rendered.find(_CUT)
    if i < 0 or rendered.count(_CUT) != 1:
        raise ChatTemplateError("the tokenizer's chat template altered the user message; cannot find the "
                                "document's place in it")
    return rendered[:i], rendered[i + len(_CUT):]


def document_split(tok, doc_text: str) -> tuple[str, str]:
    """(prefix text, tail) of a chat document: the prefix ends with doc_text + SEPARATOR; an agent's
    plain question q continues the turn as q + tail (tail closes the turn, opens the assistant's)."""
    return split_at_document(tok, [{"role": "user", "content": ""}], doc_text.rstrip() + SEPARATOR)


def conversation_tail(tok, messages: list[dict]) -> str:
    """Suffix text of a conversation over a chat document: the conversation rendered after the
    document's place. The prefix's system part is fixed, so system messages are folded into the
    first user message (joined by SEPARATOR, before its text); a conversation that does not start
    with a user message gets an empty one first."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if not rest or rest[0]["role"] != "user":
        rest.insert(0, {"role": "user", "content": ""})
    rest[0]["content"] = SEPARATOR.join(system + [rest[0]["content"]])
    return split_at_document(tok, rest)[1]


def conversation_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of a whole conversation and the generation prompt: the chat template when the
    tokenizer has one, else "role: content" lines ended by "assistant:"."""
    if has_chat_template(tok):
        out = _apply(tok, messages, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return list(tok(text, add_special_tokens=False)["input_ids"])
