#!/usr/bin/env bash
# One prepared run on a CUDA machine: the environment, the GPU test tier and the CUDA benchmarks.
#
#   scripts/gpu_check.sh OUTDIR [STAGE ...]      (from the repository root)
#
# Stages run in the order given; the default is what the open work needs first:
#   env calibrate offload meta-plan gpt2-b8 bf16 compile-b8 sac-probe
# (a device profile with the view and attention fields; bert-large's offloading plans, their copies
# queued behind the forward; meta's plan for this GPU benched beside its own profile's; meta's bf16
# autocast and the options' unkept autocast copies against a bf16 bench; the whole-model compile of
# bert-large with dp's min-cut candidate; what SAC recomputes and costs per layer), and the others:
# tests bert profile gpt2 compile regions rank seed.
# Each runs under its own time limit (LIMIT_<stage> in seconds overrides it, '-' as '_': LIMIT_gpt2_b8)
# and logs to OUTDIR/<stage>.log; the bench reports go to reports/cuda/ (kept) and everything is packed
# into $TARBALL (default OUTDIR/cuda.tgz) after every stage. A failing stage does not stop the next.
# Environment: META_TARGET (the device model meta plans with; default h200 on an H200, else h100),
# PYTEST_K (a -k expression), PYTEST_ARGS (more arguments, e.g. -v), OFFLOAD_COMPARE, GPT2_B8_COMPARE, BF16_COMPARE,
# BERT_COMPARE and COMPILE_COMPARE (the
# --compare lists), COMPILE_MODELS (compile-b8's specs; default bert-large; gpt2-small too), TARBALL.
# ckplan runs from the checkout (PYTHONPATH), so nothing is installed; set PY to another interpreter.
set -u
OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR [STAGE ...]}
shift
STAGES=${*:-env calibrate offload meta-plan gpt2-b8 bf16 compile-b8 sac-probe}
REP=${REP:-reports/cuda}  # where the reports go (one folder per GPU: reports/cuda/h100)
mkdir -p "$OUTDIR" "$REP" "$REP/meta-plan" "$REP/offload" "$REP/compiled" "$REP/b8" "$REP/bf16"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=220
PY=${PY:-python3}
CK="$PY -m ckplan"

