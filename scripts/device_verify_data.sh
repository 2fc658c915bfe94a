#!/usr/bin/env bash
# verify --data warm and cold against cat on one lent machine, in one call of under 5 minutes: the machine's
# cores and CRC-32 library, the checkpoint (12.9 GB, torch's dcp.save), the warm row with another tree and the
# switches of this round timed in the same rounds (CKPT_CRC32_ZLIB=1: zlib's CRC-32; CKPT_VERIFY_PIECE_KIB=0 or
# 1024: whole windows, 1 MiB pieces), the cold row with the other tree, then the pass's stages on 1, 8 and 16
# threads.
# Each stage has its own time limit, so a slow host still returns what finished (all output under OUT).
#
#   scripts/device_verify_data.sh OUT AGAINST_TREE
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
stage "machine"
{
    echo "$HOST"
    lscpu | grep -E "^(Model name|Thread|Core|Socket|NUMA node\(s\)|L2|L3)"
    $PY -c "import zlib; print('zlib', zlib.ZLIB_RUNTIME_VERSION)"
    $PY -c "from gtp_format.hashing import crc32_backend; print('hashing.crc32:', crc32_backend())"
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} 2>&1 | tee "$OUT/machine.txt"
stage "checkpoint"
timeout 110 $PY benchmarks/bench_cli_scale.py --only verify --no-warm --no-cold --dcp-dir /tmp/vdcp \
    --verify-gb "$GB" --workdir /tmp/w16 --out "$OUT/make" || exit 1
DATA=$(ls /tmp/vdcp/*.distcp | head -1)
stage "warm"
timeout 55 $PY benchmarks/bench_cli_scale.py --only verify --repeats 2 --no-cold --dcp-dir /tmp/vdcp \
    --workdir /tmp/w16 --out "$OUT/warm" --against "$AGAINST" --variant zlib=CKPT_CRC32_ZLIB=1 \
    --variant whole=CKPT_VERIFY_PIECE_KIB=0 --variant piece1m=CKPT_VERIFY_PIECE_KIB=1024 --host "$HOST"
stage "cold"
timeout 70 $PY benchmarks/bench_cli_scale.py --only verify --repeats 2 --no-warm --dcp-dir /tmp/vdcp \
    --workdir /tmp/w16 --out "$OUT/cold" --against "$AGAINST" --host "$HOST"
stage "stages of the pass"
cat "$DATA" > /dev/null
timeout 25 $PY benchmarks/verify_data_stages.py "$DATA" --mib 2048 --threads 1,8,16 --seconds 0.3 \
    --only "zlib,hashing.crc32" --out "$OUT/stages.json"
stage "done"
