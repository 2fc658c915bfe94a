#!/usr/bin/env bash
# The main job on the embedded default: train a small CP-folded GPT on 8 local CPU ranks
# (tp1 cp2 gtp_remat2 dp2, fold on), checkpoint it, then inspect and verify it with `ckpt`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
OUT=${1:-runs/demo}
rm -rf "$OUT"
python -m gtp_runtime.train --nproc-per-node 8 --tp 1 --cp 2 --gtp-remat 2 --dp 2 --fold-cp \
  --steps 10 --save-interval 5 --save "$OUT"
ckpt inspect "$OUT"
ckpt verify "$OUT" --data
