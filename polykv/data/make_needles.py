"""Generate needle_prompts.jsonl: needle-in-a-haystack prompts over Pride and Prejudice filler.

Deterministic (seeded, no model needed): ``python polykv/data/make_needles.py`` rewrites
``needle_prompts.jsonl`` beside this file byte for byte. Each line is
``{"context", "question", "needle", "depth"}``: ``context`` is a run of consecutive paragraphs of
the novel (530-680 words, about 600-900 SmolLM2 tokens) with one needle sentence inserted between
paragraphs at relative depth ``depth`` (0 = start, 1 = end); ``needle`` is the 7-digit answer.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261201
N_PROMPTS = 20
MIN_WORDS, MAX_WORDS = 530, 680

# (place, thing): distinct keys so no two prompts share a question.
KEYS = [
    ("Ashford", "vault"),
    ("Bramley", "archive"),
    ("Calloway", "strongroom"),
    ("Dunmore", "safe"),
    ("Eversley", "cellar"),
    ("Fairholt", "boathouse"),
    ("Glenridge", "observatory"),
    ("Harrowgate", "chapel"),
    ("Ivybridge", "mill"),
    ("Jessamy", "greenhouse"),
    ("Kingsworth", "armoury"),
    ("Larkspur", "library"),
    ("Mortlake", "granary"),
    ("Northcote", "bell tower"),
    ("Oakhurst", "stables"),
    ("Pennington", "counting house"),
    ("Quarrendon", "ice house"),
    ("Ravensworth", "gatehouse"),
    ("Stanbury", "wine store"),
    ("Thornfield", "dovecote"),
]


def paragraphs(text: str) -> list[str]:
    """Prose paragraphs of the novel, each reflowed onto one line (chapter headings dropped)."""
    out = []
    for block in text.split("\n\n"):
        para = " ".join(block.split())
        if len(para.split()) < 8 or para.lower().startswith("chapter "):
            continue
        out.append(para)
    return out


def make(seed: int = SEED, n: int = N_PROMPTS) -> list[dict]:
    if n > len(KEYS):
        raise ValueError(f"at most {len(KEYS)} prompts (one per key)")
    rng = random.Random(seed)
    paras = paragraphs((HERE / "pride_and_prejudice.txt").read_text(encoding="utf-8"))
    keys = KEYS[:n]
    values = rng.sample(range(1_000_000, 10_000_000), n)
    rows = []
    for i, ((place, thing), value) in enumerate(zip(keys, values)):
        target = rng.randint(MIN_WORDS, MAX_WORDS)
        start = rng.randrange(0, len(paras) - 200)
        chunk, words = [], 0
        for p in paras[start:]:
            if words + len(p.split()) > target and chunk:
                break
            chunk.append(p)
            words += len(p.split())
        depth = i / (n - 1) if n > 1 else 0.5  # spread evenly over 0..1
        pos = round(depth * len(chunk))
        needle = f"The secret code for the {place} {thing} is {value}."
        chunk.insert(pos, needle)
        rows.append(
            {
                "context": "\n\n".join(chunk),
                "question": f"What is the secret code for the {place} {thing}?",
                "needle": str(value),
                "depth": round(pos / (len(chunk) - 1), 3),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "needle_prompts.jsonl")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("-n", type=int, default=N_PROMPTS)
    args = ap.parse_args()
    rows = make(args.seed, args.n)
    with open(args.out, "w", encoding="utf-8", newline="\n") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
