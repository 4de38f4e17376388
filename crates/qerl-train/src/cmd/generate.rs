//! `qerl generate --model DIR [--adapter DIR] --prompt TEXT [--chat] [--max-new-tokens N]
//! [--greedy | --temperature T --top-p P --top-k K] [--seed S] [--json]`.
//!
//! Loads a Qwen2 / Llama checkpoint (dense, or NVFP4 as `qerl quantize` writes it) on the CPU,
//! wgpu or CUDA, and generates a completion for each `--prompt` (several prompts run as one
//! left-padded batch). Without sampling flags the defaults of `generation_config.json` apply
//! (`do_sample: false` or no file with them: greedy). Prints the completions, or with `--json`
//! the token ids and the log-probability of each sampled token (`log_softmax(logits / T)`,
//! before top-k/top-p). Timing goes to stderr.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use qerl_model::generate::truncate_at_stop;
use qerl_model::{
    config::eos_token_ids, load_with_stats, Adapter, CausalLm, ChatTemplate, FinishReason,
    GenerationConfig, GenerationDefaults, LoadOptions, Message, Precision, QerlBackend,
    SamplingParams, Tokenizer,
};
use serde_json::{json, Value};

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// burn's NdArray backend, f32 (the reference path).
    Cpu,
    /// wgpu (Vulkan, Metal, DX12), f32 activations.
    Wgpu,
    /// CUDA, bf16 activations (build with --features qerl-train/cuda).
    Cuda,
}

/// How the decoder linears are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    Bf16,
    Nvfp4,
    Mxfp4,
    Nf4,
}

impl From<PrecisionArg> for Precision {
    fn from(p: PrecisionArg) -> Self {
        match p {
            PrecisionArg::Bf16 => Precision::Bf16,
            PrecisionArg::Nvfp4 => Precision::Nvfp4,
            PrecisionArg::Mxfp4 => Precision::Mxfp4,
            PrecisionArg::Nf4 => Precision::Nf4,
        }
    }
}

/// The model options `generate` and `score` share.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// Hugging Face model directory (config.json + safetensors), dense or NVFP4.
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// tokenizer.json to use when the model directory has none.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Storage of the decoder linears; default: as the checkpoint has them (bf16 for a dense
    /// checkpoint, its 4-bit format for a quantized one).
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text; repeat for a batch.
    #[arg(long, required = true)]
    pub prompt: Vec<String>,
    /// Wrap each prompt as a user message in the ChatML template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat (default: the template's own, if any).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Pick the most likely token at every step.
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    pub greedy: bool,
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop a sequence once its text contains this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print JSON: ids, log-probs, texts, finish reasons.
    #[arg(long)]
    pub json: bool,
}

/// A loaded model and its tokenizer.
pub struct Loaded<B: QerlBackend> {
    pub model: CausalLm<B>,
    pub tokenizer: Tokenizer,
    pub precision: Precision,
}

/// Loads model, adapter and tokenizer for `B`, printing the load time to stderr.
pub fn load<B: QerlBackend>(args: &ModelArgs, device: &B::Device) -> Result<Loaded<B>> {
    let start = Instant::now();
    let tokenizer = Tokenizer::for_model(&args.model, args.tokenizer.as_deref())?;
    let adapter = args.adapter.as_deref().map(Adapter::open).transpose()?;
    let options = LoadOptions {
        precision: args.precision.map(Precision::from),
        ..LoadOptions::default()
    };
    let (model, stats) = load_with_stats::<B>(&args.model, &options, adapter.as_ref(), device)
        .with_context(|| format!("cannot load the model in `{}`", args.model.display()))?;
    let precision = model
        .layers
        .first()
        .map_or(Precision::Bf16, |l| l.self_attn.q_proj.precision());
    eprintln!(
        "loaded {} ({} layers, {precision}) on {:?} in {:.2}s; weights: {stats}",
        args.model.display(),
        model.config().num_hidden_layers,
        args.device,
        start.elapsed().as_secs_f64()
    );
    memory_line(args.device, "after loading");
    Ok(Loaded {
        model,
        tokenizer,
        precision,
    })
}

/// The device memory cubecl's allocator holds on `device`: bytes in use by live tensors and
/// bytes reserved from the driver (the pool), for a GPU device; `None` on the CPU. Excludes
/// the CUDA context itself (a few hundred MB per process, outside any pool).
pub fn pool_memory(device: DeviceArg) -> Option<(u64, u64)> {
    match device {
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda => qerl_nn::backends::cuda_memory(),
        _ => None,
    }
}

/// `pool_memory` as a line for stderr.
fn memory_line(device: DeviceArg, when: &str) {
    if let Some((used, reserved)) = pool_memory(device) {
        eprintln!(
            "device memory {when}: {:.1} MB in use, {:.1} MB reserved",
            used as f64 / 1e6,
            reserved as f64 / 1e6
        );
    }
}

/// Runs `$body` with `$B` bound to the backend of `$device`.
macro_rules! with_backend {
    ($device:expr, $B:ident => $body:expr) => {
        match $device {
            $crate::cmd::generate::DeviceArg::Cpu => {
                type $B = qerl_nn::backends::Cpu;
                $body
            }
            #[cfg(feature = "wgpu")]
            $crate::cmd::generate::DeviceArg::Wgpu => {
                type $B = qerl_nn::backends::Wgpu;
                qerl_kernels::runtime::wgpu_device()?;
                $body
            }
            #[cfg(feature = "cuda")]
            $crate::cmd::generate::DeviceArg::Cuda => {
                type $B = qerl_nn::backends::Cuda;
                $body
            }
            #[allow(unreachable_patterns)]
            other => anyhow::bail!("this build of qerl has no {other:?} support (see --features)"),
        }
    };
}
pub(crate) use with_backend;

