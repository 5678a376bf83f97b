"""Many agents over one shared, compressed document: prefill once, ask in one batch, save, reload.

    python examples/shared_document_agents.py [path/to/document.txt]
"""

import sys
import tempfile

import polykv
from polykv.data import demo_document

model, tok = polykv.load_model()
text = open(sys.argv[1]).read() if len(sys.argv) > 1 else demo_document()

pool = polykv.SharedKVPool(model, tok, k="q8_0", v="turbo3")
doc = pool.add_document(text, name="handbook")  # prefilled once, stored once, compressed
questions = ["Who is the current chair of the Tallow Moot?",
             "On what frequency does Radio Tallow broadcast?",
             "How high is Mount Greyhallow?"]
for q, a in zip(questions, pool.generate(doc, questions, max_new_tokens=32)):
    print(f"Q: {q}\nA: {a}\n")
report = pool.memory_report()
print(f"shared compressed prefix: {report['kv_bytes_shared']:,} bytes; one f16 copy: "
      f"{report['kv_bytes_naive_f16']:,} bytes (each agent would need its own)")

with tempfile.TemporaryDirectory() as d:
    pool.save(d)
    again = polykv.SharedKVPool.load(d, model, tok)  # no re-prefill: the compressed KV is loaded
    print("after reload:", again.generate(doc, questions[:1], max_new_tokens=32)[0])
