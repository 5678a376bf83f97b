"""Automatic precision policy (issue K): per-layer K/V types that meet an average bits/value budget.

    table = measure_sensitivity(model, tok, innerq=iq)    # per layer and candidate type: an error
    policy = table.allocate(4.25)                           # per-layer (k, v) types, <= 4.25 bits/value
    cache = KVCache(model, overrides=policy.overrides(), innerq=iq)
    table.save(precision_path(model))                       # KVCache(model, preset="balanced") loads it

Measurement. Calibration tokens (`calibration_ids`: the *end* of the bundled novel; perplexity
windows are cut from its start) are split into a prefix (default 1024 tokens) and a scored part
(default 256). The prefix runs once through the model into a plain DynamicCache (exact float32 K/V,
post-RoPE, as KVCache encodes them). Then, for every layer l and every candidate type t of K (resp. V),
layer l's stored prefix K (resp. V) is replaced by its round trip through a `CompressedLayer` of type t
(InnerQ scales included for turbo K, exactly what KVCache stores), every other layer and the other
half of the pair stay exact, and the scored part is run once against that prefix. The error is the
mean over scored tokens of KL(p_exact || p_test) in nats, p over the full vocabulary: how much the
model's next-token distribution moves when only that layer's K (or V) is stored as t. Codec error
alone is flat across layers (docs/quality.md, "What hurts"); what differs is how much each layer's
output depends on it, which only an end-to-end measurement sees. Cost: one scored forward per
(layer, type) — SmolLM2 (30 layers, 6 types, 256 scored tokens): 180 forwards, ~4 min on 1 CPU thread.

Signals. The measurement above on novel text ("novel") does not see copy fidelity: the calibrated
presets kept perplexity but lost random codes that f16 copied (docs/quality.md). With
`copy_weight` > 0 (`polykv calibrate --copy-weight W`) the same per-layer, per-type measurement also
runs on needle-style prompts (`copy_examples`: `make_codes.make(COPY_SEED)`, COPY_SEED = 1, never the
evaluated seed 0; 1024 tokens of technical prose with one random code, the chat question and answer
prefix as the stored prefix; the exact code and "." teacher-forced as the scored part): "copy" = mean
KL over those answer positions. The table's errors combine the two:

    err[l][t] = total_novel * sum_s w_s * err_s[l][t] / total_s,   w = {novel: 1 - cw, copy: cw}

with total_s = err_s of the all-cheapest allocation (sum over layers, K and V): each signal counts by
its weight whatever its scale (SmolLM2: the copy total is 2x the novel one, two thirds of it in the K
of layers 18, 23, 20, 19), and the result stays in the novel signal's nats (cw = 0 gives the
novel-only table exactly). Both signals are saved (meta "signals", "weights");
`PrecisionTable.reweigh(cw)` recombines them without measuring again. Cost: 8 prompts x ~13 answer
tokens per (layer, type), 6-9 min more for SmolLM2 on 1 CPU thread. Measured (docs/quality.md,
"A copying signal in the calibration"): per layer, weights 0.5-1 copied better teacher-forced on
held-out code prompts but did not move the greedy code-needle gate. Per head at weight 0.25 (sessions
15-16, 48 code needles per seed): SmolLM2 max 37/48 on seed 0 (per layer, novel only: 33) and 40/48 =
f16 on seed 2, equivalence 3/24 (4/24); balanced and Gemma-3 (one KV head: per head = per layer) as
good as before on every gate. So `polykv calibrate` measures per head with COPY_WEIGHT = 0.25 unless
told otherwise (`--per-layer`, `--copy-weight 0`).

Allocation (`PrecisionTable.allocate`). Errors are taken as additive over layers and over K/V.
Start with every layer at the cheapest candidate of K and of V; repeatedly apply the upgrade (one
layer's K or V to any costlier candidate) with the largest error reduction per extra bit of the
average, while the average stays within the budget; upgrades that do not reduce the error are never
made. The sequence of upgrades does not depend on the budget, and a budget takes the longest prefix
of it that fits, so a larger budget never gives any layer a cheaper type (monotone in B).

Bits per value: the codecs' real stored bytes (`Codec.bits_per_value` of an encode: codes plus fp16
scales/norms, DESIGN §3) for the layer's head_dim; the average weighs each layer by the values it
holds at `ctx` tokens (kv_heads x head_dim x rows; a sliding layer holds at most window - 1 rows),
i.e. it is the bits/value `KVCache.memory_report()` measures on a ctx-token window.

Per head (`measure_sensitivity(..., per_head=True)`, `polykv calibrate --per-head`). The same
measurement with one row per (layer, KV head): only that head's rows of the layer stored as the type
(meta "kv_heads": the heads of each layer). The allocation is unchanged (rows are units; a head weighs
its share of the layer's values), so the same bits can go to the heads that matter instead of to
whole layers. Its policy's `overrides()` gives {layer: [(k, v) per head]}, which a KVCache stores head
by head (`polykv.cache.HeadGroupedLayer`). A SharedKVPool stores one type per layer: it allocates the
table collapsed to layers (`PrecisionTable.per_layer`: a layer's error is the sum of its heads', as
measured: median ratio 1.02, docs/quality.md "Per-head types, simulated").

A preset that states a ratio (`Preset.ratio`, balanced) pays for its recent ring from the table, per
model (`preset_policy`, `ratio_budget`): the budget is 16 / (ratio x (1 + RATIO_MARGIN)) minus the
ring's bits/value at the gate length (2,048 tokens; `ring_bits`: R q8_0 rows per layer, a sliding layer
min(R, window - 1), over the rows every layer holds), at most `Preset.bits`. One ring costs models
differently: R = 64 adds 0.266 bits/value on SmolLM2 (2,047 rows a layer) and 0.709 on Gemma-3 (15 of
its 18 layers hold 511 rows), so one fixed budget cannot meet one byte gate on both (docs/quality.md,
"Balanced with a ring paid by its table (session 12)").

File (JSON, `precision_path(model)` = the InnerQ table's path with suffix ".precision.json"):
{format "polykv-precision", version 1, model (innerq_key), metric, tokens, prefix, text, innerq,
 ctx, k_types, v_types, layers: [{layer, weight, bits: {type: bits}, k_error: {type: err},
 v_error: {type: err}}] (the combined errors), signals: {novel|copy: {k_error: [...], v_error: [...]}}
 and weights: {novel, copy} (only with the copying signal), policies: {"<bits>": {bits_target, bits_achieved, predicted_error,
 types: [[k, v], ...]}}} — `policies` holds the allocations that `polykv calibrate --bits` asked for.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "polykv-precision"
VERSION = 1
K_TYPES = ("turbo3", "turbo4", "q8_0")  # candidates for K (turbo with InnerQ when a table is given)
V_TYPES = ("turbo2", "turbo3", "turbo4")
PREFIX_TOKENS = 1024
SCORED_TOKENS = 256
COPY_WEIGHT = 0.25   # share of the copying signal (cli calibrate --copy-weight; module doc "Signals")
PER_HEAD = True      # cli calibrate measures per (layer, KV head) unless --per-layer
COPY_PROMPTS = 8     # copying signal: needle-style prompts (one per code kind)
COPY_SEED = 1        # make_codes seed of those prompts; the evaluated set is seed 0 (make_codes.SEED)
COPY_CTX = 1024
CTX = 2048
_EPS = 1e-9


def head_rows(kv_heads) -> list[range]:
    """The rows of each layer in a per-head table (layer-major): kv_heads [2, 3] -> [0:2, 2:5]."""
    out, u = [], 0
    for n in kv_heads:
        out.append(range(u, u + int(n)))
        u += int(n)
    return out


@dataclass(frozen=True)
class Policy:
    """(k, v) types chosen for a bits/value budget: one per layer, or with `kv_heads` (a per-head
    table) one per (layer, KV head), layer-major."""

    bits_target: float
    bits_achieved: float
    predicted_error: float
    types: tuple[tuple[str, str], ...]
    kv_heads: tuple[int, ...] | None = None

    def overrides(self) -> dict[int, tuple[str, str] | list[tuple[str, str]]]:
        """{layer: (k, v)} for `KVCache(..., overrides=...)`; per head, {layer: [(k, v) per head]}
        where a layer's heads differ."""
        if self.kv_heads is None:
            return {i: kv for i, kv in enumerate(self.types)}
        out = {}
        for i, rows in enumerate(head_rows(self.kv_heads)):
            heads = [self.types[r] for r in rows]
            out[i] = heads[0] if len(set(heads)) == 1 else heads
        return out

    def to_json(self) -> dict:
        d = {"bits_target": self.bits_target, "bits_achieved": self.bits_achieved,
             "predicted_error": self.predicted_error, "types": [list(t) for t in self.types]}
        return d if self.kv_heads is None else {**d, "kv_heads": list(self.kv_heads)}

    @classmethod
    def from_json(cls, d: dict) -> "Policy":
        heads = d.get("kv_heads")
        return cls(float(d["bits_target"]), float(d["bits_achieved"]), float(d["predicted_error"]),
                   tuple((str(k), str(v)) for k, v in d["types"]), None if heads is None else tuple(heads))


