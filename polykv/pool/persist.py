"""Pool persistence: a store directory of versioned, complete saves (safetensors, no pickle).

On-disk contract (format "polykv-pool", version 2)
    <store>/pool-<generation, 8 digits>/   one complete save; the highest generation is the pool
        pool.safetensors
        manifest.json
    <store>/.tmp-<pid>-<hex>/              a save in progress, or one a crash interrupted: never read;
                                           the next save removes it once process <pid> is gone
    Nothing else in the store is read. The flat version-1 layout (manifest.json at the top) is
    recognised only to refuse it with a clear message; a save removes its files.

Save (`save_pool`)
    1. both files are written into a fresh `.tmp-<pid>-<hex>/`; each file, then the directory, is
       fsynced;
    2. the directory is renamed to `pool-<g+1>` (g: the highest generation present; a rename never
       replaces a non-empty directory, so concurrent saves get distinct generations); the store
       directory is fsynced;
    3. older generations, temp directories of dead processes and version-1 files are removed.
    A crash before 2 leaves the previous generation as the pool, after it the new one: a reader sees
    either the old or the new complete pool, never a mix. A failing save removes its temp directory
    and re-raises; a manifest that loading would refuse (e.g. a document name that is not a string)
    fails the save with PoolFormatError before anything is published.

pool.safetensors (header metadata {"format": "polykv-pool", "version": "2"}); exactly these tensors:
    doc.<i>.ids                      int64 [tokens]  token ids (always; evicted documents keep only these)
    doc.<i>.layer.<l>.{k,v}.codes    codec.code_dtype [1, kv_heads(l), rows[l], codec.code_bytes / itemsize]
    doc.<i>.layer.<l>.{k,v}.scales   float16 [1, kv_heads(l), rows[l], codec.n_scales] (not for raw types)
    doc.<i>.ngram                    int64 [tokens]  the document's n-gram index (`polykv.spec.NgramIndex`: a
                                     suffix array, a permutation of 0..tokens-1); optional — a pool saved
                                     without it (older polykv) rebuilds it from the ids on load
    innerq.layer.<l>                 float32 [kv_heads(l), head_dim(l)] InnerQ scales (turbo K only)
    empty                            float32 [1], only when there is nothing else
manifest.json: every field required, no other field allowed
    format "polykv-pool"; version 2
    manifest_sha256     sha256 of the manifest without this field (canonical JSON: sorted keys,
                        separators "," ":"): any edit of the file is detected
    model_fingerprint, tokenizer_fingerprint   64 hex (`polykv.hf.loading`: every weight tensor hashed)
    codec               {k, v: KV type names; innerq_sha256: 64 hex (K turbo only) or null; optional
                         layers: one [k, v] per layer (only when some layer differs from the pair);
                         optional recent: int >= 1, the agents' recent window R (only when R > 0:
                         `polykv.pool.ring`; a store without it loads with R = 0, load(recent=) wins)}
    files               {"pool.safetensors": {bytes: int, sha256: 64 hex}}
    documents           [{index: its position in the list; id: "doc-" + ids_sha256[:16] (unique);
                          name: str or null; tokens: int >= 1; ids_sha256: 64 hex; chat: bool;
                          tail: str; resident: bool; naive_f16_bytes: int >= 0;
                          prefix_start, rows: one int per model layer when resident, else null —
                          full-attention layers 0 and tokens; sliding layers 1 <= rows <= window,
                          prefix_start = tokens - rows}]
Loading checks, in order (the first failure raises PoolFormatError naming the file and the field):
    1. the store holds a generation directory; 2. manifest.json parses to an object with the right
    format and version; 3. manifest_sha256; 4. every field's type and range (above), against the
    model's layer count and windows; 5. model fingerprint; 6. tokenizer fingerprint; 7. size and
    sha256 of pool.safetensors; 8. safetensors header and metadata; 9. the tensor names are exactly
    the expected set, every dtype and shape matches the model's KV layout and the codecs; token ids
    match ids_sha256 and the vocabulary; scales and InnerQ values are finite (InnerQ > 0); the InnerQ
    table matches innerq_sha256.
A generation removed by a concurrent save while it is being read is retried on the newer one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

import torch

from ..cache.layer import CompressedLayer
from ..codecs import CODEC_NAMES, Packed, get_codec

FORMAT = "polykv-pool"
VERSION = 2
TENSORS = "pool.safetensors"
MANIFEST = "manifest.json"
GENERATION = re.compile(r"pool-(\d{8})")
TMP = re.compile(r"\.tmp-(\d+)-[0-9a-f]+")
V1_FILES = (MANIFEST, TENSORS, MANIFEST + ".tmp", TENSORS + ".tmp")  # the flat version-1 layout

log = logging.getLogger(__name__)

_TOP = {"format", "version", "manifest_sha256", "model_fingerprint", "tokenizer_fingerprint", "codec",
        "files", "documents"}
_DOC = {"index", "id", "name", "tokens", "ids_sha256", "chat", "tail", "resident", "prefix_start", "rows",
        "naive_f16_bytes"}
_HEX64 = re.compile(r"[0-9a-f]{64}")


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


def manifest_sha256(manifest: dict) -> str:
    """sha256 of the manifest without its `manifest_sha256` field (canonical JSON)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fingerprints(model, tok) -> tuple[str, str]:
    from ..hf.loading import model_fingerprint, tokenizer_fingerprint

    return model_fingerprint(model), tokenizer_fingerprint(tok)


