#!/usr/bin/env bash
# One device call for the checks of a session's CUDA paths (the release `qerl` carried in
# .device/qerl.tar.gz): the engine against the host reference (f32 and bf16) with top-k/top-p
# timing; `qerl generate` on tiny-math through the engine (greedy == burn path; top-p sampling
# runs); then whichever helper scripts are passed as arguments (each run with bash, its output
# tailed). Usage there: bash tools/device_session_checks.sh [script args ...]
source tools/device_preamble.sh
start=$SECONDS
timeout -k 10 ${ROLLOUT_T:-150} /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 1,64 \
  --prompt 256 --new-tokens 128 --top-p 0.95 --top-k 50 --json "$OUT/topp.jsonl" 2>&1 | grep -v "^|" | tail -6
echo "rollout check + top-p bench: $((SECONDS - start)) s"
for e in 1 0; do
  start=$SECONDS
  QERL_ENGINE=$e timeout -k 10 ${GEN_T:-150} /tmp/qerl generate --device cuda --model models/tiny-math --precision nvfp4 \
    --prompt "Question: Tom has 12 apples and buys 35 more. How many apples does he have?" --greedy --max-new-tokens 48 --json \
    > "$OUT/gen-engine$e.json" 2> "$OUT/gen-engine$e.err"
  echo "generate greedy engine=$e: rc $? in $((SECONDS - start)) s: $(python3 -c "import json; d=json.load(open('$OUT/gen-engine$e.json')); c=d['completions'][0] if 'completions' in d else d; print(c.get('ids', c)[:48])" 2>&1 | tail -1)"
done
QERL_ENGINE=1 timeout -k 10 60 /tmp/qerl generate --device cuda --model models/tiny-math --precision nvfp4 \
  --prompt "Question: Tom has 12 apples and buys 35 more. How many apples does he have?" --temperature 0.8 --top-p 0.9 --top-k 20 \
  --max-new-tokens 48 2>&1 | tail -3
for s in "$@"; do
  echo "== $s"
  start=$SECONDS
  timeout -k 10 ${SCRIPT_T:-240} bash $s 2>&1 | tail -${SCRIPT_LINES:-25}
  echo "== $s: $((SECONDS - start)) s"
done