@dataclass
class PrecisionTable:
    """Measured sensitivity per layer and candidate type, and the allocations made from it.

    bits[l][t]: stored bits/value of type t at layer l's head_dim; weight[l]: values layer l holds
    per K (or V) at `ctx` tokens; k_error[l][t] / v_error[l][t]: the measured error (module docstring).
    """

    bits: list[dict[str, float]]
    weight: list[float]
    k_error: list[dict[str, float]]
    v_error: list[dict[str, float]]
    k_types: tuple[str, ...] = K_TYPES
    v_types: tuple[str, ...] = V_TYPES
    meta: dict = field(default_factory=dict)
    policies: dict[str, Policy] = field(default_factory=dict)
    path: str | None = None

    @property
    def layers(self) -> int:
        """Rows of the table: layers, or (layer, KV head) pairs of a per-head table."""
        return len(self.weight)

    @property
    def kv_heads(self) -> tuple[int, ...] | None:
        """The KV heads of each layer for a per-head table (rows layer-major), else None."""
        heads = self.meta.get("kv_heads")
        return None if heads is None else tuple(int(h) for h in heads)

    def per_layer(self) -> "PrecisionTable":
        """A per-head table collapsed to one row per layer: weights and errors summed over the
        layer's heads (errors add up: module docstring), bits as they are (one head_dim per layer).
        A per-layer table is returned as is."""
        if self.kv_heads is None:
            return self
        rows = head_rows(self.kv_heads)
        k_err = [{t: sum(self.k_error[r][t] for r in rr) for t in self.k_types} for rr in rows]
        v_err = [{t: sum(self.v_error[r][t] for r in rr) for t in self.v_types} for rr in rows]
        meta = {k: v for k, v in self.meta.items() if k not in ("kv_heads", "signals")}
        return PrecisionTable(bits=[self.bits[rr[0]] for rr in rows],
                              weight=[sum(self.weight[r] for r in rr) for rr in rows], k_error=k_err,
                              v_error=v_err, k_types=self.k_types, v_types=self.v_types,
                              meta={**meta, "collapsed": "per_head"}, path=self.path)

    # --- bits --------------------------------------------------------------------------------
    def average_bits(self, types) -> float:
        """Average stored bits/value of per-layer (k, v) types, weighted by the values each layer holds."""
        num = sum(w * (self.bits[i][k] + self.bits[i][v]) for i, (w, (k, v)) in enumerate(zip(self.weight, types)))
        return num / (2 * sum(self.weight))

    def min_bits(self) -> float:
        return self.average_bits([(self._cheapest(i, self.k_types), self._cheapest(i, self.v_types))
                                  for i in range(self.layers)])

    def _cheapest(self, i: int, types) -> str:
        return min(types, key=lambda t: self.bits[i][t])

    # --- allocation ----------------------------------------------------------------------------
    def upgrades(self) -> tuple[list[tuple[str, str]], list[tuple[int, str, str, float]]]:
        """(start, sequence): the cheapest per-layer types and the greedy upgrade sequence
        [(layer, "k"|"v", new type, average bits after)] (module docstring)."""
        start = [(self._cheapest(i, self.k_types), self._cheapest(i, self.v_types)) for i in range(self.layers)]
        cur = [list(kv) for kv in start]
        total_w = 2 * sum(self.weight)
        avg = self.average_bits(start)
        seq = []
        while True:
            best = None  # (ratio, layer, side, type, bits delta)
            for i in range(self.layers):
                for side, types, err in ((0, self.k_types, self.k_error), (1, self.v_types, self.v_error)):
                    now = cur[i][side]
                    for t in types:
                        extra = (self.bits[i][t] - self.bits[i][now]) * self.weight[i] / total_w
                        gain = err[i][now] - err[i][t]
                        if extra <= 0 or gain <= 0:
                            continue
                        if best is None or gain / extra > best[0]:
                            best = (gain / extra, i, side, t, extra)
            if best is None:
                return start, seq
            _, i, side, t, extra = best
            cur[i][side] = t
            avg += extra
            seq.append((i, "kv"[side], t, avg))

    def allocate(self, bits: float) -> Policy:
        """Per-layer types whose average bits/value is <= bits (ValueError when even the cheapest
        types exceed it)."""
        bits = float(bits)
        floor = self.min_bits()
        if bits + _EPS < floor:
            raise ValueError(f"budget {bits:.3f} bits/value is below the cheapest candidates' "
                             f"{floor:.3f} (K {'/'.join(self.k_types)}, V {'/'.join(self.v_types)})")
        start, seq = self.upgrades()
        cur = [list(kv) for kv in start]
        for i, side, t, after in seq:
            if after > bits + _EPS:
                break
            cur[i]["kv".index(side)] = t
        types = tuple((k, v) for k, v in cur)
        err = sum(self.k_error[i][k] + self.v_error[i][v] for i, (k, v) in enumerate(types))
        return Policy(bits, self.average_bits(types), err, types, self.kv_heads)

    def reweigh(self, copy_weight: float) -> "PrecisionTable":
        """The same measurement with another weight of the copying signal (policies dropped); needs a
        table measured with both signals (meta["signals"])."""
        sig = self.meta.get("signals")
        if not sig or "copy" not in sig:
            raise ValueError("this table has no copying signal (calibrate with --copy-weight > 0)")
        weights = {"novel": 1.0 - copy_weight, "copy": float(copy_weight)}
        k, v = combine_errors(self.bits, sig, weights, self.k_types, self.v_types)
        return PrecisionTable(bits=self.bits, weight=self.weight, k_error=k, v_error=v, k_types=self.k_types,
                              v_types=self.v_types, meta={**self.meta, "weights": weights})

    def add_policy(self, bits: float) -> Policy:
        p = self.allocate(bits)
        self.policies[f"{float(bits):g}"] = p
        return p

    # --- file ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, **self.meta,
            "k_types": list(self.k_types), "v_types": list(self.v_types),
            "layers": [{"layer": i, "weight": self.weight[i], "bits": self.bits[i],
                        "k_error": self.k_error[i], "v_error": self.v_error[i]} for i in range(self.layers)],
            "policies": {b: p.to_json() for b, p in self.policies.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> "PrecisionTable":
        if d.get("format") != FORMAT or int(d.get("version", -1)) != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} table (format {d.get('format')!r}, "
                             f"version {d.get('version')!r})")
        rows = sorted(d["layers"], key=lambda r: r["layer"])
        if [r["layer"] for r in rows] != list(range(len(rows))):
            raise ValueError("precision table: layers must be 0..n-1")
        meta = {k: v for k, v in d.items() if k not in ("format", "version", "k_types", "v_types",
                                                         "layers", "policies")}
        return cls(bits=[{t: float(b) for t, b in r["bits"].items()} for r in rows],
                   weight=[float(r["weight"]) for r in rows],
                   k_error=[{t: float(e) for t, e in r["k_error"].items()} for r in rows],
                   v_error=[{t: float(e) for t, e in r["v_error"].items()} for r in rows],
                   k_types=tuple(d["k_types"]), v_types=tuple(d["v_types"]), meta=meta,
                   policies={b: Policy.from_json(p) for b, p in d.get("policies", {}).items()})

    def save(self, path: str | Path) -> Path:
        """Write atomically (temp file + rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        self.path = str(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "PrecisionTable":
        table = cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
        table.path = str(path)
        return table


def precision_path(model) -> Path:
    """Beside the model's InnerQ table: cache_dir("innerq")/<innerq_key>.precision.json."""
    from .fingerprint import innerq_path

    p = innerq_path(model)
    return p.with_name(p.name.removesuffix(".safetensors") + ".precision.json")