# --- store layout -------------------------------------------------------------------------------

def generations(root) -> list[int]:
    """Generation numbers of the complete saves in `root`, ascending."""
    try:
        entries = list(Path(root).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for e in entries if (m := GENERATION.fullmatch(e.name)) and e.is_dir())


def has_saved_pool(root) -> bool:
    """True when `root` holds a complete save (what `load_pool` reads); stray temp or foreign files
    alone do not count."""
    return bool(generations(root)) or (Path(root) / MANIFEST).is_file()


def _gen_dir(root: Path, g: int) -> Path:
    return root / f"pool-{g:08d}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # no directory handles on this platform
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers: a save of this process is never in flight here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _cleanup(root: Path, keep: int) -> None:
    """Remove generations older than `keep`, temp dirs of dead processes and version-1 files."""
    for e in list(root.iterdir()):
        try:
            m = GENERATION.fullmatch(e.name)
            t = TMP.fullmatch(e.name)
            if m and int(m.group(1)) < keep:
                shutil.rmtree(e)
            elif t and not _pid_alive(int(t.group(1))):
                shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()
            elif e.name in V1_FILES and e.is_file():
                e.unlink()
        except OSError as exc:  # a later save retries; the new generation is already in place
            log.warning("polykv pool store %s: could not remove %s: %s", root, e.name, exc)


# --- save ---------------------------------------------------------------------------------------

