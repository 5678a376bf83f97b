"""Request bodies (OpenAI-compatible, plus polykv's `document` and `top_k`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

__all__ = ["ChatMessage", "ChatRequest", "CompletionRequest", "DocumentRequest", "StreamOptions"]

_Num = Union[StrictInt, StrictFloat]


def _unicode(text: str) -> str:
    # JSON may carry a lone UTF-16 surrogate ("\ud800"); Python keeps it in a str, which no tokenizer takes
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start}") \
            from None
    return text


_Text = Annotated[StrictStr, AfterValidator(_unicode)]  # text the tokenizer reads


class _Body(BaseModel):
    # unknown OpenAI fields (user, logit_bias, ...) are accepted and ignored
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool | None = False


class _Sampling(_Body):
    model: StrictStr | None = Field(None, description="Served model name (optional).")
    max_tokens: StrictInt | None = Field(None, description="Tokens to generate (>= 1).")
    temperature: _Num | None = Field(None, ge=0, le=2, description="0 = greedy (default 1).")
    top_p: _Num | None = Field(None, ge=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0, description="polykv extension: 0 = off.")
    n: StrictInt | None = Field(1, description="Only 1 is supported.")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: _Text | Annotated[list[_Text], Field(max_length=4)] | None = None
    seed: StrictInt | None = None
    presence_penalty: _Num | None = Field(None, ge=-2, le=2)
    frequency_penalty: _Num | None = Field(None, ge=-2, le=2)
    document: StrictStr | None = Field(None, description="polykv: id of a shared document (prefix).")
    ignore_eos: StrictBool | None = Field(False, description="polykv: keep generating past EOS.")
    speculative: StrictStr | dict[str, Any] | None = Field(
        None, description='polykv: speculative decoding over the document, {"method": "prompt_lookup" | '
                          '"suffix_tree", "num_draft_tokens": k} or "method[:k]" (lossless; stats in usage).')


class CompletionRequest(_Sampling):
    prompt: _Text | list[StrictInt] | list[_Text] = Field(
        ..., description="A string, a list with one string, or a list of token ids.")
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None


class _ContentPart(_Body):
    type: Literal["text"]
    text: _Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: _Text | list[_ContentPart] | None = None
    name: StrictStr | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None


class DocumentRequest(_Body):
    text: _Text = Field(..., min_length=1, description="Document text (the shared prefix).")
    name: StrictStr | None = Field(None, max_length=200)


def message_text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(p.text for p in m.content)


def _unused(*_: Any) -> None:  # keep linters quiet about re-exported typing names
    pass
