"""Generation toolkit shared by the pool, the engine and the quality harness: which token ids end a
generation, how the next token is chosen, where a stop string cuts the text.

* `stop_token_ids(tok, model)`: the one EOS rule.
* `choose_tokens`: the per-request sampling rule (greedy, temperature, top-k, top-p), every row with
  its own parameters and seed, vectorised on the logits' device with a counter-based RNG
  (`gumbel_noise`); `SamplingRows` holds those per-row parameters as device tensors
  (`AgentBatch.set_sampling` / `step_tokens`: the engine's decode step).
* `SamplingParams` / `Sampler`: a request's parameters, its seed and token counter (engine; the
  host-logits path of batches without `step_tokens`, same draws as `choose_tokens`).
* `find_stop` / `StopChecker`: stop strings over finished or streamed text.

Pure torch (no transformers at import); tokenizers are duck-typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError

__all__ = ["END_OF_TURN_TOKENS", "Sampler", "SamplingParams", "SamplingRows", "StopChecker", "choose_tokens",
           "find_stop", "greedy_ids", "gumbel_noise", "hash32", "is_greedy", "sample_token",
           "stop_token_ids"]

#: Chat end-of-turn markers (ChatML, Gemma, Llama-3). A chat model closes its answer with one of these
#: even where its configs name another EOS (Gemma-3's tokenizer says <eos>; an answer ends with
#: <end_of_turn>), and decoding skips them as special tokens, so generating past one produces text
#: the model means as a new turn.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>")


# --------------------------------------------------------------------------------------------
# EOS
# --------------------------------------------------------------------------------------------


def stop_token_ids(tok, model=None) -> frozenset[int]:
    """The token ids that end a generation: the union of the tokenizer's `eos_token_id`, the model's
    `generation_config.eos_token_id` and (text) `config.eos_token_id` (each an int or a list), and
    every `END_OF_TURN_TOKENS` marker the tokenizer's vocabulary has."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    for src in (getattr(tok, "eos_token_id", None), getattr(gen, "eos_token_id", None),
                getattr(cfg, "eos_token_id", None)):
        for x in (src if isinstance(src, (list, tuple)) else [src]):
            if isinstance(x, int) and not isinstance(x, bool):
                ids.add(int(x))
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    ids.update(int(vocab[t]) for t in END_OF_TURN_TOKENS if t in vocab)
    return frozenset(ids)


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------


def is_greedy(temperature: float | None, top_k: int | None = 0) -> bool:
    """Greedy (argmax, no random draw): temperature <= 0 (or None) or top_k == 1."""
    return temperature is None or temperature <= 0 or top_k == 1


# Per-request sampling on the device. Every row has its own parameters and a counter-based random
# stream: the noise of token `index` of a request is a pure function of (seed, index, vocabulary id),
# so a seeded request draws the same tokens whatever rows run beside it, in whichever slot, and on
# every re-run. The draw is Gumbel-max: argmax(logits / T + G) with G = -log(-log(u)) over the
# filtered vocabulary picks token i with probability softmax(logits / T)_i. The integer hash is exact
# int64 arithmetic (identical on CPU and CUDA); the float steps (log, division) may differ between
# devices in the last ulp, which can only matter on exact near-ties. These sequences differ from the
# earlier per-request `torch.Generator` draws (the contract is reproducibility, not the sequence).

_M32 = 0xFFFF_FFFF


