#!/usr/bin/env bash
# The correctness tier (scripts/torch_tier.py) on every torch version pyproject.toml admits, one
# virtual environment at a time (a CUDA build of torch is 5-6 GB: each is removed after its run).
#
#   scripts/torch_matrix.sh                 # every minor version in the declared range
#   scripts/torch_matrix.sh 2.11.0 2.14.1   # only these
#
# Writes reports/torch-matrix/<version>.json and the table reports/torch-matrix/README.md.
# VENV_ROOT (default: a temporary folder) is where the environments are made.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
  # the newest patch release of each minor version from 2.5 (see pyproject.toml)
  VERSIONS=(2.5.1 2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.0 2.13.0 2.14.1)
fi
OUT=reports/torch-matrix
mkdir -p "$OUT"
ROOT_DIR=${VENV_ROOT:-$(mktemp -d -t ckplan-matrix-XXXXXX)}
trap 'rm -rf "$ROOT_DIR/venv"' EXIT INT TERM
status=0
for v in "${VERSIONS[@]}"; do
  echo "== torch $v" >&2
  rm -rf "$ROOT_DIR/venv"
  python3 -m venv "$ROOT_DIR/venv"
  py="$ROOT_DIR/venv/bin/python"
  # transformers 5 needs torch >= 2.6; older torch gets the last transformers 4
  hf='transformers>=4.40'
  case "$v" in 2.5.*) hf='transformers>=4.40,<5' ;; esac
  if ! { "$py" -m pip install -q "torch==$v" "$hf" && "$py" -m pip install -q -e '.[test,hf]'; } >&2; then
    echo "torch $v: install failed" >&2
    status=1
    continue
  fi
  "$py" scripts/torch_tier.py --out "$OUT/$v.json" || status=1
  rm -rf "$ROOT_DIR/venv"
done
python3 scripts/torch_tier.py --table "$OUT"/*.json > "$OUT/README.md"
cat "$OUT/README.md"
exit $status
