#!/usr/bin/env bash
# The CLI's scale figures on one lent machine, in two calls of under 10 minutes each (docs/performance.md
# records what they printed): every row's baseline is timed in the same run, on the same host.
#
#   scripts/device_round.sh OUT disk   # verify --data warm and cold vs cat, reshard and export --to hf vs cp -r
#   scripts/device_round.sh OUT more   # inspect/verify of 1M chunks vs torch, HF <-> megatron-core vs cp -r,
#                                      # torchrun ranks vs one process (RAM-backed)
#   scripts/device_round.sh OUT one    # what one call of under 8 minutes holds: verify --data cold and warm,
#                                      # reshard and export, HF <-> megatron-core (2 rounds each)
#
# Each stage has its own time limit, so a slow host still returns what finished (all output under OUT).
set -u
OUT=${1:?OUT folder}
WHAT=${2:?disk or more}
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
HOST="lent machine, one ${GPU:-no GPU}, $(nproc) cores"
T0=$(date +%s)
stage() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
mkdir -p "$OUT"
echo "$HOST" > "$OUT/host.txt"
df -h /tmp /dev/shm >> "$OUT/host.txt" 2>&1
if [ "$WHAT" = disk ]; then
    stage "checkpoint (12.9 GB, torch's dcp.save)"
    timeout 150 $PY benchmarks/bench_cli_scale.py --only verify --no-warm --no-cold --dcp-dir /tmp/vdcp \
        --workdir /tmp/w16 --out "$OUT/make" || exit 1
    stage "verify --data warm"
    timeout 60 $PY benchmarks/bench_cli_scale.py --only verify --repeats 3 --no-cold --dcp-dir /tmp/vdcp \
        --workdir /tmp/w16 --out "$OUT/warm" --host "$HOST"
    stage "verify --data cold"
    timeout 120 $PY benchmarks/bench_cli_scale.py --only verify --repeats 3 --no-warm --dcp-dir /tmp/vdcp \
        --workdir /tmp/w16 --out "$OUT/cold" --host "$HOST"
    rm -rf /tmp/vdcp
    stage "reshard and export --to hf --optimizer vs cp -r"
    timeout 200 $PY benchmarks/bench_cli_scale.py --only reshard --repeats 2 --workdir /tmp/w16r \
        --out "$OUT/reshard" --host "$HOST"
elif [ "$WHAT" = one ]; then
    stage "checkpoint (12.9 GB, torch's dcp.save)"
    timeout 130 $PY benchmarks/bench_cli_scale.py --only verify --no-warm --no-cold --dcp-dir /tmp/vdcp \
        --workdir /tmp/w16 --out "$OUT/make" || exit 1
    stage "verify --data cold"
    timeout 80 $PY benchmarks/bench_cli_scale.py --only verify --repeats 2 --no-warm --dcp-dir /tmp/vdcp \
        --workdir /tmp/w16 --out "$OUT/cold" --host "$HOST"
    stage "verify --data warm"
    timeout 40 $PY benchmarks/bench_cli_scale.py --only verify --repeats 2 --no-cold --dcp-dir /tmp/vdcp \
        --workdir /tmp/w16 --out "$OUT/warm" --host "$HOST"
    rm -rf /tmp/vdcp
    stage "reshard and export --to hf --optimizer vs cp -r"
    timeout 130 $PY benchmarks/bench_cli_scale.py --only reshard --repeats 2 --workdir /tmp/w16r \
        --out "$OUT/reshard" --host "$HOST"
    stage "HF <-> megatron-core vs cp -r"
    timeout 90 $PY benchmarks/bench_hf_megatron.py --gb 4 --repeats 2 --workdir /tmp/hfmc > "$OUT/hf_megatron.txt" 2>&1
    tail -3 "$OUT/hf_megatron.txt"
elif [ "$WHAT" = more ]; then
    stage "inspect and verify of 1M chunks vs torch"
    timeout 150 $PY benchmarks/bench_cli_scale.py --only meta --repeats 2 --workdir /tmp/w16m \
        --out "$OUT/meta" --host "$HOST"
    stage "HF <-> megatron-core vs cp -r"
    timeout 180 $PY benchmarks/bench_hf_megatron.py --gb 4 --repeats 2 --workdir /tmp/hfmc > "$OUT/hf_megatron.txt" 2>&1
    tail -3 "$OUT/hf_megatron.txt"
    stage "torchrun ranks vs one process, RAM-backed"
    timeout 220 $PY benchmarks/bench_dist_ckpt.py --layers 8 --ranks 4 --cores 4 --one-core --pycache /tmp/pyc \
        --out "$OUT/dist"
fi
stage "done"