def top_k_row(top_k: int | None) -> int:
    """top_k as a sampling row stores it (int64): 0 (off) for None, <= 0, or more than any
    vocabulary could hold (top-k over the whole vocabulary filters nothing)."""
    k = int(top_k or 0)
    return k if 0 < k < 2**31 else 0


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without int64 overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """int64 tensor -> int64 in [0, 2**32): C. Wellons' lowbias32 of the low 32 bits (a bijection)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 [G] seed halves (32 bits each) and token indices -> float32 [G, vocab] standard Gumbel
    noise, a pure function of (seed, index, vocabulary id) on the seeds' device."""
    row = hash32(hash32(hash32(hash32(seed_lo) ^ (seed_hi & _M32)) ^ (index & _M32)) + 0x632BE5AB)
    col = hash32(torch.arange(vocab, dtype=torch.int64, device=row.device) ^ 0x5BD1E995)
    bits = hash32(hash32(row[:, None] ^ col[None, :]) + row[:, None])
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 exact bits
    return -torch.log(-torch.log(u))


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """int64 [...]: the argmax over the last dim of logits [..., vocab] (the first maximum; NaN
    counts as the maximum, as torch.argmax). float32 on the CPU goes through NumPy: torch's CPU
    argmax measured ~10x slower on the 2-core sandbox (32 x 512: 47 vs 5 us; 32 x 5 x 512: 234 vs
    14 us), the largest single cost of a verify step's host work there. Elsewhere torch.argmax
    (on CUDA inside the captured step)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] > 0:
        return torch.from_numpy(logits.detach().numpy().argmax(-1).astype("int64", copy=False))
    return torch.argmax(logits, dim=-1)


def choose_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor, *, filtered: bool = True,
                  greedy_ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [G, vocab] -> int64 [G] token ids, one vectorised draw per row on the logits' device,
    no host sync. Per row: temperature, top_p float [G]; top_k, seed_lo, seed_hi, index int64 [G].

    Greedy rows (`is_greedy`: temperature <= 0 or top_k == 1) take the argmax of the logits
    (`greedy_ids` when given: the same argmax, computed where the logits were). Others: x = logits /
    T, filtered by top-k (k <= 0: off; ties with the k-th value stay), then top-p over the
    renormalised survivors (the smallest prefix of most likely tokens whose mass reaches top_p; the
    most likely token always stays; one sort per call), then argmax(x + `gumbel_noise`). A row with
    no finite logit left takes the argmax. ``filtered=False`` skips the sort (caller knows no row
    has top-k or top-p).
    """
    x = logits.detach().float()
    best = torch.argmax(x, dim=-1) if greedy_ids is None else greedy_ids
    G, V = x.shape
    greedy = (temperature <= 0) | (top_k == 1)
    x = torch.nan_to_num(x, nan=float("-inf")) / torch.where(greedy, 1.0, temperature.float())[:, None]
    if filtered:
        sx, _ = torch.sort(x, dim=-1, descending=True)
        rank = torch.arange(V, device=x.device)
        k = torch.where((top_k > 0) & (top_k < V), top_k, V)
        sx = sx.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
        probs = torch.softmax(sx, -1)
        keep = (torch.cumsum(probs, -1) - probs < top_p.float()[:, None]) | (rank[None, :] == 0)
        keep |= (top_p >= 1)[:, None]  # off: rounding of the cumulative mass must not drop the tail
        keep &= rank[None, :] < k[:, None]
        n = keep.sum(-1, keepdim=True).clamp(min=1)
        cut = sx.gather(1, n - 1)  # smallest kept value; equal values stay (ties decided by value only)
        x = x.masked_fill(x < cut, float("-inf"))
    drawn = torch.argmax(x + gumbel_noise(seed_lo, seed_hi, index, V), dim=-1)
    ok = torch.isfinite(x.amax(-1))
    return torch.where(greedy | ~ok, best, drawn)


