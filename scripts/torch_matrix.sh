#!/usr/bin/env bash
# The correctness tier (scripts/torch_tier.py) on every torch version pyproject.toml admits, one
# virtual environment per version (a CUDA build of torch is 5-6 GB: each is removed after its run
# unless KEEP_VENVS=1).
#
#   scripts/torch_matrix.sh                 # the newest patch release of every minor version
#   scripts/torch_matrix.sh 2.11.0 2.14.1   # only these
#
# Writes reports/torch-matrix/<version>.json and the table reports/torch-matrix/README.md.
# VENV_ROOT (default: a temporary folder) holds the environments, torch-<version> each; one that
# already has that torch is reused.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
  VERSIONS=(2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0)
fi
OUT=reports/torch-matrix
mkdir -p "$OUT"
ROOT_DIR=${VENV_ROOT:-$(mktemp -d -t ckplan-matrix-XXXXXX)}
KEEP=${KEEP_VENVS:-0}
current=""
cleanup() { if [ "$KEEP" != 1 ] && [ -n "$current" ]; then rm -rf "$current"; fi; }
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
status=0
for v in "${VERSIONS[@]}"; do
  echo "== torch $v" >&2
  current="$ROOT_DIR/torch-$v"
  py="$current/bin/python"
  if ! "$py" -c "import sys, torch, ckplan, xdist; sys.exit(torch.__version__.split('+')[0] != '$v')" 2>/dev/null; then
    rm -rf "$current"
    python3 -m venv "$current"
    if ! { "$py" -m pip install -q --no-cache-dir "torch==$v" \
           && "$py" -m pip install -q --no-cache-dir -e '.[test,hf]'; } >&2; then
      echo "torch $v: install failed" >&2
      status=1
      cleanup
      continue
    fi
  fi
  "$py" scripts/torch_tier.py --out "$OUT/$v.json" || status=1
  cleanup
done
current=""
python3 scripts/torch_tier.py --table "$OUT"/*.json > "$OUT/README.md"
cat "$OUT/README.md"
exit $status
