"""SharedKVPool: documents prefilled once, compressed once, shared by many agents.

Lifecycle
* `add_document` prefills the document in chunks through the model with a compressing cache and keeps
  one compressed copy per layer (`CompressedLayer`, batch 1, compacted). Sliding-window layers keep
  only the last window-1 rows (their absolute start position is recorded). The same token ids added
  twice give the same document id (no second prefill).
* Documents are refcounted: every open `AgentBatch` holds one reference.
* Residency tiers (`residency.py`): "gpu" (compressed layers on the pool's device), "host" (in host
  memory, pinned on a CUDA pool; attention streams the prefix in chunks of `stream_chunk_rows`
  rows), "evicted" (token ids only). `gpu_budget_bytes` (old name: `budget_bytes`) bounds the
  GPU-tier documents plus the suffix pages (and prefix-stream buffers) of open batches: while over
  it, the least recently used unreferenced GPU document moves to the host tier when it fits there
  (after dropping host documents used less recently than it), else it is evicted.
  `host_budget_bytes` (None or 0: no host tier) bounds the host-tier documents: over it, LRU
  unreferenced host documents are evicted. A document in use is never moved out of the tier its
  open batches read. Opening a batch on an unreferenced host document promotes it to the GPU when
  it fits the GPU budget once unreferenced GPU documents are demoted (LRU); otherwise the batch
  streams it from the host. Evicted documents keep their token ids; using one again re-prefills it
  exactly (with a `warnings.warn`).
* A closed batch's suffix storage and captured decode steps are parked with its document (one per
  document, `max_parked_batches` in all) and taken over by the next `open_batch` of that document:
  CUDA graphs are captured once per pool and document instead of once per batch (on the H200 a
  capture cost 450-725 ms, about a hundred decode steps). Parked storage is measured
  (memory_report()["kv_bytes_parked"]), counts against gpu_budget_bytes and is the first thing
  dropped under its pressure; new layers for the document (eviction, a tier move, a re-prefill),
  its removal and `close()` drop it.
* All pool state is guarded by an RLock; forwards of different batches run outside the lock.
"""

from __future__ import annotations

import hashlib
import statistics
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from ..cache.accounting import storage_bytes
from ..cache.layer import CompressedLayer
from ..codecs import InnerQTable, check_codec_name, get_codec
from ..errors import DocumentInUseError, PoolError, UnknownDocumentError  # noqa: F401 (re-exported)
from .residency import (document_bytes, gpu_nbytes, host_nbytes, layer_tensors, tier_of, to_device,
                        to_host)

TIERS = ("gpu", "host", "evicted")


class PoolFormatError(ValueError):
    """A saved pool cannot be loaded: wrong format/version, model/tokenizer/codec mismatch,
    corrupted or truncated files."""


@dataclass
class _Document:
    id: str
    name: str | None
    ids: list[int]
    chat: bool = False
    tail: str = ""  # chat: text that closes the user turn after the agent's question
    layers: list | None = None  # CompressedLayer (gpu tier) or HostLayer (host tier); None: evicted
    prefix_start: list[int] = field(default_factory=list)
    refs: int = 0
    last_used: float = 0.0
    naive_f16_bytes: int = 0  # measured bytes of one real f16 DynamicCache of the document
    ngram: object = None  # polykv.spec.NgramIndex over ids (speculative drafts), built at add_document
    outputs: object = None  # polykv.spec.SuffixTree over the outputs of its agents (created on first use)
    parked: object = None  # agents.Parked: a closed batch's storage + captured steps, for the next batch
    step_times: object = None  # polykv.spec.adaptive.StepTimes: measured step times by agents and width

    def __setattr__(self, name, value):
        # a parked batch's captured steps read these very layers: new ones (a tier move, an
        # eviction, a re-prefill) drop it, whichever code path makes them
        if name == "layers" and self.__dict__.get("parked") is not None:
            self.__dict__["parked"] = None
        object.__setattr__(self, name, value)

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def resident(self) -> bool:
        return self.layers is not None

    @property
    def tier(self) -> str:
        """"gpu", "host" or "evicted" (residency.py)."""
        return tier_of(self.layers)

    def tensors(self) -> list[torch.Tensor]:
        return [t for l in self.layers or [] for t in layer_tensors(l)]


