"""Generate code_prompts.jsonl: needles that are random strings (codes, numbers, passwords, hex ids).

Why: names and 7-digit "magic numbers" in a novel (make_needles.py, ruler niah) are recalled under
compressed V where an arbitrary string is not: a model that half-remembers a digit combination or a
hyphenated password answers with a plausible wrong string (issue K). This set asks for exactly such
strings, in technical prose and in the novel, at three context lengths.

Deterministic and model-free: ``python polykv/data/make_codes.py`` rewrites ``code_prompts.jsonl``
beside this file byte for byte (``make(seed=0)``; ``polykv eval ruler --task codes --seed S`` builds
``make(S)`` in memory). Per context length (1024, 2048, 4096 nominal tokens) 16 prompts: each of the
8 code kinds twice, depths 0..1 spread evenly and shuffled over the kinds, filler alternating between
technical prose (tech_prose.txt, 2 of 3) and Pride and Prejudice (1 of 3). The filler is
``round(ctx * WORDS_PER_TOKEN)`` words of consecutive paragraphs from a random start (SmolLM2: ~1.38
tokens per word in both texts, so the chat prompt stays under ``ctx`` tokens); one fact sentence is
inserted between paragraphs at the depth.

Each line: ``{"id", "context", "question", "needle", "prefix", "kind", "genre", "ctx", "depth"}``;
``needle`` is the code, ``prefix`` a RULER-style answer prefix. The lines are also a valid
``--prompts`` file for ``polykv eval equiv`` (it reads context, question, needle).
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
CTXS = (1024, 2048, 4096)
PER_CTX = 16
WORDS_PER_TOKEN = 0.64

_WORDS = ("amber", "anchor", "basil", "birch", "canvas", "cedar", "cobalt", "copper", "delta", "ember",
          "falcon", "fennel", "garnet", "harbor", "hazel", "indigo", "juniper", "kettle", "lantern",
          "maple", "marble", "meadow", "nickel", "orchid", "pepper", "quartz", "raven", "saffron",
          "spruce", "thistle", "tulip", "velvet", "walnut", "willow", "yarrow", "zephyr")
_HEX = "0123456789abcdef"
_ALNUM_UP = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no I/O/0/1: unambiguous when read back


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10 ** n))


def _password(rng: random.Random) -> str:
    a, b, c = rng.sample(_WORDS, 3)
    return f"{a}-{rng.randrange(10, 100)}-{b}-{c}"


# kind -> (code maker, labels). A label is what the question asks for; every kind has several.
KINDS: dict[str, tuple] = {
    "number": (lambda r: _digits(r, 8),
               ["the account number of the build farm", "the order number of the replacement disks",
                "the ticket number of the network outage", "the badge number of the night operator"]),
    "combination": (lambda r: "-".join(f"{r.randrange(100):02d}" for _ in range(4)),
                    ["the combination of the cable locker", "the door code of the north stairwell",
                     "the combination of the tape safe", "the unlock sequence of the server cage"]),
    "password": (_password,
                 ["the Wi-Fi password of the test lab", "the passphrase of the backup archive",
                  "the password of the staging database", "the password of the shared mailbox"]),
    "hex": (lambda r: "".join(r.choice(_HEX) for _ in range(12)),
            ["the API key of the metrics service", "the commit hash of the release build",
             "the device ID of the temperature sensor", "the fingerprint of the signing key"]),
    "serial": (lambda r: "-".join("".join(r.choice(_ALNUM_UP) for _ in range(4)) for _ in range(3)),
               ["the licence key of the compiler suite", "the serial number of the spare power supply",
                "the activation code of the document scanner", "the asset tag of the storage array"]),
    "token": (lambda r: "".join(r.choice(string.ascii_letters + string.digits) for _ in range(10)),
              ["the temporary password of the admin account", "the recovery token of the mail server",
               "the invitation code of the review board", "the one-time code of the payroll login"]),
    "uuid": (lambda r: "-".join("".join(r.choice(_HEX) for _ in range(n)) for n in (8, 4, 4)),
             ["the request ID of the failed upload", "the session ID of the broken deployment",
              "the trace ID of the slow query", "the job ID of the nightly export"]),
    "address": (lambda r: f"10.{r.randrange(256)}.{r.randrange(256)}.{r.randrange(1, 255)}:{r.randrange(1024, 65536)}",
                ["the address of the fallback proxy", "the address of the licence server",
                 "the address of the backup gateway", "the address of the metrics collector"]),
}

# fact sentence around "<label> is <code>."; the question and answer prefix do not depend on it
_FRAMES = ("Note for the operators: {label} is {code}.", "For the record, {label} is {code}.",
           "Important: {label} is {code}. Keep it safe.", "Please remember that {label} is {code}.")


def paragraphs(text: str) -> list[str]:
    """Paragraphs reflowed onto one line (header lines "#...", short lines and chapter headings
    dropped)."""
    out = []
    for block in text.split("\n\n"):
        if block.lstrip().startswith("#"):
            continue
        p = " ".join(block.split())
        if len(p.split()) < 8 or p.lower().startswith("chapter "):
            continue
        out.append(p)
    return out


def _filler(rng: random.Random, paras: list[str], words: int) -> list[str]:
    """Paragraphs in order from a random start, about `words` words (never more): a paragraph that
    would overshoot is skipped while the filler is under 85 % of its length, else the filler ends."""
    start = rng.randrange(len(paras))
    out, n = [], 0
    for i in range(start, start + len(paras)):
        p = paras[i % len(paras)]
        if n + len(p.split()) > words:
            if n >= 0.85 * words:
                break
            continue
        out.append(p)
        n += len(p.split())
    return out


def make(seed: int = SEED, ctxs=CTXS, per_ctx: int = PER_CTX) -> list[dict]:
    """The prompt set (see the module docstring); per_ctx: prompts per context length."""
    rng = random.Random(seed)
    texts = {"tech": paragraphs((HERE / "tech_prose.txt").read_text(encoding="utf-8")),
             "novel": paragraphs((HERE / "pride_and_prejudice.txt").read_text(encoding="utf-8"))}
    kinds = list(KINDS)
    rows = []
    for ctx in ctxs:
        depths = [i / max(1, per_ctx - 1) for i in range(per_ctx)]
        rng.shuffle(depths)
        for i in range(per_ctx):
            kind = kinds[i % len(kinds)]
            maker, labels = KINDS[kind]
            code, label = maker(rng), rng.choice(labels)
            genre = "novel" if i % 3 == 2 else "tech"
            body = _filler(rng, texts[genre], round(ctx * WORDS_PER_TOKEN))
            pos = round(depths[i] * len(body))
            body.insert(pos, rng.choice(_FRAMES).format(label=label, code=code))
            rows.append({
                "id": f"{ctx}-{i:02d}-{kind}", "context": "\n\n".join(body),
                "question": f"What is {label}? Answer with the exact value only.",
                "needle": code, "prefix": f"{label[0].upper()}{label[1:]} is", "kind": kind,
                "genre": genre, "ctx": ctx, "depth": round(pos / (len(body) - 1), 3),
            })
    return rows


def dumps(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "code_prompts.jsonl")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    rows = make(args.seed)
    with open(args.out, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(dumps(rows))
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
