#!/usr/bin/env python3
"""`qerl score` / `qerl generate` on CUDA against transformers, on the GPU machine.

    python3 tools/device_model_check.py QERL_BINARY [--device cuda]

For each fixture model (tests/fixtures/compressed-tensors/*/{bf16,nvfp4}) and a few texts
(tokenized with tests/fixtures/tokenizers/tiny), runs `qerl score --json` and compares every
position's log-probability of the actual next token and the top-1 next token with transformers'
float32 forward on the same ids; then `qerl generate --greedy --json` against transformers'
greedy `generate`. Prints one table. compressed-tensors must be importable for the NVFP4 rows
(carry .whl, see tests/fixtures/compressed-tensors/README.md).
"""
import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

TOKENIZER = "tests/fixtures/tokenizers/tiny/tokenizer.json"
MODELS = [
    "tests/fixtures/compressed-tensors/llama_untied/bf16",
    "tests/fixtures/compressed-tensors/qwen2_tied/bf16",
    "tests/fixtures/compressed-tensors/llama_untied/nvfp4",
    "tests/fixtures/compressed-tensors/qwen2_tied/nvfp4",
]
TEXTS = [
    "Tom has 3 apples and buys 4 more.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
]


def qerl(binary, device, *args):
    out = subprocess.run([binary, *args, "--device", device, "--tokenizer", TOKENIZER, "--json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout)


def main():
    binary = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    rows = []
    for model_dir in MODELS:
        try:
            # compressed-tensors runs an NVFP4 checkpoint in its bf16 dtype only (it decompresses
            # to bf16 and refuses float32): those rows compare against a bf16 forward
            dtype = torch.bfloat16 if model_dir.endswith("nvfp4") else torch.float32
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
        except Exception as e:  # noqa: BLE001 - report and go on
            rows.append((model_dir, "load", f"transformers could not load it: {e}"[:120]))
            continue
        try:
            check(binary, device, model_dir, hf, rows)
        except Exception as e:  # noqa: BLE001 - report and go on
            rows.append((model_dir, "run", f"failed: {e}"[:200].replace("\n", " ")))
    print(f"device: {torch.cuda.get_device_name()}, qerl --device {device}, transformers on cuda (float32; bf16 for the nvfp4 rows)")
    print("| model | check | result |")
    print("| --- | --- | --- |")
    for r in rows:
        print(f"| {r[0].replace('tests/fixtures/compressed-tensors/', '')} | {r[1]} | {r[2]} |")


def check(binary, device, model_dir, hf, rows):
    if True:
        for text in TEXTS:
            s = qerl(binary, device, "score", "--model", model_dir, "--text", text, "--top-k", "1")
            ids = s["ids"]
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0].float(), -1)
            diffs, top_agree = [], 0
            for p in s["positions"][1:]:
                i = p["position"]
                ref = logp[i - 1, ids[i]].item()
                diffs.append(abs(ref - p["logprob"]))
            for p in s["positions"][:-1]:
                i = p["position"]
                top_agree += int(p["top"][0]["id"] == int(logp[i].argmax()))
            rows.append((model_dir, f"score {len(ids)} tokens",
                         f"max |dlogp| {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f}, "
                         f"top-1 agree {top_agree}/{len(ids) - 1}"))
        g = qerl(binary, device, "generate", "--model", model_dir, "--prompt", TEXTS[0],
                 "--greedy", "--max-new-tokens", "16")
        prompt_ids = g["completions"][0]["prompt_ids"]
        ours = g["completions"][0]["ids"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt_ids], device="cuda"), max_new_tokens=len(ours),
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ours))
        rows.append((model_dir, "greedy 16 tokens", f"equal for the first {same} of {len(ours)} tokens"))


if __name__ == "__main__":
    main()
