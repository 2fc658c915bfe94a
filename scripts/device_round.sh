#!/usr/bin/env bash
# The CLI's scale figures on one lent machine, in two calls of under 10 minutes each (docs/performance.md
# records what they printed): every row's baseline is timed in the same run, on the same host.
#
#   scripts/device_round.sh OUT disk   # verify --data warm and cold vs cat, reshard and export --to hf vs cp -r
#   scripts/device_round.sh OUT more   # inspect/verify of 1M chunks vs torch, HF <-> megatron-core vs cp -r,
#                                      # torchrun ranks vs one process (RAM-backed)
#   scripts/device_round.sh OUT small  # reshard and export vs cp -r, HF <-> megatron-core (about 4 minutes)
#   scripts/device_round.sh OUT verify_hf  # verify --data cold and warm, HF <-> megatron-core (about 6 minutes)
#   scripts/device_round.sh OUT one    # what one call of under 8 minutes holds: verify --data cold and warm,
#                                      # reshard and export, HF <-> megatron-core (2 rounds each)
#
# Each stage has its own time limit, so a slow host still returns what finished (all output under OUT).
# The lent image lacks some dependencies: carry their cp312 wheels (.whl, see .library/device/README.md) and install
# them into the image's own python (pip install --no-index --no-deps --upgrade .whl/*.whl), not with --target:
# the benchmarks start their commands with PYTHONPATH set to the repository alone.
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
# each stage: its time limit (s), then its rounds
make_dcp() {
    stage "checkpoint (12.9 GB, torch's dcp.save)"
    timeout "$1" $PY benchmarks/bench_cli_scale.py --only verify --no-warm --no-cold --dcp-dir /tmp/vdcp \
        --workdir /tmp/w16 --out "$OUT/make" || exit 1
}
verify_rows() {  # cold|warm limit rounds
    stage "verify --data $1"
    local skip=--no-warm
    [ "$1" = warm ] && skip=--no-cold
    timeout "$2" $PY benchmarks/bench_cli_scale.py --only verify --repeats "$3" $skip --dcp-dir /tmp/vdcp \
        --workdir /tmp/w16 --out "$OUT/$1" --host "$HOST"
}
reshard_rows() {
    stage "reshard and export --to hf --optimizer vs cp -r"
    timeout "$1" $PY benchmarks/bench_cli_scale.py --only reshard --repeats 2 --workdir /tmp/w16r \
        --out "$OUT/reshard" --host "$HOST"
}
hf_rows() {
    stage "HF <-> megatron-core vs cp -r"
    timeout "$1" $PY benchmarks/bench_hf_megatron.py --gb 4 --repeats 2 --workdir /tmp/hfmc > "$OUT/hf_megatron.txt" 2>&1
    tail -3 "$OUT/hf_megatron.txt"
}
case "$WHAT" in
    disk) make_dcp 150; verify_rows warm 60 3; verify_rows cold 120 3; rm -rf /tmp/vdcp; reshard_rows 200 ;;
    small) reshard_rows 140; hf_rows 100 ;;
    verify_hf) make_dcp 120; verify_rows cold 70 2; verify_rows warm 40 2; rm -rf /tmp/vdcp; hf_rows 100 ;;
    one) make_dcp 130; verify_rows cold 80 2; verify_rows warm 40 2; rm -rf /tmp/vdcp; reshard_rows 130; hf_rows 90 ;;
    more)
        stage "inspect and verify of 1M chunks vs torch"
        timeout 150 $PY benchmarks/bench_cli_scale.py --only meta --repeats 2 --workdir /tmp/w16m \
            --out "$OUT/meta" --host "$HOST"
        hf_rows 180
        stage "torchrun ranks vs one process, RAM-backed"
        timeout 220 $PY benchmarks/bench_dist_ckpt.py --layers 8 --ranks 4 --cores 4 --one-core --pycache /tmp/pyc \
            --out "$OUT/dist" ;;
    *) echo "disk, one, small, verify_hf or more" >&2; exit 2 ;;
esac
stage "done"
