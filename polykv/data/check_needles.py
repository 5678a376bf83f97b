"""Sanity check of needle_prompts.jsonl: does SmolLM2 recall the needles with a plain DynamicCache?

    python polykv/data/check_needles.py [--model smollm2-135m] [--limit N] [--json]

Prompt format (SmolLM2 needs its chat template; plain completion prompts often return nothing):
one user message "<context>\n\n<question>", add_generation_prompt=True, greedy, 24 new tokens.
A prompt counts as recalled when the generated text contains the 7-digit needle. Not a test: it
loads a real model and takes about a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # run from a checkout without installing

from polykv.hf.loading import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description="needle recall check with a plain DynamicCache")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=Path, default=HERE / "needle_prompts.jsonl")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = ap.parse_args()

    from transformers import DynamicCache

    model, tok = load_model(args.model)
    rows = [json.loads(line) for line in args.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    if args.limit:
        rows = rows[: args.limit]

    results = []
    t0 = time.time()
    for i, r in enumerate(rows):
        msgs = [{"role": "user", "content": r["context"] + "\n\n" + r["question"]}]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        n_ctx = enc["input_ids"].shape[1]
        with torch.inference_mode():
            out = model.generate(
                **enc,
                past_key_values=DynamicCache(config=model.config),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        answer = tok.decode(out[0, n_ctx:], skip_special_tokens=True)
        hit = r["needle"] in answer
        results.append({"i": i, "tokens": n_ctx, "depth": r.get("depth"), "hit": hit, "answer": answer})
        if not args.json:
            print(f"{i:2d} tokens={n_ctx:4d} depth={r.get('depth', float('nan')):.2f} "
                  f"{'OK  ' if hit else 'MISS'} {answer!r}", flush=True)

    recalled = sum(r["hit"] for r in results)
    summary = {
        "model": args.model,
        "recalled": recalled,
        "n": len(results),
        "min_tokens": min(r["tokens"] for r in results),
        "max_tokens": max(r["tokens"] for r in results),
        "seconds": round(time.time() - t0, 1),
    }
    if args.json:
        print(json.dumps(dict(summary, rows=results)))
    else:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