def layer_bits(layout, types) -> list[dict[str, float]]:
    """Measured stored bits/value of each type at each layer's head_dim (one encode per shape)."""
    from ..codecs import get_codec

    memo: dict = {}
    out = []
    for lay in layout:
        row = {}
        for t in types:
            if (t, lay.head_dim) not in memo:
                memo[(t, lay.head_dim)] = get_codec(t, lay.head_dim).bits_per_value()
            row[t] = memo[(t, lay.head_dim)]
        out.append(row)
    return out


def layer_weights(layout, ctx: int = CTX) -> list[float]:
    """Values one of K / V holds per layer at ctx tokens (ctx - 1 rows stored; sliding: window - 1)."""
    rows = []
    for lay in layout:
        r = ctx - 1 if lay.sliding_window is None else min(ctx - 1, lay.sliding_window - 1)
        rows.append(float(lay.num_kv_heads * lay.head_dim * max(r, 1)))
    return rows


def calibration_ids(tok, tokens: int, text: str | None = None) -> list[int]:
    """The last `tokens` tokens of `text` (default: the bundled novel, whose start the perplexity
    windows use), with the tokenizer's BOS first when it adds one."""
    if text is None:
        from ..data import corpus_text

        text = corpus_text()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with_special = tok("a")["input_ids"]
    bos = tok.bos_token_id if (tok.bos_token_id is not None and with_special
                               and with_special[0] == tok.bos_token_id) else None
    body = tokens - (bos is not None)
    if len(ids) < body:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than {body}")
    return ([bos] if bos is not None else []) + ids[-body:]


