"""Codec errors on a real model's keys and values, with and without InnerQ for K."""

from __future__ import annotations

import torch

from ..codecs import CODEC_NAMES, InnerQTable, get_codec


def real_kv_table(model, tok, text: str, calib_text: str, max_tokens: int = 1024) -> dict:
    """Rel-MSE / cosine of each codec on real K and V (all layers pooled by summed error), plus K
    with InnerQ calibrated on `calib_text` (a different text than the one measured)."""
    from ..hf.capture import capture_kv

    kv = capture_kv(model, tok, text, max_tokens)
    calib = capture_kv(model, tok, calib_text, max_tokens)
    table = InnerQTable.calibrate({i: k for i, (k, _) in calib.items()})
    rows = []
    for name in CODEC_NAMES:
        row: dict = {"name": name}
        for which in ("k", "v", "k_innerq"):
            if which == "k_innerq" and not name.startswith("turbo"):
                continue
            num = den = cos_sum = 0.0
            n_layers = 0
            for i, (k, v) in kv.items():
                x = v if which == "v" else k
                codec = get_codec(name, x.shape[-1])
                if which == "k_innerq":
                    y = table.unscale_keys(i, codec.decode(codec.encode(table.scale_keys(i, x))))
                else:
                    y = codec.decode(codec.encode(x))
                num += float(((x - y) ** 2).sum())
                den += float((x ** 2).sum())
                cos_sum += float(torch.nn.functional.cosine_similarity(
                    x.reshape(-1, x.shape[-1]), y.reshape(-1, x.shape[-1]), dim=-1).mean())
                n_layers += 1
            row[f"rel_mse_{which}"] = num / den
            row[f"cosine_{which}"] = cos_sum / n_layers
        rows.append(row)
    return {"tokens": int(next(iter(kv.values()))[0].shape[2]), "innerq_layers": sorted(table.scales),
            "rows": rows}
