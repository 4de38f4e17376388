#!/usr/bin/env python3
"""Reference outputs of transformers for the qerl-model parity tests.

Usage:  python3 tools/make_parity_fixture.py [OUT_DIR]   (default: tests/fixtures/parity)

Runs on the CPU in float32 with eager attention and writes, for every model below,

  OUT_DIR/<name>.json         token ids, greedy prompts and continuations, metadata
  OUT_DIR/<name>.safetensors  float32 logits: `logits.<i>` [len_i, vocab] for sequence i, and
                              `nvfp4_logits.<i>` for the NVFP4 twin where there is one

Models:

  llama_untied  tests/fixtures/compressed-tensors/llama_untied/bf16 (+ its nvfp4/ twin)
  qwen2_tied    tests/fixtures/compressed-tensors/qwen2_tied/bf16   (+ its nvfp4/ twin)
  llama3_rope   made here into OUT_DIR/llama3_rope/: Llama with rope_parameters
                {rope_type: llama3, rope_theta: 500000, ...}, attention and MLP biases, one KV
                head, head_dim 32 != hidden/heads, untied lm_head, eos_token_id [2, 3],
                float16 weights in sharded safetensors (model.safetensors.index.json)

Logits: a few fixed token-id sequences, the logits at every position.  Greedy: prompts of
different lengths, MAX_NEW new tokens each by argmax, EOS ignored, computed one prompt at a
time without a KV cache (the whole sequence re-run each step), so the continuations check
qerl's batched, left-padded, KV-cached decoding.  `min_margin` is the smallest gap between the
best and second-best logit over all greedy steps; the script fails if it is below MIN_MARGIN,
so that an argmax tie cannot make the test flaky.

The NVFP4 twins are loaded with transformers' compressed-tensors integration
(`CompressedTensorsConfig(run_compressed=False)`): it decompresses every packed weight to
`bf16(e2m1 * (f32(fp8 scale) / global_scale))`, then the model is cast to float32.

If compressed_tensors cannot be imported, the NVFP4 references are skipped (with a warning).

Tokenizer fixtures (with the `tokenizers` library):

  tests/fixtures/tokenizers/tiny/tokenizer.json  a byte-level BPE of 512 tokens, the vocabulary
                size of the first two fixture models, trained here on a fixed text (special
                tokens <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2) (CLI tests)
  OUT_DIR/tokenizer_qwen2.5.json   ids and decoded text of a few strings (ChatML included)
                under tests/fixtures/tokenizers/qwen2.5/tokenizer.json
"""

import json
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
CT = REPO / "tests" / "fixtures" / "compressed-tensors"
SEED = 20251022
MAX_NEW = 16
MIN_MARGIN = 2e-3
LOGIT_LENGTHS = [1, 7, 19]
GREEDY_LENGTHS = [3, 9, 14]


def dumps(obj) -> str:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    flat = re.compile(r"\[\s*(-?[0-9][0-9.e+-]*(?:,\s*-?[0-9][0-9.e+-]*)*)\s*\]")
    return flat.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def rel(path: Path) -> str:
    return path.resolve().relative_to(REPO).as_posix()


def make_llama3_rope(out: Path) -> Path:
    """A third random checkpoint with the config keys the first two do not exercise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=[2, 3],
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.05 * noise)
            elif name == "model.embed_tokens.weight":
                p.copy_(noise)
            elif name == "lm_head.weight":
                p.copy_(4.0 * noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)
    model = model.to(torch.float16)
    dest = out / "llama3_rope"
    if dest.exists():
        for f in dest.iterdir():
            f.unlink()
    model.save_pretrained(dest, max_shard_size="200KB")
    return dest


def load(path: Path, nvfp4: bool = False):
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    if nvfp4:
        from transformers import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.float().eval()


def sequences(vocab: int, lengths, seed: int):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, vocab, size=n)] for n in lengths]


@torch.no_grad()
def logits_of(model, ids):
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def greedy(model, prompt):
    ids = list(prompt)
    margin = float("inf")
    for _ in range(MAX_NEW):
        last = logits_of(model, ids)[-1]
        top = torch.topk(last, 2).values
        margin = min(margin, float(top[0] - top[1]))
        ids.append(int(torch.argmax(last)))
    return ids[len(prompt):], margin


@torch.no_grad()
def cached_greedy_matches(model, prompt, expected):
    """transformers' own KV-cached generate, as a sanity check of the reference."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=MAX_NEW,
        min_new_tokens=MAX_NEW,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt):].tolist() == expected


