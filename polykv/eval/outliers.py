"""V outlier channels, simulated for measurement (issue K): per layer and KV head, C channels of V held
by one codec at higher bits and the other D - C channels by a second codec at lower bits (the
TurboQuant paper's 2.5 / 3.5-bit split: two independent quantizer instances over channel subsets).

What it is: a KVCache whose storage is per layer, as always (`nbytes()` / `memory_report()` measure
that storage), plus, for every layer whose V is split, that layer's V rows round-tripped as a per-channel
split store would hold them, kept on the side: for head h, the channels `channels[layer][h]` (C of
them) gathered into rows of width C and stored by the `hi` codec, the other D - C gathered into rows of
width D - C and stored by the `lo` codec (`polykv.hf.precision._roundtrip`, true space; each subset
row has its own norm / scales), both read back and scattered to their channels. When the materialize
path (`KVCache.attend`, CPU) decodes the layer's past rows, V is replaced by these side rows, mapped
into the domain the layer attends in (`anchors.attend_decoding`, as `heads.py` does). K is untouched.
The ring (`recent=`), when there is one, is untouched: its rows are q8_0 for all channels, as in a
real cache.

Subset sizes: each subset is a row of its codec, so C and D - C must be widths the codecs accept —
turbo: 32, 64 or a multiple of 128 (the per-group Walsh-Hadamard rotation, `turbo_group_size`); q8_0
/ q4_0: multiples of 32. For head_dim 64 (SmolLM2) that is C = 32 only: half the channels, where the
paper's head_dim 128 takes 32 of 128. A size no codec accepts raises CodecError (no padding).

Channels: chosen once on calibration text (`polykv.hf.precision.calibration_ids`: the corpus' last
tokens, never the perplexity windows, the equivalence prompts or the needles), from the exact V rows of
an f16 forward in the original (unrotated) domain, per layer and KV head: the C channels of largest
`by` = "rms" (sqrt E[v^2]), "mean_abs" (E|v|) or "var" (variance over positions); "first" takes
channels 0..C-1 (a control without selection).

Bits: `outlier_bits` — each layer's V at (C x hi + (D - C) x lo) bits / D, each codec's bits/value
from a real encode at its subset width (`Codec.bits_per_value`: codes and norms / scales), K at its
codec's; so what a split store would hold, derived (no such store exists), with the ring's bits on
top for the f16 / held ratio. Not a storage format: the side rows are float32, sliding layers with a
split and the fused (CUDA) path are refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch

from ..codecs import check_codec_name, get_codec
from ..hf.kv_cache import KVCache
from .anchors import attend_decoding, materialize_only

SELECT = ("rms", "mean_abs", "var", "first")
CALIB_TOKENS = 2048


@dataclass(frozen=True)
class VOutliers:
    c: int = 32  # outlier channels per KV head
    by: str = "rms"  # SELECT
    splits: tuple[tuple[str, str, str], ...] = ()  # (layer V type or "all", hi codec, lo codec)
    tokens: int = CALIB_TOKENS  # calibration tokens for the channel statistics
    channels: tuple | None = field(default=None, compare=False)  # [layer] -> int64 [kv_heads, c], or None
    stats: dict = field(default_factory=dict, compare=False)  # calibration summary (as_dict)

    def __post_init__(self):
        if self.c < 1:
            raise ValueError(f"c must be >= 1, got {self.c}")
        if self.by not in SELECT:
            raise ValueError(f"by={self.by!r}: choose one of {', '.join(SELECT)}")
        if not self.splits:
            raise ValueError("no split: give FROM=HI/LO (FROM a V type or 'all')")
        for src, hi, lo in self.splits:
            if src != "all":
                check_codec_name(src)
            check_codec_name(hi)
            check_codec_name(lo)

    @classmethod
    def parse(cls, spec: str) -> "VOutliers":
        """'c=32,by=rms,tokens=2048,turbo3=turbo3/turbo2,turbo4=turbo4/turbo3' or 'all=turbo3/turbo2':
        FROM=HI/LO splits every layer whose V type is FROM (every layer: 'all') into C channels at HI
        and the rest at LO; c, by, tokens optional."""
        kw: dict = {}
        splits = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, val = part.partition("=")
            key, val = key.strip(), val.strip()
            if not sep:
                raise ValueError(f"v-outliers spec {spec!r}: expected KEY=VALUE, got {part!r}")
            if key in ("c", "tokens"):
                kw[key] = int(val)
            elif key == "by":
                kw[key] = val
            else:
                hi, slash, lo = val.partition("/")
                if not slash:
                    raise ValueError(f"v-outliers spec {spec!r}: {part!r} is not FROM=HI/LO")
                splits.append((key, hi.strip(), lo.strip()))
        return cls(splits=tuple(splits), **kw)

    def split_for(self, v_type: str) -> tuple[str, str] | None:
        """(hi, lo) for a layer stored with V `v_type`, or None (the layer keeps its V)."""
        for src, hi, lo in self.splits:
            if src == "all" or src == v_type:
                return hi, lo
        return None

    def calibrated(self, model, tok, ids: list[int] | None = None) -> "VOutliers":
        """This spec with `channels` chosen on calibration text (module docstring): exact V of an f16
        forward over `ids` (default: calibration_ids(tok, tokens))."""
        from transformers import DynamicCache

        from ..hf.precision import calibration_ids
        from .common import model_device

        if ids is None:
            ids = calibration_ids(tok, self.tokens)
        x = torch.as_tensor(ids, device=model_device(model)).reshape(1, -1)
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        values = [lay.values for lay in cache.layers]
        chans = tuple(select_channels(v, self.c, self.by) for v in values)
        share = [float(channel_energy(v, ch)) for v, ch in zip(values, chans)]
        stats = {"calibration_tokens": len(ids),
                 "energy_share_mean": sum(share) / len(share),  # of E[v^2] in the C channels
                 "energy_share_min": min(share), "energy_share_max": max(share)}
        return replace(self, channels=chans, stats=stats)

    def as_dict(self) -> dict:
        return {"c": self.c, "by": self.by, "tokens": self.tokens,
                "splits": [f"{s}={h}/{lo}" for s, h, lo in self.splits], **self.stats,
                **({"channels": [ch.tolist() for ch in self.channels]} if self.channels is not None else {})}


def select_channels(v: torch.Tensor, c: int, by: str) -> torch.Tensor:
    """Outlier channels of V rows v [B, H, S, D] (original domain): int64 [H, c], sorted, the c
    channels of largest `by` per head (SELECT)."""
    d = v.shape[-1]
    if not 1 <= c < d:
        raise ValueError(f"outlier channels c={c}: need 1 <= c < head_dim {d}")
    x = v.detach().float().transpose(0, 1).reshape(v.shape[1], -1, d)  # [H, B*S, D]
    if by == "first":
        return torch.arange(c).expand(v.shape[1], c).clone()
    score = {"rms": lambda: x.pow(2).mean(1), "mean_abs": lambda: x.abs().mean(1),
             "var": lambda: x.var(1)}[by]()
    return score.topk(c, dim=-1).indices.sort(-1).values


def channel_energy(v: torch.Tensor, chans: torch.Tensor) -> torch.Tensor:
    """Share of sum(v^2) that the channels chans [H, c] hold in v [B, H, S, D]."""
    e = v.detach().float().pow(2).sum((0, 2))  # [H, D]
    return e.gather(1, chans).sum() / e.sum()


def complement(chans: torch.Tensor, d: int) -> torch.Tensor:
    """The other channels: int64 [H, d - c], sorted."""
    keep = torch.ones(chans.shape[0], d, dtype=torch.bool)
    keep.scatter_(1, chans, False)
    return torch.stack([torch.nonzero(r).flatten() for r in keep])


def split_roundtrip(v: torch.Tensor, chans: torch.Tensor, hi: str, lo: str) -> torch.Tensor:
    """V rows v [B, H, S, D] as a split store reads them back (true space, float32): per head h,
    channels chans[h] through `hi`, the others through `lo`, each subset a row of its own."""
    from ..hf.precision import _roundtrip

    b, h, s, d = v.shape
    v = v.float()
    out = torch.empty_like(v)
    for idx, t in ((chans, hi), (complement(chans, d), lo)):
        ix = idx.to(v.device)[None, :, None, :].expand(b, h, s, idx.shape[1])
        sub = v.gather(-1, ix).contiguous()
        _, rt = _roundtrip(sub, sub, "f16", t, None)
        out.scatter_(-1, ix, rt.float())
    return out


class OutlierKVCache(KVCache):
    """KVCache(model, ..., outliers=VOutliers(...).calibrated(model, tok)): module docstring. Other
    arguments as KVCache (overrides: the per-layer types whose V a split replaces)."""

    def __init__(self, model, *args, outliers: VOutliers, **kwargs):
        super().__init__(model, *args, **kwargs)
        if outliers.channels is None:
            raise ValueError("VOutliers without channels: call .calibrated(model, tok) first")
        if len(outliers.channels) != len(self.layers):
            raise ValueError(f"outlier channels for {len(outliers.channels)} layers, the model has {len(self.layers)}")
        self.outliers = outliers
        self._split: dict[int, tuple[str, str]] = {}
        for i, lay in enumerate(self.layers):
            sp = outliers.split_for(lay.v_type)
            if sp is None:
                continue
            if lay.is_sliding:
                raise NotImplementedError(f"layer {i} is sliding: V outliers are simulated on "
                                          "full-attention layers only (rows = positions)")
            ch = outliers.channels[i]
            if tuple(ch.shape) != (lay.layout.num_kv_heads, outliers.c):
                raise ValueError(f"layer {i}: channels {tuple(ch.shape)}, expected "
                                 f"({lay.layout.num_kv_heads}, {outliers.c})")
            d = lay.layout.head_dim
            get_codec(sp[0], outliers.c)  # CodecError when a subset width is not the codec's
            get_codec(sp[1], d - outliers.c)
            self._split[i] = sp
        self._side: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._static is not None:
            raise NotImplementedError("OutlierKVCache simulates on the materialize path only")
        sp = self._split.get(layer_idx)
        if sp is not None:
            rt = split_roundtrip(value_states.detach(), self.outliers.channels[layer_idx], *sp)
            side = self._side.get(layer_idx)
            self._side[layer_idx] = rt if side is None else torch.cat([side, rt], 2)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def attend(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        materialize_only(self, query, "OutlierKVCache simulates V outliers")
        i = module.layer_idx
        if i not in self._split:
            return super().attend(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        layer = self.layers[i]
        store = layer.store
        decode = store.decode_rows
        side = self._side[i]

        def split(start, stop, dtype=torch.float32, rotated=(False, False)):
            k, v = decode(start, stop, dtype, rotated)
            start = max(0, int(start))
            xv = side[:, :, start:start + v.shape[2]]
            _, xv = layer.attention_domain(xv, xv, False, rotated[1] and store.v_codec.rotated)
            return k, xv.to(v.dtype)

        return attend_decoding(self, store, split, module, query, key, value, attention_mask,
                               scaling=scaling, **kwargs)


def outlier_bits(cache: KVCache, outliers: VOutliers) -> dict:
    """Bits/value of `cache`'s layer types with `outliers`' splits (module docstring, "Bits"): V alone
    as stored and as split, and K + V as split; every codec's bits from a real encode at its width.
    Weighted by the values each layer holds per row (kv_heads x head_dim; full-attention layers hold
    the same rows)."""
    k_bits = v_base = v_split = w_all = 0.0
    per_layer = []
    for lay in cache.layers:
        d, w = lay.layout.head_dim, lay.layout.num_kv_heads * lay.layout.head_dim
        bk = get_codec(lay.k_type, d).bits_per_value()
        bv = get_codec(lay.v_type, d).bits_per_value()
        sp = outliers.split_for(lay.v_type)
        if sp is None:
            bs = bv
        else:
            c = outliers.c
            bs = (c * get_codec(sp[0], c).bits_per_value() + (d - c) * get_codec(sp[1], d - c).bits_per_value()) / d
        per_layer.append(round(bs, 4))
        k_bits += w * bk
        v_base += w * bv
        v_split += w * bs
        w_all += w
    return {"v_bits_stored": v_base / w_all, "v_bits_split": v_split / w_all, "k_bits": k_bits / w_all,
            "bits_per_value_stored": (k_bits + v_base) / (2 * w_all),
            "bits_per_value_split": (k_bits + v_split) / (2 * w_all), "v_bits_per_layer": per_layer}


def outlier_fields(r: dict, vo: VOutliers | None, model, k, v, innerq, overrides, recent: int) -> None:
    """The run's JSON with --v-outliers: field 'v_outliers' (the spec, channel statistics, bits/value
    stored and as split, the f16 / held ratio a split store with this ring would reach at 2,048
    tokens, derived); the simulation's 'anchors' field removed."""
    if vo is None:
        return
    from ..hf.kv_cache import model_layout
    from ..hf.precision import ring_bits
    from ..presets import GATE_CTX

    r.pop("anchors", None)
    bits = outlier_bits(KVCache(model, k=k, v=v, innerq=innerq, overrides=overrides, recent=recent), vo)
    rb = ring_bits(model_layout(model), recent, GATE_CTX)
    r["v_outliers"] = {**vo.as_dict(), **bits, "recent": recent, "ring_bits": rb,
                       "ratio_expected_split": 16.0 / (bits["bits_per_value_split"] + rb),
                       "ratio_expected_stored": 16.0 / (bits["bits_per_value_stored"] + rb)}


@contextlib.contextmanager
def attached():
    """Within the block, the eval modules' make_cache builds an OutlierKVCache when passed
    anchors=VOutliers (common.make_cache knows Anchors and HeadTypes only; this wraps the name each
    module bound at import and restores it after)."""
    from . import equiv, ppl, ruler

    mods = (ppl, equiv, ruler)
    orig = [m.make_cache for m in mods]

    def make_cache(model, k, v, innerq=None, keep_layers_q8=0, overrides=None, anchors=None, recent=0):
        if isinstance(anchors, VOutliers):
            return OutlierKVCache(model, k=k, v=v, innerq=innerq, keep_layers_q8=keep_layers_q8,
                                  overrides=overrides, recent=recent, outliers=anchors)
        return orig[0](model, k, v, innerq=innerq, keep_layers_q8=keep_layers_q8, overrides=overrides,
                       anchors=anchors, recent=recent)

    try:
        for m in mods:
            m.make_cache = make_cache
        yield
    finally:
        for m, f in zip(mods, orig):
            m.make_cache = f


__all__ = ["OutlierKVCache", "SELECT", "VOutliers", "attached", "channel_energy", "complement",
           "outlier_bits", "outlier_fields", "select_channels", "split_roundtrip"]
