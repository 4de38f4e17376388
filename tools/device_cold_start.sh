#!/usr/bin/env bash
# Cold start on a GPU machine (issue 14): load throughput, time to first token and to the end of
# step 0, fresh (empty kernel caches) and warm, and the size of the kernel cache.
#   tools/device_cold_start.sh QERL [SHAPE] [WORK]
# QERL: a release `qerl` built with --features cuda; SHAPE: qwen2.5-7b (default) or another
# preset of `qerl bench load`; WORK: scratch directory (default /tmp/qerl-cold). Run from the
# repository root (configs/, the tiny tokenizer). Prints one line per measurement.
# Env: LOAD_REPEAT (loads of each checkpoint, 3), TRAIN (0: skip the training measurements).
set -euo pipefail
QERL=$(realpath "$1"); SHAPE=${2:-qwen2.5-7b}; WORK=${3:-/tmp/qerl-cold}
ROOT=$PWD; TOK=$ROOT/tests/fixtures/tokenizers/tiny/tokenizer.json
mkdir -p "$WORK/run"
# A cubecl.toml of its own: every cache under $WORK/cache, emptied for the fresh runs.
cat > "$WORK/run/cubecl.toml" <<TOML
[compilation]
cache = { file = "$WORK/cache" }
[autotune]
cache = { file = "$WORK/cache" }
TOML
export CUDA_CACHE_PATH=$WORK/cache/nv CUDA_CACHE_MAXSIZE=4294967296
fresh() { rm -rf "$WORK/cache"; mkdir -p "$WORK/cache"; }
secs() { local s=$(date +%s.%N); "$@" >/dev/null 2>"$WORK/last.err" || { cat "$WORK/last.err"; exit 1; }; python3 -c "import sys; print(round(float(sys.argv[1]) - float(sys.argv[2]), 2))" "$(date +%s.%N)" "$s"; }

echo "== load throughput ($SHAPE, page cache after the first load)"
"$QERL" bench load --shape "$SHAPE" --dir "$WORK/ckpt" --device cuda --repeat ${LOAD_REPEAT:-3}

cd "$WORK/run"
GEN=("$QERL" generate --model "$WORK/ckpt/nvfp4" --tokenizer "$TOK" --prompt "What is 12 times 7?" --max-new-tokens 32 --device cuda)
for state in fresh warm; do
  [ $state = fresh ] && fresh
  t=$(secs "${GEN[@]}")
  echo "generate ($state): ${t}s to the end of 32 tokens; $(grep -h 'loaded\|generated' "$WORK/last.err" | tr '\n' ' ')"
done
echo "kernel cache after generate: $(du -sh "$WORK/cache" | cut -f1), $(find "$WORK/cache" -type f | wc -l) files"

CONFIG=$ROOT/configs/${SHAPE}-gsm8k-grpo.toml
if [ "${TRAIN:-1}" = 0 ]; then
  echo "TRAIN=0: training not measured"
elif [ -f "$CONFIG" ]; then
  TRAIN=("$QERL" train --config "$CONFIG" --tokenizer "$TOK" --quiet --device cuda --max-steps 1
         --set "model.dir=\"$WORK/ckpt/nvfp4\"" --set "train.eval_interval=0")
  for state in fresh warm; do
    [ $state = fresh ] && fresh
    rm -rf "$WORK/train-run"
    t=$(secs "${TRAIN[@]}" --set "train.output_dir=\"$WORK/train-run\"")
    echo "train step 0 ($state): ${t}s from start to the end of step 0"
  done
  echo "kernel cache after train: $(du -sh "$WORK/cache" | cut -f1)"
  fresh
  t=$(secs "$QERL" warmup --model "$WORK/ckpt/nvfp4" --train "$CONFIG" --tokenizer "$TOK" --set "model.dir=\"$WORK/ckpt/nvfp4\"")
  echo "qerl warmup --train (fresh): ${t}s; cache $(du -sh "$WORK/cache" | cut -f1)"
  rm -rf "$WORK/train-run"
  t=$(secs "${TRAIN[@]}" --set "train.output_dir=\"$WORK/train-run\"")
  echo "train step 0 after warmup: ${t}s"
else
  echo "no $CONFIG: training not measured"
fi
