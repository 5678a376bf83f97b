"""Prefix/suffix split for chat models: the document opens the first user message.

Rendered chat prompt of an agent = template(user: doc_text + "\\n\\n" + question). The prefix text is
the rendering up to and including doc_text + "\\n\\n"; it is tokenized once (the shared prefix), and an
agent's suffix is tokenize(question + tail) where tail closes the user turn and opens the assistant
turn. An agent's full prompt is prefix ids + suffix ids, so the prefix is a stable token prefix of
every agent's prompt by construction.
"""

from __future__ import annotations

SEPARATOR = "\n\n"
_SENTINEL = "\u2063POLYKV\u2063QUESTION\u2063"


def chat_split(tok, doc_text: str) -> tuple[str, str]:
    """(prefix_text, tail_text) for a document rendered into the first user turn."""
    content = doc_text.rstrip() + SEPARATOR
    rendered = tok.apply_chat_template([{"role": "user", "content": content + _SENTINEL}],
                                       tokenize=False, add_generation_prompt=True)
    i = rendered.find(_SENTINEL)
    if i < 0:
        raise ValueError("the tokenizer's chat template altered the user message; cannot split it")
    return rendered[:i], rendered[i + len(_SENTINEL):]