class SamplingRows:
    """Per-slot sampling parameters of a batch, as device tensors (the engine's rows of
    `choose_tokens`): ``f`` float32 [capacity, 2] = (temperature, top_p); ``i`` int64 [capacity, 4]
    = (top_k, seed low 32 bits, seed high 32 bits, index of the slot's next drawn token). Written
    once per admission (`set`) and slot move (`move`); a step reads them and bumps the counters on
    the device (`choose`), so nothing per step on the host grows with the rows."""

    def __init__(self, capacity: int, device):
        self.f = torch.zeros(capacity, 2, dtype=torch.float32, device=device)
        self.i = torch.zeros(capacity, 4, dtype=torch.int64, device=device)

    def reserve(self, capacity: int) -> None:
        n = self.f.shape[0]
        if capacity > n:
            n = max(capacity, 2 * n)
            self.f = torch.cat([self.f, self.f.new_zeros(n - self.f.shape[0], 2)])
            self.i = torch.cat([self.i, self.i.new_zeros(n - self.i.shape[0], 4)])

    def set(self, slot: int, temperature: float, top_p: float, top_k: int, seed: int, start: int = 0) -> None:
        seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        self.reserve(slot + 1)
        self.f[slot] = torch.tensor([float(temperature), float(top_p)])
        self.i[slot] = torch.tensor([top_k_row(top_k), seed & _M32, seed >> 32, int(start)])

    def move(self, src: int, dst: int) -> None:
        self.f[dst] = self.f[src]
        self.i[dst] = self.i[src]

    def choose(self, logits: torch.Tensor, rows, *, filtered: bool = True,
               greedy_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`choose_tokens` for `rows` (a slice, or an int64 index tensor on the device, of slots in
        the order of logits' rows); advances those rows' token counters."""
        ids = self.draw(logits, rows, filtered=filtered, greedy_ids=greedy_ids)
        self.advance(rows)
        return ids

    def draw(self, logits: torch.Tensor, rows, offsets: torch.Tensor | None = None, *, filtered: bool = True,
             greedy_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`choose_tokens` for `rows` (as in `choose`; a slot may repeat) at token index = the slot's
        counter + offsets (int64, one per row; speculative verification draws several columns of one
        slot). The counters are left as they are (`advance`)."""
        f, i = self.f[rows], self.i[rows]
        index = i[:, 3] if offsets is None else i[:, 3] + offsets
        return choose_tokens(logits, f[:, 0], f[:, 1], i[:, 0], i[:, 1], i[:, 2], index, filtered=filtered,
                             greedy_ids=greedy_ids)

    def advance(self, rows, by: torch.Tensor | int = 1) -> None:
        """Move the token counters of `rows` (distinct slots) on by `by` tokens."""
        self.i[rows, 3] += by


@dataclass
class SamplingParams:
    """Decoding parameters of one request (OpenAI semantics).

    ``temperature == 0`` means greedy. ``top_k <= 0`` or ``None`` disables top-k; ``top_p >= 1``
    disables nucleus filtering. ``seed`` keys the request's own random stream (`choose_tokens`;
    ``None``: a seed is drawn once at admission from the global torch RNG, so the request is still
    independent of others).
    ``ignore_eos``: generate past `stop_token_ids`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens must be a positive integer")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise InvalidRequestError("temperature must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature, self.top_k)


def sample_token(logits: torch.Tensor, params: SamplingParams) -> int:
    """One token id from a ``[vocab]`` logits vector under ``params``: a fresh `Sampler`'s first
    draw (``params.seed``, or a random one)."""
    return Sampler(params)(logits)


class Sampler:
    """A request's sampling state: parameters, a seed (``params.seed``, or drawn once from the global
    torch RNG) and the index of its next token. Draws are `choose_tokens`' (a batch of one row on the
    logits' device): a seeded request gives the same tokens whatever else runs beside it, and the
    same as a batch's `SamplingRows` set with (params, ``seed``, ``index``)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        self.index = 0

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        dev = logits.device
        ints = torch.tensor([[top_k_row(p.top_k), self.seed & _M32, self.seed >> 32, self.index]], device=dev)
        tok = choose_tokens(logits.reshape(1, -1), torch.tensor([float(p.temperature)], device=dev),
                            torch.tensor([float(p.top_p)], device=dev), *ints.unbind(1),
                            filtered=top_k_row(p.top_k) > 0 or p.top_p < 1.0)
        self.index += 1
        return int(tok[0])


# --------------------------------------------------------------------------------------------
# stop strings
# --------------------------------------------------------------------------------------------


def find_stop(text: str, stops) -> int:
    """Index of the earliest occurrence of any stop string in `text`; -1 when there is none."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


class StopChecker:
    """Incremental stop-string detection over streamed text.

    ``push(delta) -> (emit, stopped)``: the text that is safe to send now and whether a stop string
    was found. Text that could be the start of a stop string is held back until it can be decided;
    the stop string itself is never emitted. ``flush()`` returns whatever is still held back.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        cut = find_stop(text, self.stops)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return text[:cut], True
        # hold back the longest suffix that is a proper prefix of some stop string
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.stopped else out
