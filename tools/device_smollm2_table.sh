#!/usr/bin/env bash
# Issue 21 item 3: the learning table of docs/results.md on SmolLM2-135M-Instruct, on one GPU.
# Step-0 policy entropy for BF16, NVFP4, MXFP4 and NF4, and GRPO runs (reward curve, held-out
# accuracy before and after) of BF16-LoRA, NVFP4-LoRA, NVFP4 + AQN and NF4 (QLoRA) x 3 seeds, all
# at once on the one GPU, with configs/smollm2-135m-grpo.toml on models/tiny-math's one-step word
# problems. Prints one markdown table last; logs, metrics and evaluations come back
# in $OUT/smollm2-table.tgz.
#
# Here:  the release binary as for tools/device_results.sh (.device/qerl.tar.gz), then
#        tools/smollm2_pieces.sh   (.device/smollm2.part-aa, -ab, smollm2.sha256, smollm2-skel.tar.xz)
# There (repository root; carry .device/... paths):
#        bash tools/device_smollm2_table.sh
# The GGUF does not fit one call beside the binary (64 MiB a call including the working tree,
# ~23 MB; the binary ~15 MiB, the xz'd GGUF 86 MiB), so it comes in four pieces of 22 MiB over
# four calls to the same warm machine (the first with the binary): each call
# keeps the pieces it finds in .device/ under $WORK/parts (runs/ survives between calls; a later
# call's carry may replace .device/). While a piece is missing the call says which and
# (WARM=1, the default) fills the kernel caches with a made-up model of the same shape
# (tools/smollm2_skeleton.py, carried as .device/smollm2-skel.tar.xz): the table's 15 processes
# for 3 steps each, so that the next call trains from its first seconds instead of spending
# minutes in NVRTC; it prints their step times and memory and records the STEPS that fit. Once
# every piece is there, the GGUF is reassembled, its sha256 checked, converted once, and the
# table is run. MODEL_GGUF=path skips the pieces.
#
# Knobs (env): STEPS (as given, else what the warm-up measured to fit, runs/smollm2/steps-fit,
#   else 50), SEEDS ("1 2 3"), EVAL_LIMIT (128), PROMPTS (8), GROUP (8), MAX_TOKENS (128),
#   MAX_OPS (1: the tasks' operations), GRAD_ACCUM (4: micro-batches a step), DEADLINE (seconds
#   from the start by which everything is written back, 570), EVAL_RESERVE (seconds kept for the
#   final evaluation, 60), DEVICE (cuda; cpu for a dry run), QERL (a qerl binary instead of
#   .device/qerl.tar.gz), WORK (runs/smollm2), WARM (1), STAGE (auto | warm | table).
# CPU dry run (a few minutes on 2 cores):
#   QERL=path/to/qerl DEVICE=cpu STEPS=2 SEEDS=1 EVAL_LIMIT=2 PROMPTS=2 GROUP=2 MAX_TOKENS=8 \
#     OUT=/tmp/out bash tools/device_smollm2_table.sh
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
work=${WORK:-runs/smollm2}
mkdir -p "$work/parts" "$work/logs"
work=$(cd "$work" && pwd)
logs=$work/logs
config=configs/smollm2-135m-grpo.toml
device=${DEVICE:-cuda}
deadline=${DEADLINE:-570}
# STEPS: as given, else what the warm-up measured to fit (steps-fit), else 50
steps=${STEPS:-$(cat "$work/steps-fit" 2> /dev/null || echo 50)}
seeds=${SEEDS:-1 2 3}
eval_limit=${EVAL_LIMIT:-128}
prompts=${PROMPTS:-8}
group=${GROUP:-8}
max_tokens=${MAX_TOKENS:-128}
max_ops=${MAX_OPS:-1}
grad_accum=${GRAD_ACCUM:-4}
left() { echo $((deadline - SECONDS)); }
say() { echo "[$(date -u +%T) +${SECONDS}s] $*"; }

