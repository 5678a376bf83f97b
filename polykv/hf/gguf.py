"""GGUF files -> a converted Hugging Face directory in polykv's model cache (no network).

Loading a GGUF file dequantizes every tensor (13-60 s on two cores). The first load therefore
converts once into a cache directory (`cache_root()`: ``$POLYKV_CACHE_DIR/models``, default
``~/.cache/polykv/models``)::

    <root>/<name>-<key>/model.safetensors      float32 state dict (tied lm_head dropped)
                        config.json            quantization_config removed
                        generation_config.json
                        tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
                        polykv_meta.json       source, key, format version

and every load (the first one too) returns the model read back from that directory, so all loads of
one name give the same weights, config and fingerprints. The conversion checks, before publishing
the directory, that the reloaded model gives bit-identical logits to the GGUF-loaded one. The
directory is written under a temporary name and renamed into place, so a concurrent process never
sees half a cache; a lock file avoids converting twice at the same time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

__all__ = ["CACHE_FORMAT_VERSION", "ModelNotAvailableError", "cache_root", "ensure_cache", "ensure_gguf_cache",
           "file_key", "finalize_tokenizer", "short_hash"]

log = logging.getLogger(__name__)

#: Bump when the layout or content of a converted cache directory changes.
CACHE_FORMAT_VERSION = 2
_META_FILE = "polykv_meta.json"
_WEIGHTS_FILE = "model.safetensors"


class ModelNotAvailableError(RuntimeError):
    """A model is not installed: a registry model's package, a file it should contain, or a package
    the GGUF conversion needs."""


def cache_root() -> Path:
    """Where converted models live: ``polykv.paths.cache_dir("models")`` (``$POLYKV_CACHE_DIR/models``,
    default ``~/.cache/polykv/models``)."""
    from ..paths import cache_dir

    return cache_dir("models")


def ensure_gguf_cache(gguf: Path) -> Path:
    gguf = gguf.resolve()
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in gguf.stem.lower())
    key = file_key(gguf, extra=str(gguf))
    return ensure_cache(f"gguf-{stem}", key, lambda tmp: gguf, source=str(gguf))


def file_key(path: Path, extra: str = "") -> str:
    st = path.stat()
    return short_hash(f"size={st.st_size};mtime_ns={st.st_mtime_ns};{extra}")


def short_hash(text: str) -> str:
    import transformers

    payload = f"{text};format={CACHE_FORMAT_VERSION};transformers={transformers.__version__}"
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# cache conversion
# --------------------------------------------------------------------------------------------


def _cache_complete(d: Path) -> bool:
    return (d / _META_FILE).is_file() and (d / _WEIGHTS_FILE).is_file() and (d / "config.json").is_file()


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: atomic rename alone keeps it correct
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def ensure_cache(name: str, key: str, produce_gguf, *, source: str) -> Path:
    """Return the converted directory for (name, key), converting once if needed.

    ``produce_gguf(tmp_dir) -> Path`` yields the GGUF file to convert (it may write into tmp_dir).
    """
    root = cache_root()
    final = root / f"{name}-{key}"
    if _cache_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{name}-{key}.lock"):
        if _cache_complete(final):  # another process finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-{key}-", dir=root))
        try:
            work = tmp / "work"
            out = tmp / "out"
            work.mkdir()
            out.mkdir()
            gguf = produce_gguf(work)
            log.info("polykv: converting %s (%s) into %s (one time)", name, gguf, final)
            _convert_gguf(gguf, out, meta={"name": name, "key": key, "source": source})
            if final.exists():  # incomplete leftover (e.g. manual deletion of a file): replace it
                trash = root / f".trash-{name}-{key}-{uuid.uuid4().hex[:8]}"
                os.rename(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            try:
                os.rename(out, final)
            except OSError:
                if not _cache_complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _require_accelerate() -> None:
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise ModelNotAvailableError(
            "Converting a GGUF file needs the `accelerate` package (transformers refuses GGUF "
            "loading without it). Install it with: pip install accelerate"
        )


def _convert_gguf(gguf: Path, out: Path, *, meta: dict) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_accelerate()
    src_model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    src_model.eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    finalize_tokenizer(tok, src_model.config)
    # transformers ignores the GGUF flag tokenizer.ggml.add_bos_token (Gemma-3: true, SmolLM2: false),
    # so a Gemma tokenizer read from GGUF would not prepend <bos>.
    meta_tok = _gguf_tokenizer_meta(gguf)
    if meta_tok.get("add_bos_token") and tok.bos_token_id is not None:
        if tok("a").input_ids[:1] != [tok.bos_token_id]:
            tok.add_bos_token = True
    # GGUF "llama" (SentencePiece) vocabularies are BPE with merge priority = token score (that is how
    # llama.cpp tokenizes them), but transformers builds a Unigram model from them (Gemma-3: "capital"
    # -> "▁c ap it al"). Rebuild the backend as the equivalent BPE.
    if meta_tok.get("model") == "llama":
        _spm_scores_to_bpe(tok, meta_tok)

    # config: drop the GGUF "quantization" marker, otherwise from_pretrained would look for a GGUF file
    config = src_model.config
    cfg_dict = config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
    gen = getattr(src_model, "generation_config", None)
    if gen is not None:
        gen.to_json_file(str(out / "generation_config.json"))

    save_file(_state_dict_for_save(src_model), str(out / _WEIGHTS_FILE), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    # The GGUF reader builds the exact backend (Gemma-3: a Unigram model) into tokenizer.json, but a
    # model-specific class such as GemmaTokenizer rebuilds its own (BPE, no merges: one token per
    # character) on reload. The generic backend class loads tokenizer.json as written.
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["tokenizer_class"] = "TokenizersBackend"
    tcfg["add_bos_token"] = bool(getattr(tok, "add_bos_token", False))
    for k in ("is_local", "local_files_only"):
        tcfg.pop(k, None)
    tcfg_path.write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")
    tok_back = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    for text in _TOKENIZER_PROBES:
        if tok(text).input_ids != tok_back(text).input_ids:
            raise RuntimeError(
                f"polykv: the tokenizer saved in {out} does not reproduce the GGUF tokenizer on {text!r}: "
                f"{tok(text).input_ids[:12]} vs {tok_back(text).input_ids[:12]}"
            )

    # Check the round trip before publishing the directory (cheap: ~0.5 s load + 8-token forward).
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True)
    reloaded.eval()
    ids = torch.tensor([[tok.bos_token_id or 1, 100, 200, 300, 400, 500, 600, 700]], dtype=torch.long)
    with torch.inference_mode():
        a = src_model(input_ids=ids).logits
        b = reloaded(input_ids=ids).logits
    if not torch.equal(a, b):
        raise RuntimeError(
            f"polykv: converted model in {out} does not reproduce the GGUF model's logits "
            f"(max abs diff {(a - b).abs().max().item():.3g}); refusing to cache it"
        )
    del reloaded, src_model

    for f in out.iterdir():  # safetensors writes 0600; a cache may be shared between users
        f.chmod(0o644)
    meta = dict(meta, format=CACHE_FORMAT_VERSION, gguf_file=gguf.name)
    tmp_meta = out / (_META_FILE + ".tmp")
    tmp_meta.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_meta, out / _META_FILE)  # written last: marks the directory complete


_TOKENIZER_PROBES = (
    "The capital of France is",
    "  Two spaces, tabs\tand\nnewlines; digits 4817263 and 3.14159!",
    "Unicode: café, naïve, 東京, emoji 🙂, math ∑x².",
)


def _gguf_tokenizer_meta(gguf: Path) -> dict:
    """tokenizer.ggml.{model, add_bos_token, tokens, scores, token_type} of a GGUF file ({} if unreadable)."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(gguf)).fields
        out = {}
        for key in ("model", "add_bos_token", "tokens", "scores", "token_type"):
            f = fields.get(f"tokenizer.ggml.{key}")
            if f is not None:
                out[key] = f.contents()
        return out
    except Exception:  # metadata unreadable: keep transformers' behaviour
        return {}


