#!/usr/bin/env bash
# Chosen ncu metrics of a few launches of one kernel in steady decode, per variant (session 31:
# whether the weights prefetched into L2 by the product before are found there).
# One device call. Carry .device/qerl.tar.gz (the release `qerl`, --features cuda).
# There: bash tools/device_ncu_metrics.sh "name:ENV=v,ENV=v@kernel-regex" ...
# Env: BATCH (1), SHAPE (qwen2.5-7b), SKIP (launches of the kernel skipped, 224: two batch-1
#   steps of gemv_mma), COUNT (8), CACHE (none: L2 keeps what the kernels before left),
#   METRICS (duration, L2 hit rate, DRAM bytes read).
source tools/device_preamble.sh
metrics=${METRICS:-gpu__time_duration.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum}
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; envs=${rest%@*}; regex=${rest##*@}
  IFS=, read -ra ev <<< "$envs"
  csv="$OUT/m-$name.csv"
  env "${ev[@]}" timeout -k 10 ${NCU_T:-150} ncu --clock-control none \
    --cache-control ${CACHE:-none} --kernel-name "regex:$regex" --launch-skip ${SKIP:-224} \
    --launch-count ${COUNT:-8} --metrics "$metrics" --csv \
    /tmp/qerl bench rollout --shape ${SHAPE:-qwen2.5-7b} --precision nvfp4 --batch ${BATCH:-1} \
    --prompt 256 --new-tokens 16 --no-check > "$csv" 2>/dev/null
  echo "== $name (${envs:-defaults}) @ $regex"
  python3 - "$csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("  no ncu rows"); sys.exit()
h = rows[0]
ii, gi, mi, ui, vi = (h.index(c) for c in ("ID", "Grid Size", "Metric Name", "Metric Unit", "Metric Value"))
by = collections.OrderedDict()
for r in rows[1:]:
    by.setdefault((r[ii], r[gi].replace(" ", "")), {})[r[mi]] = f"{r[vi]} {r[ui]}"
for (i, g), m in by.items():
    print(f"  {i:>4} grid {g:14s} " + "  ".join(f"{k.split('__')[1].split('.')[0]}={v}" for k, v in m.items()))
PY
done
