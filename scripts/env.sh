# Shared by demo.sh and test.sh: a project-local virtualenv with the pinned dependencies.
# torch==2.13.0 (pinned in pyproject.toml) is the CPU build; a looser spec pulls a multi-GB CUDA one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import gtp_runtime, ckpt_tool, torch, numba, typer, pytest, xdist, hypothesis, tokenizers, transformers, xxhash, zlib_ng, blake3, moto, boto3, obstore, s3fs" 2>/dev/null; then
  # torch first, alone: then pip takes the CPU build from local disk. Resolved together with the test
  # extras (moto, s3fs, ...), pip once chose PyPI's CUDA build of the same version (GBs, and a torch
  # import that runs ldconfig and takes 515 MB: the hostile tests' bounds failed on a fresh clone).
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
fi
export PATH="$PWD/.venv/bin:$PATH"
