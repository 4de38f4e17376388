# The peer of `qerl bench rollout`: Hugging Face transformers `generate` on a random model of
# the same shape (bf16, sdpa attention, built on the GPU, nothing downloaded), the same batch
# sizes, prompt and new-token counts, sampling at T = 1 without early stop. Also measures the
# GPU's copy bandwidth (the limit a memory-bound decode step is held to).
# Usage: python3 tools/hf_rollout_peer.py --shape 7b --batch 1,16,64,256 --prompt 256 --new 512
#        [--budget SECONDS] [--json FILE]
import argparse, json, time
import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}

p = argparse.ArgumentParser()
p.add_argument("--shape", default="7b", choices=SHAPES)
p.add_argument("--batch", default="1,16,64,256")
p.add_argument("--prompt", type=int, default=256)
p.add_argument("--new", type=int, default=512)
p.add_argument("--budget", type=float, default=1e9, help="skip the batches left once this many seconds have passed")
p.add_argument("--json")
a = p.parse_args()

t0 = time.time()
# Copy bandwidth: read + write of a 4 GiB buffer, best of 5.
x = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")
y = torch.empty_like(x)
best = 1e9
for _ in range(5):
    torch.cuda.synchronize(); t = time.time(); y.copy_(x); torch.cuda.synchronize(); best = min(best, time.time() - t)
copy_tbs = 2 * x.numel() * 2 / best / 1e12
del x, y
print(f"{torch.cuda.get_device_name()}: copy bandwidth (read + write) {copy_tbs:.2f} TB/s", flush=True)

cfg = Qwen2Config(**SHAPES[a.shape], max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  bos_token_id=151643, eos_token_id=151645)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = Qwen2ForCausalLM(cfg).eval()
print(f"transformers {transformers.__version__}, torch {torch.__version__}: random Qwen2.5-{a.shape}-shaped model "
      f"in {time.time() - t0:.1f}s", flush=True)

rows = []
for b in [int(v) for v in a.batch.split(",")]:
    if time.time() - t0 > a.budget:
        print(f"batch {b}: skipped (budget of {a.budget:.0f}s spent)", flush=True)
        continue
    prompts = torch.randint(100, 30000, (b, a.prompt), device="cuda")
    mask = torch.ones_like(prompts)
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)

    def timed(new):
        torch.cuda.synchronize(); t = time.time()
        with torch.no_grad():
            model.generate(prompts, max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
        return time.time() - t

    timed(2)  # warm-up
    prefill = timed(1)
    total = timed(a.new)
    step = (total - prefill) / max(a.new - 1, 1)
    row = dict(peer="transformers-generate-bf16-sdpa", shape=a.shape, batch=b, prompt_tokens=a.prompt,
               new_tokens=a.new, prefill_ms=prefill * 1e3, decode_ms_per_step=step * 1e3, total_s=total,
               tokens_per_s=b * a.new / total, decode_tokens_per_s=b / step, copy_tb_per_s=copy_tbs,
               peak_gb=torch.cuda.max_memory_allocated() / 1e9)
    rows.append(row)
    print(f"HF batch {b}: prefill {prefill*1e3:.1f} ms, decode {step*1e3:.2f} ms/step, "
          f"{row['tokens_per_s']:.0f} tokens/s ({row['decode_tokens_per_s']:.0f} decoding)", flush=True)
if a.json:
    with open(a.json, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
