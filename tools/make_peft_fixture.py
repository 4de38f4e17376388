#!/usr/bin/env python3
"""PEFT-written LoRA adapters with trained RMSNorms, and PEFT's log-probs on them.

    python3 tools/make_peft_fixture.py   # from the repository root; needs torch, transformers, peft

Writes tests/fixtures/peft/<name>/{adapter_config.json, adapter_model.safetensors, reference.json}
for two adapters made by PEFT itself (get_peft_model + save_pretrained) on the tiny fixture
models of tests/fixtures/compressed-tensors:

* qwen2_tied_norms: LoRA on q/v/down_proj, `rank_pattern` {down_proj: 2}, `alpha_pattern`
  {v_proj: 16}, `modules_to_save` ["norm"] (every RMSNorm), float32;
* llama_untied_rslora: LoRA on all seven linears with `use_rslora`, `modules_to_save`
  ["post_attention_layernorm", "model.norm"], the saved tensors rewritten as bfloat16.

A and B and the saved norms are random (not PEFT's zero init of B), so every part shows in
the logits. reference.json holds, for a few texts tokenized with
tests/fixtures/tokenizers/tiny, the token ids and every position's log-probability of the
next token from `PeftModel.from_pretrained(base, adapter_dir)` in float32, i.e. what PEFT
computes from the files as committed. crates/qerl-train/tests/peft_cli.rs checks
`qerl score --adapter` against them.
"""
import json
import os

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "tests/fixtures/tokenizers/tiny/tokenizer.json")
OUT = os.path.join(ROOT, "tests/fixtures/peft")
TEXTS = [
    "Tom has 3 apples and buys 4 more.",
    "What is two plus two? Two plus two is four.",
]
ADAPTERS = {
    "qwen2_tied_norms": dict(
        base="tests/fixtures/compressed-tensors/qwen2_tied/bf16",
        config=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                    rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 16},
                    modules_to_save=["norm"]),
        bf16=False,
    ),
    "llama_untied_rslora": dict(
        base="tests/fixtures/compressed-tensors/llama_untied/bf16",
        config=dict(r=4, lora_alpha=8, use_rslora=True,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"],
                    modules_to_save=["post_attention_layernorm", "model.norm"]),
        bf16=True,
    ),
}


def base_model(path):
    return AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, path), dtype=torch.float32).eval()


def make(name, spec, tokenizer):
    torch.manual_seed(sum(map(ord, name)))
    model = get_peft_model(base_model(spec["base"]),
                           LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **spec["config"]))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".modules_to_save." in pname:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif ".lora_B." in pname:
                p.copy_(0.2 * torch.randn_like(p))
    out = os.path.join(OUT, name)
    model.save_pretrained(out)
    weights = os.path.join(out, "adapter_model.safetensors")
    if spec["bf16"]:
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)
    # base_model_name_or_path is this machine's absolute path: make it the repository path
    config_path = os.path.join(out, "adapter_config.json")
    config = json.load(open(config_path))
    config["base_model_name_or_path"] = spec["base"]
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    for f in os.listdir(out):
        if f not in ("adapter_config.json", "adapter_model.safetensors"):
            os.remove(os.path.join(out, f))

    peft = PeftModel.from_pretrained(base_model(spec["base"]), out).eval()
    base = base_model(spec["base"])
    rows = []
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        x = torch.tensor([ids])
        with torch.no_grad():
            lp = torch.log_softmax(peft(x).logits[0].float(), -1)
            lp_base = torch.log_softmax(base(x).logits[0].float(), -1)
        nxt = torch.tensor(ids[1:])
        logprobs = lp[:-1].gather(1, nxt[:, None])[:, 0]
        rows.append(dict(
            text=text,
            ids=ids,
            logprobs=[float(v) for v in logprobs],
            top1=[int(v) for v in lp.argmax(-1)],
            max_abs_logprob_change_from_base=float((lp - lp_base).abs().max()),
        ))
    meta = dict(
        made_by="tools/make_peft_fixture.py",
        versions=dict(torch=torch.__version__, peft=__import__("peft").__version__,
                      transformers=__import__("transformers").__version__),
        base=spec["base"],
        texts=rows,
    )
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(name, [r["max_abs_logprob_change_from_base"] for r in rows])


def main():
    tokenizer = Tokenizer.from_file(TOKENIZER)
    for name, spec in ADAPTERS.items():
        make(name, spec, tokenizer)


if __name__ == "__main__":
    main()
