#!/usr/bin/env python3
"""A qerl checkpoint with trained norms, loaded by transformers + PEFT as it is.

    python3 tools/device_peft_check.py QERL_BINARY [--device cuda|cpu] [--checkpoint DIR --model DIR]

From the repository root. Without --checkpoint, first trains one: `qerl train` with
configs/tiny-cpu.toml on the bf16 Qwen2 fixture (tests/fixtures/compressed-tensors/qwen2_tied/bf16),
3 steps at a learning rate high enough to move the LoRA B matrices and the norms visibly.
Then, for the checkpoint:

1. `PeftModel.from_pretrained(base, checkpoint)` (transformers float32, on cuda when there is
   one): the state PEFT re-exports (`get_peft_model_state_dict`) must equal the checkpoint's
   adapter_model.safetensors tensor for tensor, the norms (`modules_to_save`) included, so
   PEFT took every trained tensor and nothing else;
2. `qerl score --json --adapter checkpoint` on a few texts against PEFT's log-softmax at every
   position (the token's log-prob): the largest difference, beside how far the adapter moves
   the base model's log-probs and how far PEFT's would be off if the norms were dropped.

Prints one table; exits 1 if a check fails (log-prob tolerance --tol, default 1e-4 on the
CPU, 5e-2 with --device cuda, where qerl runs bf16).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

TOKENIZER = "tests/fixtures/tokenizers/tiny/tokenizer.json"
MODEL = "tests/fixtures/compressed-tensors/qwen2_tied/bf16"
TEXTS = [
    "Tom has 3 apples and buys 4 more.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
]


def train(binary, device, out):
    sets = [f'train.output_dir="{out}"', f'model.dir="{MODEL}"', 'model.precision="bf16"',
            "train.steps=3", "train.eval_interval=0", "train.ckpt_interval=0", "optim.lr=3e-2",
            "optim.warmup_ratio=0.0"]
    cmd = [binary, "train", "--config", "configs/tiny-cpu.toml", "--tokenizer", TOKENIZER,
           "--device", device, "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(" ".join(cmd) + "\n" + r.stderr[-3000:])
    return os.path.join(out, open(os.path.join(out, "latest")).read().strip())


def qerl_score(binary, device, model, adapter, text):
    cmd = [binary, "score", "--json", "--top-k", "1", "--model", model, "--tokenizer", TOKENIZER,
           "--device", device, "--text", text]
    if adapter:
        cmd += ["--adapter", adapter]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(" ".join(cmd) + "\n" + r.stderr[-3000:])
    doc = json.loads(r.stdout)
    return doc["ids"], [p["logprob"] for p in doc["positions"][1:]]


def logprobs(model, ids, where):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids], device=where)).logits[0].float(), -1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--checkpoint")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--tol", type=float)
    args = ap.parse_args()
    tol = args.tol or (5e-2 if args.device == "cuda" else 1e-4)
    where = "cuda" if torch.cuda.is_available() else "cpu"
    tmp = tempfile.mkdtemp(prefix="qerl-peft-check-")
    ckpt = args.checkpoint or train(args.binary, args.device, os.path.join(tmp, "run"))
    config = json.load(open(os.path.join(ckpt, "adapter_config.json")))
    saved = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    rows, failed = [], False

    def base():
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(where).eval()

    peft = PeftModel.from_pretrained(base(), ckpt).eval()
    exported = {k: v.cpu() for k, v in get_peft_model_state_dict(peft).items()}
    same_keys = exported.keys() == saved.keys()
    worst = max((float((exported[k] - saved[k]).abs().max()) for k in saved if k in exported), default=0.0)
    norms = [k for k in saved if ".lora_" not in k]
    ok = same_keys and worst == 0.0 and len(norms) > 0
    failed |= not ok
    rows.append(("PEFT state == checkpoint", f"modules_to_save {config.get('modules_to_save')}: "
                 f"{len(saved)} tensors ({len(norms)} norms), same names {same_keys}, "
                 f"max |difference| {worst:.1e}", "ok" if ok else "FAIL"))

    # PEFT with the saved norms dropped: the policy qerl used to run with --adapter
    no_norms = os.path.join(tmp, "no-norms")
    os.makedirs(no_norms, exist_ok=True)
    from safetensors.torch import save_file
    save_file({k: v for k, v in saved.items() if ".lora_" in k},
              os.path.join(no_norms, "adapter_model.safetensors"))
    json.dump(dict(config, modules_to_save=None), open(os.path.join(no_norms, "adapter_config.json"), "w"))
    peft_no_norms = PeftModel.from_pretrained(base(), no_norms).eval()
    plain = base()

    for text in TEXTS:
        ids, ours = qerl_score(args.binary, args.device, args.model, ckpt, text)
        ref = logprobs(peft, ids, where)
        d = max(abs(a - b) for a, b in zip(ours, ref))
        moved = max(abs(a - b) for a, b in zip(logprobs(plain, ids, where), ref))
        norms_matter = max(abs(a - b) for a, b in zip(logprobs(peft_no_norms, ids, where), ref))
        ok = d <= tol
        failed |= not ok
        rows.append((f"score {len(ids)} tokens", f"max |qerl - PEFT| {d:.2e} (tolerance {tol:.0e}); "
                     f"PEFT vs base {moved:.2e}; PEFT without the norms vs with {norms_matter:.2e}",
                     "ok" if ok else "FAIL"))

    print(f"checkpoint {ckpt}; qerl --device {args.device}; transformers + peft float32 on {where}")
    print("| check | figures | result |")
    print("| --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
