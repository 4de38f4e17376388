#!/usr/bin/env bash
# qerl-model on CUDA: parity test binary, the CLI on the fixtures, timings on a random 0.5B model.
set -uo pipefail
out=${OUT:-/tmp}
[ "$PWD" = /work/main ] || { mkdir -p /work; ln -sfn "$PWD" /work/main; }
tar -xJf .device-model/bins.tar.xz -C /tmp
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $out/device.txt
ls /usr/local/cuda/include/cuda.h >/dev/null && echo "cuda headers ok"
stages=" $* "
if [[ $stages == *" parity "* ]]; then
  /tmp/parity --ignored cuda --nocapture --test-threads=1 2>&1 | grep -vE '^ +[0-9]+: |^ +at ' | tee $out/parity.log
fi
if [[ $stages == *" cli "* ]]; then
  T=tests/fixtures/tokenizers/tiny/tokenizer.json
  for m in llama_untied/bf16 qwen2_tied/nvfp4; do
    for d in cuda cpu; do
      /tmp/qerl generate --device $d --model tests/fixtures/compressed-tensors/$m --tokenizer $T \
        --prompt "Hello, world!" --prompt "The quick brown" --greedy --max-new-tokens 16 --json \
        > $out/gen_${d}_${m%%/*}.json 2>>$out/cli.log
    done
  done
  /tmp/qerl score --device cuda --model tests/fixtures/compressed-tensors/qwen2_tied/nvfp4 --tokenizer $T --text "Hello world" --top-k 3 2>&1 | tee -a $out/cli.log
  cat $out/cli.log
fi
if [[ $stages == *" bench "* ]]; then
  python3 tools/device-model/make_random_qwen.py /tmp/q05 2>&1 | grep -v Warning | tee $out/q05.log
  args=()
  for i in 1 2 3 4 5 6 7 8; do args+=(--prompt "Question $i: what is the sum of the first $i odd numbers? Think step by step."); done
  t0=$SECONDS; /tmp/qerl quantize /tmp/q05 /tmp/q05-nvfp4 2>&1 | tail -n 4 | tee -a $out/q05.log
  echo "qerl quantize (debug build): $((SECONDS - t0)) s" | tee -a $out/q05.log
  for run in "q05 1.0" "q05 1.0" "q05-nvfp4 1.0" "q05-nvfp4 0.9"; do
    set -- $run; m=$1
    echo "== $m top_p $2" >> $out/q05.log
    /tmp/qerl generate --device cuda --model /tmp/$m --tokenizer tests/fixtures/tokenizers/qwen2.5/tokenizer.json \
      "${args[@]}" --max-new-tokens 128 --temperature 1.0 --top-p $2 --seed 1 --json > $out/gen_$m.json 2>>$out/q05.log
    tail -n 2 $out/q05.log
  done
fi