def _write_manifest(path: Path, manifest: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def save_pool(pool, path) -> None:
    from safetensors.torch import save_file

    from .pool import ids_sha256

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    docs = []
    for i, d in enumerate(pool._docs.values()):
        tensors[f"doc.{i}.ids"] = torch.tensor(d.ids, dtype=torch.int64)
        if d.ngram is not None:
            tensors[f"doc.{i}.ngram"] = d.ngram.sa.to(torch.int64).contiguous().cpu()
        rows = []
        if d.resident:
            for li, layer in enumerate(d.layers):
                rows.append(int(layer.length))
                for kv, p in (("k", layer.keys()), ("v", layer.values())):
                    tensors[f"doc.{i}.layer.{li}.{kv}.codes"] = p.codes.contiguous().cpu()
                    if p.scales is not None:
                        tensors[f"doc.{i}.layer.{li}.{kv}.scales"] = p.scales.contiguous().cpu()
        docs.append(dict(index=i, id=d.id, name=d.name, tokens=d.length, ids_sha256=ids_sha256(d.ids),
                         chat=bool(d.chat), tail=d.tail, resident=d.resident,
                         prefix_start=[int(x) for x in d.prefix_start] if d.resident else None,
                         rows=rows if d.resident else None, naive_f16_bytes=int(d.naive_f16_bytes)))
    if pool.innerq is not None:
        for li, s in pool.innerq.scales.items():
            tensors[f"innerq.layer.{li}"] = s.float().contiguous().cpu()
    if not tensors:
        tensors["empty"] = torch.zeros(1)
    mfp, tfp = _fingerprints(pool.model, pool.tok)

    tmp = root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / TENSORS), metadata={"format": FORMAT, "version": str(VERSION)})
        _fsync_file(tmp / TENSORS)
        manifest = dict(format=FORMAT, version=VERSION, model_fingerprint=mfp, tokenizer_fingerprint=tfp,
                        codec=_codec_field(pool),
                        documents=docs,
                        files={TENSORS: dict(bytes=(tmp / TENSORS).stat().st_size,
                                             sha256=_file_sha256(tmp / TENSORS))})
        manifest["manifest_sha256"] = manifest_sha256(manifest)
        _validate_manifest(manifest, tmp / MANIFEST, pool.layout)  # never publish what load refuses
        _write_manifest(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        g = (generations(root) or [0])[-1] + 1
        while True:
            try:
                os.rename(tmp, _gen_dir(root, g))
                break
            except OSError:  # a concurrent save took generation g (non-empty target): take the next
                if not _gen_dir(root, g).exists():
                    raise
                g += 1
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _cleanup(root, keep=g)


# --- load ---------------------------------------------------------------------------------------

class _Vanished(Exception):
    """A file of the generation being read disappeared (a concurrent save removed it)."""


def load_pool(cls, path, model, tok, **kwargs):
    from .pool import PoolFormatError

    fixed = sorted({"k", "v", "innerq", "overrides", "preset"} & set(kwargs))
    if fixed:
        raise TypeError(f"SharedKVPool.load takes {', '.join(fixed)} from the save (its documents are stored "
                        f"in those types); to hold them otherwise, add them to a new pool")
    root = Path(path)
    if GENERATION.fullmatch(root.name) and (root / MANIFEST).is_file() and not generations(root):
        try:  # one generation named directly
            return _load_generation(cls, root, model, tok, kwargs)
        except _Vanished as e:
            raise PoolFormatError(f"{e} is missing") from None
    for _ in range(5):
        gens = generations(root)
        if not gens:
            if (root / MANIFEST).is_file():
                raise PoolFormatError(f"{root} holds a pool in the flat layout of polykv pool format "
                                      f"version 1 (manifest.json at the top); this polykv reads version "
                                      f"{VERSION} (pool-<generation>/ directories): re-add its documents")
            raise PoolFormatError(f"{root} holds no saved polykv pool (no pool-<generation>/ directory)")
        try:
            return _load_generation(cls, _gen_dir(root, gens[-1]), model, tok, kwargs)
        except _Vanished as e:
            if generations(root)[-1:] == gens[-1:]:
                raise PoolFormatError(f"{e} is missing") from None
    raise PoolFormatError(f"{root}: the pool changed under every read attempt (concurrent saves)")


def _fail(where: str, what: str):
    from .pool import PoolFormatError

    raise PoolFormatError(f"{where}: {what}")


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _check_int(v, where: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        _fail(where, f"must be an integer {rng}, got {_show(v)}")
    return v


def _check_type(v, types, where: str, what: str):
    if type(v) not in types:
        _fail(where, f"must be {what}, got {_show(v)}")
    return v


def _check_hex(v, where: str, nullable: bool = False):
    if v is None and nullable:
        return v
    if not isinstance(v, str) or not _HEX64.fullmatch(v):
        _fail(where, f"must be 64 lowercase hex digits{' or null' if nullable else ''}, got {_show(v)}")
    return v


def _codec_field(pool) -> dict:
    """The manifest's codec object: the pool's K / V pair, its InnerQ table's digest, and (only when
    some layer differs from the pair) every layer's [k, v]."""
    out = dict(k=pool.k_type, v=pool.v_type, innerq_sha256=innerq_sha256(pool.innerq))
    if any(t != (pool.k_type, pool.v_type) for t in pool.layer_types):
        out["layers"] = [list(t) for t in pool.layer_types]
    if getattr(pool, "recent", 0):
        out["recent"] = int(pool.recent)
    return out


def _layer_types(codec: dict, layout) -> list[tuple[str, str]]:
    """Per-layer (k, v) of a manifest's codec object (the pair for every layer without "layers")."""
    if "layers" in codec:
        return [tuple(p) for p in codec["layers"]]
    return [(codec["k"], codec["v"])] * len(layout)


def _check_keys(obj, want: set, where: str) -> None:
    if not isinstance(obj, dict):
        _fail(where, f"must be a JSON object, got {_show(obj)}")
    missing, extra = want - set(obj), set(obj) - want
    if missing or extra:
        _fail(where, f"fields missing {sorted(missing)} / unexpected {sorted(extra)}")


def _validate_manifest(m: dict, mpath: Path, layout) -> None:
    """Every field of a parsed manifest (format and version already checked): types and ranges."""
    w = str(mpath)
    _check_keys(m, _TOP, w)
    _check_hex(m["model_fingerprint"], f"{w}: model_fingerprint")
    _check_hex(m["tokenizer_fingerprint"], f"{w}: tokenizer_fingerprint")
    codec = m["codec"]
    _check_keys(codec, {"k", "v", "innerq_sha256"} | ({"layers"} if "layers" in codec else set())
                | ({"recent"} if "recent" in codec else set()), f"{w}: codec")
    if "recent" in codec:
        _check_int(codec["recent"], f"{w}: codec.recent", lo=1)
    for kv in ("k", "v"):
        if not isinstance(codec[kv], str) or codec[kv] not in CODEC_NAMES:
            _fail(f"{w}: codec.{kv}", f"must be one of {', '.join(CODEC_NAMES)}, got {_show(codec[kv])}")
    if "layers" in codec:  # per-layer types (a calibrated preset): one [k, v] pair per layer
        lt = codec["layers"]
        if not isinstance(lt, list) or len(lt) != len(layout) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(t, str) and t in CODEC_NAMES for t in p)
                for p in lt):
            _fail(f"{w}: codec.layers", f"must be {len(layout)} [k, v] pairs of {', '.join(CODEC_NAMES)}, "
                  f"got {_show(lt)}")
    _check_hex(codec["innerq_sha256"], f"{w}: codec.innerq_sha256", nullable=True)
    if codec["innerq_sha256"] is not None and not any(k.startswith("turbo") for k, _ in _layer_types(codec, layout)):
        _fail(f"{w}: codec.innerq_sha256", f"an InnerQ table is only stored for turbo K, K is {codec['k']}")
    files = m["files"]
    _check_keys(files, {TENSORS}, f"{w}: files")
    _check_keys(files[TENSORS], {"bytes", "sha256"}, f"{w}: files.{TENSORS}")
    _check_int(files[TENSORS]["bytes"], f"{w}: files.{TENSORS}.bytes", lo=8)
    _check_hex(files[TENSORS]["sha256"], f"{w}: files.{TENSORS}.sha256")
    docs = _check_type(m["documents"], (list,), f"{w}: documents", "a list")
    seen = set()
    n_layers = len(layout)
    for pos, d in enumerate(docs):
        dw = f"{w}: documents[{pos}]"
        _check_keys(d, _DOC, dw)
        if type(d["index"]) is not int or d["index"] != pos:
            _fail(f"{dw}.index", f"must equal its position {pos}, got {_show(d['index'])}")
        _check_hex(d["ids_sha256"], f"{dw}.ids_sha256")
        if d["id"] != "doc-" + d["ids_sha256"][:16]:
            _fail(f"{dw}.id", f"must be 'doc-' + ids_sha256[:16], got {_show(d['id'])}")
        if d["id"] in seen:
            _fail(f"{dw}.id", f"duplicate document {d['id']!r}")
        seen.add(d["id"])
        if d["name"] is not None:
            _check_type(d["name"], (str,), f"{dw}.name", "a string or null")
        tokens = _check_int(d["tokens"], f"{dw}.tokens", lo=1)
        _check_type(d["chat"], (bool,), f"{dw}.chat", "true or false")
        _check_type(d["tail"], (str,), f"{dw}.tail", "a string")
        _check_type(d["resident"], (bool,), f"{dw}.resident", "true or false")
        _check_int(d["naive_f16_bytes"], f"{dw}.naive_f16_bytes")
        if not d["resident"]:
            for f in ("prefix_start", "rows"):
                if d[f] is not None:
                    _fail(f"{dw}.{f}", f"must be null for a document that is not resident, got {_show(d[f])}")
            continue
        for f in ("prefix_start", "rows"):
            if type(d[f]) is not list or len(d[f]) != n_layers:
                _fail(f"{dw}.{f}", f"must be a list of {n_layers} integers (one per layer), got {_show(d[f])}")
        for li, spec in enumerate(layout):
            rw, sw = f"{dw}.rows[{li}]", f"{dw}.prefix_start[{li}]"
            if spec.sliding_window is None:
                _check_int(d["rows"][li], rw, lo=tokens, hi=tokens)
                _check_int(d["prefix_start"][li], sw, lo=0, hi=0)
            else:
                rows = _check_int(d["rows"][li], rw, lo=1, hi=min(tokens, int(spec.sliding_window)))
                _check_int(d["prefix_start"][li], sw, lo=tokens - rows, hi=tokens - rows)


