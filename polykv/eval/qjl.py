"""A QJL-style residual for keys, simulated for measurement (issue K: "QJL-style residual for keys").

TurboQuant's inner-product variant (Zandieh et al. 2025) stores, beside a (b - 1)-bit MSE code of a
key, one sign bit per coordinate of a Gaussian projection of the residual r = k - k_mse (QJL) and
||r||: the estimate

    r_hat = sqrt(pi / 2) / m * ||r|| * S^T sign(S r),   S ~ N(0, 1)^{m x d}

makes <q, k_mse + r_hat> an unbiased estimate of <q, k>. It costs m bits + one fp16 norm per row.
Question: does it pay at equal bits in softmax attention, where the MSE codes' small bias meets the
residual's variance? Measured end to end like the precision table (`polykv.hf.precision`): per layer,
only that layer's prefix K stored as the type, mean KL of the next-token distribution over novel text
and over teacher-forced random codes (the copying signal, `copy_examples`).

Types: "turboB+qjl" (m = head_dim: B + 1.5 bits/value at head_dim 64) and "turboB+qjlM" (m = M).
The residual is taken where the code is (keys InnerQ-scaled); the projection is fixed (seeded).

    python -m polykv.eval.qjl --out qjl.json       # SmolLM2, K types below, V exact (~15 min, 1 thread)
"""

from __future__ import annotations

import contextlib
import math
import re

import torch

QJL_SEED = 20251205
K_TYPES = ("turbo2", "turbo2+qjl", "turbo2+qjl48", "turbo3", "turbo3+qjl", "turbo4")


def parse(name: str, head_dim: int) -> tuple[str, int]:
    """(base type, projection rows m; 0: no residual) of a K type name."""
    m = re.fullmatch(r"(turbo\d)\+qjl(\d*)", name)
    if m is None:
        return name, 0
    return m.group(1), int(m.group(2)) if m.group(2) else head_dim


def bits_per_value(name: str, head_dim: int) -> float:
    """Stored bits/value: the base codec's real bits + m sign bits and one fp16 norm per row."""
    from ..codecs import get_codec

    base, m = parse(name, head_dim)
    return get_codec(base, head_dim).bits_per_value() + ((m + 16) / head_dim if m else 0.0)


@torch.no_grad()
def qjl_estimate(r: torch.Tensor, m: int, seed: int = QJL_SEED) -> torch.Tensor:
    """r float [..., d] -> r_hat [..., d] (module docstring); the norm is rounded to fp16 as stored."""
    d = r.shape[-1]
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(m, d, generator=g).to(device=r.device, dtype=torch.float32)
    rf = r.float()
    norm = rf.norm(dim=-1, keepdim=True).to(torch.float16).float()
    return (math.sqrt(math.pi / 2) / m) * norm * (torch.sign(rf @ S.T) @ S)


def roundtrip_keys(keys: torch.Tensor, name: str, scales: torch.Tensor | None) -> torch.Tensor:
    """Keys [1, H, S, D] stored as `name` and read back in true space."""
    from ..hf.precision import _roundtrip

    base, m = parse(name, keys.shape[-1])
    k_mse, _ = _roundtrip(keys, keys, base, "f16", scales)
    if not m:
        return k_mse
    s = scales.to(keys.device, torch.float32)[None, :, None, :] if scales is not None else 1.0
    r = (keys.float() - k_mse.float()) * s  # the residual where the code is (InnerQ-scaled)
    return (k_mse.float() + qjl_estimate(r, m) / s).to(keys.dtype)


@contextlib.contextmanager
def qjl_types():
    """Within: `polykv.hf.precision`'s round trip also knows the "+qjl" K types."""
    from ..hf import precision

    real = precision._roundtrip

    def rt(keys, values, k, v, scales):
        if "+qjl" in k:
            return roundtrip_keys(keys, k, scales), real(keys, values, "f16", v, None)[1]
        return real(keys, values, k, v, scales)

    precision._roundtrip = rt
    try:
        yield
    finally:
        precision._roundtrip = real


@torch.inference_mode()
def measure(model, tok, innerq=None, k_types=K_TYPES, copy_prompts: int = 8, progress: bool = True) -> dict:
    """Per K type: the per-layer errors (novel text, copying) with V exact, their sums over layers,
    and bits/value."""
    from ..hf.kv_cache import model_layout
    from ..hf.precision import PREFIX_TOKENS, SCORED_TOKENS, _layer_errors, calibration_ids, copy_examples

    layout = model_layout(model)
    d = layout[0].head_dim
    ids = calibration_ids(tok, PREFIX_TOKENS + SCORED_TOKENS)
    out = {"k_types": list(k_types), "bits": {t: bits_per_value(t, d) for t in k_types}, "signals": {}}
    with qjl_types():
        for name, examples in (("novel", [(ids, PREFIX_TOKENS)]), ("copy", copy_examples(tok, copy_prompts))):
            k_err, _, pos = _layer_errors(model, examples, layout, innerq, k_types, (), progress,
                                          f"qjl: {name}, layer x K type")
            out["signals"][name] = {"positions": pos, "per_layer": k_err,
                                    "total": {t: sum(e[t] for e in k_err) for t in k_types}}
    return out


def main(argv=None) -> None:
    import argparse
    import json

    from ..hf.kv_cache import _resolve_innerq
    from ..hf.loading import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--copy-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    iq = _resolve_innerq("auto", model, "turbo3")
    res = measure(model, tok, iq, copy_prompts=a.copy_prompts)
    res["innerq"] = iq is not None
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    rows = [f"{t:14s} {res['bits'][t]:6.3f} bits  novel {res['signals']['novel']['total'][t]:.5f}  "
            f"copy {res['signals']['copy']['total'][t]:.5f}" for t in res["k_types"]]
    print("\n".join(rows))


if __name__ == "__main__":
    main()