/// Sampling from the flags, else from generation_config.json, else greedy.
fn sampling(args: &Args, defaults: &GenerationDefaults) -> Result<SamplingParams> {
    let explicit = args.temperature.is_some() || args.top_p.is_some() || args.top_k.is_some();
    let params = if args.greedy {
        SamplingParams::greedy()
    } else if explicit || defaults.do_sample == Some(true) {
        let d = SamplingParams::default();
        SamplingParams {
            temperature: args
                .temperature
                .or(defaults.temperature.map(|t| t as f32))
                .unwrap_or(d.temperature),
            top_p: args
                .top_p
                .or(defaults.top_p.map(|p| p as f32))
                .unwrap_or(d.top_p),
            top_k: args.top_k.or(defaults.top_k).unwrap_or(d.top_k),
        }
    } else {
        SamplingParams::greedy()
    };
    params.validate()?;
    Ok(params)
}

fn prompt_ids(
    args: &Args,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    text: &str,
) -> Result<Vec<u32>> {
    let ids = match template {
        Some(t) => {
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(Message::new("system", system));
            }
            messages.push(Message::new("user", text));
            t.encode(tokenizer, &messages, true)?
        }
        None => tokenizer.encode(text, true)?,
    };
    if ids.is_empty() {
        bail!("the prompt {text:?} encodes to no tokens");
    }
    Ok(ids)
}

/// An f32 parameter as the decimal the user typed (0.8, not 0.800000011920929).
fn short(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

fn finish_json(f: &FinishReason) -> (&'static str, Value) {
    match f {
        FinishReason::Eos(t) => ("eos", json!(t)),
        FinishReason::Stop(s) => ("stop", json!(s)),
        FinishReason::Length => ("length", Value::Null),
    }
}

pub fn run(args: Args) -> Result<()> {
    with_backend!(args.model.device, B => run_on::<B>(&args, &Default::default()))
}

fn run_on<B: QerlBackend>(args: &Args, device: &B::Device) -> Result<()> {
    let loaded = load::<B>(&args.model, device)?;
    let (model, tokenizer) = (&loaded.model, &loaded.tokenizer);
    let dir: &Path = &args.model.model;
    let defaults = GenerationDefaults::from_dir(dir)?;
    let template = if args.chat {
        Some(ChatTemplate::for_model(dir)?)
    } else {
        None
    };
    let prompts = args
        .prompt
        .iter()
        .map(|p| prompt_ids(args, tokenizer, template.as_ref(), p))
        .collect::<Result<Vec<_>>>()?;
    let config = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        sampling: sampling(args, &defaults)?,
        seed: args.seed,
        eos_token_ids: eos_token_ids(model.config(), &defaults),
        stop_strings: args.stop.clone(),
        pad_token_id: defaults
            .pad_token_id
            .or(model.config().pad_token_id)
            .unwrap_or(0),
    };
    let start = Instant::now();
    qerl_model::check_context(&model.config, &prompts, config.max_new_tokens)?;
    let out =
        qerl_train::engine_rollout::generate_rows(model, &prompts, &config, Some(tokenizer), 0)?;
    let secs = start.elapsed().as_secs_f64();
    let new_tokens: usize = out.iter().map(|c| c.tokens.len()).sum();
    eprintln!(
        "generated {new_tokens} tokens for {} prompts in {secs:.2}s ({:.1} tokens/s)",
        prompts.len(),
        new_tokens as f64 / secs.max(1e-9)
    );
    memory_line(args.model.device, "after generating");
    let texts = out
        .iter()
        .map(|c| {
            Ok(truncate_at_stop(&tokenizer.decode_ids(&c.tokens, true)?, &args.stop).to_string())
        })
        .collect::<Result<Vec<String>>>()?;
    if args.json {
        let completions: Vec<Value> = (0..out.len())
            .map(|i| {
                let (reason, detail) = finish_json(&out[i].finish);
                json!({
                    "prompt": args.prompt[i],
                    "prompt_ids": prompts[i],
                    "ids": out[i].tokens,
                    "logprobs": out[i].logprobs,
                    "text": texts[i],
                    "finish_reason": reason,
                    "finish_detail": detail,
                })
            })
            .collect();
        let s = config.sampling;
        let doc = json!({
            "model": dir.display().to_string(),
            "device": format!("{:?}", args.model.device).to_lowercase(),
            "precision": loaded.precision.to_string(),
            "sampling": {
                "temperature": short(s.temperature),
                "top_p": short(s.top_p),
                "top_k": s.top_k,
                "seed": config.seed,
            },
            "max_new_tokens": config.max_new_tokens,
            "device_memory": pool_memory(args.model.device)
                .map(|(used, reserved)| json!({"bytes_in_use": used, "bytes_reserved": reserved})),
            "completions": completions,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else if texts.len() == 1 {
        println!("{}", texts[0]);
    } else {
        for (i, t) in texts.iter().enumerate() {
            println!("=== {i} ===\n{t}");
        }
    }
    Ok(())
}
