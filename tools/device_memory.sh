#!/usr/bin/env bash
# Device memory of a loaded model in each precision (docs/model.md): a random checkpoint with
# Qwen2.5-1.5B's shapes, written by transformers, quantized by `qerl quantize`, then for each
# precision one `qerl generate --device cuda` (8 prompts, 64 new tokens) that reports what
# cubecl's allocator holds after loading and after generating.
# There (carry .device with qerl.tar.gz): bash tools/device_memory.sh
set -uo pipefail
out=${OUT:-/tmp}
[ -x /tmp/qerl ] || tar -xzf .device/qerl.tar.gz -C /tmp
export CUBECL_AUTOTUNE_LEVEL=minimal
log=/tmp/memory.log
QWEN_SIZE=1.5b python3 tools/device-model/make_random_qwen.py /tmp/q15 2>&1 | grep -v Warning | tee $log
for f in nvfp4 mxfp4 nf4; do
  /tmp/qerl quantize /tmp/q15 /tmp/q15-$f --format $f > /tmp/quantize-$f.log 2>&1 &
done
wait
du -sh /tmp/q15 /tmp/q15-* | tee -a $log
args=()
for i in 1 2 3 4 5 6 7 8; do args+=(--prompt "Question $i: what is the sum of the first $i odd numbers?"); done
for m in q15 q15-nvfp4 q15-mxfp4 q15-nf4; do
  timeout -k 15 ${MEM_TIMEOUT:-400} /tmp/qerl generate --device cuda --model /tmp/$m \
    --tokenizer tests/fixtures/tokenizers/qwen2.5/tokenizer.json "${args[@]}" --max-new-tokens 64 \
    --temperature 1.0 --seed 1 > /dev/null 2> /tmp/gen-$m.log &
done
wait
for m in q15 q15-nvfp4 q15-mxfp4 q15-nf4; do echo "== $m"; grep -E "^loaded|^generated|^device memory|rror" /tmp/gen-$m.log; done | tee -a $log
cp $log $out/memory.log
