"""Shared helpers of the quality harness: bundled data, prompt formatting, cache construction,
greedy / teacher-forced decoding over a KVCache."""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

import torch

DATA = "polykv.data"


def data_path(name: str) -> Path:
    return Path(str(resources.files(DATA).joinpath(name)))


def load_text(text: str | Path | None = None) -> str:
    """The text to evaluate: a file path, a literal string (when it is not a path), or the bundled
    Pride and Prejudice when None."""
    if text is None:
        return data_path("pride_and_prejudice.txt").read_text(encoding="utf-8")
    p = Path(text) if isinstance(text, Path) or (isinstance(text, str) and len(text) < 4096
                                                    and "\n" not in text) else None
    if p is not None:
        if not p.exists():
            raise FileNotFoundError(f"text file not found: {text}")
        return p.read_text(encoding="utf-8", errors="replace")
    return str(text)


def load_prompts(prompts: str | Path | list | None = None) -> list[dict]:
    """Needle prompts: a JSONL path ({context, question, needle} per line), a list of such dicts, or
    the bundled needle_prompts.jsonl when None."""
    if isinstance(prompts, list):
        rows = prompts
    else:
        path = data_path("needle_prompts.jsonl") if prompts is None else Path(prompts)
        if not path.exists():
            raise FileNotFoundError(f"prompts file not found: {path}")
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from None
    for n, r in enumerate(rows, 1):
        if not isinstance(r, dict) or any(not isinstance(r.get(f), str) for f in ("context", "question", "needle")):
            raise ValueError(f"prompt {n}: expected a JSON object with string fields context, question, "
                             f"needle; got {str(r)[:120]!r}")
    if not rows:
        raise ValueError("no prompts")
    return rows


def uses_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def format_prompt(tok, context: str, question: str, answer_prefix: str = "") -> list[int]:
    """Token ids of a recall prompt: the chat template (one user message "<context>\\n\\n<question>",
    generation prompt added) when the tokenizer has one (SmolLM2-Instruct), else a plain completion
    prompt "<context>\\n\\nQuestion: <question>\\nAnswer:" (Gemma-3 base). `answer_prefix` (RULER
    style) is appended after the generation prompt / "Answer:"."""
    if uses_chat_template(tok):
        msgs = [{"role": "user", "content": context + "\n\n" + question}]
        ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])
        if answer_prefix:
            ids += tok(answer_prefix, add_special_tokens=False)["input_ids"]
        return ids
    tail = " " + answer_prefix if answer_prefix else ""
    return list(tok(context + "\n\nQuestion: " + question + "\nAnswer:" + tail)["input_ids"])


def make_cache(model, k: str, v: str, innerq=None, keep_layers_q8: int = 0, overrides=None, anchors=None,
               recent: int = 0):
    """overrides: {layer: (k, v)} per-layer types (e.g. a preset's calibrated precision policy);
    anchors: a simulation on the cache under test (measurement only; None: a KVCache) —
    polykv.eval.anchors.Anchors (anchor rows; no ring); or polykv.eval.heads.HeadTypes, per-head types
    stored for real (not a simulation: they replace `overrides`, the ring kept); recent: R, the recent
    window held as storage (`KVCache(..., recent=R)`)."""
    from ..hf.kv_cache import KVCache
    from .heads import HeadTypes

    if isinstance(anchors, HeadTypes):
        overrides, anchors = anchors.overrides(), None
    if anchors is not None:
        from .anchors import AnchoredKVCache

        return AnchoredKVCache(model, k=k, v=v, innerq=innerq, keep_layers_q8=keep_layers_q8,
                               overrides=overrides, anchors=anchors, recent=recent)
    return KVCache(model, k=k, v=v, innerq=innerq, keep_layers_q8=keep_layers_q8, overrides=overrides,
                   recent=recent)


def is_f16_reference(k: str, v: str, keep_layers_q8: int = 0, overrides=None, anchors=None, recent: int = 0) -> bool:
    """The cache `make_cache` builds from these arguments is the f16 reference itself (so a run of it
    is its own reference): f16 K and V with nothing that stores rows otherwise (q8_0 edge layers,
    per-layer or per-head types, simulated anchors / outliers, a recent window)."""
    return (k, v) == ("f16", "f16") and not keep_layers_q8 and not overrides and anchors is None and not recent


def model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def prefill(model, cache, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Run the prompt into the cache; returns float32 logits [vocab] of the last position."""
    x = torch.as_tensor(ids, device=model_device(model)).reshape(1, -1)
    out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


@torch.inference_mode()
def decode_steps(model, cache, first_logits: torch.Tensor, max_new: int, stop: set[int],
                 force: list[int] | None = None, keep_probs: bool = False):
    """Greedy decoding (or teacher forcing `force`) from a prefilled cache.

    Returns (tokens, probs): tokens chosen/forced; probs float32 [n, vocab] of the distribution at
    every step when keep_probs (the step-t distribution predicts token t)."""
    dev = model_device(model)
    logits, toks, probs = first_logits, [], []
    n = len(force) if force is not None else max_new
    for t in range(n):
        if keep_probs:
            probs.append(torch.softmax(logits.float(), -1))
        nxt = int(force[t]) if force is not None else int(torch.argmax(logits))
        toks.append(nxt)
        if t == n - 1 or (force is None and nxt in stop):
            break
        out = model(input_ids=torch.tensor([[nxt]], device=dev), past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1].float()
    return toks, (torch.stack(probs) if keep_probs else None)


def progress(iterable=None, total=None, desc=None, enabled=True):
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=False,
                dynamic_ncols=True)
