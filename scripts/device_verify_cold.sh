#!/usr/bin/env bash
# verify --data cold against cat on one lent machine, in one call (docs/performance.md ran its earlier
# form: variants then named cache=CKPT_VERIFY_DIRECT=0, span16/span0=CKPT_VERIFY_SPAN_MIB=16/0 when direct was the
# default): the checkpoint (12.9 GB, torch's dcp.save),
# the warm row, the disk's cold read sweep, then the cold row with another tree and the read variants timed in the
# same rounds. Each stage has its own time limit, so a slow host still returns what finished (all output under OUT).
#
#   scripts/device_verify_cold.sh OUT AGAINST_TREE
set -u
OUT=${1:?OUT folder}
AGAINST=${2:?another checkout to time in the same rounds}
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
GB=${GB:-12.9}  # the checkpoint's size (a smaller one to try the script)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
HOST="lent machine, one ${GPU:-no GPU}, $(nproc) cores"
T0=$(date +%s)
stage() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
mkdir -p "$OUT"
stage "checkpoint"
timeout 150 $PY benchmarks/bench_cli_scale.py --only verify --no-warm --no-cold --dcp-dir /tmp/vdcp \
    --verify-gb "$GB" --workdir /tmp/w16 --out "$OUT/make" || exit 1
DATA=$(ls /tmp/vdcp/*.distcp | head -1)
stage "cold start of the CLI (no data read)"
sync; echo 3 > /proc/sys/vm/drop_caches
for k in cold warm; do
    $PY -c "import subprocess, sys, time; t = time.perf_counter(); subprocess.run([sys.executable, '-m', \
'ckpt_tool.cli', '--help'], stdout=subprocess.DEVNULL, check=True); print('ckpt --help $k:', \
round(time.perf_counter() - t, 3), 's')"
done
stage "warm"
timeout 60 $PY benchmarks/bench_cli_scale.py --only verify --repeats 2 --no-cold --dcp-dir /tmp/vdcp \
    --workdir /tmp/w16 --out "$OUT/warm" --against "$AGAINST" --host "$HOST"
stage "cold reads of $DATA"
timeout 50 $PY benchmarks/disk_ceiling.py --reads "$DATA" --read-gib 0.5 --workdir /tmp/dc --out "$OUT/reads.json"
stage "cold"
timeout 220 $PY benchmarks/bench_cli_scale.py --only verify --repeats 3 --no-warm --dcp-dir /tmp/vdcp \
    --workdir /tmp/w16 --out "$OUT/cold" --against "$AGAINST" --variant direct=CKPT_VERIFY_DIRECT=1 \
    --variant span8=CKPT_VERIFY_DIRECT=1,CKPT_VERIFY_SPAN_MIB=8 --host "$HOST"
stage "done"
