#!/usr/bin/env python3
"""The markdown table of tools/device_smollm2_table.sh: one row per run (VARIANT-sSEED under
RUNS_DIR: metrics.jsonl, eval.jsonl), then each variant's mean +- standard deviation over its
seeds. Standard library only.

  smollm2_table.py RUNS_DIR NAME...

Columns: steps done; the policy's entropy at step 0 (nats per completion token, over the step's
sampled completions); the mean training reward of the first and the last 10 steps (fewer when
the run made fewer); held-out accuracy (greedy) at step 0 and after the last step, flexible
extraction (what the reward reads) and strict (`####` / <answer> / \\boxed) in parentheses.
"""
import json
import math
import os
import re
import sys


def lines(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except (OSError, ValueError):
        return []


def num(x):
    return x if isinstance(x, (int, float)) and not math.isnan(x) else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def std(xs):
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def fmt(x, pct=False, digits=3):
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:.{digits}f}"


def pm(xs, pct=False, digits=3):
    m, s = mean(xs), std(xs)
    if m is None:
        return "-"
    return fmt(m, pct, digits) + ("" if s is None else " ± " + fmt(s, pct, digits))


def run(runs, name):
    m = lines(os.path.join(runs, name, "metrics.jsonl"))
    e = lines(os.path.join(runs, name, "eval.jsonl"))
    rewards = [num(x.get("reward_mean")) for x in m]
    k = min(10, len(rewards))
    before = e[0] if e and e[0].get("step") == 0 else None
    after = e[-1] if e and e[-1].get("step", 0) > 0 else None
    return {
        "steps": len(m),
        "entropy": num(m[0].get("entropy")) if m else None,
        "first": mean(rewards[:k]) if k else None,
        "last": mean(rewards[-k:]) if k else None,
        "before": num(before.get("accuracy_flexible")) if before else None,
        "after": num(after.get("accuracy_flexible")) if after else None,
        "before_strict": num(before.get("accuracy")) if before else None,
        "after_strict": num(after.get("accuracy")) if after else None,
        "questions": (before or after or {}).get("questions"),
    }


def acc(r, key):
    if r[key] is None:
        return "-"
    return f"{fmt(r[key], True)} ({fmt(r[key + '_strict'], True)})"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    runs, names = sys.argv[1], sys.argv[2:]
    rows, by_variant = [], {}
    for name in names:
        match = re.fullmatch(r"(.+)-s(\d+)", name)
        variant, seed = (match.group(1), match.group(2)) if match else (name, "-")
        r = run(runs, name)
        rows.append((variant, seed, r))
        by_variant.setdefault(variant, []).append(r)
    order = sorted(by_variant, key=lambda v: [x[0] for x in rows].index(v))
    print("| variant | seed | steps | step-0 entropy | reward, first 10 steps | reward, last 10 steps "
          "| held-out before | held-out after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for variant in order:
        for v, seed, r in rows:
            if v == variant:
                print(f"| {v} | {seed} | {r['steps']} | {fmt(r['entropy'], digits=4)} | {fmt(r['first'])} "
                      f"| {fmt(r['last'])} | {acc(r, 'before')} | {acc(r, 'after')} |")
    for variant in order:
        rs = by_variant[variant]
        steps = sorted({r["steps"] for r in rs})
        steps = str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        print(f"| **{variant}** | mean ± std ({len(rs)}) | {steps} | {pm([r['entropy'] for r in rs], digits=4)} "
              f"| {pm([r['first'] for r in rs])} | {pm([r['last'] for r in rs])} "
              f"| {pm([r['before'] for r in rs], True)} | {pm([r['after'] for r in rs], True)} |")
    q = next((r["questions"] for _, _, r in rows if r["questions"]), None)
    print()
    print(f"Held-out: {q} questions, greedy, flexible extraction (strict in parentheses). "
          "Entropy: nats per completion token of step 0's samples (no AQN noise at step 0). "
          "mxfp4-entropy: one step, entropy only.")


if __name__ == "__main__":
    main()
