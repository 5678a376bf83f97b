"""KVCache: a transformers `Cache` whose layers hold only compressed (packed) K/V.

    cache = KVCache(model, k="q8_0", v="turbo3")            # switches the model to "polykv" attention
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)

Each attention layer owns a `polykv.cache.CompressedLayer`. `update(k, v, layer_idx)` encodes the
new rows into it and marks this cache active; the "polykv" attention function then calls
`attend(...)`, the materialize path (DESIGN §4): the layer's past rows are decoded to the compute
dtype (a transient, per-call workspace), the exact new rows of this chunk are appended, and
transformers' own SDPA attention runs with the mask transformers built (the "polykv" mask function
is `sdpa_mask`, so the mask is the SDPA one: a 4D boolean mask, or None where SDPA's `is_causal`
applies). For turbo K/V the attention runs in the rotated domain: q is rotated once, stored rows are
read as centroid x norm, and the output is inverse-rotated once.

Sliding-window layers (Gemma-3 local layers) mirror `DynamicSlidingWindowLayer` exactly: after a
chunk has attended, only the newest `sliding_window - 1` rows are kept, and `get_mask_sizes` /
`get_seq_length` report the same numbers, so the masks transformers builds match.

InnerQ (DESIGN §3) applies only when K is a turbo type: keys are stored as K*s, queries use q/s.
`innerq="auto"` loads the table calibrated for this model from `polykv.paths.cache_dir("innerq")`
(see `polykv.hf.capture.calibrate_innerq`), when one exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache import CompressedLayer, HeadGroupedLayer, RecentRing, storage_bytes
from ..codecs import CODEC_NAMES, CodecError, InnerQTable, check_codec_name, get_codec
from ..codecs.rotation import rotate, unrotate
from .attention import activate, use_polykv_attention
from .fingerprint import innerq_path
from .layout import UnsupportedModelError, kv_layout


@dataclass(frozen=True)
class LayerLayout:
    """KV shape of one attention layer, read from the model config."""

    index: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None


FUSED_MAX_QUERIES = 8
"""On CUDA, attention for at most this many new queries per sequence runs the fused decode kernel;
larger chunks (prefill) take the materialize path (DESIGN §4 gate)."""



def _fused_available(query: torch.Tensor) -> bool:
    """CUDA always takes the fused path (`dispatch` runs the reference there when forced, so the
    switch compares kernel and reference on the same packed data); CPU only under the Triton
    interpreter (tests)."""
    if query.is_cuda:
        return True
    from ..kernels import dispatch

    return dispatch.use_triton(query)


def left_padding(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """int32 [B]: index of each sequence's first attended key row, from transformers' 4D boolean
    mask [B, 1, q_len, kv_len] (its last query row; left padding only), computed on the device
    without a host sync. None when there is no mask (no padding)."""
    if attention_mask is None:
        return None
    return attention_mask[:, 0, -1, :].to(torch.int8).argmax(-1).to(torch.int32)


def model_layout(model_or_config) -> list[LayerLayout]:
    """Per-layer KV layout of a decoder-only transformers model (or its config).

    Supports models whose layers are all "full_attention" / "sliding_attention" (Llama, Gemma-3,
    Qwen2, Mistral, ...). Anything else raises UnsupportedModelError."""
    config = getattr(model_or_config, "config", model_or_config)
    name = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"unsupported architecture {name!r}: encoder-decoder models are not "
                                    "supported; KVCache serves decoder-only attention models")
    try:
        config = config.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001 - configs without sub-configs
        pass
    n_layers = getattr(config, "num_hidden_layers", None)
    n_heads = getattr(config, "num_attention_heads", None)
    if not n_layers or not n_heads:
        raise UnsupportedModelError(
            f"unsupported architecture {name!r}: the config has no num_hidden_layers / "
            "num_attention_heads; KVCache serves decoder-only attention models (llama, gemma3, ...)")
    if any(getattr(config, a, None) for a in ("kv_lora_rank", "attention_chunk_size")):
        raise UnsupportedModelError(f"unsupported architecture {name!r}: MLA / chunked attention "
                                    "layers are not supported")
    if getattr(config, "num_kv_shared_layers", None):
        raise UnsupportedModelError(f"unsupported architecture {name!r}: KV-shared layers are not "
                                    "supported")
    try:  # the project-wide layout (layer types, use_sliding_window, ...)
        specs = kv_layout(model_or_config)
    except ValueError as e:
        raise UnsupportedModelError(f"unsupported architecture {name!r}: {e}") from None
    return [LayerLayout(s.index, int(s.num_kv_heads), int(s.head_dim),
                        None if s.sliding_window is None else int(s.sliding_window)) for s in specs]


def _resolve_innerq(innerq, model, k: str) -> InnerQTable | None:
    if innerq is None:
        return None
    if isinstance(innerq, InnerQTable):
        table = innerq
    elif innerq == "auto":
        path = innerq_path(model)
        if not path.exists():
            return None
        table = InnerQTable.load(path)
    elif isinstance(innerq, (str, Path)):
        if not Path(innerq).exists():
            raise FileNotFoundError(f"InnerQ table not found: {innerq}")
        table = InnerQTable.load(innerq)
    else:
        raise TypeError(f"innerq must be None, 'auto', a path or an InnerQTable, got {type(innerq).__name__}")
    return table


class PolyKVLayer(CacheLayerMixin):
    """One attention layer of a KVCache: a CompressedLayer, nothing dense kept between calls.

    head_types: [kv_heads] (k, v) pairs when the layer's heads differ in type (`k` / `v` are then
    ignored): the layer stores a `polykv.cache.HeadGroupedLayer` and attends in true space on the
    materialize path, group by group on the fused one (`_decode_stored`); `k_codec` / `v_codec` are
    None; k_type / v_type list the heads' types joined by ",". A list of one pair for every head is
    the uniform layer."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, layout: LayerLayout, k: str, v: str, key_scales: torch.Tensor | None = None,
                 device=None, recent: int = 0, head_types=None):
        super().__init__()
        self.layout = layout
        if head_types is not None:
            head_types = tuple((str(hk), str(hv)) for hk, hv in head_types)
            if len(head_types) != layout.num_kv_heads:
                raise ValueError(f"layer {layout.index}: {len(head_types)} head types for "
                                 f"{layout.num_kv_heads} KV heads")
            if len(set(head_types)) == 1:
                (k, v), head_types = head_types[0], None
        self.head_types = head_types
        if head_types is None:
            self.k_type, self.v_type = k, v
            self.k_codec = get_codec(k, layout.head_dim)
            self.v_codec = get_codec(v, layout.head_dim)
            k_turbo = self.k_codec.rotated
        else:
            self.k_type, self.v_type = (",".join(t[i] for t in head_types) for i in (0, 1))
            self.k_codec = self.v_codec = None
            k_turbo = any(get_codec(hk, layout.head_dim).rotated for hk, _ in head_types)
        if key_scales is not None and not k_turbo:
            key_scales = None  # InnerQ applies only to turbo keys
        if key_scales is not None and tuple(key_scales.shape) != (layout.num_kv_heads, layout.head_dim):
            raise ValueError(f"InnerQ table for layer {layout.index} has shape {tuple(key_scales.shape)}, "
                             f"expected ({layout.num_kv_heads}, {layout.head_dim}): calibrated for "
                             "another model?")
        self.key_scales = key_scales
        self.device = None if device is None else torch.device(device)
        self.is_sliding = layout.sliding_window is not None
        self.sliding_window = layout.sliding_window
        self.cumulative_length = 0
        self.store: CompressedLayer | None = None
        self._past_rows = 0  # rows that were stored before the latest update (what `attend` decodes)
        self._trim_pending = False
        # recent window (polykv.cache.ring): a sliding layer's ring never outgrows what it keeps
        recent = int(recent)
        if recent < 0:
            raise ValueError(f"recent must be >= 0, got {recent}")
        self.recent = min(recent, self.sliding_window - 1) if self.is_sliding else recent
        self.ring: RecentRing | None = None
        self._ring_pending: tuple | None = None  # (k, v, first position) not yet in the ring

    def __repr__(self):
        ring = f", recent={self.recent}" if self.recent else ""
        return f"PolyKVLayer({self.k_type}/{self.v_type}, sliding={self.sliding_window}{ring})"

    @property
    def mixed(self) -> bool:
        """The layer's KV heads are stored at different types (`head_types`)."""
        return self.head_types is not None

    def attends_rotated(self, rotated_attention: bool = True) -> tuple[bool, bool]:
        """(k_rot, v_rot): whether the materialize path attends to K (V) in its codec's rotated
        domain. A mixed layer's heads are stored in different domains: true space for both."""
        if self.mixed:
            return False, False
        return rotated_attention and self.k_codec.rotated, rotated_attention and self.v_codec.rotated

    # --- transformers layer API ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype = key_states.dtype
        if self.device is None:
            self.device = key_states.device
        b, h = key_states.shape[0], key_states.shape[1]
        if self.mixed:
            self.store = HeadGroupedLayer(self.head_types, self.layout.head_dim, b, self.device,
                                          self.key_scales)
        else:
            self.store = CompressedLayer(self.k_codec, self.v_codec, b, h, self.device, self.key_scales)
        if self.recent:
            self.ring = RecentRing(self.recent, self.layout.head_dim, b, h, self.device)
        self.is_initialized = True

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        lay = self.layout
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ValueError(f"layer {lay.index}: expected K/V [batch, kv_heads, seq, head_dim] of equal "
                             f"shape, got {tuple(key_states.shape)} / {tuple(value_states.shape)}")
        if key_states.shape[-1] != lay.head_dim:
            raise ValueError(f"layer {lay.index}: K/V head_dim {key_states.shape[-1]} does not match the "
                             f"cache layout head_dim {lay.head_dim} (KVCache built for another model?)")
        if key_states.shape[1] != lay.num_kv_heads:
            raise ValueError(f"layer {lay.index}: got {key_states.shape[1]} KV heads, the cache layout "
                             f"has {lay.num_kv_heads} (KVCache built for another model?)")
        if self.store is not None and key_states.shape[0] != self.store.batch:
            raise ValueError(f"layer {lay.index}: batch {key_states.shape[0]} differs from the cache "
                             f"batch {self.store.batch}; use a fresh KVCache per batch")

    def apply_pending_trim(self) -> None:
        """Work an update leaves for after its chunk's attention: the sliding trim and the ring
        write (`flush_ring`)."""
        self.flush_ring()
        if self._trim_pending and self.store is not None:
            self.store.trim(self.sliding_window - 1)
        self._trim_pending = False

    def flush_ring(self) -> None:
        """Write the latest update's rows into the ring. The materialize path flushes after its
        attention (the chunk then reads the R rows before it from the ring and its own rows exact,
        as the simulation did); the fused path before (it reads the chunk's rows stored, so the
        ring then holds them: main [0, L - R) + ring [L - R, L))."""
        if self._ring_pending is not None:
            k, v, first = self._ring_pending
            self._ring_pending = None
            self.ring.write(k, v, first)

    def ring_rows(self) -> int:
        """Positions the ring holds now: the last min(R, positions written to it)."""
        if self.ring is None:
            return 0
        pending = 0 if self._ring_pending is None else self._ring_pending[0].shape[2]
        return min(self.recent, self.cumulative_length - pending)

    def attention_domain(self, k: torch.Tensor, v: torch.Tensor, k_rot: bool, v_rot: bool):
        """True-space rows k, v [B, H, T, D] -> the domain the materialize path attends in: turbo K
        InnerQ-scaled and rotated, turbo V rotated (rotated results are float32; callers cast)."""
        if k_rot:
            if self.key_scales is not None:
                # storage-domain keys are K*s (InnerQ): the query carries 1/s (k_rot: never mixed)
                k = k * self.key_scales.to(device=k.device, dtype=k.dtype)[None, :, None, :]
            k = rotate(k, self.k_codec.group)
        if v_rot:
            v = rotate(v, self.v_codec.group)
        return k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.apply_pending_trim()
        self._past_rows = self.store.length
        k_dev, v_dev = key_states.to(self.device), value_states.to(self.device)
        self.store.append(k_dev, v_dev)
        if self.ring is not None:
            self._ring_pending = (k_dev, v_dev, self.cumulative_length)
        self.cumulative_length += key_states.shape[-2]
        # Sliding layers keep the last window-1 rows, but only after this chunk has attended
        # (the chunk's first queries still see rows that the trim drops).
        self._trim_pending = self.is_sliding
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.cumulative_length + query_length, 0
        w = self.sliding_window
        kv_offset = max(self.cumulative_length - w + 1, 0)
        if self.cumulative_length >= w:
            return w - 1 + query_length, kv_offset
        return self.cumulative_length + query_length, kv_offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        if self.store is not None:
            self.store.truncate(0)
        self.cumulative_length = 0
        self._past_rows = 0
        self._trim_pending = False
        self._ring_pending = None  # the ring's slots hold no position until written again

    def offload(self):  # compressed storage stays where it is
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # legacy: absolute target length
            tokens_to_remove = tokens_to_remove - self.cumulative_length
            if tokens_to_remove >= 0:
                return
        n = abs(tokens_to_remove)
        if n == 0:
            self.apply_pending_trim()
            return
        if self.is_sliding and self.cumulative_length >= self.sliding_window:
            raise RuntimeError("cannot crop a sliding-window layer after the window was reached")
        self.flush_ring()
        self.store.truncate(self.store.length - n)
        self.cumulative_length -= n
        self._past_rows = min(self._past_rows, self.store.length)
        self._refill_ring(n)

    def _refill_ring(self, removed: int) -> None:
        """After `removed` rows were cropped, the positions that re-enter the window had their slots
        overwritten by the removed rows: write them again from the main storage (decoded from the
        layer's codec, true space, then q8_0 — the exact rows are gone, so those rows read at about
        the layer codec's precision until they leave the window)."""
        if self.ring is None:
            return
        end = self.cumulative_length  # full layers (and sliding ones before the window): row = position
        start, stop = max(0, end - self.recent), min(end, end + removed - self.recent)
        if stop > start:
            k, v = self.store.decode_rows(start, stop, torch.float32)
            self.ring.write(k, v, start)

    def _select(self, index: torch.Tensor) -> None:
        if self.store is not None and self.store.capacity:
            self.flush_ring()
            self.store.select_batch(index.to(self.store.device))
            if self.ring is not None:
                self.ring.select_batch(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None and self.store.capacity:
            self._select(torch.arange(self.store.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    # --- polykv ----------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Measured bytes of the main storage and the ring."""
        return storage_bytes(self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        if self.store is None:
            return []
        main = self.store.tensors()
        return main + (self.ring.tensors() if main and self.ring is not None else [])


def _override(entry, lay: LayerLayout) -> tuple[str, str, tuple | None]:
    """(k, v, head_types) of one `overrides` entry: a (k, v) pair, or one pair per KV head."""
    if len(entry) == 2 and all(isinstance(t, str) for t in entry):
        return str(entry[0]), str(entry[1]), None
    heads = tuple(tuple(p) for p in entry)
    if len(heads) != lay.num_kv_heads or any(len(p) != 2 for p in heads):
        raise ValueError(f"overrides[{lay.index}]: expected (k, v) or {lay.num_kv_heads} (k, v) pairs "
                         f"(one per KV head), got {entry!r}")
    return heads[0][0], heads[0][1], heads


def _decode_stored(layer: PolyKVLayer, query: torch.Tensor, rows: int, **kw):
    """`dispatch.attention_decode` of query [B, Hq, n_q, D] over the layer's stored rows [0, rows):
    (out [B, Hq, n_q, D], lse float32 [B, Hq, n_q]). A mixed layer (per-head types) runs one call
    per group of heads: the group's query heads gathered (GQA: q head j reads KV head j // (Hq /
    Hkv)), its own codecs and InnerQ scales, outputs and LSEs scattered back to their heads."""
    from ..kernels import dispatch

    store = layer.store
    sl = (slice(None), slice(None), slice(0, int(rows)))
    if not layer.mixed:
        return dispatch.attention_decode(query, store.k.index(sl), store.v.index(sl), layer.k_codec,
                                         layer.v_codec, k_innerq=layer.key_scales, **kw)
    G = query.shape[1] // store.kv_heads
    out = lse = None
    for _, index, g in store.groups:
        qi = (index[:, None] * G + torch.arange(G, device=index.device)).flatten().to(query.device)
        o, l = dispatch.attention_decode(query.index_select(1, qi), g.k.index(sl), g.v.index(sl), g.k_codec,
                                         g.v_codec, k_innerq=g.key_scales, **kw)
        if out is None:
            out = o.new_empty(o.shape[0], query.shape[1], *o.shape[2:])
            lse = l.new_empty(l.shape[0], query.shape[1], *l.shape[2:])
        out.index_copy_(1, qi, o)
        lse.index_copy_(1, qi, l)
    return out, lse


class KVCache(Cache):
    """A transformers Cache holding every layer's K/V compressed (DESIGN §1, §3).

    k, v:            KV types (polykv.codecs.CODEC_NAMES), e.g. k="q8_0", v="turbo3"; they override
                     `preset` ("default" = K q8_0 / V turbo3, "balanced", "max": polykv.presets).
    innerq:          None | "auto" | path | InnerQTable — key channel scales, used only for turbo K.
    device:          where the compressed storage lives (default: where the K/V come from).
    keep_layers_q8:  the first n and the last n layers store K and V as q8_0.
    overrides:       {layer_index: (k, v)} per-layer types (applied after keep_layers_q8), or
                     {layer_index: [(k, v), ...]} one pair per KV head (per-head types: the layer
                     stores its heads by type, `PolyKVLayer.head_types`; a fused decode runs one
                     kernel per group of heads; DecodeGraph runs such caches eagerly).
    rotated_attention: run turbo K/V attention in the rotated domain (default True).
    precision:       for preset="balanced" / "max" without k= / v=: "auto" (default) takes per-layer
                     types from the model's calibrated precision table when one exists
                     (`polykv.hf.precision`, `polykv calibrate --bits`), None keeps the preset's fixed
                     types; or a table path / PrecisionTable. `self.precision` says which was used
                     ({"source": "calibrated" | "fixed", ...}; None without a preset). k_type / v_type
                     stay the preset's fixed pair; memory_report()["per_layer"] has the real types.
    recent:          R, the recent window (issue K, `polykv.cache.ring`): every layer also holds its
                     last R rows at q8_0, and attention reads those instead of the layer codec's copy
                     (sliding layers: at most window - 1). None takes the preset's R when a preset is
                     named or nothing is (`polykv.presets.recent_for`), 0 with explicit k= / v=.

    Constructing a KVCache switches `model` to the "polykv" attention implementation.
    """

    def __init__(self, model, k: str | None = None, v: str | None = None, innerq=None, device=None,
                 keep_layers_q8: int = 0, rotated_attention: bool = True,
                 overrides: dict[int, tuple[str, str]] | None = None, preset: str | None = None,
                 precision="auto", recent: int | None = None):
        from ..presets import recent_for, resolve
        from .precision import preset_precision

        fixed_by = "explicit k= / v=" if (k is not None or v is not None) else None
        recent = recent_for(preset, k, v, recent)
        k, v, innerq = resolve(preset, k, v, innerq)
        policy, self.precision = preset_precision(model, preset, fixed_by, precision, recent=recent)
        check_codec_name(k)
        check_codec_name(v)
        layout = model_layout(model)
        n = len(layout)
        keep = int(keep_layers_q8)
        if keep < 0 or keep > n:
            raise ValueError(f"keep_layers_q8 must be in [0, {n}], got {keep_layers_q8}")
        table = _resolve_innerq(innerq, model, k)
        layers = []
        for lay in layout:
            kt, vt, heads = _override(policy[lay.index], lay) if policy else (k, v, None)
            if keep and (lay.index < keep or lay.index >= n - keep):
                kt, vt, heads = "q8_0", "q8_0", None
            if overrides and lay.index in overrides:
                kt, vt, heads = _override(overrides[lay.index], lay)
            for hk, hv in heads or ((kt, vt),):
                check_codec_name(hk)
                check_codec_name(hv)
                try:
                    get_codec(hk, lay.head_dim)
                    get_codec(hv, lay.head_dim)
                except CodecError as e:
                    raise CodecError(f"layer {lay.index} (head_dim {lay.head_dim}): {e}") from None
            scales = table.layer(lay.index) if table is not None else None
            layers.append(PolyKVLayer(lay, kt, vt, scales, device, recent, head_types=heads))
        super().__init__(layers=layers)
        self.k_type, self.v_type = k, v
        self.recent = recent
        self.keep_layers_q8 = keep
        self.innerq = table if (table is not None and any(lay.key_scales is not None for lay in layers)) else None
        self.rotated_attention = bool(rotated_attention)
        # (write positions int64 [B, 1], lengths int32 [B], left padding int32 [B] or None) on the
        # device while a captured decode step (polykv.hf.graphs.DecodeGraph) runs: writes and
        # lengths come from device tensors, host bookkeeping is left to the runner
        self._static: tuple | None = None
        use_polykv_attention(model)

    # --- transformers API --------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs):
        if self._static is not None:
            layer = self.layers[layer_idx]
            layer.store.write_at(key_states, value_states, self._static[0])
            if layer.ring is not None:
                layer.ring.write_at(key_states, value_states, self._static[0])
            activate(self)
            return key_states, value_states
        out = self.layers[layer_idx].update(key_states, value_states)
        activate(self)
        return out

    # --- the attention protocol (polykv.hf.attention) -----------------------------------------
    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask, scaling=None, **kwargs) -> torch.Tensor:
        """Materialize path: decode this layer's stored past rows, append the exact new rows
        (`key`/`value`, as returned by `update`), then transformers' SDPA with the given mask."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer: PolyKVLayer = self.layers[module.layer_idx]
        store = layer.store
        if self._static is not None:
            return self._attend_static(layer, query, scaling)
        n_q = query.shape[2]
        if n_q <= FUSED_MAX_QUERIES and _fused_available(query) and (
                layer.ring is None or (n_q <= layer.recent and (n_q == 1 or not layer.is_sliding))):
            # with a ring: the chunk must fit the window (the main segment is then wholly before
            # every query), and a sliding layer's multi-query chunk needs per-query window starts
            # in the main segment that the kernel has no argument for: both take the materialize path
            if query.shape[0] == 1:
                return self._attend_fused(layer, query, scaling)
            if not layer.is_sliding and (attention_mask is None or attention_mask.dtype == torch.bool):
                # a batch: left padding from the mask's last query row, read in the kernel
                return self._attend_fused(layer, query, scaling, left_padding(attention_mask))
        dtype = query.dtype
        k_rot, v_rot = layer.attends_rotated(self.rotated_attention)
        # with a ring, the last r rows before this chunk come from it (q8_0), the rest from the
        # layer's codec; the ring's write of this chunk is still pending (flushed below)
        r = layer.ring_rows()
        past_k, past_v = store.decode_rows(0, layer._past_rows - r, dtype, rotated=(k_rot, v_rot))
        if r:
            end = layer.cumulative_length - n_q  # positions before this chunk
            rk, rv = layer.attention_domain(*layer.ring.decode(end - r, end), k_rot, v_rot)
            past_k = torch.cat([past_k, rk.to(dtype)], dim=2)
            past_v = torch.cat([past_v, rv.to(dtype)], dim=2)
        past_k, past_v = past_k.to(query.device), past_v.to(query.device)
        new_k, new_v = layer.attention_domain(key, value, k_rot, v_rot)
        q = query
        if layer.key_scales is not None and k_rot:
            # (true-space decoding already divides by s, so nothing to do there)
            s = layer.key_scales.to(device=query.device, dtype=dtype)
            q = q / s.repeat_interleave(q.shape[1] // s.shape[0], 0)[None, :, None, :]
        if k_rot:
            q = rotate(q, layer.k_codec.group).to(dtype)
        k_all = torch.cat([past_k, new_k.to(dtype)], dim=2)
        v_all = torch.cat([past_v, new_v.to(dtype)], dim=2)
        out, _ = sdpa_attention_forward(module, q, k_all, v_all, attention_mask, scaling=scaling,
                                        **kwargs)
        del k_all, v_all, past_k, past_v
        if v_rot:
            out = unrotate(out, layer.v_codec.group).to(dtype)
        layer.apply_pending_trim()
        return out

    def _attend_fused(self, layer: "PolyKVLayer", query: torch.Tensor, scaling,
                      kv_start: torch.Tensor | None = None) -> torch.Tensor:
        """Fused decode path (DESIGN §4, Level B): the kernel reads the packed K/V of every stored
        row, including this step's (written compressed by `update`), in-register. Every sequence of
        a batch has the same number of rows (query j at row length - n_q + j); kv_start int32 [B]
        marks each one's left padding (rows before it are not keys)."""
        store = layer.store
        if layer.ring is not None:
            layer.flush_ring()  # the ring holds this step's rows too: main [0, L - R) + ring [L - R, L)
            out = self._attend_ring(layer, query, scaling, store.length, layer.cumulative_length,
                                    kv_start)
            layer.apply_pending_trim()
            return out
        out, _ = _decode_stored(layer, query, store.length, causal=True, sm_scale=scaling,
                                window=layer.sliding_window, kv_start=kv_start)
        layer.apply_pending_trim()
        return out.transpose(1, 2)

    def _attend_ring(self, layer: "PolyKVLayer", query: torch.Tensor, scaling, rows, end,
                     kv_start: torch.Tensor | None) -> torch.Tensor:
        """Fused attention of a layer with a ring, as two segments merged by LSE: the main storage's
        rows [0, rows - R) in the layer's codec, every one before every query (n_q <= R, checked
        by the gate), so not causal; and the ring's R slots gathered in position order (q8_0, true
        space), causal, with query j at position end - n_q + j. rows / end: the stored rows and
        positions (equal for full layers; a sliding layer stores only its last rows, and a
        single query sees all of them) — host ints, or int32 [B] device tensors in a captured step.
        kv_start int32 [B]: left padding, in rows = positions (full layers)."""
        from ..kernels import dispatch

        store, ring, R = layer.store, layer.ring, layer.recent
        main_len = rows - R
        rk, rv, first = ring.ordered(end)  # row i = position first + i; rows at positions < 0 unwritten
        if isinstance(end, torch.Tensor):
            ring_start = (-first).clamp_min(0) if kv_start is None else (kv_start - first).clamp_min(0)
            ring_start = ring_start.to(torch.int32)
        elif kv_start is None:
            ring_start = None if first >= 0 else torch.full((query.shape[0],), -first, dtype=torch.int32,
                                                            device=query.device)
        else:
            ring_start = (kv_start - first).clamp_min(0).to(torch.int32)
        out_r, lse_r = dispatch.attention_decode(
            query, rk, rv, ring.codec, ring.codec, causal=True, sm_scale=scaling, kv_start=ring_start)
        if isinstance(main_len, torch.Tensor):
            out_m, lse_m = dispatch.attention_decode(
                query, store.k, store.v, layer.k_codec, layer.v_codec,
                kv_lens=main_len.clamp_min(0).to(torch.int32), causal=False, sm_scale=scaling,
                k_innerq=layer.key_scales, kv_start=kv_start)
        elif main_len > 0:
            out_m, lse_m = _decode_stored(layer, query, main_len, causal=False, sm_scale=scaling,
                                          kv_start=kv_start)
        else:
            return out_r.transpose(1, 2)
        out, _ = dispatch.merge_attention(out_m, lse_m, out_r, lse_r)
        return out.transpose(1, 2)

    def _attend_static(self, layer: "PolyKVLayer", query: torch.Tensor, scaling) -> torch.Tensor:
        """Fused decode over the whole reserved capacity with lengths read from the device (the
        captured step: no host-side slicing by length)."""
        from ..kernels import dispatch

        store = layer.store
        if layer.ring is not None:  # lengths stay device tensors: ring order gathered on the device
            lens = self._static[1]
            return self._attend_ring(layer, query, scaling, lens, lens, self._static[2])
        out, _ = dispatch.attention_decode(
            query, store.k, store.v, layer.k_codec, layer.v_codec, kv_lens=self._static[1],
            causal=True, sm_scale=scaling, window=None, k_innerq=layer.key_scales,
            kv_start=self._static[2])
        return out.transpose(1, 2)

    # --- polykv extras -----------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.tensors()]

    def nbytes(self) -> int:
        """Measured KV bytes (DESIGN §7): untyped storage of every KV tensor, each storage once."""
        return storage_bytes(self.tensors())

    def compact(self) -> None:
        """Shrink every layer's storage to exactly its rows (drops growth slack)."""
        for layer in self.layers:
            layer.apply_pending_trim()
            if layer.store is not None:
                layer.store.compact()

    def memory_report(self) -> dict:
        """Measured bytes: kv_bytes (allocated storage, the recent rings included), kv_bytes_used
        (payload of stored rows and of the rings' written slots), bits_per_value (used bytes x 8 /
        values stored in the layers' codecs: a ring's rows are second copies), per-layer detail."""
        per_layer, used, values = [], 0, 0
        for layer in self.layers:
            st = layer.store
            rows = 0 if st is None else st.length
            u = 0 if st is None else st.used_nbytes()
            ring_used = 0 if layer.ring is None else layer.ring.used_nbytes(layer.ring_rows())
            vals = 0 if st is None else 2 * st.batch * st.kv_heads * rows * st.head_dim
            used += u + ring_used
            values += vals
            row = {"layer": layer.layout.index, "k": layer.k_type, "v": layer.v_type,
                   "sliding_window": layer.sliding_window, "rows": rows,
                   "bytes": layer.nbytes(), "bytes_used": u + ring_used}
            if layer.mixed:
                row["head_types"] = [list(t) for t in layer.head_types]
            if layer.ring is not None:
                row.update(recent=layer.recent, ring_bytes=layer.ring.nbytes())
            per_layer.append(row)
        return {
            "k": self.k_type, "v": self.v_type, "keep_layers_q8": self.keep_layers_q8, "recent": self.recent,
            "innerq": self.innerq is not None, "precision": self.precision, "layers": len(self.layers),
            "tokens": self.get_seq_length(), "kv_bytes": self.nbytes(), "kv_bytes_used": used,
            "bits_per_value": (used * 8 / values) if values else None, "per_layer": per_layer,
        }

    def __repr__(self):
        ring = f", recent={self.recent}" if self.recent else ""
        return (f"KVCache(k={self.k_type!r}, v={self.v_type!r}, layers={len(self.layers)}, "
                f"tokens={self.get_seq_length()}, bytes={self.nbytes()}{ring})")


__all__ = ["CODEC_NAMES", "KVCache", "LayerLayout", "PolyKVLayer", "UnsupportedModelError",
           "innerq_path", "model_layout"]
