"""Generate with an asymmetrically compressed KV cache (K q8_0, V turbo3) and compare with f16.

    python examples/kvcache_generate.py
"""

import torch

import polykv

model, tok = polykv.load_model()  # embedded SmolLM2-135M-Instruct
messages = [{"role": "user", "content": "Name three uses of a lighthouse, briefly."}]
inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

for k, v in [("f16", "f16"), ("q8_0", "turbo3")]:
    cache = polykv.KVCache(model, k=k, v=v)
    with torch.inference_mode():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"K={k:5} V={v:6} KV bytes={cache.nbytes():>10,}  {text!r}")
