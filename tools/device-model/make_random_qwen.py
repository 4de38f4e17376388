# A random checkpoint with Qwen2.5-0.5B's shapes (QWEN_SIZE=1.5b or 7b: Qwen2.5-1.5B's or -7B's),
# bf16, for timing and measuring qerl generate and train (not a test).
import os, sys, time, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
out = sys.argv[1]
shape = {"0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
         "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
         "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)}
cfg = Qwen2Config(**{**dict(vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True),
                     **shape[os.environ.get("QWEN_SIZE", "0.5b")]},
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  bos_token_id=151643, eos_token_id=151645)
torch.manual_seed(0)
t = time.time()
torch.set_default_dtype(torch.bfloat16)  # 7B in f32 first would be 30 GB for nothing
with torch.device("cuda"):
    m = Qwen2ForCausalLM(cfg).eval()
m.save_pretrained(out)
print(f"random Qwen2.5-{os.environ.get('QWEN_SIZE', '0.5b')}-shaped model in {out} ({time.time() - t:.1f}s)", flush=True)
if len(sys.argv) > 2:
    # transformers' own generate on the same GPU, same batch, for reference
    tok_prompts = torch.randint(0, 151000, (8, 16), device="cuda")
    for _ in range(2):
        torch.cuda.synchronize(); t = time.time()
        o = m.generate(tok_prompts, attention_mask=torch.ones_like(tok_prompts), max_new_tokens=128, min_new_tokens=128,
                       do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
        torch.cuda.synchronize(); dt = time.time() - t
    print(f"transformers {__import__('transformers').__version__} generate bf16 sdpa, batch 8 x 128 new tokens: {dt:.2f}s, {8*128/dt:.0f} tokens/s", flush=True)