def _roundtrip(keys: torch.Tensor, values: torch.Tensor, k: str, v: str, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [1, heads, S, D] stored as k / v and read back in true space (what KVCache attends to)."""
    from ..cache import CompressedLayer

    s = scales if (scales is not None and k.startswith("turbo")) else None
    store = CompressedLayer.for_types(k, v, keys.shape[-1], keys.shape[0], keys.shape[1], keys.device, s)
    store.append(keys.float(), values.float())
    kd, vd = store.dense(torch.float32)
    return kd.to(keys.dtype), vd.to(values.dtype)


def copy_examples(tok, n: int = COPY_PROMPTS, seed: int = COPY_SEED, ctx: int = COPY_CTX
                  ) -> list[tuple[list[int], int]]:
    """Needle-style copy prompts for the copying signal: [(ids, prefix)] where ids[:prefix] is a chat
    prompt from `make_codes.make(seed)` (a random code in technical prose, question, answer prefix)
    and ids[prefix:] the exact code followed by ".", teacher-forced. seed must not be the bundled
    set's (make_codes.SEED, what `eval ruler --task codes` scores); only technical-prose fillers (the
    generator's novel fillers may overlap the perplexity windows); one prompt per code kind in turn."""
    from ..data.make_codes import KINDS, SEED, make
    from ..eval.common import format_prompt

    if seed == SEED:
        raise ValueError(f"copy calibration seed {seed} is the evaluated code set's (make_codes.SEED)")
    if n < 1:
        raise ValueError(f"copy prompts must be >= 1, got {n}")
    rows = [r for r in make(seed, ctxs=(ctx,), per_ctx=3 * n + 3 * len(KINDS)) if r["genre"] == "tech"]
    picked: list[dict] = []
    while len(picked) < n:  # round robin over kinds, so a handful of prompts covers every kind
        for kind in KINDS:
            r = next((r for r in rows if r["kind"] == kind and r not in picked), None)
            if r is not None and len(picked) < n:
                picked.append(r)
    out = []
    for r in picked:
        prompt = format_prompt(tok, r["context"], r["question"], r["prefix"])
        answer = tok(" " + r["needle"] + ".", add_special_tokens=False)["input_ids"]
        out.append((prompt + answer, len(prompt)))
    return out


def _layer_errors(model, examples, layout, innerq, k_types, v_types, progress: bool, desc: str,
                  per_head: bool = False) -> tuple[list[dict], list[dict], int]:
    """Per layer and candidate type, the mean over scored positions (pooled over examples) of
    KL(p_exact || p_test) when only that layer's prefix K (resp. V) is stored as the type.
    examples: [(ids, prefix)]: ids[:prefix] is the stored prefix, ids[prefix:] the scored part
    (run as one chunk; its own rows exact, as KVCache attends to a chunk). per_head: one entry per
    (layer, KV head) in layer-major order instead, only that head's rows stored as the type (the
    codecs encode each head's rows on their own, so that head's slice of the layer's round trip is
    exactly what it would store). Returns (k_err, v_err, scored positions)."""
    from transformers import DynamicCache

    from ..eval.common import progress as bar

    dev = next(model.parameters()).device
    runs = []  # (cache, scored input, prefix, ref log-probs, ref probs)
    for ids, prefix in examples:
        if not 1 <= prefix < len(ids):
            raise ValueError(f"prefix {prefix} out of range for {len(ids)} tokens")
        x = torch.tensor(ids, device=dev)[None]
        cache = DynamicCache()  # every layer keeps every row, exact
        model(input_ids=x[:, :prefix], past_key_values=cache, use_cache=True, logits_to_keep=1)
        if len(cache.layers) != len(layout):
            raise ValueError(f"captured {len(cache.layers)} cache layers, the layout has {len(layout)}")
        runs.append([cache, x[:, prefix:], prefix, None, None])

    def scored(run) -> torch.Tensor:
        cache, tail, prefix = run[0], run[1], run[2]
        out = model(input_ids=tail, past_key_values=cache, use_cache=True)
        cache.crop(-tail.shape[1])  # negative: a sliding layer (Gemma) refuses an absolute length
        return torch.log_softmax(out.logits[0].float(), -1)

    for run in runs:
        run[3] = scored(run)
        run[4] = run[3].exp()
    positions = sum(run[1].shape[1] for run in runs)
    heads = [lay.num_kv_heads if per_head else 1 for lay in layout]
    first = [sum(heads[:i]) for i in range(len(layout))]  # unit index of layer i's first head
    k_err: list[dict] = [{} for _ in range(sum(heads))]
    v_err: list[dict] = [{} for _ in range(sum(heads))]
    jobs = [(i, side, t) for i in range(len(layout)) for side, types in (("k", k_types), ("v", v_types))
            for t in types]
    for i, side, t in bar(jobs, desc=desc, enabled=progress):
        scales = innerq.layer(i) if innerq is not None else None
        total = [0.0] * heads[i]
        for run in runs:
            layer = run[0].layers[i]
            keys, values = layer.keys, layer.values
            if side == "k":
                rt, _ = _roundtrip(keys, values, t, "f16", scales)
            else:
                _, rt = _roundtrip(keys, values, "f16", t, None)
            for h in range(heads[i]):
                if per_head:
                    sub = (keys if side == "k" else values).clone()
                    sub[:, h] = rt[:, h]
                else:
                    sub = rt
                if side == "k":
                    layer.keys = sub
                else:
                    layer.values = sub
                try:
                    total[h] += float((run[4] * (run[3] - scored(run))).sum())
                finally:
                    layer.keys, layer.values = keys, values
        for h in range(heads[i]):
            (k_err if side == "k" else v_err)[first[i] + h][t] = max(total[h] / positions, 0.0)
    return k_err, v_err, positions


def _cheapest_total(bits, k_err, v_err, k_types, v_types) -> float:
    """Total error of the all-cheapest allocation under one signal (its scale, for combining)."""
    return sum(k_err[i][min(k_types, key=lambda t: bits[i][t])] + v_err[i][min(v_types, key=lambda t: bits[i][t])]
               for i in range(len(k_err)))


def combine_errors(bits, signals: dict, weights: dict, k_types, v_types) -> tuple[list[dict], list[dict]]:
    """The allocation's per-layer error from several measured signals (module docstring, "Signals"):
    sum over signals s of weights[s] * err_s / total_s, total_s = err_s of the all-cheapest allocation
    (so each signal counts by its weight whatever its units), times total_novel (to stay in nats
    comparable with a novel-only table). signals: {name: {"k_error": [...], "v_error": [...]}}."""
    names = [s for s in signals if weights.get(s, 0.0) > 0]
    if not names:
        raise ValueError(f"no signal with a positive weight (signals {sorted(signals)}, weights {weights})")
    totals = {s: _cheapest_total(bits, signals[s]["k_error"], signals[s]["v_error"], k_types, v_types)
              for s in names}
    unit = totals.get("novel") or 1.0
    wsum = sum(weights[s] for s in names)
    out = []
    for side, types in (("k_error", k_types), ("v_error", v_types)):
        rows = []
        for i in range(len(bits)):
            rows.append({t: unit * sum(weights[s] / wsum * signals[s][side][i][t] / max(totals[s], _EPS)
                                       for s in names) for t in types})
        out.append(rows)
    return out[0], out[1]


@torch.inference_mode()
def measure_sensitivity(model, tok, ids: list[int] | None = None, innerq=None, k_types=K_TYPES,
                        v_types=V_TYPES, prefix: int = PREFIX_TOKENS, ctx: int = CTX,
                        progress: bool = False, copy_weight: float = 0.0,
                        copy: list[tuple[list[int], int]] | None = None, per_head: bool = False
                        ) -> PrecisionTable:
    """Per layer and candidate type, the mean KL of the next-token distribution when only that
    layer's K (resp. V) prefix is stored as that type (module docstring). ids: calibration tokens
    (default: `calibration_ids(tok, PREFIX_TOKENS + SCORED_TOKENS)`); innerq: InnerQTable for turbo K.
    copy_weight > 0 also measures the copying signal on `copy` (default `copy_examples(tok)`) and
    the table's errors combine both (`combine_errors`, weights novel 1 - copy_weight, copy copy_weight);
    both signals are kept in meta["signals"] (`PrecisionTable.reweigh` recombines them).
    per_head: one table row per (layer, KV head), layer-major ("Per head" in the module docstring;
    meta "kv_heads" lists each layer's heads): KVCache stores its allocation head by head, a
    SharedKVPool the table collapsed to layers (`PrecisionTable.per_layer`)."""
    from .fingerprint import innerq_key
    from .kv_cache import model_layout

    if not 0.0 <= copy_weight <= 1.0:
        raise ValueError(f"copy_weight must be in [0, 1], got {copy_weight}")
    if ids is None:
        ids = calibration_ids(tok, prefix + SCORED_TOKENS)
    if not 1 <= prefix < len(ids) - 1:
        raise ValueError(f"prefix {prefix} out of range for {len(ids)} calibration tokens")
    layout = model_layout(model)
    bits = layer_bits(layout, set(k_types) | set(v_types))
    weight = layer_weights(layout, ctx)
    if per_head:
        n_h = [lay.num_kv_heads for lay in layout]
        bits = [b for b, n in zip(bits, n_h) for _ in range(n)]
        weight = [w / n for w, n in zip(weight, n_h) for _ in range(n)]
    k_err, v_err, _ = _layer_errors(model, [(ids, prefix)], layout, innerq, k_types, v_types, progress,
                                    "precision: layer x type", per_head)
    meta = {"model": innerq_key(model), "metric": "mean KL(p_f32 || p_test), nats/token",
            "tokens": len(ids), "prefix": prefix, "text": "end of the bundled novel (calibration_ids)",
            "innerq": innerq is not None and bool(getattr(innerq, "scales", None)), "ctx": ctx}
    if per_head:
        meta["kv_heads"] = n_h
    if copy_weight > 0:
        if copy is None:
            copy = copy_examples(tok)
        ck, cv, pos = _layer_errors(model, copy, layout, innerq, k_types, v_types, progress,
                                    "precision: copy, layer x type", per_head)
        signals = {"novel": {"k_error": k_err, "v_error": v_err},
                   "copy": {"k_error": ck, "v_error": cv, "prompts": len(copy), "scored": pos,
                            "text": f"make_codes.make(seed={COPY_SEED}), {COPY_CTX} tokens, technical "
                                    "prose; the code + '.' teacher-forced"}}
        meta["signals"] = signals
        meta["weights"] = {"novel": 1.0 - copy_weight, "copy": copy_weight}
        k_err, v_err = combine_errors(bits, signals, meta["weights"], k_types, v_types)
    return PrecisionTable(bits=bits, weight=weight, k_error=k_err, v_error=v_err,
                          k_types=tuple(k_types), v_types=tuple(v_types), meta=meta)


def load_precision(model, path=None) -> PrecisionTable | None:
    """The table for `model` (path, or `precision_path(model)`), None when there is none. A table
    measured on another model (different innerq_key or layer count) raises ValueError."""
    from .fingerprint import innerq_key
    from .kv_cache import model_layout

    p = Path(path) if path is not None else precision_path(model)
    if not p.exists():
        if path is not None:
            raise FileNotFoundError(f"precision table not found: {p}")
        return None
    table = PrecisionTable.load(p)
    layout = model_layout(model)
    n = len(layout)
    heads = table.kv_heads
    if heads is not None:
        if list(heads) != [lay.num_kv_heads for lay in layout] or sum(heads) != table.layers:
            raise ValueError(f"per-head precision table {p}: kv_heads {list(heads)} ({table.layers} rows) "
                             f"do not match the model's {[lay.num_kv_heads for lay in layout]}")
    elif table.layers != n:
        raise ValueError(f"precision table {p} has {table.layers} layers, the model {n}")
    key = innerq_key(model)
    if path is None and table.meta.get("model") not in (None, key):
        raise ValueError(f"precision table {p} was measured on {table.meta.get('model')}, not {key}")
    return table


def ring_bits(layout, recent: int, ctx: int = CTX) -> float:
    """Bits per stored codec value that a recent ring adds at ctx tokens: every layer holds
    min(R, rows) rows of K and of V at the ring's type (q8_0, its real stored bits at the layer's
    head_dim) beside its rows (ctx - 1; a sliding layer window - 1: `layer_weights`), so ring bytes
    x 8 / codec values — the share `KVCache.memory_report()["bits_per_value"]` measures on top of
    the table's average. SmolLM2 R = 64: 64 x 8.5 / 2,047 = 0.266; Gemma-3 (15 of 18 layers hold 511
    rows) 0.709."""
    from ..cache.ring import RING_TYPE

    if recent <= 0:
        return 0.0
    q8 = layer_bits(layout, (RING_TYPE,))
    weight = layer_weights(layout, ctx)
    num = 0.0
    for lay, w, b in zip(layout, weight, q8):
        rows = w / (lay.num_kv_heads * lay.head_dim)
        num += w * min(recent, rows) / rows * b[RING_TYPE]
    return num / sum(weight)


def ratio_budget(layout, ratio: float, recent: int, ctx: int = CTX, margin: float | None = None) -> float:
    """The table's bits/value budget for held bytes >= ratio x (1 + margin) fewer than f16 at ctx
    tokens with a ring of R rows: 16 / (ratio x (1 + margin)) - ring_bits. Bytes follow from the
    codecs' real stored bits (what the held tensors measure: tests/hf/test_precision.py)."""
    from ..presets import RATIO_MARGIN

    if ratio <= 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    m = RATIO_MARGIN if margin is None else float(margin)
    return 16.0 / (float(ratio) * (1.0 + m)) - ring_bits(layout, int(recent), ctx)


def preset_policy(model, preset_name: str, precision="auto", recent: int | None = None,
                  per_head: bool = True) -> tuple[dict | None, dict]:
    """(overrides or None, info) for a preset: the calibrated table's allocation at the preset's
    budget when the preset has one and a table exists, else None (the preset's fixed types).
    precision: "auto" (precision_path), None (fixed types), a path or a PrecisionTable.
    info: {"source": "calibrated"|"fixed", ...} — what KVCache reports as `precision`.

    The budget: `Preset.bits` for a preset without a ratio (the ring's rows come on top). A preset
    with `Preset.ratio` pays for its ring from the table, per model: budget = `ratio_budget` at the
    gate length (presets.GATE_CTX) for the model's layout and ring R (recent; None: the preset's R),
    at most `Preset.bits`; info records it as bits_target, with the ring's cost ("ring": rows,
    bits/value, ctx) and the expected ratio (16 / (bits_achieved + ring bits)). A budget under the
    table's cheapest types allocates those, and info's ratio_expected says what is held.
    per_head: a per-head table gives per-head overrides (KVCache); False allocates it collapsed to
    layers (`PrecisionTable.per_layer`: a SharedKVPool stores one type per layer)."""
    from ..presets import GATE_CTX, PRESETS, RATIO_MARGIN

    p = PRESETS[preset_name]
    if p.bits is None and p.ratio is None:
        return None, {"source": "fixed", "reason": f"preset {preset_name!r} has no bits budget"}
    if precision is None:
        return None, {"source": "fixed", "reason": "precision=None"}
    if isinstance(precision, PrecisionTable):
        table = precision
    else:
        table = load_precision(model, None if precision == "auto" else precision)
    if table is None:
        return None, {"source": "fixed", "reason": f"no calibrated table at {precision_path(model)} "
                      "(polykv calibrate --bits B)"}
    measured_per_head = table.kv_heads is not None
    if not per_head:
        table = table.per_layer()
    extra: dict = {}
    budget = p.bits
    if p.ratio is not None:
        from .kv_cache import model_layout

        layout = model_layout(model)
        R = p.recent if recent is None else int(recent)
        ring = ring_bits(layout, R, GATE_CTX)
        budget = ratio_budget(layout, p.ratio, R, GATE_CTX)
        if p.bits is not None:
            budget = min(budget, p.bits)
        budget = max(budget, table.min_bits())
        extra = {"ratio_target": p.ratio, "ratio_margin": RATIO_MARGIN, "bits_cap": p.bits,
                 "ring": {"rows": R, "bits": round(ring, 4), "ctx": GATE_CTX}}
    pol = table.allocate(budget)
    info = {"source": "calibrated", "path": table.path, "bits_target": round(pol.bits_target, 4),
            "bits_achieved": round(pol.bits_achieved, 4), "types": [list(t) for t in pol.types]}
    if measured_per_head:  # types: one pair per (layer, head) when per_head, else per layer
        info["per_head"] = pol.kv_heads is not None
    if extra:
        info.update(extra)
        info["ratio_expected"] = round(16.0 / (pol.bits_achieved + ring), 4)
    return pol.overrides(), info


def preset_precision(model, preset: str | None, fixed_by: str | None, precision="auto",
                     recent: int | None = None, per_head: bool = True) -> tuple[dict | None, dict | None]:
    """What a cache, pool or eval command built with `preset=` stores: (None, None) without a preset;
    the preset's fixed pair when the caller fixed types by hand (`fixed_by` says how, e.g.
    "explicit k= / v=": info {"source": "fixed", "reason": fixed_by}); else `preset_policy` (recent:
    the cache's ring R when it is not the preset's; None: the preset's)."""
    if preset is None:
        return None, None
    if fixed_by:
        return None, {"source": "fixed", "reason": fixed_by}
    return preset_policy(model, str(preset), precision, recent, per_head)


def policy_summary(policy: Policy) -> dict:
    """JSON fields of a policy for the CLI: bits_target, bits_achieved, per-layer types (per
    (layer, head) for a per-head policy: each entry also has "head")."""
    counts: dict[str, int] = {}
    for k, v in policy.types:
        counts[f"{k}/{v}"] = counts.get(f"{k}/{v}", 0) + 1
    rows = [{"layer": i} for i in range(len(policy.types))]
    if policy.kv_heads is not None:
        rows = [{"layer": i, "head": h} for i, n in enumerate(policy.kv_heads) for h in range(n)]
    return {"bits_target": policy.bits_target, "bits_achieved": round(policy.bits_achieved, 4),
            "predicted_error": policy.predicted_error,
            "layer_types": [{**r, "k": k, "v": v} for r, (k, v) in zip(rows, policy.types)],
            "type_counts": counts}


__all__ = ["COPY_PROMPTS", "COPY_WEIGHT", "COPY_SEED", "CTX", "K_TYPES", "PER_HEAD", "PREFIX_TOKENS", "SCORED_TOKENS", "V_TYPES", "Policy", "PrecisionTable",
           "calibration_ids", "combine_errors", "copy_examples", "head_rows", "layer_bits", "layer_weights", "load_precision", "measure_sensitivity",
           "policy_summary", "precision_path", "preset_policy", "preset_precision", "ratio_budget", "ring_bits"]
