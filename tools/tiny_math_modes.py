#!/usr/bin/env python3
"""Accuracy of tiny-math's two ways to answer, by number of operations.

Reads the per-sample output of `qerl eval --output FILE` on models/tiny-math/data/test.jsonl:
a completion that starts with `####` is a guess (no working), any other shows its working.

  qerl eval --model runs/demo/tiny-math-nvfp4 --device cpu --prompt bare \
    --dataset models/tiny-math/data/test.jsonl --limit 200 --samples 4 --temperature 1.0 \
    --max-new-tokens 200 --output /tmp/eval.jsonl
  python3 tools/tiny_math_modes.py /tmp/eval.jsonl
"""
import collections
import json
import sys

samples, test = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "models/tiny-math/data/test.jsonl"
# a solution has one line per operation, then `#### N`
ops = {d["question"]: d["answer"].count("\n") for d in map(json.loads, open(test))}
right = collections.defaultdict(lambda: [0, 0])
for d in map(json.loads, open(samples)):
    mode = "guess" if d["completion"].lstrip().startswith("####") else "worked"
    for key in [(mode, "all"), (mode, ops[d["question"]])]:
        right[key][0] += bool(d["strict"])
        right[key][1] += 1
total = sum(n for (m, k), (_, n) in right.items() if k == "all")
print("| answer | operations | samples | right |")
print("| --- | --- | ---: | ---: |")
for mode in ["worked", "guess"]:
    for k in ["all", 1, 2, 3, 4]:
        a, n = right[(mode, k)]
        if n:
            share = f" ({n / total:.0%} of all)" if k == "all" else ""
            print(f"| {mode} | {k} | {n}{share} | {a / n:.1%} |")