def run(name: str, path: Path, nvfp4_path, out: Path, seed: int, have_ct: bool) -> dict:
    from safetensors.torch import save_file

    model = load(path)
    vocab = model.config.vocab_size
    tensors = {}
    logit_seqs = sequences(vocab, LOGIT_LENGTHS, seed)
    for i, ids in enumerate(logit_seqs):
        tensors[f"logits.{i}"] = logits_of(model, ids).contiguous()

    prompts = sequences(vocab, GREEDY_LENGTHS, seed + 1)
    conts, margin = [], float("inf")
    for p in prompts:
        c, m = greedy(model, p)
        conts.append(c)
        margin = min(margin, m)
        if not cached_greedy_matches(model, p, c):
            sys.exit(f"{name}: transformers' cached generate disagrees with the uncached loop")
    if margin < MIN_MARGIN:
        sys.exit(f"{name}: greedy margin {margin:.2e} < {MIN_MARGIN}: change SEED")

    record = {
        "model": rel(path),
        "vocab_size": vocab,
        "logits": [{"ids": ids, "tensor": f"logits.{i}"} for i, ids in enumerate(logit_seqs)],
        "greedy": {
            "max_new_tokens": MAX_NEW,
            "prompts": prompts,
            "continuations": conts,
            "min_margin": margin,
        },
    }
    if nvfp4_path is not None and have_ct:
        qmodel = load(nvfp4_path, nvfp4=True)
        for i, ids in enumerate(logit_seqs):
            tensors[f"nvfp4_logits.{i}"] = logits_of(qmodel, ids).contiguous()
        record["nvfp4"] = {
            "model": rel(nvfp4_path),
            "tensors": [f"nvfp4_logits.{i}" for i in range(len(logit_seqs))],
        }
    elif nvfp4_path is not None:
        print(f"warning: compressed_tensors not importable, no NVFP4 reference for {name}")
    save_file(tensors, str(out / f"{name}.safetensors"))
    (out / f"{name}.json").write_text(dumps(record))
    print(f"{name}: greedy margin {margin:.3e}, {len(tensors)} logit tensors")
    return record


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning fine-tunes a policy with rewards from its own samples.",
    "Quantized weights in four bits, adapters in higher precision, and noise for exploration.",
    "What is two plus two? Two plus two is four. What is three times three? It is nine.",
    "Hello, world! Hello again, world. A model reads tokens and predicts the next one.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 3.14159 2.71828",
]

TOKENIZER_STRINGS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\nnewlines  ",
    "\u6570\u5b57 12345 and \u00e9mojis \U0001f916",
    "I'm sure they'll've done it, DON'T",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def make_tokenizers(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    numbered = [" ".join(f"{w}{i}" for i in range(0, 400, 7)) for w in ["step", "token", "reward", "x"]]
    tok.train_from_iterator(CORPUS * 4 + numbered, trainer)
    assert tok.get_vocab_size() == 512, tok.get_vocab_size()
    tiny = REPO / "tests" / "fixtures" / "tokenizers" / "tiny"
    tiny.mkdir(parents=True, exist_ok=True)
    tok.save(str(tiny / "tokenizer.json"))

    qwen = Tokenizer.from_file(str(REPO / "tests" / "fixtures" / "tokenizers" / "qwen2.5" / "tokenizer.json"))
    cases = []
    for text in TOKENIZER_STRINGS:
        ids = qwen.encode(text, add_special_tokens=True).ids
        cases.append({"text": text, "ids": ids, "decoded": qwen.decode(ids, skip_special_tokens=False)})
    tiny_cases = []
    for text in TOKENIZER_STRINGS[:2]:
        ids = tok.encode(text).ids
        tiny_cases.append({"text": text, "ids": ids})
    record = {"qwen2.5": cases, "tiny": tiny_cases}
    (out / "tokenizer_qwen2.5.json").write_text(dumps(record))


def version(pkg: str):
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "tests" / "fixtures" / "parity"
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    try:
        import compressed_tensors  # noqa: F401

        have_ct = True
    except ImportError:
        have_ct = False
    make_tokenizers(out)
    l3 = make_llama3_rope(out)
    models = [
        ("llama_untied", CT / "llama_untied" / "bf16", CT / "llama_untied" / "nvfp4"),
        ("qwen2_tied", CT / "qwen2_tied" / "bf16", CT / "qwen2_tied" / "nvfp4"),
        ("llama3_rope", l3, None),
    ]
    for i, (name, path, q) in enumerate(models):
        run(name, path, q, out, SEED + 10 * i, have_ct)
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "compressed-tensors": version("compressed-tensors"),
        "safetensors": version("safetensors"),
        "tokenizers": version("tokenizers"),
        "numpy": np.__version__,
        "device": "cpu",
        "dtype": "float32",
        "attn_implementation": "eager",
        "seed": SEED,
    }
    (out / "versions.json").write_text(dumps(versions))


if __name__ == "__main__":
    main()
