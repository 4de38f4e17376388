#!/usr/bin/env bash
# One device call hunting an intermittent hang (sessions 31 and 33: the batch-1 benchmark after
# its check, on a fresh machine, ran past its timeout while every --no-check run finished).
# Runs the check + batch-1 benchmark RUNS times under the variants HANG_VARIANTS ("name:ENV=v,..."
# cycled); a run still going after WATCH seconds gets its GPU utilisation, every host thread's
# backtrace (gdb or cuda-gdb, where present) and its threads' kernel wait channels written to
# $OUT/hang-<run>.txt, and is then killed. Carry .device/qerl.tar.gz.
# There: RUNS=3 WATCH=75 HANG_VARIANTS="base: noahead:QERL_GEMV_MMA_X_AHEAD=0" bash tools/device_hang.sh
source tools/device_preamble.sh
read -ra variants <<< "${HANG_VARIANTS:-base:}"
dbg=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda*/bin/cuda-gdb 2>/dev/null | head -1)
echo "debugger: ${dbg:-none}"
for run in $(seq 1 "${RUNS:-3}"); do
  v=${variants[$(( (run - 1) % ${#variants[@]} ))]}
  name=${v%%:*}; IFS=, read -ra ev <<< "${v#*:}"
  start=$SECONDS
  env "${ev[@]}" /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 1 \
    --prompt 256 --new-tokens 16 > "$OUT/run-$run.txt" 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null && [ $((SECONDS - start)) -lt "${WATCH:-75}" ]; do sleep 1; done
  if kill -0 $pid 2>/dev/null; then
    f="$OUT/hang-$run.txt"
    { echo "== run $run ($name) still going after $((SECONDS - start)) s"
      nvidia-smi --query-gpu=utilization.gpu,utilization.memory,power.draw --format=csv
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv
      for t in /proc/$pid/task/*; do
        echo "$(basename "$t") $(cat "$t/comm") $(awk '{print $3}' "$t/stat") $(cat "$t/wchan")"
      done
      [ -n "$dbg" ] && timeout 60 "$dbg" -p $pid -batch -ex "thread apply all bt 12" 2>&1 | \
        grep -E "^Thread|^#" | cut -c1-200
    } > "$f" 2>&1
    kill -9 $pid; wait $pid 2>/dev/null
    echo "run $run ($name): HUNG (after check: $(grep -c '^check' "$OUT/run-$run.txt") check lines)"
    grep -E "utilization|^[0-9]+ %|^Thread" "$f" | head -20
    grep -E "^#[0-9]" "$f" | awk '{$1=""; print}' | sed 's/0x[0-9a-f]* in //' | cut -c1-110 | \
      sort | uniq -c | sort -rn | head -25
  else
    wait $pid; rc=$?
    echo "run $run ($name): exit $rc in $((SECONDS - start)) s; $(grep -E '^\| qwen' "$OUT/run-$run.txt" | awk -F'|' '{print $6}') ms/step"
  fi
done
