"""Kernels per pool decode step, counted on the CPU through the Triton interpreter (issue F): how
many Triton launches and how many torch ops that would each be a device kernel one eager decode
step of a pool runs — the structure of a captured step, without a GPU (the GPU times it:
`e2e.py`, `window_step.py`).

    POLYKV_TRITON_ON_CPU=1 TRITON_INTERPRET=1 python -m polykv.bench.launch_count [--out FILE]

Tiny random Llama (2 full-attention layers) and Gemma-3 (2 sliding + 1 full), head_dim 64, K q8_0 /
V turbo3, 4 agents over a 40-token document, recent windows R = 0 and 4; the fourth step of the
batch is counted, and with R = 4 also a verify step of 2 drafts per agent (issue I; case
"<model>_R4_verify2"); then, per R, the prefill of a 20-token prompt joining a running batch of 4
(continuous batching; case "<model>_R<R>_join20": the eager forward, what a GPU runs where the
captured prefill step does not apply). torch ops: aten ops other than views and allocations,
outside the Triton launches (the interpreter's own tensor traffic is not counted; a reshape that
copies counts).
Prints one line per case and writes the JSON to --out.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that are no device kernel of their own (views, metadata, allocations, host reads)
_FREE = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "select",
         "slice", "as_strided", "unsqueeze", "squeeze", "alias", "detach", "split",
         "split_with_sizes", "unbind", "narrow", "flatten", "lift_fresh", "_reshape_alias",
         "empty", "empty_strided", "empty_like", "is_nonzero", "_local_scalar_dense", "item",
         "sym_size", "sym_stride", "size", "stride", "dim", "numel"}
# a view where the layout allows one, else a copy kernel (inference mode hands these to the mode
# whole): counted as "<name> (copy)" when the result has storage of its own
_MAY_COPY = {"reshape", "flatten"}


class _TorchOps(TorchDispatchMode):
    def __init__(self, inside: list):
        super().__init__()
        self.inside, self.ops = inside, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name in _MAY_COPY and not _shares_storage(out, args[0]):
            name += " (copy)"
        if name not in _FREE and not self.inside:
            self.ops[name] = self.ops.get(name, 0) + 1
        return out


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _models():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    yield "llama", LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, max_position_embeddings=1024,
                                                **common)).eval()
    torch.manual_seed(0)
    yield "gemma", Gemma3ForCausalLM(Gemma3TextConfig(
        num_hidden_layers=3, sliding_window=8, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], **common)).eval()


def count(recents=(0, 4), agents: int = 4, drafts: int = 2, models=("llama", "gemma"), join: int = 20) -> dict:
    from triton.runtime.interpreter import InterpretedFunction

    from polykv.kernels import use_triton
    from polykv.pool import SharedKVPool

    if not use_triton(torch.zeros(1)):
        raise RuntimeError("run with POLYKV_TRITON_ON_CPU=1 TRITON_INTERPRET=1 (the interpreter)")
    launches, inside, run = [], [], InterpretedFunction.run

    def recorded(fn, *a, **k):
        launches.append(fn.__name__)
        inside.append(1)
        try:
            return run(fn, *a, **k)
        finally:
            inside.pop()

    res = {}

    def record(case: str, layers: int, ops: _TorchOps) -> None:
        kernels = {k: launches.count(k) for k in sorted(set(launches))}
        res[case] = dict(layers=layers, triton=len(launches), triton_by_kernel=kernels,
                         torch_ops=sum(ops.ops.values()), torch_by_op=ops.ops)
        print(f"{case}: {len(launches)} Triton launches {kernels}, {sum(ops.ops.values())} torch ops",
              flush=True)

    InterpretedFunction.run = recorded
    try:
        for name, model in _models():
            if name not in models:
                continue
            for R in recents:
                verify = drafts if R else 0
                pool = SharedKVPool(model, None, k="q8_0", v="turbo3", progress=False, recent=R)
                g = torch.Generator().manual_seed(1)
                doc = pool.add_document(torch.randint(3, 120, (40,), generator=g).tolist())
                with torch.inference_mode(), pool.open_batch(doc, capacity=agents, seq_capacity=40,
                                                             graphs=False) as b:
                    if verify:
                        b.expect_drafts(verify)
                    for n in (5, 1, 11, 3)[:agents]:
                        b.add(torch.randint(3, 120, (n,), generator=g).tolist())
                    toks = b.step_tokens()
                    for _ in range(3):
                        b.feed(toks)
                        toks = b.step_tokens()
                    b.feed(toks)
                    launches.clear()
                    with _TorchOps(inside) as ops:
                        toks = b.step_tokens()
                    record(f"{name}_R{R}", model.config.num_hidden_layers, ops)
                    if verify:  # drafts of any tokens: the count does not depend on acceptance
                        b.feed(toks, {a: [3 + (t % 100)] * verify for a, t in toks.items()})
                        launches.clear()
                        with _TorchOps(inside) as ops:
                            b.launch_verify().result()
                        record(f"{name}_R{R}_verify{verify}", model.config.num_hidden_layers, ops)
                if join:  # a prompt joining a running batch: its prefill, an eager forward of its tokens
                    with torch.inference_mode(), pool.open_batch(doc, capacity=agents + 1, seq_capacity=64,
                                                                 graphs=False) as b:
                        for n in (5, 1, 11, 3)[:agents]:
                            b.add(torch.randint(3, 120, (n,), generator=g).tolist())
                        b.step_tokens()  # nothing fed after it: the next step is the joiner's alone
                        b.add(torch.randint(3, 120, (join,), generator=g).tolist())
                        launches.clear()
                        with _TorchOps(inside) as ops:
                            b.step_tokens()
                        record(f"{name}_R{R}_join{join}", model.config.num_hidden_layers, ops)
                pool.close()
    finally:
        InterpretedFunction.run = run
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    res = count()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
