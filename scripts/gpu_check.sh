#!/usr/bin/env bash
# One prepared run on a CUDA machine: the environment, the GPU test tier and the CUDA benchmarks.
#
#   scripts/gpu_check.sh OUTDIR [STAGE ...]      (from the repository root; default: every stage)
#
# Stages: env offload gpt2-b8 bert meta-plan calibrate profile tests gpt2 compile regions seed (the default order: what
# the open work needs first). Environment: META_TARGET (the device model meta plans with; default
# h200 on an H200, else h100), PYTEST_ARGS (e.g. -k resnet),
# TESTS_LIMIT (seconds), GPT2_B8_COMPARE and BERT_COMPARE (the --compare lists), TARBALL. Each runs under its own time limit and logs to
# OUTDIR/<stage>.log; the bench reports go to reports/cuda/ (kept) and everything is packed into
# $TARBALL (default OUTDIR/cuda.tgz) after every stage. A failing stage does not stop the next. ckplan runs from the checkout
# (PYTHONPATH), so nothing is installed; set PY to another interpreter if needed.
set -u
OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR [STAGE ...]}
shift
STAGES=${*:-env offload gpt2-b8 bert meta-plan calibrate profile tests gpt2 compile regions seed}
REP=reports/cuda
mkdir -p "$OUTDIR" "$REP" "$REP/meta-plan" "$REP/offload"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=220
PY=${PY:-python3}
CK="$PY -m ckplan"

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 secs=$2
  shift 2
  echo "=== $name start $(date +%T) (limit ${secs}s): $*"
  timeout -k 10 "$secs" "$@" >"$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc end $(date +%T)"
  tail -n 30 "$OUTDIR/$name.log"
  tar czf "${TARBALL:-$OUTDIR/cuda.tgz}" "$REP" "$OUTDIR"/*.log 2>/dev/null  # after every stage: a kill keeps it
}

want() { [[ " $STAGES " == *" $1 "* ]]; }

if want env; then
  stage env 60 bash -c "nvidia-smi; $PY -c '
import torch, numpy, pandas, pydantic, typer, rich
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))
print(\"numpy\", numpy.__version__, \"pandas\", pandas.__version__, \"pydantic\", pydantic.__version__,
      \"typer\", typer.__version__)
for m in (\"transformers\", \"numba\", \"pynvml\", \"matplotlib\"):
    try:
        mod = __import__(m); print(m, getattr(mod, \"__version__\", \"?\"))
    except Exception as e:
        print(m, \"MISSING\", e)
'; $CK --help | head -5"
fi
if want tests; then
  stage tests "${TESTS_LIMIT:-200}" $PY -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rA -n 4 \
    --timeout 240 ${PYTEST_ARGS:-}
fi
# gpt2-small as configured (2 x 512 tokens, SGD), the CPU reference's shapes and default budget
# (halfway between the smallest feasible peak and none's).
if want gpt2; then
  stage gpt2 150 $CK bench configs/gpt2-small.yaml --device cuda \
    --compare none,every-k,sqrtn,chen,dp-layer,dp,selective,sac-policy,hf --k 1 --steps 20 --warmup 3 \
    --out-dir $REP --wide --debug
fi
# activation offload: bert-large at 8 x 512 (AdamW fp32) at 50%act, ckplan's dp (which offloads where the
# profile's measured host link makes it faster), a plan offloading every layer but the last, the
# torchtune-style and Megatron-style peers; the plan's peak and slowdown predicted against the measured ones.
if want offload; then
  stage offload 240 bash -c "$PY -c \"
import json; from ckplan.planner.plan import Plan, Store
n = 24; print(json.dumps(Plan('offload', n, tuple(Store(i, 'offload' if i < n - 1 else 'store') for i in range(n))).to_dict()))
\" > $REP/offload/plan-offload-bert-large.json && $CK bench configs/bert-large.yaml --device cuda --budget 50%act \
    --compare none,dp,offload-all,offload-attn --k 1 --plan $REP/offload/plan-offload-bert-large.json --steps 6 --warmup 2 \
    --out-dir $REP/offload --wide --debug"
fi
# gpt2-small at 8 x 512 tokens, the default budget.
if want gpt2-b8; then
  stage gpt2-b8 150 $CK bench configs/gpt2-small.yaml --device cuda --batch-size 8 \
    --compare ${GPT2_B8_COMPARE:-none,every-k,sqrtn,dp-layer,dp,selective,sac-policy,hf,offload-all} --k 1 --steps 10 --warmup 2 \
    --out-dir $REP/b8 --wide --debug
fi
# bert-large at the seed article's batch, 8 x 512 tokens, AdamW fp32 as configured (dropout 0.1);
# 50%act: the no-checkpoint peak with half its activations.
if want bert; then
  stage bert 180 $CK bench configs/bert-large.yaml --device cuda --budget 50%act \
    --compare ${BERT_COMPARE:-none,every-k,sqrtn,dp-layer,dp,selective,sac-policy,hf,offload-all} --k 1 --steps 6 --warmup 2 \
    --out-dir $REP --wide --debug
fi
# the plan meta chooses (fake tensors, the device model of this GPU) against the plan of the GPU's own
# profile, at the same budget, in one bench: gpt2-small at 8 x 512 tokens, 50%act
if want meta-plan; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  target=${META_TARGET:-$([[ $gpu == *H200* ]] && echo h200 || echo h100)}
  stage meta-plan 240 bash -c "$CK plan configs/gpt2-small.yaml --device meta --target $target --batch-size 8 \
    --budget 50%act -o $REP/meta-plan/meta-plan-gpt2-b8-$target.json && $CK bench configs/gpt2-small.yaml \
    --device cuda --batch-size 8 --budget 50%act --compare none,dp \
    --plan $REP/meta-plan/meta-plan-gpt2-b8-$target.json --steps 10 --warmup 2 --out-dir $REP/meta-plan --wide"
fi
# this GPU's device profile (for --device meta --target FILE)
if want calibrate; then
  stage calibrate 90 $CK calibrate --device cuda -o $REP/device-profile.json
fi
# the profile with its options table and notes (what `plan` reads), gpt2-small at 8 x 512
if want profile; then
  stage profile 90 $CK profile configs/gpt2-small.yaml --device cuda --batch-size 8 --format json \
    -o $REP/profile-gpt2-small-b8-cuda.json
fi
if want compile; then
  stage compile 200 $CK bench configs/gpt2-small.yaml --device cuda \
    --compare none,dp,selective,torch-compile,torch-compile-nobudget --steps 20 --warmup 3 \
    --out-dir $REP/peers --wide --debug
fi
# ckplan's selective options as regions inside a whole-model torch.compile against torch.compile's
# budget, gpt2-small and bert-large at 8 x 512 (SGD): peaks, held bytes, step times, gradients
if want regions; then
  stage regions 500 bash -c "$PY scripts/compiled_regions.py configs/gpt2-small.yaml --batch-size 8 \
      --variants 'nobudget;b0.5;sac-compute@all;sac-linear@all' --steps 10 --out $REP/compiled-regions-gpt2-small-b8.md; \
    $PY scripts/compiled_regions.py configs/bert-large.yaml \
      --variants 'nobudget;b0.5;sac-compute@all;sac-linear@all' --steps 10 --out $REP/compiled-regions-bert-large.md"
fi
if want seed; then
  stage seed 150 $PY scripts/seed_claims.py --device cuda --full --steps 5 --out $REP/seed-claims.md
fi
ls -la "$OUTDIR"
