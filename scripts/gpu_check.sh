#!/usr/bin/env bash
# One command for the GPU machine: checks and times attention backend "pallas" and writes one JSON.
#
#   scripts/gpu_check.sh [OUT.json] [extra gpu_check.py flags]   default OUT: $OUT/gpu_check.json
#   scripts/gpu_check.sh --dry-run                                  CPU smoke run of the same script
#
# Designed to finish in under 8 minutes on one H200 (python 3.12, jax 0.11 with CUDA plugins, no
# network). Pure-Python dependencies missing there travel as wheels in .whl/ (or $JAXSCHED_WHEELS)
# and are installed into /tmp/site, never into the system environment. See
# `python scripts/gpu_check.py --help` for the phases and the table the JSON fills in.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# Each phase runs in its own process; without this the first would hold 75 % of the GPU's memory.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

WHEELS=${JAXSCHED_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# What the offline engine imports; the server's packages (starlette, uvicorn, msgspec) are not needed.
missing=$("$PY" - <<'PYEOF'
import importlib.util
mods = ["jax", "flax", "numpy", "transformers", "tokenizers", "safetensors", "jinja2", "tqdm"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python packages: $missing" >&2
  echo "  download their wheels for python 3.12 into $WHEELS/ on a machine with network access" >&2
  echo "  (pip download --no-deps --only-binary=:all: --python-version 3.12 -d $WHEELS NAME) and rerun" >&2
  exit 2
fi

args=()
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
  args+=(--out "$1")
  shift
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
exec "$PY" scripts/gpu_check.py "${args[@]}" "$@"
