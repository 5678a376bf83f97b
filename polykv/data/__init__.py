"""Bundled public-domain / original data (see SOURCES.md): the perplexity corpus, the demo
document and questions, and the needle prompt set."""

from __future__ import annotations

import json
from importlib import resources


def _path(name: str):
    return resources.files(__name__).joinpath(name)


def read_text(name: str) -> str:
    return _path(name).read_text(encoding="utf-8")


def corpus_text() -> str:
    """Pride and Prejudice (Jane Austen, 1813; public domain): the default perplexity corpus."""
    return read_text("pride_and_prejudice.txt")


def demo_document() -> str:
    return read_text("demo_document.md")


def demo_questions() -> list[dict]:
    """[{question, answer}] whose answers appear literally in the demo document."""
    return json.loads(read_text("demo_questions.json"))


def needle_prompts() -> list[dict]:
    """[{context, question, needle}]: the default logit-equivalence prompt set."""
    return [json.loads(line) for line in read_text("needle_prompts.jsonl").splitlines() if line.strip()]