def ids_sha256(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


class SharedKVPool:
    """A pool of shared compressed documents for one model (see module doc and DESIGN §5).

    model, tok: a transformers causal LM and its tokenizer (`polykv.load_model()`); the model's
        attention is switched to the "polykv" implementation (which falls back to SDPA for any
        forward without a polykv cache).
    k, v: KV storage types (`polykv.codecs.CODEC_NAMES`), shared prefix and agent suffixes alike;
        they override `preset` ("default" = K q8_0 / V turbo3, "balanced", "max": polykv.presets).
    recent: R, the agents' recent window (issue K, `polykv.pool.ring`): each agent's last R suffix
        rows of every layer are also held at q8_0, and each query reads its own last R rows from
        there (the shared prefix and older suffix rows in the pool's types). None takes the
        preset's R when a preset is named or nothing is (`polykv.presets.recent_for`), 0 with
        explicit k= / v= (as KVCache). The document's tail is never in a window (module doc of
        polykv.pool.ring); `save` records R, `load(..., recent=)` overrides it.
    overrides: {layer_index: (k, v)} per-layer types (`layer_types` lists every layer's pair).
    precision: for preset="balanced" / "max" without k= / v= / overrides=: "auto" (default) takes
        per-layer types from the model's calibrated precision table when one exists (`polykv
        calibrate --bits`, polykv.hf.precision), None keeps the preset's fixed pair, or a table path /
        PrecisionTable; `self.precision` (and memory_report()["precision"]) says which.
    device: where the compressed KV lives (default: the model's device).
    budget_bytes: the old name of gpu_budget_bytes (same meaning; give one, or both equal).
    gpu_budget_bytes: bound on GPU-tier bytes — GPU-tier shared prefixes plus the suffix pages (and
        prefix-stream buffers) of open batches (None: unbounded); documents not in use are demoted
        to the host tier or evicted (LRU) to stay under it (module doc).
    host_budget_bytes: bound on host-tier document bytes (None or 0: no host tier; documents over
        the GPU budget are evicted, as before tiers existed).
    stream_chunk_rows: prefix rows per host chunk (one contiguous host buffer per chunk and layer,
        one host-to-device copy each when a batch streams the document). A multiple of
        `kernels.dispatch.PREFIX_CHUNK_ALIGN` (16,384, the default) makes a streamed document's
        logits those of the GPU-resident one bit for bit (full-attention layers; other sizes
        merge per chunk, equal up to float rounding).
    innerq: an `InnerQTable`, a path to one, or "auto" (the model's calibrated table, if any); used
        only when K is a turbo type.
    prefill_chunk: tokens per prefill forward. Default (None): 4096 where the flash split path of
        `pool/prefill.py` runs — KV on CUDA and a float16/bfloat16 model (the chunking of a plain
        chunked transformers prefill) — else 512: the CPU path's historical size (CPU outputs stay
        what they were), and a CUDA float32 model keeps the masked path, whose [C, L] mask and
        scores grow with the chunk.
    """

    max_parked_batches = 4
    """Closed batches kept for reuse (`open_batch`), at most one per document, least recently
    parked dropped first; 0 turns reuse off. A parked batch holds its suffix pages (measured:
    memory_report()["kv_bytes_parked"], inside gpu_tier_bytes and the GPU budget, dropped first
    under budget pressure) and its captured steps (CUDA graph pools: activations and logits per
    bucket and width — not KV, and not counted, as for open batches). Four covers the documents a
    server alternates between without holding idle graph memory for every document ever used."""

    spec_overlap = True
    """`generate` with speculation overlaps host work with the device's verify step: the step is
    launched (`AgentBatch.launch_verify`), the outputs tree adds the tokens logged so far
    (`Speculator.ahead`) while it runs, then its ids are read. The tree is then read one step late
    (drafts for step t+1 see the outputs of steps <= t-1; docs/speculative.md). False: the
    synchronous order (each step's outputs added before the next drafts), for comparison."""

    def __init__(self, model, tok, k: str | None = None, v: str | None = None, device=None,
                 budget_bytes: int | None = None, innerq=None, prefill_chunk: int | None = None,
                 progress: bool | None = None, preset: str | None = None,
                 gpu_budget_bytes: int | None = None, host_budget_bytes: int | None = None,
                 stream_chunk_rows: int = 16384, overrides: dict[int, tuple[str, str]] | None = None,
                 precision="auto", recent: int | None = None):
        from ..hf.attention import use_polykv_attention
        from ..hf.layout import kv_layout
        from ..presets import recent_for, resolve

        from ..hf.precision import preset_precision

        by_hand = k is not None or v is not None or overrides
        self.recent = recent_for(preset, k, v, recent)
        k, v, innerq = resolve(preset, k, v, innerq)
        # as KVCache.precision: a preset's calibrated or fixed types (None without a preset)
        # one type per layer here: a per-head table is allocated collapsed to layers
        policy, self.precision = preset_precision(model, preset, "explicit k= / v= / overrides=" if by_hand
                                                  else None, precision, recent=self.recent, per_head=False)
        overrides = overrides or policy

        self.model, self.tok = model, tok
        self.k_type, self.v_type = check_codec_name(k), check_codec_name(v)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if budget_bytes is not None and gpu_budget_bytes is not None and budget_bytes != gpu_budget_bytes:
            raise ValueError(f"budget_bytes={budget_bytes} and gpu_budget_bytes={gpu_budget_bytes} differ: "
                             f"budget_bytes is the old name of gpu_budget_bytes, give one")
        self.gpu_budget_bytes = _budget("gpu_budget_bytes", gpu_budget_bytes if gpu_budget_bytes is not None
                                        else budget_bytes)
        self.host_budget_bytes = _budget("host_budget_bytes", host_budget_bytes)
        if int(stream_chunk_rows) < 1:
            raise ValueError(f"stream_chunk_rows must be >= 1, got {stream_chunk_rows}")
        self.stream_chunk_rows = int(stream_chunk_rows)
        if prefill_chunk is None:
            half = getattr(model, "dtype", None) in (torch.float16, torch.bfloat16)
            prefill_chunk = 4096 if self.device.type == "cuda" and half else 512
        self.prefill_chunk = int(prefill_chunk)
        self.progress = progress
        self.layout = kv_layout(model)
        self._windows = [s.sliding_window for s in self.layout]
        # per-layer (K, V) types: the pool's pair, or `overrides` {layer: (k, v)} (a calibrated preset)
        self.layer_types = [tuple(overrides.get(s.index, (self.k_type, self.v_type))) if overrides
                            else (self.k_type, self.v_type) for s in self.layout]
        for i, t in enumerate(self.layer_types):
            if len(t) != 2 or not all(isinstance(x, str) for x in t):
                raise ValueError(f"overrides[{i}]: SharedKVPool stores one (k, v) pair per layer, got {t!r} "
                                 "(per-head types are a KVCache feature)")
        for kt, vt in self.layer_types:
            check_codec_name(kt)
            check_codec_name(vt)
        turbo_k = any(kt.startswith("turbo") for kt, _ in self.layer_types)
        if innerq == "auto" and not turbo_k:
            innerq = None  # InnerQ applies to turbo keys only: no fingerprint, no table lookup
        if innerq == "auto":  # the table calibrated for this model, when there is one
            from ..hf.fingerprint import innerq_path

            path = innerq_path(model)
            innerq = path if path.exists() else None
        if innerq is not None and not isinstance(innerq, InnerQTable):
            innerq = InnerQTable.load(innerq)
        self.innerq = innerq if (innerq is not None and turbo_k) else None
        for s, (kt, vt) in zip(self.layout, self.layer_types):  # fail early on unsupported head_dim
            get_codec(kt, s.head_dim), get_codec(vt, s.head_dim)
        use_polykv_attention(model)
        self._lock = threading.RLock()
        self._docs: dict[str, _Document] = {}
        self._batches: "weakref.WeakSet" = weakref.WeakSet()
        pad = getattr(tok, "pad_token_id", None)
        self._pad_id = int(pad) if pad is not None else 0
        self.peak_agent_bytes = 0
        self.last_generate: dict = {}

    @property
    def budget_bytes(self) -> int | None:
        """The old name of `gpu_budget_bytes` (settable)."""
        return self.gpu_budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int | None) -> None:
        self.gpu_budget_bytes = _budget("budget_bytes", value)

    # --- documents ---------------------------------------------------------------------------
    def add_document(self, text_or_ids, name: str | None = None,
                     chat_template: bool | None = None) -> str:
        """Prefill a document once and store its compressed KV; returns the document id.

        text_or_ids: text, or token ids (list[int], used verbatim as the prefix; prompts are then
            appended as plain tokens). Text with a tokenizer chat template (default chat_template=None
            -> use it when available) becomes the start of the first user message: prefix = the
            rendered template up to the document text + "\\n\\n"; each agent's question continues the
            same user turn (`prompt_ids`).
        """
        ids, chat, tail = self._doc_tokens(text_or_ids, chat_template)
        doc_id = "doc-" + ids_sha256(ids)[:16]
        with self._lock:
            doc = self._docs.get(doc_id)
            if doc is None:
                doc = _Document(doc_id, name, ids, chat, tail)
                self._docs[doc_id] = doc
            if doc.ngram is None:
                from ..spec import NgramIndex

                doc.ngram = NgramIndex(ids)
            elif name and not doc.name:
                doc.name = name
            doc.last_used = time.monotonic()
            if not doc.resident:
                self._prefill(doc)
                self._enforce_budget(keep=doc_id)
        return doc_id

    def _doc_tokens(self, text_or_ids, chat_template: bool | None = None) -> tuple[list[int], bool, str]:
        """(prefix token ids, chat?, tail) of a document (see add_document)."""
        from ..hf.chat import document_split, has_chat_template

        chat, tail = False, ""
        if isinstance(text_or_ids, str):
            if chat_template if chat_template is not None else has_chat_template(self.tok):
                prefix_text, tail = document_split(self.tok, text_or_ids)
                ids = self.tok(prefix_text, add_special_tokens=False)["input_ids"]
                chat = True
            else:
                ids = self.tok(text_or_ids)["input_ids"]
        else:
            if torch.is_tensor(text_or_ids):
                if text_or_ids.dim() == 2 and text_or_ids.shape[0] == 1:  # a tokenizer's [1, T] input_ids
                    text_or_ids = text_or_ids[0]
                if text_or_ids.dim() != 1:
                    raise ValueError(f"document token ids must be a 1-D tensor (or [1, T]), got shape "
                                     f"{tuple(text_or_ids.shape)}")
                text_or_ids = text_or_ids.tolist()
            ids = [int(t) for t in text_or_ids]
        if not ids:
            raise ValueError("empty document")
        return ids, chat, tail

    def remove_document(self, doc: str) -> None:
        """Forget a document. Refuses (DocumentInUseError) while agent batches hold it."""
        with self._lock:
            d = self._doc(doc)
            if d.refs:
                raise DocumentInUseError(f"document {doc!r} is in use by {d.refs} open agent batch(es); "
                                         f"close them before removing it")
            d.parked = None
            del self._docs[doc]

    def documents(self) -> list[dict]:
        """[{id, name, tokens, bytes, refs, resident, tier}] (bytes: measured compressed prefix bytes
        in its tier; tier: "gpu" | "host" | "evicted"; resident: tier != "evicted")."""
        with self._lock:
            return [dict(id=d.id, name=d.name, tokens=d.length, bytes=storage_bytes(d.tensors()),
                         refs=d.refs, resident=d.resident, tier=d.tier) for d in self._docs.values()]

    def evict(self, doc: str) -> None:
        """Drop a document's KV now (keeps its token ids). Refuses while in use."""
        with self._lock:
            d = self._doc(doc)
            if d.refs:
                raise DocumentInUseError(f"document {doc!r} is in use; cannot evict it")
            d.layers = None

    def _doc(self, doc: str) -> _Document:
        try:
            return self._docs[doc]
        except KeyError:
            raise UnknownDocumentError(f"unknown document {doc!r}; known: {sorted(self._docs)}", doc) from None

    def move(self, doc: str, tier: str) -> None:
        """Move a document to `tier` ("gpu", "host" or "evicted") now, whatever the budgets say for
        it; other unreferenced documents are then demoted / evicted (LRU) to fit the budgets.
        Refuses (DocumentInUseError) while agent batches read it."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; tiers: {', '.join(TIERS)}")
        with self._lock:
            d = self._doc(doc)
            if d.refs:
                raise DocumentInUseError(f"document {doc!r} is in use; cannot move it to {tier!r}")
            if tier == "evicted":
                d.layers = None
                return
            if d.layers is None:
                self._prefill(d)
            if tier == "gpu" and d.tier == "host":
                d.layers = to_device(d.layers, self.device)
            elif tier == "host" and d.tier == "gpu":
                d.layers = to_host(d.layers, self.stream_chunk_rows, self.device.type == "cuda")
            self._enforce_budget(fixed=doc)

    def _open_batches(self) -> list:
        return [b for b in list(self._batches) if not b._closed]

    def _tier_tensors(self, tier: str) -> list[torch.Tensor]:
        return [t for d in self._docs.values() if d.tier == tier for t in d.tensors()]

    def _gpu_tier_bytes(self) -> int:
        """What gpu_budget_bytes bounds, measured: GPU-tier documents + suffix pages and stream
        buffers of open and parked batches."""
        batches = [t for b in self._open_batches() for t in b.cache.tensors() + b.cache.buffer_tensors()]
        parked = [t for p in self._parked() for t in p.tensors()]
        return storage_bytes(self._tier_tensors("gpu") + batches + parked)

    def _enforce_budget(self, keep: str | None = None, fixed: str | None = None) -> None:
        """Fit both budgets (module doc). keep: moved last (to the host tier only, never evicted);
        fixed: never moved."""
        self._fit_gpu(keep=keep, fixed=fixed)
        self._fit_host(fixed=fixed or keep)

    def _fit_gpu(self, keep: str | None = None, fixed: str | None = None, extra: int = 0,
                 host_release: int = 0) -> bool:
        """Demote / evict unreferenced GPU documents, least recently used first (`keep` last, only
        to the host, `fixed` never) until GPU-tier bytes + `extra` fit gpu_budget_bytes.
        host_release: host bytes about to be freed (a promotion in progress). False if it cannot."""
        budget = self.gpu_budget_bytes
        if budget is None:
            return True
        while True:
            total = self._gpu_tier_bytes() + extra
            if total <= budget:
                return True
            parked = self._parked()
            if parked:  # parked batches go first: dropping one costs captures later, not a prefill
                self._docs[parked[0].doc_id].parked = None
                continue
            victims = sorted((d for d in self._docs.values()
                              if d.tier == "gpu" and d.refs == 0 and d.id != fixed),
                             key=lambda d: (d.id == keep, d.last_used))
            v = victims[0] if victims else None
            if v is not None and self._demote(v, host_release):
                continue
            if v is None or v.id == keep:
                warnings.warn(f"polykv pool: {total} GPU-tier bytes exceed gpu_budget_bytes={budget}, and no "
                              f"other document can make room (none is left, or the others are in use)", stacklevel=4)
                return False
            v.layers = None

    def _demote(self, d: _Document, host_release: int = 0) -> bool:
        """Move GPU document `d` to the host tier if it fits host_budget_bytes once host documents
        used less recently than `d` (unreferenced) are evicted; evicts those it needs. False (nothing
        changed) if it cannot fit."""
        budget = self.host_budget_bytes or 0
        need = host_nbytes(d.layers, self.stream_chunk_rows)
        free = budget - (storage_bytes(self._tier_tensors("host")) - host_release)
        older = sorted((h for h in self._docs.values()
                        if h.tier == "host" and h.refs == 0 and h.last_used <= d.last_used),
                       key=lambda h: h.last_used)
        sizes = [document_bytes(h.layers) for h in older]
        if need > free + sum(sizes):
            return False
        for h, n in zip(older, sizes):
            if need <= free:
                break
            h.layers = None
            free += n
        d.layers = to_host(d.layers, self.stream_chunk_rows, self.device.type == "cuda")
        return True

    def _fit_host(self, fixed: str | None = None) -> None:
        """Evict unreferenced host documents (LRU; `fixed` never) while the host tier exceeds
        host_budget_bytes."""
        budget = self.host_budget_bytes or 0
        while True:
            total = storage_bytes(self._tier_tensors("host"))
            if total <= budget:
                return
            victims = sorted((d for d in self._docs.values()
                              if d.tier == "host" and d.refs == 0 and d.id != fixed),
                             key=lambda d: d.last_used)
            if not victims:
                warnings.warn(f"polykv pool: {total} host-tier bytes exceed host_budget_bytes={budget}, "
                              f"but every other host document is in use", stacklevel=4)
                return
            victims[0].layers = None

    def _promote(self, d: _Document) -> bool:
        """Bring unreferenced host document `d` to the GPU tier if it fits gpu_budget_bytes once
        unreferenced GPU documents are demoted; False (d stays in the host tier) otherwise."""
        need = gpu_nbytes(d.layers)
        if self.gpu_budget_bytes is not None:
            batches = [t for b in self._open_batches() for t in b.cache.tensors() + b.cache.buffer_tensors()]
            pinned = storage_bytes([t for x in self._docs.values() if x.tier == "gpu" and x.refs
                                    for t in x.tensors()] + batches)
            if pinned + need > self.gpu_budget_bytes:
                return False
            if not self._fit_gpu(fixed=d.id, extra=need, host_release=document_bytes(d.layers)):
                return False
        d.layers = to_device(d.layers, self.device)
        return True

    # --- prefill -----------------------------------------------------------------------------
    def _new_layers(self, batch: int = 1) -> list[CompressedLayer]:
        out = []
        for s, (kt, vt) in zip(self.layout, self.layer_types):
            # InnerQ scales turbo keys only (as KVCache): a calibrated preset mixes q8_0 K layers in
            scales = self.innerq.layer(s.index) if self.innerq is not None and kt.startswith("turbo") else None
            out.append(CompressedLayer.for_types(kt, vt, s.head_dim, batch, s.num_kv_heads, self.device,
                                                 scales))
        return out

    def _add_document_with_f16(self, text_or_ids, name: str | None = None, chat_template=None):
        """(doc id, the real f16 DynamicCache built during this document's prefill) — for
        benchmarks that allocate naive per-agent copies. Always prefills (drops a resident copy)."""
        ids, chat, tail = self._doc_tokens(text_or_ids, chat_template)
        doc_id = "doc-" + ids_sha256(ids)[:16]
        with self._lock:
            doc = self._docs.get(doc_id) or _Document(doc_id, name, list(ids), chat, tail)
            if doc.refs:
                raise DocumentInUseError(f"document {doc_id!r} is in use")
            self._docs[doc_id] = doc
            doc.last_used = time.monotonic()
            out = []
            self._prefill(doc, shadow_out=out)
            self._enforce_budget(keep=doc_id)
        return doc_id, out[0]

    @torch.no_grad()
    def _prefill(self, doc: _Document, shadow_out: list | None = None) -> None:
        """Prefill and compress `doc`. With `shadow_out`, a real f16 DynamicCache receives the same
        rows during the prefill (benchmarks deep-copy it into naive agents) and is appended to it;
        otherwise the naive f16 figure is measured afterwards one layer at a time (bounded memory:
        no whole f16 copy of the document ever exists)."""
        from .agent_cache import dummy_mask
        from .prefill import F16DynamicCache, PrefillCache

        layers = self._new_layers()
        shadow = F16DynamicCache(config=self.model.config) if shadow_out is not None else None
        cache = PrefillCache(layers, self._windows, shadow)
        ids = torch.tensor(doc.ids, dtype=torch.long)
        n, C = len(doc.ids), self.prefill_chunk
        starts = range(0, n, C)
        show = self.progress if self.progress is not None else n > 4 * C
        if show:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc=f"prefill {doc.name or doc.id}", unit="chunk")
        for a in starts:
            b = min(n, a + C)
            cache.begin_chunk(a)
            chunk = ids[a:b][None].to(self.device)
            self.model(input_ids=chunk, position_ids=torch.arange(a, b, device=self.device)[None],
                       attention_mask=dummy_mask(1, b - a, self.device), past_key_values=cache,
                       use_cache=True, logits_to_keep=1)
            cache.end_chunk(b)
        for l in layers:
            l.compact()
        doc.layers, doc.prefix_start = layers, list(cache.start_abs)
        if shadow is None:
            doc.naive_f16_bytes = self._naive_f16_bytes(layers)
        else:
            doc.naive_f16_bytes = storage_bytes(
                [t for lay in shadow.layers for t in (getattr(lay, "keys", None), getattr(lay, "values", None))
                 if isinstance(t, torch.Tensor)])
            if shadow_out is not None:
                shadow_out.append(shadow)
            del shadow

    @torch.no_grad()
    def _naive_f16_bytes(self, layers: list[CompressedLayer]) -> int:
        """Bytes of one real f16 transformers DynamicCache of the document, measured layer by layer:
        each layer's rows (decoded from the compressed store) go through that layer's own
        DynamicCache layer (its sliding-window rule included), its tensors are measured, then freed.
        Sliding layers count window-1 rows: the steady state. (Right after a one-chunk prefill a
        DynamicSlidingWindowLayer still pins the whole chunk's storage through a view, so this is the
        smaller, conservative naive figure.)"""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        total = 0
        for i, layer in enumerate(layers):
            k, v = layer.dense(torch.float16)
            lay = cache.layers[i]
            lay.update(k, v)
            total += storage_bytes([lay.keys, lay.values])
            lay.keys = lay.values = None
            del k, v
        return total

    # --- agents ------------------------------------------------------------------------------
    def open_batch(self, doc: str, capacity: int | None = None, seq_capacity: int | None = None,
                   backend: str = "auto", graphs: bool = True, promote: bool = True):
        """An `AgentBatch` over `doc` (holds a reference until closed). An evicted document is
        re-prefilled from its token ids (warns). capacity / seq_capacity: initial agent slots and
        suffix rows to allocate (grown on demand). graphs: replay captured CUDA graphs for decode
        steps where supported (CUDA, full-attention layers; host-tier documents too).
        promote: bring an unreferenced host-tier document to the GPU tier when it fits (module
        doc); False: the batch streams it from the host (the offload benchmark, tests)."""
        from .agents import AgentBatch

        with self._lock:
            d = self._doc(doc)
            d.last_used = time.monotonic()
            if not d.resident:
                warnings.warn(f"polykv pool: document {doc!r} ({d.name or 'unnamed'}, {d.length} tokens) "
                              f"was evicted; re-prefilling it", stacklevel=2)
                self._prefill(d)
                self._enforce_budget(keep=doc)  # may go straight to the host tier
            elif d.tier == "host" and d.refs == 0 and promote:
                self._promote(d)
            d.refs += 1
            parked = self._unpark(d, capacity, backend, graphs)
            try:
                batch = AgentBatch(self, d, capacity, seq_capacity, backend, graphs, parked=parked)
            except BaseException:
                d.refs -= 1
                raise
            self._batches.add(batch)
            self._enforce_budget(keep=doc)
            return batch

    def _unpark(self, d: _Document, capacity: int | None, backend: str, graphs: bool):
        """The document's parked batch (`max_parked_batches`) if a new batch can take it over: same
        backend and graphs setting, built over the document's current layers, at least `capacity`
        slots (fewer would reallocate the page table and drop every captured step: a fresh batch is
        as good, and the larger one is parked when it closes). Taken out: one batch owns it."""
        p = d.parked
        if p is None or p.backend != backend or p.graphs_on != bool(graphs) or p.cache.doc_layers is not d.layers:
            return None
        if capacity is not None and p.cache.batch_capacity < capacity:
            return None
        d.parked = None
        if self.gpu_budget_bytes is not None and self._gpu_tier_bytes() + p.nbytes() > self.gpu_budget_bytes:
            # over the budget with it parked (a budget set or lowered since): a fresh batch holds
            # only what its agents need, as if the parked one had been dropped under pressure
            return None
        return p

    def _release(self, batch, parked=None) -> None:
        """A batch closed: drop its reference; park its storage and captured steps (`parked`,
        agents.Parked) for the next batch of the document when the pool keeps any — replacing a
        parked one with fewer slots — within `max_parked_batches` (least recently parked dropped)
        and the GPU budget."""
        with self._lock:
            self._batches.discard(batch)
            d = self._docs.get(batch.doc_id)
            if d is not None and d.refs > 0:
                d.refs -= 1
                d.last_used = time.monotonic()
            if (parked is not None and d is not None and self.max_parked_batches > 0
                    and parked.cache.doc_layers is d.layers):
                old = d.parked
                if old is None or old.cache.batch_capacity <= parked.cache.batch_capacity:
                    parked.since = time.monotonic()
                    d.parked = parked
                extra = sorted((x for x in self._docs.values() if x.parked is not None),
                               key=lambda x: x.parked.since)
                for x in extra[: max(0, len(extra) - self.max_parked_batches)]:
                    x.parked = None
            self._enforce_budget()

    def _grown(self) -> None:
        """An open batch's storage grew: drop parked batches (least recently parked first) while
        the GPU tier exceeds gpu_budget_bytes — idle storage must not crowd out live agents (the
        engine refuses requests by this figure). Documents are not moved here (as before: live
        growth may overshoot until the next open / close)."""
        if self.gpu_budget_bytes is None:
            return
        with self._lock:
            for p in self._parked():
                if self._gpu_tier_bytes() <= self.gpu_budget_bytes:
                    return
                self._docs[p.doc_id].parked = None

    def _parked(self) -> list:
        """The parked batches (agents.Parked), least recently parked first."""
        return sorted((d.parked for d in self._docs.values() if d.parked is not None), key=lambda p: p.since)

    def close(self) -> None:
        """Free what the pool keeps beyond its documents: the parked batches (suffix pages and
        captured steps). The pool stays usable (a later batch starts fresh); open batches are the
        caller's to close."""
        with self._lock:
            for d in self._docs.values():
                d.parked = None

    def prompt_ids(self, doc: str, prompt, chat_template: bool = True) -> list[int]:
        """Suffix token ids of one agent; its full prompt is always doc ids + these ids.

        Token ids: used verbatim. Text: over a chat document (and chat_template=True) the question
        continues the user turn and the turn is closed with the generation prompt (`doc tail`);
        otherwise the text is tokenized plainly (no special tokens). A conversation (a list of
        {"role", "content"} messages): over a chat document, its rendering after the document's
        place (`polykv.hf.chat.conversation_tail`); otherwise the whole rendered conversation
        (`conversation_ids`)."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            from ..hf.chat import conversation_ids, conversation_tail

            if chat_template and self._doc(doc).chat:
                return self.tok(conversation_tail(self.tok, prompt), add_special_tokens=False)["input_ids"]
            return conversation_ids(self.tok, prompt)
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        d = self._doc(doc)
        text = prompt + d.tail if (chat_template and d.chat) else prompt
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _step_times(self, doc: str):
        """The document's measured batch step times (`polykv.spec.adaptive.StepTimes`: by agent
        bucket and draft width), kept across generate calls so a new call's width planner starts
        informed; plain calls feed it too."""
        from ..spec.adaptive import StepTimes

        with self._lock:
            d = self._doc(doc)
            if d.step_times is None:
                d.step_times = StepTimes()
            return d.step_times

    def spec_sources(self, doc: str) -> tuple:
        """(n-gram index, outputs suffix tree) of a document, for `polykv.spec.Speculator` (built
        here when missing: a document added through another path)."""
        from ..spec import NgramIndex, SuffixTree

        with self._lock:
            d = self._doc(doc)
            if d.ngram is None:
                d.ngram = NgramIndex(d.ids)
            if d.outputs is None:
                d.outputs = SuffixTree()
            return d.ngram, d.outputs

    def generate(self, doc: str, prompts, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=None,
                 chat_template: bool = True, speculative=None, pipelined: bool = True,
                 max_batch: int | None = None) -> list[str]:
        """Answer every prompt as one agent over `doc`; all agents run in one batched forward per
        step. prompts: a list of texts, conversations or suffix id lists (see `prompt_ids`). Greedy when
        temperature == 0. Generation stops at `polykv.generation.stop_token_ids`, at any `stop` string (cut
        before it) or after max_new_tokens. Sampling (temperature > 0): agent i of the call draws
        from its own stream seeded `seed + i` (a random seed when None), independent of the other
        agents. pipelined (without `speculative`): step t+1 is launched before step t's ids are read
        (`AgentBatch.step_tokens_ahead`; the same tokens as pipelined=False, which waits for every
        step's ids before the next). With `speculative`, each verify step is launched and the
        outputs tree's logged tokens are added while it runs (`spec_overlap`); with pipelined too,
        the plain steps the width planner decides before drafting (backed off, or measuring T(0):
        `Speculator.plain_next`) run pipelined in stretches (`_spec_plain_stretch`; stats
        `pipelined_steps`), and their period is the plain step time T(0) the planner weighs verify
        steps against; once no prompt waits, the planner aims at the batch's finish (its longest
        answer), not its tokens per second (spec/adaptive.py, "Static batches"). max_batch: at most
        this many agents decode at once (None: every prompt); the others wait in order and each
        joins the batch when an agent finishes (continuous batching: a slot never idles while a
        prompt waits; a joining prompt is prefilled in the same step as the others decode). Each
        prompt's answer is the same whatever max_batch (the agents are independent; exactly so
        under `row_invariant`). Returns the decoded answers (special tokens skipped, leading and
        trailing whitespace stripped), in prompt order; the token ids are in
        `last_generate["answer_ids"]`, and beside the step times there the captured steps where
        prompts joined, by whether their attention split (`join_steps_split`, `join_steps_unsplit`:
        `DecodeGraphs._split`)."""
        from ..generation import find_stop, is_greedy, stop_token_ids
        from ..spec import SpecConfig, Speculator

        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of prompts")
        if max_batch is not None and int(max_batch) < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {max_batch}")
        if int(max_new_tokens) < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
        spec_cfg = SpecConfig.parse(speculative)
        t0 = time.perf_counter()
        suffixes = [self.prompt_ids(doc, p, chat_template) for p in prompts]
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        eos = stop_token_ids(self.tok, self.model)
        # Tokens are chosen on the device, one copy of the ids per step. Sampled agents draw from
        # their own counter-based streams (generation.choose_tokens): agent i of the call uses
        # seed + i (a seed drawn once when none is given), whatever else runs beside it.
        sampled = not is_greedy(temperature, top_k)
        base_seed = int(seed) if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        outs: dict[int, list[int]] = {}
        steps = 0
        peak = 0
        if not suffixes:
            return []
        spec = None
        times = self._step_times(doc)  # this document's measured step times, across calls
        overlap = spec_cfg is not None and bool(self.spec_overlap)
        if spec_cfg is not None:
            index, tree = self.spec_sources(doc)
            spec = Speculator(index, tree, self.device.type, times=times, overlap=overlap)
        extra = spec_cfg.num_draft_tokens if spec_cfg is not None else 0
        slots = len(suffixes) if max_batch is None else min(int(max_batch), len(suffixes))
        with self.open_batch(doc, capacity=slots) as batch:
            # pages the agents need (+ room for the drafts of their last step): the `slots` largest
            # needs, so that prompts joining later reuse the pages of those that left
            batch.reserve(sorted((len(s) + max_new_tokens + extra for s in suffixes), reverse=True)[:slots])
            if spec is not None:
                batch.expect_drafts(spec_cfg.num_draft_tokens)  # every verify width captured up front
            aids: list[int] = []  # per prompt, in order: its agent (once it joined)
            outs: dict[int, list[int]] = {}
            live: set[int] = set()

            def waiting() -> bool:
                """A prompt waits to join (else the batch is static: the width planner aims at its
                finish, spec/adaptive.py)."""
                return len(aids) < len(suffixes) and max_new_tokens > 0

            def joinable() -> bool:
                """A prompt waits and the batch has a free slot."""
                return waiting() and len(batch) < slots

            def join() -> bool:
                """Waiting prompts join the batch while it has fewer than `slots` agents."""
                joined = False
                while joinable():
                    i = len(aids)
                    a = batch.add(suffixes[i])
                    if sampled:  # prompt i draws from seed + i, whenever it joins
                        batch.set_sampling(a, temperature, top_p, top_k, seed=base_seed + i)
                    if spec is not None:
                        spec.add(a, suffixes[i], spec_cfg)
                    aids.append(a)
                    outs[a] = []
                    live.add(a)
                    joined = True
                return joined

            join()
            step_s: list[tuple[int, float, bool]] = []  # (widest draft count, seconds, prefilled joiners) per step
            if pipelined and spec is None and live:  # empties `live`: the loop below is the synchronous one
                steps = self._decode_pipelined(batch, outs, live, max_new_tokens, eos, stops, times, step_s,
                                               join)
                peak = batch.peak_bytes
            drafted: dict[int, int] = {}
            # a step's time: from the previous step's ids on the host to its own (the pipelined
            # loop's basis): its inputs' host work (the last ids' rules, `record`, drafting, `feed`)
            # and its launch and wait, billed to the width its drafts made (spec/adaptive.py)
            t_read, captured = time.perf_counter(), batch.graph_captures
            joined = False  # prompts joined before this step: it prefills them (not a decode step's time)
            while live:
                n_step = len(live)
                width = max(drafted.values(), default=0)
                if spec is None:
                    chosen = {a: [t] for a, t in batch.step_tokens().items()}
                elif overlap:
                    pending = batch.launch_verify()  # on CUDA: returns while the device runs the step
                    spec.ahead()  # host work independent of the step's ids: the outputs tree's adds
                    chosen = pending.result()  # waits for the ids; acceptance, rollback
                else:
                    chosen = batch.step_verify()
                now = time.perf_counter()  # each step ends in a copy to the host
                step_s.append((width, now - t_read, joined))
                # timed: decode steps (the first step prefills the prompts) that captured no graph
                timed = steps > 0 and batch.graph_captures == captured and not joined
                t_read, captured = now, batch.graph_captures
                if spec is not None:
                    if timed and (width > 0 or not pipelined):  # pipelined, T(0) is the stretches' period
                        spec.observe_step(width, step_s[-1][1], agents=n_step)
                    spec.step_done(any(drafted.values()))
                elif timed:
                    times.observe(n_step, width, step_s[-1][1])
                steps += 1
                feed, limits = {}, {}
                record = spec.record if spec is not None else None
                for a in aids:
                    if a not in live:
                        continue
                    emitted = chosen[a]
                    if record is not None:
                        record(a, emitted, drafted.get(a, 0))
                    out = outs[a]
                    if not stops and len(out) + len(emitted) < max_new_tokens and eos.isdisjoint(emitted):
                        out += emitted  # what the rules below do when no token ends the agent
                        done = False
                    else:
                        done = False
                        for t in emitted:  # the plain loop's rules, token by token
                            done = self._took(out, t, max_new_tokens, eos, stops)
                            if done:
                                break
                    if done:
                        live.discard(a)
                        if spec is not None:
                            spec.remove(a)
                    else:
                        feed[a] = emitted[-1]
                        limits[a] = max_new_tokens - len(out) - 1
                # every agent's drafts, cut to the one width the batch step is worth (WidthPlanner)
                drafts = spec.propose_all(limits, len(feed), not waiting()) if spec is not None else {}
                self.peak_agent_bytes = max(self.peak_agent_bytes, batch.nbytes())
                peak = batch.peak_bytes
                if len(live) < len(batch):  # agents done this step leave the batch
                    for a in [a for a in batch.agents() if a not in live]:
                        batch.remove(a)
                drafts = {a: d for a, d in drafts.items() if d}
                if (pipelined and spec is not None and feed and not drafts
                        and spec.plain_next({a: n - 1 for a, n in limits.items()}, len(feed), not waiting())):
                    # this step and the next are plain (the planner backed off or measures T(0)):
                    # run them, and the plain steps it decides after them, pipelined
                    n, joined, ready = self._spec_plain_stretch(batch, spec, feed, outs, live, max_new_tokens,
                                                                eos, stops, step_s, join, joinable, waiting, t_read)
                    steps += n
                    # the next step's time starts at the stretch's last read: its drafting is billed to it
                    t_read, captured = time.perf_counter(), batch.graph_captures
                    limits = {a: max_new_tokens - len(outs[a]) - 1 for a in ready}
                    drafts = spec.propose_all(limits, len(ready), not waiting()) if ready else {}
                    drafts = {a: d for a, d in drafts.items() if d}
                    batch.feed_drafts(drafts)  # after each agent's last token (read, still pending)
                else:
                    batch.feed(feed, drafts)  # the token each agent emitted last, then its drafts
                    joined = join()  # waiting prompts take the slots of those done
                drafted = {a: len(d) for a, d in drafts.items()}
            captures, join_steps = batch.graph_captures, batch.join_steps
        # every prompt joined unless max_new_tokens <= 0 (nothing to generate)
        answers = [outs[a] for a in aids] + [[] for _ in range(len(suffixes) - len(aids))]
        texts = []
        for out in answers:
            s = self.tok.decode(out, skip_special_tokens=True)
            cut = find_stop(s, stops)
            texts.append((s[:cut] if cut >= 0 else s).strip())
        self.last_generate = dict(agents=len(prompts), max_batch=slots, steps=steps, suffix_tokens=[len(s) for s in suffixes],
                                  new_tokens=[len(a) for a in answers], kv_bytes_agents_peak=peak,
                                  suffix_ids=suffixes, answer_ids=[list(a) for a in answers],
                                  seconds=time.perf_counter() - t0, graph_captures=captures,
                                  join_steps_split=join_steps[0], join_steps_unsplit=join_steps[1],
                                  step_ms=_step_ms(step_s), pipelined=bool(pipelined and spec is None))
        if spec is not None:
            self.last_generate["speculative"] = dict(spec.stats(), method=spec_cfg.method,
                                                     num_draft_tokens=spec_cfg.num_draft_tokens)
        return texts

    def _took(self, out: list[int], t: int, max_new_tokens: int, eos, stops: list) -> bool:
        """The decoding rules for one chosen token t of an agent whose answer so far is `out`:
        an eos id ends it and is not kept; any other id is kept, and ends it at max_new_tokens or
        when the answer holds a stop string. Returns whether the agent is done."""
        from ..generation import find_stop

        if t in eos:
            return True
        out.append(t)
        return len(out) >= max_new_tokens or bool(
            stops and find_stop(self.tok.decode(out, skip_special_tokens=True), stops) >= 0)

    def _spec_plain_stretch(self, batch, spec, feed: dict, outs: dict, live: set, max_new_tokens: int, eos,
                            stops: list, step_s: list, join, joinable, waiting, t_read: float) -> tuple[int, bool, list[int]]:
        """Plain steps of the speculative loop, pipelined as `_decode_pipelined` runs them: the
        caller fed nothing yet and `spec.plain_next` approved the step after this one. Feeds
        `feed`, lets waiting prompts take free slots (`join`), launches this step and the next,
        then, each time it reads a step (the next one already running): the tokens' rules and
        `spec.record`, agents done leave, and the step after the one in flight is launched while
        `spec.plain_next` approves it (static while no prompt is `waiting`) and no waiting prompt
        has a free slot (`joinable`). Such
        prompts join once the last step in flight is read (their prefill is the caller's next step):
        had they joined before, an agent leaving on that read would move a joiner's slot into its
        own, the decoders of the caller's step would not be slots 0..n-1, and that step would run
        eagerly instead of replaying its captured graph. Each step's period (from the
        previous read, t_read for the first) is a plain step time of the planner unless that step,
        or the one launched while it was waited for, captured a graph or prefilled prompts (as
        `_decode_pipelined`). Returns (steps run, whether prompts joined at the end, the agents
        whose last read token is pending for the caller's next step — drafts may follow it)."""
        batch.feed(feed)
        clean: list[bool] = []  # per launched step: it captured nothing and prefilled no prompt

        def launch(prefill: bool = False):
            before = batch.graph_captures
            pending = batch.step_tokens_ahead()
            clean.append(batch.graph_captures == before and not prefill)
            return pending

        joined = join()  # the only prompts a stretch prefills: in its first step (later ones wait for its end)
        ahead = launch(joined)
        nxt = launch()
        reads, ready = 0, []
        while ahead is not None:
            spec.ahead()  # the outputs tree's adds while the device runs
            chosen = ahead.result()
            now = time.perf_counter()
            step_s.append((0, now - t_read, reads == 0 and joined))  # the first period holds its launch
            if clean[reads] and (nxt is None or clean[reads + 1]):
                spec.observe_step(0, now - t_read, agents=len(chosen))
            t_read = now
            reads += 1
            spec.step_done(False)
            ready = []
            for a in ahead.agents:
                if a not in live:
                    continue  # stopped a step ago: this token is the wasted one
                t = chosen[a]
                spec.record(a, [t], 0)
                if self._took(outs[a], t, max_new_tokens, eos, stops):
                    live.discard(a)
                    spec.remove(a)
                    if a in batch:
                        batch.remove(a)  # fed into the step in flight already; its rows go with the slot
                else:
                    ready.append(a)
            self.peak_agent_bytes = max(self.peak_agent_bytes, batch.nbytes())
            ahead, nxt = nxt, None
            if ahead is None:
                break
            for a in [a for a in batch.agents() if len(outs[a]) + 1 >= max_new_tokens]:
                batch.remove(a)  # its token in flight is its last
            if joinable():
                continue  # read the step in flight; the prompts join after it
            limits = {a: max_new_tokens - len(outs[a]) - 2 for a in batch.agents() if a in live and a in ahead.agents}
            if limits and spec.plain_next(limits, len(batch), not waiting()):
                nxt = launch()
        return len(clean), join(), [a for a in ready if a in batch]

    def _decode_pipelined(self, batch, outs: dict, live: set, max_new_tokens: int, eos, stops: list,
                          times, step_s: list, join=lambda: False) -> int:
        """`generate`'s loop without speculation, one step ahead (`AgentBatch.step_tokens_ahead`):
        step t+1 is launched with step t's ids fed on the device, then step t's ids are read and the
        synchronous loop's rules applied (an eos id ends an agent and is not kept; max_new_tokens;
        stop strings). An agent that stops on a token of step t (eos, stop string) is already in
        step t+1: it is removed after that launch and its token of step t+1 never read (one wasted
        row per such agent). One whose token in flight is its last by count leaves before the
        launch (nothing wasted). Fills `outs`, empties `live`, appends to `step_s` the seconds
        between consecutive reads (once the loop runs ahead: a step's period; the first entry also
        holds the launch of step 1) and feeds `times` the periods of decode steps whose launch, and
        the launch made while waiting for them, captured nothing. join(): waiting prompts take the
        free slots (`generate`'s max_batch; True if any did) — called before each launch, so a
        joining prompt is prefilled in the step launched next (that step's period is not a decode
        step's: not fed to `times`). Returns the steps launched."""
        t_read = time.perf_counter()
        before = batch.graph_captures
        ahead = batch.step_tokens_ahead()  # the prompts' prefill; its ids feed step 1 on the device
        captured = [batch.graph_captures != before]  # per launched step
        prefills = [True]  # per launched step: it prefilled prompts
        while ahead is not None:
            for a in [a for a in batch.agents() if len(outs[a]) + 1 >= max_new_tokens]:
                batch.remove(a)  # its token in flight is its last
            joined = join()
            nxt = None
            if len(batch):
                before = batch.graph_captures
                nxt = batch.step_tokens_ahead()  # step t+1, launched before step t is read
                captured.append(batch.graph_captures != before)
                prefills.append(joined)
            chosen = ahead.result()
            now = time.perf_counter()
            i = len(step_s)  # the step just read; 0 prefilled the prompts
            step_s.append((0, now - t_read, i > 0 and (prefills[i] or (nxt is not None and prefills[i + 1]))))
            t_read = now
            if (i > 0 and not captured[i] and not prefills[i]
                    and not (nxt is not None and (captured[i + 1] or prefills[i + 1]))):
                times.observe(len(chosen), 0, step_s[-1][1])
            for a in ahead.agents:
                if a not in live:
                    continue  # stopped a step ago: this token is the wasted one
                if self._took(outs[a], chosen[a], max_new_tokens, eos, stops):
                    live.discard(a)
                    if a in batch:
                        batch.remove(a)  # fed into nxt already; its rows go with the slot
            self.peak_agent_bytes = max(self.peak_agent_bytes, batch.nbytes())
            ahead = nxt
        return len(captured)

    # --- memory ------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Measured bytes (DESIGN §7: untyped_storage().nbytes(), each storage once).

        kv_bytes_shared: every resident document's compressed prefix
        kv_bytes_agents: live suffix storage of all open batches (allocated capacity included), the
            agents' recent windows included
        kv_bytes_ring: of which the recent windows (`recent`: R; 0 without windows)
        kv_bytes_naive_f16: one real f16 DynamicCache per resident document, measured at prefill
            (the single-agent naive figure; N-agent naive figures are measured by
            `polykv.bench.fanout`, which really allocates the N copies)
        ratio: kv_bytes_naive_f16 / kv_bytes_shared
        kv_bytes_gpu / kv_bytes_host: the GPU-tier / host-tier documents' compressed prefixes
            (kv_bytes_shared = kv_bytes_gpu + kv_bytes_host)
        kv_bytes_stream_buffers: device buffers of batches streaming host-tier documents
        kv_bytes_parked: suffix pages (and stream buffers) of closed batches parked for reuse
            (`max_parked_batches`); parked_batches: how many
        gpu_tier_bytes: what gpu_budget_bytes bounds (GPU-tier documents + suffix pages + stream
            buffers of open and parked batches); tiers: documents per tier
        """
        with self._lock:
            docs = [d for d in self._docs.values() if d.resident]
            shared = storage_bytes([t for d in docs for t in d.tensors()])
            batches = [b for b in list(self._batches) if not b._closed]
            agents = storage_bytes([t for b in batches for t in b.cache.tensors()])
            naive = sum(d.naive_f16_bytes for d in docs)
            gpu, host = (storage_bytes(self._tier_tensors(t)) for t in ("gpu", "host"))
            buffers = storage_bytes([t for b in batches for t in b.cache.buffer_tensors()])
            ring = storage_bytes([t for b in batches for t in b.cache.ring_tensors()])
            tiers = {t: sum(d.tier == t for d in self._docs.values()) for t in TIERS}
            parked = self._parked()
            return dict(kv_bytes_shared=shared, kv_bytes_agents=agents, kv_bytes_naive_f16=naive,
                        kv_bytes_gpu=gpu, kv_bytes_host=host, kv_bytes_stream_buffers=buffers,
                        kv_bytes_parked=storage_bytes([t for p in parked for t in p.tensors()]),
                        parked_batches=len(parked),
                        gpu_tier_bytes=self._gpu_tier_bytes(), tiers=tiers,
                        gpu_budget_bytes=self.gpu_budget_bytes, host_budget_bytes=self.host_budget_bytes,
                        ratio=(naive / shared) if shared else 0.0,
                        documents=len(self._docs), resident_documents=len(docs),
                        open_batches=len(batches), agents=sum(len(b) for b in batches),
                        kv_bytes_agents_peak=max(self.peak_agent_bytes, agents),
                        kv_bytes_ring=ring, recent=self.recent,
                        k=self.k_type, v=self.v_type, precision=self.precision,
                        naive_basis="one measured f16 DynamicCache per document (single agent)")

    # --- persistence -------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the pool to store directory `path` as a new complete generation (pool.safetensors +
        manifest.json, fsynced, renamed into place: an interrupted save leaves the previous one
        loadable; see persist.py)."""
        from .persist import save_pool

        with self._lock:
            save_pool(self, path)

    @classmethod
    def load(cls, path, model, tok, **kwargs) -> "SharedKVPool":
        """Load the newest complete save in `path` (a store directory; a `pool-<generation>`
        directory in it loads that generation); raises PoolFormatError on any mismatch, corruption
        or invalid manifest field (see persist.py). The K/V types, InnerQ tables and per-layer
        types come from the save (passing k=, v=, innerq=, overrides= or preset= is a TypeError);
        `kwargs` are SharedKVPool's other arguments (device, budgets, recent, ...)."""
        from .persist import load_pool

        pool = load_pool(cls, path, model, tok, **kwargs)
        with pool._lock:  # a save holds every resident document in the GPU form: fit the budgets
            pool._enforce_budget()
        return pool


def _budget(name: str, value):
    """A byte budget: None (none) or an integer >= 0."""
    if value is not None and int(value) < 0:
        raise ValueError(f"{name} must be >= 0 bytes or None, got {value}")
    return value


def _step_ms(step_s: list[tuple[int, float, bool]]) -> dict:
    """`generate`'s step times from (width, seconds, prefilled joining prompts) per step: the first
    step (the prompts' prefill), the median of the later decode steps by width (the widest draft
    count verified in the step; 0 = plain decode) and their counts, and the later steps whose
    period held the prefill of prompts that joined (continuous batching): their count and total
    (`joins`, `joins_ms`), in ms."""
    by: dict[int, list[float]] = {}
    joins = []
    for w, t, prefill in step_s[1:]:
        (joins if prefill else by.setdefault(w, [])).append(t)
    return dict(first=step_s[0][1] * 1e3 if step_s else 0.0,
                by_width={w: statistics.median(ts) * 1e3 for w, ts in sorted(by.items())},
                count_by_width={w: len(ts) for w, ts in sorted(by.items())},
                joins=len(joins), joins_ms=sum(joins) * 1e3)