def _spm_scores_to_bpe(tok, meta: dict) -> None:
    """Replace a Unigram backend built from a SentencePiece-BPE GGUF vocabulary by the BPE it encodes.

    Merges: every split of a normal token (type 1) into two vocabulary pieces, ordered by the merged
    token's score (higher first), ties by piece ids -- the SentencePiece BPE extraction transformers
    itself uses for .model files. Normalizer, pre-tokenizer, post-processor, decoder and added tokens
    are kept.
    """
    from tokenizers import Tokenizer

    tokens, scores, types = meta.get("tokens"), meta.get("scores"), meta.get("token_type")
    if not tokens or scores is None or types is None or len(tokens) != len(scores) or len(tokens) != len(types):
        return
    data = json.loads(tok.backend_tokenizer.to_str())
    if data.get("model", {}).get("type") != "Unigram":
        return
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        return  # duplicate pieces: BPE cannot represent it, keep transformers' model
    cands = []
    for t, score, ty in zip(tokens, scores, types):
        if int(ty) != 1 or len(t) < 2:
            continue
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            il, ir = vocab.get(left), vocab.get(right)
            if il is not None and ir is not None:
                cands.append((-float(score), il, ir))
    cands.sort()
    unk_id = data["model"].get("unk_id")
    data["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": tokens[unk_id] if isinstance(unk_id, int) else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [[tokens[il], tokens[ir]] for _, il, ir in cands],
    }
    tok._tokenizer = Tokenizer.from_str(json.dumps(data))


def _state_dict_for_save(model) -> dict[str, torch.Tensor]:
    """State dict safetensors accepts: tied copies dropped, no shared storage, contiguous, CPU."""
    sd = model.state_dict()
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied_targets = set(tied) if isinstance(tied, dict) else set(tied)
    out_emb = model.get_output_embeddings()
    if out_emb is not None and out_emb.weight is model.get_input_embeddings().weight:
        tied_targets |= {k for k, v in sd.items() if v is out_emb.weight or k.endswith("lm_head.weight")}

    by_storage: dict[tuple, list[str]] = {}
    for k, v in sd.items():
        by_storage.setdefault((v.device, v.untyped_storage().data_ptr()), []).append(k)

    out: dict[str, torch.Tensor] = {}
    for names in by_storage.values():
        # aliases of one storage: drop the tie targets (lm_head.weight), from_pretrained re-ties them
        keep = [n for n in names if n not in tied_targets] or names[:1]
        for i, n in enumerate(keep):
            t = sd[n].detach().to("cpu")
            out[n] = t.clone().contiguous() if (i > 0 or not t.is_contiguous()) else t
    return out


def finalize_tokenizer(tok, config) -> None:
    """eos consistent with the model config, pad token set, left padding."""
    cfg_eos = getattr(config.get_text_config(), "eos_token_id", None)
    if isinstance(cfg_eos, list):
        cfg_eos = cfg_eos[0] if cfg_eos else None
    # transformers' GGUF tokenizer reader sets SmolLM2's eos to <|im_start|> (id 1) while the model
    # config (and the original HF tokenizer) say <|im_end|> (id 2): follow the config.
    if isinstance(cfg_eos, int) and 0 <= cfg_eos < len(tok) and tok.eos_token_id != cfg_eos:
        tok.eos_token = tok.convert_ids_to_tokens(cfg_eos)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