if [ "$device" = cuda ]; then
  source tools/device_cache.sh # kernel caches under target/ (kept on a warm machine)
  cache_restore
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%FT%TZ; } | tee "$logs/device.txt"
  export CUBECL_AUTOTUNE_LEVEL=minimal
  # MPS (MPS=1, the default): the table's processes launch small kernels; without MPS the GPU
  # time-slices between their contexts, with it their kernels run side by side. Checked with
  # one CUDA context first; off again if that fails, and stopped when the script ends.
  if [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/qerl-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/qerl-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT &&
      timeout 60 python3 -c "import torch; print('MPS on: a CUDA context answers', float(torch.ones(8, device='cuda').sum()))"; then
      :
    else
      echo quit | nvidia-cuda-mps-control; trap - EXIT
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; echo "MPS failed: off"
    fi
  fi
fi

# --- the pieces: keep what this call brought, check it, reassemble when complete
for f in .device/smollm2.sha256 .device/smollm2-skel.tar.xz .device/smollm2.part-*; do
  [ -f "$f" ] && cp "$f" "$work/parts/"
done
# --- the binary (after the pieces are stored: a call without it still keeps what it brought)
if [ -n "${QERL:-}" ]; then
  qerl=$(realpath "$QERL")
else
  [ -f .device/qerl.tar.gz ] && tar -xzf .device/qerl.tar.gz -C "$work"
  qerl=$work/qerl
fi
[ -x "$qerl" ] || { echo "no qerl binary: carry .device/qerl.tar.gz (or set QERL); pieces kept: $(ls "$work/parts" | tr '\n' ' ')"; exit 1; }

gguf=${MODEL_GGUF:-}
missing=""
if [ -z "$gguf" ]; then
  sums=$work/parts/smollm2.sha256
  [ -s "$sums" ] || { echo "no .device/smollm2.sha256 (tools/smollm2_pieces.sh) and no MODEL_GGUF"; exit 1; }
  want=$(awk '$2 == "gguf" { print $1 }' "$sums")
  gguf=$work/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ -s "$gguf" ] && [ "$(sha256sum < "$gguf" | cut -d' ' -f1)" = "$want" ]; then
    say "GGUF already reassembled: $gguf"
  else
    parts=$(awk '$2 ~ /^smollm2\.part-/ { print $2 }' "$sums")
    for p in $parts; do
      have=$( [ -f "$work/parts/$p" ] && sha256sum < "$work/parts/$p" | cut -d' ' -f1)
      [ "$have" = "$(awk -v p="$p" '$2 == p { print $1 }' "$sums")" ] || missing="$missing $p"
    done
    if [ -z "$missing" ]; then
      unxz() { if command -v xz > /dev/null; then xz -dc; else
        python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)"; fi; }
      (cd "$work/parts" && cat $parts) | unxz > "$gguf.tmp"
      got=$(sha256sum < "$gguf.tmp" | cut -d' ' -f1)
      [ "$got" = "$want" ] || { echo "reassembled GGUF: sha256 $got, expected $want"; exit 1; }
      mv "$gguf.tmp" "$gguf" && rm -f "$work"/parts/smollm2.part-*
      say "GGUF reassembled, sha256 $got"
    else
      say "pieces still missing:$missing (have: $(cd "$work/parts" && ls smollm2.part-* 2> /dev/null | tr '\n' ' '))"
    fi
  fi
fi
stage=${STAGE:-auto}
if [ "$stage" = auto ]; then
  if [ -z "$missing" ]; then stage=table; elif [ "${WARM:-1}" = 1 ]; then stage=warm; else exit 0; fi
fi

# --- the task: models/tiny-math's problems with at most MAX_OPS operations
for split in train test; do
  awk -v max="$max_ops" '{ line = $0; if (gsub(/<</, "", line) <= max) print }' \
    models/tiny-math/data/$split.jsonl > "$work/$split.jsonl"
done
say "task: $(wc -l < "$work/train.jsonl") training and $(wc -l < "$work/test.jsonl") held-out problems of at most $max_ops operations"

# one run: NAME SEED PRECISION AQN_SCHEDULE MODEL_DIR [more qerl train arguments]
run() {
  local name=$1 seed=$2 prec=$3 sched=$4 model=$5
  shift 5
  local dir=$work/runs/$name-s$seed
  rm -rf "$dir"
  timeout -k 45 "$run_timeout" "$qerl" train --config $config --device "$device" --quiet \
    --time-budget "$budget" \
    --set "model.dir=\"$model\"" --set "model.precision=\"$prec\"" --set "aqn.schedule=\"$sched\"" \
    --set train.seed="$seed" --set "train.output_dir=\"$dir\"" --set train.steps="$steps" \
    --set "data.path=\"$work/train.jsonl\"" --set "eval.dataset=\"$work/test.jsonl\"" \
    --set eval.limit="$eval_limit" --set rollout.batch_prompts="$prompts" --set rollout.group_size="$group" \
    --set rollout.max_completion_tokens="$max_tokens" --set eval.max_completion_tokens="$max_tokens" \
    --set optim.grad_accum="$grad_accum" \
    "$@" > "$logs/$name-s$seed.log" 2>&1
  echo "exit $? after ${SECONDS}s" >> "$logs/$name-s$seed.log"
}