stage() {  # stage NAME SECONDS COMMAND...   (LIMIT_<NAME> overrides SECONDS)
  local name=$1 var="LIMIT_${1//-/_}"
  local secs=${!var:-$2}
  shift 2
  echo "=== $name start $(date +%T) (limit ${secs}s): $*"
  timeout -k 10 "$secs" "$@" >"$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc end $(date +%T)"
  tail -n 30 "$OUTDIR/$name.log"
  tar czf "${TARBALL:-$OUTDIR/cuda.tgz}" "$REP" "$OUTDIR"/*.log 2>/dev/null  # after every stage: a kill keeps it
}

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
target=${META_TARGET:-$([[ $gpu == *H200* ]] && echo h200 || echo h100)}
META_PLAN=$REP/meta-plan/meta-plan-gpt2-b8-$target.json

run_env() {
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
}

# activation offload: bert-large at 8 x 512 (AdamW fp32) at 50%act, ckplan's dp (which offloads where the
# profile's measured host link makes it faster, its copies queued behind the whole forward and released
# where the profile says they are done), a plan offloading every layer but the last (its release points
# chosen the same way by the bench), the torchtune-style and Megatron-style peers; the plan's peak and
# slowdown predicted against the measured ones; with the default OFFLOAD_COMPARE also the rows a meta
# device model is checked against. The mark: 50% of the activations saved at no more than 2% slowdown.
run_offload() {
  stage offload 240 bash -c "$PY -c \"
import json; from ckplan.planner.plan import Plan, Store
n = 24; print(json.dumps(Plan('offload', n, tuple(Store(i, 'offload' if i < n - 1 else 'store') for i in range(n))).to_dict()))
\" > $REP/offload/plan-offload-bert-large.json && $CK bench configs/bert-large.yaml --device cuda --budget 50%act \
    --compare ${OFFLOAD_COMPARE:-none,every-k,dp-layer,dp,selective,sac-policy,offload-all,offload-attn} --k 1 \
    --plan $REP/offload/plan-offload-bert-large.json --steps 6 --warmup 2 --out-dir $REP/offload --wide --debug"
}

# the plans meta chooses (fake tensors, the device model of this GPU) at 50%act, gpt2-small and bert-large
# at 8 x 512: the gpt2-b8 stage benches the first beside the plan of the GPU's own profile
run_meta-plan() {
  stage meta-plan 90 bash -c "$CK plan configs/gpt2-small.yaml --device meta --target $target --batch-size 8 \
    --budget 50%act -o $META_PLAN && $CK plan configs/bert-large.yaml --device meta --target $target --batch-size 8 \
    --budget 50%act -o $REP/meta-plan/meta-plan-bert-large-b8-$target.json"
}

# gpt2-small at 8 x 512 tokens (SGD) at 50%act, with the meta plan (meta-plan stage) when there is one
run_gpt2-b8() {
  local plan_arg=""
  [[ -f $META_PLAN ]] && plan_arg="--plan $META_PLAN"
  stage gpt2-b8 150 $CK bench configs/gpt2-small.yaml --device cuda --batch-size 8 --budget 50%act $plan_arg \
    --compare "${GPT2_B8_COMPARE:-none,every-k,sqrtn,dp-layer,dp,selective,sac-policy,hf,offload-all,offload-attn}" \
    --k 1 --steps 10 --warmup 2 --out-dir $REP/b8 --wide --debug
}

# bf16 autocast: gpt2-small at 8 x 512 (SGD), dp planned halfway (no budget), its options
# (OptionRecord.cast_bytes) measured; on a CPU afterwards `scripts/meta_vs_gpu.py --target h200
# reports/cuda/bf16/bench-gpt2-small-cuda.json` checks meta's CUDA autocast rules against it
run_bf16() {
  stage bf16 150 $CK bench configs/gpt2-small.yaml --device cuda --batch-size 8 --precision bf16 \
    --compare "${BF16_COMPARE:-none,every-k,dp,selective,sac-policy}" --k 1 --steps 10 --warmup 2 \
    --out-dir $REP/bf16 --wide --debug
}

# this GPU's device profile (for --device meta --target FILE)
run_calibrate() {
  stage calibrate 90 $CK calibrate --device cuda -o $REP/device-profile.json
}

run_tests() {
  # shellcheck disable=SC2086
  stage tests 200 $PY -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rA -n 4 --timeout 240 \
    ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-}
}

# ckplan's plans against torch.compile with and without its activation budget, at 8 x 512 tokens and
# 50%act: gpt2-small (SGD) and bert-large (AdamW); COMPILE_SCOPE model (default): ckplan's rows as
# one whole-model compile each, a checkpoint region per layer; layers: each chain layer compiled
run_compile-b8() {
  local m
  for m in ${COMPILE_MODELS:-bert-large}; do
    stage "compile-b8-$m" 300 $CK bench "configs/$m.yaml" --device cuda --batch-size 8 --budget 50%act --compile \
      --compile-scope "${COMPILE_SCOPE:-model}" \
      --compare "${COMPILE_COMPARE:-none,dp,torch-compile,torch-compile-nobudget}" --steps 10 --warmup 2 \
      --out-dir $REP/compiled --wide --debug
  done
}

# bert-large at the seed article's batch, 8 x 512 tokens, AdamW fp32 as configured (dropout 0.1);
# 50%act: the no-checkpoint peak with half its activations.
run_bert() {
  stage bert 180 $CK bench configs/bert-large.yaml --device cuda --budget 50%act \
    --compare "${BERT_COMPARE:-none,every-k,sqrtn,dp-layer,dp,selective,sac-policy,hf,offload-all}" --k 1 --steps 6 \
    --warmup 2 --out-dir $REP --wide --debug
}

# the profile with its options table and notes (what `plan` reads), gpt2-small at 8 x 512
run_profile() {
  stage profile 90 $CK profile configs/gpt2-small.yaml --device cuda --batch-size 8 --format json \
    -o $REP/profile-gpt2-small-b8-cuda.json
}

# gpt2-small as configured (2 x 512 tokens, SGD), the CPU reference's shapes and default budget
# (halfway between the smallest feasible peak and none's).
run_gpt2() {
  stage gpt2 150 $CK bench configs/gpt2-small.yaml --device cuda \
    --compare none,every-k,sqrtn,chen,dp-layer,dp,selective,sac-policy,hf --k 1 --steps 20 --warmup 3 \
    --out-dir $REP --wide --debug
}

run_compile() {
  stage compile 200 $CK bench configs/gpt2-small.yaml --device cuda \
    --compare none,dp,selective,torch-compile,torch-compile-nobudget --steps 20 --warmup 3 \
    --out-dir $REP/peers --wide --debug
}

# ckplan's selective options as regions inside a whole-model torch.compile against torch.compile's
# budget, gpt2-small and bert-large at 8 x 512 (SGD): peaks, held bytes, step times, gradients
run_regions() {
  stage regions 500 bash -c "$PY scripts/compiled_regions.py configs/gpt2-small.yaml --batch-size 8 \
      --variants 'nobudget;b0.5;sac-compute@all;sac-linear@all' --steps 10 --out $REP/compiled-regions-gpt2-small-b8.md; \
    $PY scripts/compiled_regions.py configs/bert-large.yaml \
      --variants 'nobudget;b0.5;sac-compute@all;sac-linear@all' --steps 10 --out $REP/compiled-regions-bert-large.md"
}

# what torch's SAC policy and ckplan's selective plans recompute and cost per layer, gpt2-small at 8 x 512
# (the meta device model prices them 8-12 points below what an H100 measured): kernels counted per step
run_sac-probe() {
  stage sac-probe 120 $PY scripts/sac_probe.py --device cuda --batch-size 8 --rounds 5
}

# one NCCL rank under FSDP2 (the GPU has no peer here): the small GPT of configs/gpt-small-dist.yaml
# in fp32, with bf16 autocast, and under FSDP2's MixedPrecisionPolicy (param_dtype bf16, reducing in
# fp32 and in bf16), per-rank peaks from torch.cuda.max_memory_allocated against the per-rank model
run_rank() {
  { cat configs/gpt-small-dist.yaml; echo "parallel: {kind: fsdp, param_dtype: bf16}"; } \
    > "$OUTDIR/gpt-small-dist-policy.yaml"
  { cat configs/gpt-small-dist.yaml; echo "parallel: {kind: fsdp, param_dtype: bf16, reduce_dtype: bf16}"; } \
    > "$OUTDIR/gpt-small-dist-policy-bf16-reduce.yaml"
  stage rank 300 bash -c "$CK bench configs/gpt-small-dist.yaml --device cuda --nproc 1 --compare none,every-k,dp \
      --steps 5 --out-dir $REP/rank --wide --debug; \
    $CK bench configs/gpt-small-dist.yaml --device cuda --nproc 1 --precision bf16 --compare none,every-k,dp \
      --steps 5 --out-dir $REP/rank-bf16 --wide --debug; \
    $CK bench $OUTDIR/gpt-small-dist-policy.yaml --device cuda --nproc 1 --compare none,every-k,dp \
      --steps 5 --out-dir $REP/rank --wide --debug; \
    $CK bench $OUTDIR/gpt-small-dist-policy-bf16-reduce.yaml --device cuda --nproc 1 --compare none,every-k,dp \
      --steps 5 --out-dir $REP/rank --wide --debug"
}

run_seed() {
  stage seed 150 $PY scripts/seed_claims.py --device cuda --full --steps 5 --out $REP/seed-claims.md
}

for s in $STAGES; do
  if declare -F "run_$s" >/dev/null; then "run_$s"; else echo "=== unknown stage: $s"; fi
done
ls -la "$OUTDIR"
