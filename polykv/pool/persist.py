"""Pool persistence: a directory with `pool.safetensors` (no pickle) and `manifest.json`.

pool.safetensors tensors
    doc.<i>.ids                      int64 [T]   token ids (always; evicted documents keep only these)
    doc.<i>.layer.<l>.{k,v}.codes    packed rows, leading [1, kv_heads, rows]
    doc.<i>.layer.<l>.{k,v}.scales   fp16 block scales / turbo norms (absent for raw types)
    innerq.layer.<l>                 float32 [kv_heads, head_dim] InnerQ scales (turbo K only)
manifest.json
    format "polykv-pool", version 1, model / tokenizer fingerprints, codec config {k, v, innerq_sha256},
    documents [{index, id, name, tokens, ids_sha256, chat, tail, resident, prefix_start, rows, naive_f16_bytes}],
    files {"pool.safetensors": {bytes, sha256}}
Loading checks, in order: manifest parses and has the right format/version; model fingerprint;
tokenizer fingerprint; file size and sha256 (truncation/corruption); every document's token-id
sha256; tensor shapes against the model's KV layout. Any failure raises PoolFormatError.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..cache.layer import CompressedLayer
from ..codecs import Packed, get_codec

FORMAT = "polykv-pool"
VERSION = 1
TENSORS = "pool.safetensors"
MANIFEST = "manifest.json"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def innerq_sha256(table) -> str | None:
    if table is None:
        return None
    h = hashlib.sha256()
    for i in sorted(table.scales):
        h.update(f"{i}|".encode())
        h.update(table.scales[i].float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _fingerprints(model, tok) -> tuple[str, str]:
    from ..hf.loading import model_fingerprint, tokenizer_fingerprint

    return model_fingerprint(model), tokenizer_fingerprint(tok)


def save_pool(pool, path) -> None:
    from safetensors.torch import save_file

    from .pool import ids_sha256

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    docs = []
    for i, d in enumerate(pool._docs.values()):
        tensors[f"doc.{i}.ids"] = torch.tensor(d.ids, dtype=torch.int64)
        rows = []
        if d.resident:
            for li, layer in enumerate(d.layers):
                rows.append(layer.length)
                for kv, p in (("k", layer.keys()), ("v", layer.values())):
                    tensors[f"doc.{i}.layer.{li}.{kv}.codes"] = p.codes.contiguous().cpu()
                    if p.scales is not None:
                        tensors[f"doc.{i}.layer.{li}.{kv}.scales"] = p.scales.contiguous().cpu()
        docs.append(dict(index=i, id=d.id, name=d.name, tokens=d.length, ids_sha256=ids_sha256(d.ids),
                         chat=d.chat, tail=d.tail, resident=d.resident,
                         prefix_start=list(d.prefix_start) if d.resident else None,
                         rows=rows if d.resident else None, naive_f16_bytes=d.naive_f16_bytes))
    if pool.innerq is not None:
        for li, s in pool.innerq.scales.items():
            tensors[f"innerq.layer.{li}"] = s.float().contiguous().cpu()
    if not tensors:
        tensors["empty"] = torch.zeros(1)
    mfp, tfp = _fingerprints(pool.model, pool.tok)
    tmp = out / (TENSORS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "version": str(VERSION)})
    os.replace(tmp, out / TENSORS)
    manifest = dict(format=FORMAT, version=VERSION, model_fingerprint=mfp, tokenizer_fingerprint=tfp,
                    codec=dict(k=pool.k_type, v=pool.v_type, innerq_sha256=innerq_sha256(pool.innerq)),
                    documents=docs,
                    files={TENSORS: dict(bytes=(out / TENSORS).stat().st_size,
                                         sha256=_file_sha256(out / TENSORS))})
    tmpm = out / (MANIFEST + ".tmp")
    tmpm.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmpm, out / MANIFEST)


def load_pool(cls, path, model, tok, **kwargs):
    from safetensors import safe_open

    from ..codecs import InnerQTable
    from .pool import PoolFormatError, _Document, ids_sha256

    root = Path(path)
    mpath, tpath = root / MANIFEST, root / TENSORS
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise PoolFormatError(f"{mpath} not found: not a saved polykv pool") from None
    except (OSError, ValueError) as e:
        raise PoolFormatError(f"{mpath} is not valid JSON (corrupted or truncated): {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PoolFormatError(f"{mpath}: format is {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise PoolFormatError(f"{mpath}: unsupported pool format version {manifest.get('version')!r} "
                              f"(this polykv reads version {VERSION})")
    mfp, tfp = _fingerprints(model, tok)
    if manifest.get("model_fingerprint") != mfp:
        raise PoolFormatError(f"the pool in {root} was saved for a different model "
                              f"(fingerprint {str(manifest.get('model_fingerprint'))[:16]}..., this model "
                              f"{mfp[:16]}...); its KV cannot be reused")
    if manifest.get("tokenizer_fingerprint") != tfp:
        raise PoolFormatError(f"the pool in {root} was saved with a different tokenizer "
                              f"(fingerprint {str(manifest.get('tokenizer_fingerprint'))[:16]}..., this "
                              f"tokenizer {tfp[:16]}...)")
    info = (manifest.get("files") or {}).get(TENSORS) or {}
    if not tpath.is_file():
        raise PoolFormatError(f"{tpath} is missing")
    size = tpath.stat().st_size
    if size != info.get("bytes"):
        raise PoolFormatError(f"{tpath} has {size} bytes, the manifest says {info.get('bytes')} "
                              f"(truncated or replaced)")
    if _file_sha256(tpath) != info.get("sha256"):
        raise PoolFormatError(f"{tpath}: sha256 does not match the manifest (corrupted)")
    codec = manifest.get("codec") or {}
    try:
        with safe_open(str(tpath), framework="pt") as f:
            data = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001
        raise PoolFormatError(f"{tpath} is not a readable safetensors file: {e}") from None
    innerq = None
    iq = {int(k.split(".")[2]): t for k, t in data.items() if k.startswith("innerq.layer.")}
    if iq:
        innerq = InnerQTable(scales=iq)
    from .persist import innerq_sha256 as _iq_hash

    if _iq_hash(innerq) != codec.get("innerq_sha256"):
        raise PoolFormatError(f"{root}: InnerQ table hash does not match the manifest")
    pool = cls(model, tok, k=codec.get("k"), v=codec.get("v"), innerq=innerq, **kwargs)
    for d in manifest.get("documents", []):
        i = d["index"]
        ids_t = data.get(f"doc.{i}.ids")
        if ids_t is None:
            raise PoolFormatError(f"{tpath}: token ids of document {d.get('id')!r} are missing")
        ids = [int(x) for x in ids_t.tolist()]
        if ids_sha256(ids) != d.get("ids_sha256") or len(ids) != d.get("tokens"):
            raise PoolFormatError(f"{tpath}: token ids of document {d.get('id')!r} do not match the manifest")
        doc = _Document(d["id"], d.get("name"), ids, bool(d.get("chat")), d.get("tail") or "",
                        naive_f16_bytes=int(d.get("naive_f16_bytes") or 0))
        if d.get("resident"):
            layers = []
            for li, spec in enumerate(pool.layout):
                k_codec = get_codec(pool.k_type, spec.head_dim)
                v_codec = get_codec(pool.v_type, spec.head_dim)
                scales = pool.innerq.layer(li) if pool.innerq is not None else None
                layer = CompressedLayer(k_codec, v_codec, 1, spec.num_kv_heads, pool.device, scales)
                rows = int(d["rows"][li])
                packed = []
                for kv, c in (("k", k_codec), ("v", v_codec)):
                    codes = data.get(f"doc.{i}.layer.{li}.{kv}.codes")
                    sc = data.get(f"doc.{i}.layer.{li}.{kv}.scales")
                    want = (1, spec.num_kv_heads, rows, c.code_bytes)
                    if codes is None or tuple(codes.shape) != want or codes.dtype != c.code_dtype or \
                            (c.n_scales and (sc is None or tuple(sc.shape) != (1, spec.num_kv_heads, rows, c.n_scales))):
                        raise PoolFormatError(f"{tpath}: document {d['id']!r} layer {li} {kv} tensors do not "
                                              f"match the model's KV layout / codec {c.name}")
                    packed.append(Packed(codes.to(pool.device), None if sc is None else sc.to(pool.device)))
                layer.k, layer.v = packed
                layer.length = rows
                layers.append(layer)
            doc.layers, doc.prefix_start = layers, [int(x) for x in d["prefix_start"]]
        pool._docs[doc.id] = doc
    return pool
