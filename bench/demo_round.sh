#!/usr/bin/env bash
# The demo pair against llama.cpp on a quiet machine: bench/spec_cores.py (--threads 1,2, llama.cpp
# plain and DFlash beside ours, both calibrated first), for the fp32 drafter and the int4 one
# (`quantize --draft-only`), block 8. About 3 minutes on a quiet machine with 2 or more cores.
#
# Needs: this repository's venv with the export extras (PY, default .venv/bin/python), the llama.cpp
# build and the demo GGUFs under ~/.cache/dflash-export/llamacpp (or DFLASH_LLAMACPP_CACHE; see
# bench/spec_cores.py). Writes the exports under OUT (default /tmp/demo_round) and logs to stdout.
#
#     bash bench/demo_round.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DX=$(dirname "$PY")/dflash-export
OUT=${1:-/tmp/demo_round}
export OMP_WAIT_POLICY=PASSIVE
mkdir -p "$OUT"
[ -f "$OUT/b8/manifest.json" ] || "$DX" export --target demo/pair/target --draft demo/pair/draft \
    --out "$OUT/b8" --attention ort --block-size 8 >/dev/null
[ -f "$OUT/b8-d4/manifest.json" ] || "$DX" quantize "$OUT/b8" --out "$OUT/b8-d4" --quantize int4 \
    --draft-only >/dev/null
echo "== $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), load $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" bench/spec_cores.py --ours "f32=$OUT/b8" --ours "d4=$OUT/b8-d4" --threads 1,2 --rounds 2 --calibrate --json
echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
