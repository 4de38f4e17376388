//! `qerl convert <file.gguf> <out_dir> [--dtype f32|bf16]`.
//!
//! Converts a llama.cpp / Ollama GGUF file (Llama or Qwen2; F32, F16, BF16, Q8_0, Q4_0, Q4_1,
//! Q5_0, Q5_1, Q4_K, Q5_K, Q6_K tensors) into a Hugging Face model directory that `qerl
//! generate`, `qerl quantize` and transformers load: `config.json`, `generation_config.json`,
//! `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` (with the chat template),
//! `special_tokens_map.json`. See `qerl_format::gguf` and docs/gguf.md.

use std::path::PathBuf;

use anyhow::Result;
use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use qerl_format::gguf::{convert_gguf, ConvertOptions, ConvertReport, OutDtype, Progress};

/// The dtype of the written tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// Every dequantized value exactly.
    F32,
    /// Half the size; values rounded to bf16.
    Bf16,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF file (versions 2 and 3).
    pub gguf: PathBuf,
    /// Output directory; must not exist or be empty.
    pub out_dir: PathBuf,
    /// Dtype of the written tensors.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
}

pub fn run(args: Args) -> Result<()> {
    let options = ConvertOptions {
        dtype: match args.dtype {
            DtypeArg::F32 => OutDtype::F32,
            DtypeArg::Bf16 => OutDtype::Bf16,
        },
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("converting [{bar:40}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let on_tensor = |p: Progress| {
        bar.set_length(p.total as u64);
        bar.set_position(p.done as u64);
        bar.set_message(p.tensor.to_string());
    };
    let result = convert_gguf(&args.gguf, &args.out_dir, &options, &on_tensor);
    bar.finish_and_clear();
    print!("{}", summary(&result?));
    println!("wrote {}", args.out_dir.display());
    Ok(())
}

/// The end-of-run summary: model, tensor types, sizes.
pub fn summary(r: &ConvertReport) -> String {
    let h = &r.hyper;
    let mut out = format!(
        "{} (GGUF v{}{}): {} layers, hidden {}, {} heads / {} kv heads, vocab {}{}\n",
        r.arch.hf_class(),
        r.gguf_version,
        r.model_name
            .as_deref()
            .map(|n| format!(", \"{n}\""))
            .unwrap_or_default(),
        h.num_hidden_layers,
        h.hidden_size,
        h.num_attention_heads,
        h.num_key_value_heads,
        h.vocab_size,
        if h.tie_word_embeddings {
            ", tied embeddings"
        } else {
            ""
        },
    );
    let types: Vec<String> = r.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
    out += &format!(
        "{} tensors ({}), {:.1}M parameters; un-permuted the RoPE rows of {} q/k tensors\n",
        r.tensors,
        types.join(", "),
        r.parameters as f64 / 1e6,
        r.unpermuted
    );
    if r.duplicate_tokens > 0 {
        out += &format!(
            "note: {} token strings occur twice in the vocabulary; the first id is kept\n",
            r.duplicate_tokens
        );
    }
    out += &format!(
        "size: {:.2} MB -> {:.2} MB ({})\n",
        r.input_bytes as f64 / 1e6,
        r.output_bytes as f64 / 1e6,
        r.files.join(", ")
    );
    out
}