if [ "$stage" = warm ]; then
  skel=$work/parts/smollm2-skel.tar.xz
  [ -f "$skel" ] || { echo "no .device/smollm2-skel.tar.xz: nothing to warm with"; exit 0; }
  [ -s "$work/skeleton/model.safetensors" ] || python3 tools/smollm2_skeleton.py make "$skel" "$work/skeleton" || exit 1
  run_timeout=$(($(left) - 40)) budget=$(($(left) - 100))
  # One process per variant (WARM_SEEDS, default one seed): the kernels are the same for every
  # seed, and a fresh machine's NVRTC needs minutes per process (2026-11-26: 15 processes at
  # once finished no step in 279 s), so fewer processes reach the later steps' kernels sooner.
  say "warm-up on the made-up model (one process per variant, 2 steps each), ${run_timeout}s at most"
  for seed in ${WARM_SEEDS:-1}; do
    for v in "bf16 bf16 none" "nvfp4 nvfp4 none" "nvfp4-aqn nvfp4 exponential" "nf4 nf4 none" "mxfp4 mxfp4 none"; do
      set -- $v
      run warm-$1 "$seed" $2 $3 "$work/skeleton" --set train.steps=2 --set aqn.num_stages=2 --set train.eval_interval=2 &
    done
  done
  wait
  for f in "$logs"/warm-*.log; do echo "== $f: $(tail -n 1 "$f")"; grep -iE "error|panic|out of memory" "$f" | head -n 3; done
  tar -czf "$out/smollm2-warm-logs.tgz" -C "$work" logs $(cd "$work" && ls -d runs/warm-*/metrics.jsonl runs/warm-*/eval.jsonl 2> /dev/null)
  # what a step costs with every process of the table on the GPU at once (completions of the
  # made-up model always reach MAX_TOKENS: an upper bound), and the memory each holds
  python3 - "$work/runs" "$deadline" "${EVAL_RESERVE:-60}" <<'PY' | tee "$logs/warm-timing.txt"
import glob, json, os, sys
times, mem = [], []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "warm-*", "metrics.jsonl"))):
    m = [json.loads(l) for l in open(f) if l.strip()]
    later = [m[-1]["step_time_s"]] if len(m) > 1 and m[-1].get("step_time_s") else []
    peak = max((x.get("peak_memory_bytes") or 0) for x in m) if m else 0
    print(f"{os.path.basename(os.path.dirname(f))}: steps {[round(x.get('step_time_s') or 0, 2) for x in m]} s, peak memory {peak / 1e9:.2f} GB")
    times += later
    mem.append(peak)
if times:
    slow = max(times)
    room = int(sys.argv[2]) - 30 - int(sys.argv[3]) - 60
    # the table runs 3x as many processes at once as the warm-up: count each step twice as long
    fit = max(10, min(100, int(room / (2 * slow))))
    print(f"slowest last step: {slow:.2f} s; memory of all processes: {sum(mem) / 1e9:.1f} GB; "
          f"a table call has ~{room} s of training: STEPS={fit} fits (the next call's default)")
    open(os.path.join(sys.argv[1], "..", "steps-fit"), "w").write(f"{fit}\n")
PY
  [ "$device" = cuda ] && cache_save && [ "$(stat -c %s "$out/cubecl-cache.tgz")" -gt 16000000 ] &&
    rm -f "$out/cubecl-cache.tgz" && echo "(cache past 16 MB: not brought back)"
  say "warm-up done; carry the missing pieces ($missing) next"
  exit 0
fi

# --- the table
if [ ! -s "$work/model/config.json" ]; then
  "$qerl" convert "$gguf" "$work/model" --dtype bf16 > "$logs/convert.log" 2>&1 || { cat "$logs/convert.log"; exit 1; }
fi
cat "$logs/convert.log" 2> /dev/null
run_timeout=$(($(left) - 30))
budget=$((run_timeout - ${EVAL_RESERVE:-60}))
say "runs: STEPS=$steps SEEDS=\"$seeds\" EVAL_LIMIT=$eval_limit PROMPTS=$prompts GROUP=$group MAX_TOKENS=$max_tokens; timeout ${run_timeout}s, time budget ${budget}s"
names=""
for seed in $seeds; do
  for v in "bf16 bf16 none" "nvfp4 nvfp4 none" "nvfp4-aqn nvfp4 exponential" "nf4 nf4 none"; do
    set -- $v
    run $1 "$seed" $2 $3 "$work/model" &
    names="$names $1-s$seed"
  done
  # MXFP4: step-0 entropy only (one step, no evaluation)
  run mxfp4-entropy "$seed" mxfp4 none "$work/model" --max-steps 1 --set train.eval_interval=0 &
  names="$names mxfp4-entropy-s$seed"
done
wait
say "runs done"
for n in $names; do
  d=$work/runs/$n
  for f in metrics.jsonl eval.jsonl metrics.png config.toml; do
    [ -f "$d/$f" ] && mkdir -p "$work/collect/$n" && cp "$d/$f" "$work/collect/$n/"
  done
done
cp -r "$logs" "$work/collect/" 2> /dev/null
python3 tools/smollm2_table.py "$work/runs" $names > "$work/runs/table.md"
cp "$work/runs/table.md" "$work/collect/"
tar -czf "$out/smollm2-table.tgz" -C "$work" collect && rm -rf "$work/collect"
for n in $names; do
  echo "== $n: $(tail -n 1 "$logs/$n.log")"
  grep -iE "error|panic|out of memory" "$logs/$n.log" | head -n 3
done
echo
cat "$work/runs/table.md"