def _expect(data: dict, name: str, dtype: torch.dtype, shape: tuple, where: str) -> torch.Tensor:
    t = data.get(name)
    if t is None:
        _fail(where, f"tensor {name!r} is missing")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        _fail(where, f"tensor {name!r} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)} "
                     f"(the model's KV layout and the codec)")
    return t


def _load_generation(cls, gdir: Path, model, tok, kwargs):
    from safetensors import safe_open

    from ..codecs import CodecError, InnerQTable
    from ..hf.loading import kv_layout
    from .pool import _Document, ids_sha256

    mpath, tpath = gdir / MANIFEST, gdir / TENSORS
    try:
        raw = mpath.read_bytes()
    except FileNotFoundError:
        raise _Vanished(mpath) from None
    except OSError as e:
        _fail(str(mpath), f"cannot be read: {e}")
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        _fail(str(mpath), f"is not valid JSON (corrupted or truncated): {e}")
    if not isinstance(m, dict):
        _fail(str(mpath), f"must hold a JSON object, got {type(m).__name__}")
    if m.get("format") != FORMAT:
        _fail(str(mpath), f"format is {_show(m.get('format'))}, expected {FORMAT!r}")
    if type(m.get("version")) is not int or m["version"] != VERSION:
        _fail(str(mpath), f"unsupported pool format version {_show(m.get('version'))} "
                          f"(this polykv reads version {VERSION})")
    if m.get("manifest_sha256") != manifest_sha256(m):
        _fail(str(mpath), "manifest_sha256 does not match its content (edited or corrupted)")
    layout = kv_layout(model)
    _validate_manifest(m, mpath, layout)

    mfp, tfp = _fingerprints(model, tok)
    if m["model_fingerprint"] != mfp:
        _fail(str(gdir), f"saved for a different model (fingerprint {m['model_fingerprint'][:16]}..., "
                         f"this model {mfp[:16]}...); its KV cannot be reused")
    if m["tokenizer_fingerprint"] != tfp:
        _fail(str(gdir), f"saved with a different tokenizer (fingerprint {m['tokenizer_fingerprint'][:16]}"
                         f"..., this tokenizer {tfp[:16]}...)")

    info = m["files"][TENSORS]
    try:
        size = tpath.stat().st_size
        if not tpath.is_file():
            _fail(str(tpath), "is not a file")
        digest = _file_sha256(tpath)
    except FileNotFoundError:
        raise _Vanished(tpath) from None
    except OSError as e:
        _fail(str(tpath), f"cannot be read: {e}")
    if size != info["bytes"]:
        _fail(str(tpath), f"has {size} bytes, the manifest says {info['bytes']} (truncated or replaced)")
    if digest != info["sha256"]:
        _fail(str(tpath), "sha256 does not match the manifest (corrupted)")
    try:
        with safe_open(str(tpath), framework="pt") as f:
            meta = f.metadata() or {}
            data = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        _fail(str(tpath), f"is not a readable safetensors file: {e}")
    if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
        _fail(str(tpath), f"header metadata {_show(meta)} is not polykv-pool version {VERSION}")

    # --- tensors against the manifest, the model's KV layout and the codecs ---------------------
    codec = m["codec"]
    k_type, v_type = codec["k"], codec["v"]
    types = _layer_types(codec, layout)
    try:
        codecs = [(get_codec(kt, s.head_dim), get_codec(vt, s.head_dim)) for s, (kt, vt) in zip(layout, types)]
    except CodecError as e:
        _fail(f"{mpath}: codec", f"cannot hold this model's KV: {e}")
    expected = set()
    vocab = _vocab_size(model)
    docs = []
    for d in m["documents"]:
        i, dw = d["index"], f"{tpath}: document {d['id']!r}"
        ids_t = _expect(data, f"doc.{i}.ids", torch.int64, (d["tokens"],), dw)
        expected.add(f"doc.{i}.ids")
        ids = [int(x) for x in ids_t.tolist()]
        if ids_sha256(ids) != d["ids_sha256"]:
            _fail(dw, "token ids do not match ids_sha256 in the manifest")
        if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
            _fail(dw, f"token ids outside this model's vocabulary [0, {vocab})")
        ngram = None
        if f"doc.{i}.ngram" in data:
            from ..spec import NgramIndex

            sa = _expect(data, f"doc.{i}.ngram", torch.int64, (d["tokens"],), dw)
            expected.add(f"doc.{i}.ngram")
            try:
                ngram = NgramIndex(ids, sa)
            except ValueError as e:
                _fail(dw, f"tensor doc.{i}.ngram: {e}")
        packed = []
        if d["resident"]:
            for li, (spec, cs) in enumerate(zip(layout, codecs)):
                rows, pl = d["rows"][li], []
                for kv, c in zip(("k", "v"), cs):
                    base = f"doc.{i}.layer.{li}.{kv}"
                    lead = (1, spec.num_kv_heads, rows)
                    width = c.code_bytes // c.code_dtype.itemsize  # raw types: head_dim values
                    codes = _expect(data, base + ".codes", c.code_dtype, lead + (width,), dw)
                    expected.add(base + ".codes")
                    sc = None
                    if c.n_scales:
                        sc = _expect(data, base + ".scales", torch.float16, lead + (c.n_scales,), dw)
                        expected.add(base + ".scales")
                        if not bool(torch.isfinite(sc).all()):
                            _fail(dw, f"tensor {base}.scales has non-finite values")
                    pl.append(Packed(codes, sc))
                packed.append(pl)
        docs.append((d, ids, packed, ngram))
    iq = {}
    for name, t in data.items():
        mm = re.fullmatch(r"innerq\.layer\.(\d+)", name)
        if mm is None:
            continue
        li = int(mm.group(1))
        if codec["innerq_sha256"] is None or li >= len(layout):
            _fail(str(tpath), f"unexpected tensor {name!r}")
        spec = layout[li]
        _expect(data, name, torch.float32, (spec.num_kv_heads, spec.head_dim), str(tpath))
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            _fail(str(tpath), f"tensor {name!r}: InnerQ scales must be finite and positive")
        expected.add(name)
        iq[li] = t
    if not expected:
        _expect(data, "empty", torch.float32, (1,), str(tpath))
        expected.add("empty")
    extra = set(data) - expected
    if extra:
        _fail(str(tpath), f"unexpected tensors {sorted(extra)[:5]}")
    innerq = InnerQTable(scales=iq) if codec["innerq_sha256"] is not None else None
    if innerq_sha256(innerq) != codec["innerq_sha256"]:
        _fail(str(tpath), "InnerQ table does not match innerq_sha256 in the manifest")

    # --- build ---------------------------------------------------------------------------------
    overrides = {i: tuple(t) for i, t in enumerate(types) if tuple(t) != (k_type, v_type)}
    kwargs = {"recent": codec.get("recent", 0), **kwargs}  # the saved window, unless load() names one
    pool = cls(model, tok, k=k_type, v=v_type, innerq=innerq, overrides=overrides or None, **kwargs)
    for d, ids, packed, ngram in docs:
        if ngram is None:  # saved without an index: rebuild it from the ids
            from ..spec import NgramIndex

            ngram = NgramIndex(ids)
        doc = _Document(d["id"], d["name"], ids, d["chat"], d["tail"], naive_f16_bytes=d["naive_f16_bytes"],
                        ngram=ngram)
        if d["resident"]:
            layers = []
            for li, (spec, (kc, vc)) in enumerate(zip(layout, codecs)):
                scales = pool.innerq.layer(li) if pool.innerq is not None else None
                layer = CompressedLayer(kc, vc, 1, spec.num_kv_heads, pool.device, scales)
                layer.k, layer.v = (p.to(pool.device) for p in packed[li])
                layer.length = d["rows"][li]
                layers.append(layer)
            doc.layers, doc.prefix_start = layers, list(d["prefix_start"])
        pool._docs[doc.id] = doc
    return pool


def _vocab_size(model) -> int | None:
    try:
        emb = model.get_input_embeddings()
        return int(emb.num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        return None
