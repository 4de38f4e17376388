//! `qerl bench train`: GRPO steps on a Qwen2.5-shaped model with random weights built in
//! memory (`qerl_model::random`), NVFP4 and BF16 LoRA in the same run: the step time split into
//! rollout / reference / update, the allocator's peak, and the update's TFLOP/s. With
//! `--max-context` it then searches the longest completion whose step fits in device memory.
//!
//! Prompts are random token ids; rollouts have no EOS, so every completion is exactly
//! `--completion-len` tokens (`--rollout synthetic` skips generation and uses random
//! completions: the update's memory and time without the rollout's). Advantages alternate ±1
//! within each group.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, Optimizer};
use qerl_model::random::{random_model, RandomModel};
use qerl_model::{CausalLm, GenerationConfig, LoraConfig, ModelConfig, Precision, QerlBackend};
use qerl_rl::loss::{GlobalNormalizer, PolicyLossConfig};
use qerl_train::out_of_memory::{guard, OutOfMemory};
use qerl_train::update::{
    accumulate_gradients, FixedLogProbs, TrainBatch, UpdateConfig, TRAIN_LENGTH_MULTIPLE,
};

use super::bench_train_report::{describe, print_table, update_flops, StepTimes};
use super::generate::DeviceArg;

#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// tiny (a 2-layer model for tests), qwen2.5-0.5b, -1.5b, -7b, -14b or -32b.
    #[arg(long, default_value = "qwen2.5-7b")]
    pub shape: String,
    /// Frozen weights: nvfp4, bf16 (comma-separated; both run in one process, in this order).
    #[arg(long, default_value = "nvfp4,bf16", value_delimiter = ',')]
    pub precision: Vec<String>,
    /// Prompts per step.
    #[arg(long, default_value_t = 8)]
    pub prompts: usize,
    /// Completions per prompt (G).
    #[arg(long, default_value_t = 8)]
    pub group: usize,
    #[arg(long, default_value_t = 256)]
    pub prompt_len: usize,
    /// Tokens of every completion (no EOS: all reach it).
    #[arg(long, default_value_t = 1024)]
    pub completion_len: usize,
    /// GRPO steps per precision; the first compiles and autotunes kernels and is reported apart.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Micro-batches of the update (optim.grad_accum).
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// LoRA rank on every decoder linear (alpha = rank).
    #[arg(long, default_value_t = 16)]
    pub lora_rank: usize,
    /// KL coefficient (0.04: the QeRL GRPO scripts; 0 skips the reference pass).
    #[arg(long, default_value_t = 0.04)]
    pub beta: f32,
    /// Keep every layer's activations for the backward (optim.activation_checkpointing = false).
    #[arg(long)]
    pub no_checkpointing: bool,
    /// Completion tokens per lm_head chunk (optim.logprob_chunk_tokens; 0: from a budget).
    #[arg(long, default_value_t = 0)]
    pub logprob_chunk_tokens: usize,
    /// generate (the trainer's rollout path) or synthetic (random completions, no generation).
    #[arg(long, default_value = "generate")]
    pub rollout: String,
    /// After the timed steps, double the completion length until a step runs out of memory
    /// (then bisect to 256 tokens), one step each.
    #[arg(long)]
    pub max_context: bool,
    /// Largest completion length the search tries.
    #[arg(long, default_value_t = 32_768)]
    pub max_context_limit: usize,
    #[arg(long, value_enum, default_value = "cuda")]
    pub device: DeviceArg,
}

pub fn run(a: TrainArgs) -> Result<()> {
    let config = shape_config(&a.shape)?;
    for p in &a.precision {
        if p != "nvfp4" && p != "bf16" {
            bail!("--precision: `{p}` is not nvfp4 or bf16");
        }
    }
    if a.prompts == 0 || a.group == 0 || a.prompt_len == 0 || a.completion_len == 0 || a.steps == 0
    {
        bail!("--prompts, --group, --prompt-len, --completion-len and --steps must be positive");
    }
    // A micro-batch past 32-bit indexing panics inside CubeCL: refuse it here, naming the
    // arguments to change.
    qerl_train::limits::check_micro_batch(
        a.prompts * a.group,
        a.grad_accum,
        a.prompt_len + a.completion_len,
        config.intermediate_size,
    )
    .map_err(|e| {
        anyhow::anyhow!("{e} (here: --prompts x --group, --grad-accum, --completion-len)")
    })?;
    if a.rollout != "generate" && a.rollout != "synthetic" {
        bail!("--rollout: `{}` is not generate or synthetic", a.rollout);
    }
    match a.device {
        DeviceArg::Cpu => bench::<qerl_nn::backends::Cpu>(&a, &config, &Default::default()),
        #[cfg(feature = "wgpu")]
        DeviceArg::Wgpu => {
            let device = qerl_kernels::runtime::wgpu_device()?;
            bench::<qerl_nn::backends::Wgpu>(&a, &config, &device)
        }
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda => bench::<qerl_nn::backends::Cuda>(&a, &config, &Default::default()),
        #[allow(unreachable_patterns)]
        other => bail!("this build of qerl has no {other:?} support (see --features)"),
    }
}

/// The Qwen2 config of a shape preset, or the tiny test shape.
fn shape_config(name: &str) -> Result<ModelConfig> {
    let (v, h, i, layers, q, kv, tied) = if name == "tiny" {
        (512, 64, 128, 2, 4, 2, false)
    } else {
        let s = qerl_engine::ModelShape::preset(name)?;
        let tied = s.tied_embeddings;
        (
            s.vocab,
            s.hidden,
            s.intermediate,
            s.layers,
            s.q_heads,
            s.kv_heads,
            tied,
        )
    };
    let json = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": v, "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": layers, "num_attention_heads": q, "num_key_value_heads": kv,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 131_072,
        "tie_word_embeddings": tied, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2
    });
    Ok(ModelConfig::from_json(&json, std::path::Path::new(name))?)
}

fn bench<B>(a: &TrainArgs, config: &ModelConfig, device: &B::Device) -> Result<()>
where
    B: QerlBackend,
{
    println!(
        "{}: {} layers, hidden {}, {} prompts x {} completions, {} + {} tokens, grad_accum {}, \
         LoRA rank {}, beta {}, checkpointing {}, device {:?}",
        a.shape,
        config.num_hidden_layers,
        config.hidden_size,
        a.prompts,
        a.group,
        a.prompt_len,
        a.completion_len,
        a.grad_accum,
        a.lora_rank,
        a.beta,
        !a.no_checkpointing,
        a.device
    );
    let mut rows = Vec::new();
    for p in &a.precision {
        let precision: Precision = p.parse()?;
        let pool = || pool_text::<B>(device);
        let result = guard(&format!("{p} steps"), pool, || {
            let mut model = build::<Autodiff<B>>(config, precision, a.lora_rank, device)?;
            let mut optim = AdamWConfig::new()
                .with_beta_2(0.99)
                .with_weight_decay(0.1)
                .init::<Autodiff<B>, CausalLm<Autodiff<B>>>();
            let mut steps = Vec::new();
            for step in 0..a.steps {
                let t = grpo_step(&mut model, &mut optim, a, a.completion_len, step, device)?;
                println!("{p} step {step}: {}", describe(&t));
                steps.push(t);
            }
            let mut fits = None;
            if a.max_context {
                fits = Some(max_context(&mut model, &mut optim, a, device)?);
            }
            Ok((steps, fits))
        });
        match result {
            Ok((steps, fits)) => rows.push((p.clone(), Some(steps), fits)),
            Err(e) if runtime_lost(&e) => {
                // the runtime's server thread is gone: nothing more can run in this process
                return Err(e);
            }
            Err(e) if e.downcast_ref::<OutOfMemory>().is_some() => {
                println!("{p}: {e:#}");
                rows.push((p.clone(), None, None));
            }
            Err(e) => return Err(e).with_context(|| format!("{} {p}", a.shape)),
        }
        B::memory_cleanup(device);
    }
    print_table(a, &rows);
    Ok(())
}

type Ad<B> = Autodiff<B>;
type Optim<B> = burn::optim::adaptor::OptimizerAdaptor<burn::optim::AdamW, CausalLm<Ad<B>>, Ad<B>>;

fn build<B: QerlBackend>(
    config: &ModelConfig,
    precision: Precision,
    rank: usize,
    device: &B::Device,
) -> Result<CausalLm<B>> {
    let spec = RandomModel {
        precision,
        lora: (rank > 0).then_some(LoraConfig {
            rank,
            alpha: rank as f32,
        }),
        trainable_norms: true,
        seed: 7,
    };
    let t = Instant::now();
    let model = random_model::<B>(config, &spec, device)?;
    B::sync(device).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    eprintln!(
        "built a random {precision} model in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(model)
}

/// The process's peak resident set (`VmHWM`), the figure on the CPU backend (no device pool).
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `(in use, reserved)` as text for an out-of-memory message.
fn pool_text<B: QerlBackend>(device: &B::Device) -> Option<String> {
    B::memory_usage(device).map(|(used, reserved)| {
        format!(
            "{:.1} GB in use, {:.1} GB reserved",
            used as f64 / 1e9,
            reserved as f64 / 1e9
        )
    })
}

/// The synthetic rollout batch: prompts, completions (generated or random) and their
/// log-probabilities.
fn rollout<B: QerlBackend>(
    model: &CausalLm<B>,
    a: &TrainArgs,
    completion_len: usize,
    step: usize,
) -> Result<TrainBatch> {
    let vocab = model.config().vocab_size;
    let mut rng = qerl_model::sampling::Rng::new(1000 + step as u64);
    // ids 3.. (0-2 are pad, BOS and EOS)
    let mut ids = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                3 + ((rng.next_open01() as f64 * (vocab - 3) as f64) as u32).min(vocab as u32 - 4)
            })
            .collect()
    };
    let prompts: Vec<Vec<u32>> = (0..a.prompts).map(|_| ids(a.prompt_len)).collect();
    let rows: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), a.group))
        .collect();
    let completions: Vec<(Vec<u32>, Vec<f32>)> = if a.rollout == "synthetic" {
        rows.iter()
            .map(|_| (ids(completion_len), vec![-2.0; completion_len]))
            .collect()
    } else {
        let gen = GenerationConfig {
            max_new_tokens: completion_len,
            seed: step as u64,
            ..GenerationConfig::default()
        };
        qerl_train::engine_rollout::generate_rows(model, &rows, &gen, None, 0)?
            .into_iter()
            .map(|c| (c.tokens, c.logprobs))
            .collect()
    };
    let advantages: Vec<f32> = (0..rows.len())
        .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let p: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let c: Vec<(&[u32], &[f32])> = completions
        .iter()
        .map(|(t, l)| (t.as_slice(), l.as_slice()))
        .collect();
    Ok(
        TrainBatch::new(&p, &c, advantages, &vec![false; rows.len()], 0)?
            .padded_to_multiple(TRAIN_LENGTH_MULTIPLE, 0),
    )
}

/// One GRPO step: rollout, reference (and old) log-probs, update; each phase synchronised.
fn grpo_step<B>(
    model: &mut CausalLm<Ad<B>>,
    optim: &mut Optim<B>,
    a: &TrainArgs,
    completion_len: usize,
    step: usize,
    device: &B::Device,
) -> Result<StepTimes>
where
    B: QerlBackend,
{
    let mut t = StepTimes::default();
    // The allocator's reservation only grows within a step, so its value after each phase
    // says which phase raised the peak.
    let note_peak = |t: &mut StepTimes| {
        let reserved = B::memory_usage(device)
            .map(|(_, reserved)| reserved)
            .or_else(peak_rss_bytes);
        if let Some(r) = reserved {
            t.peak_reserved = Some(t.peak_reserved.unwrap_or(0).max(r));
        }
        t.reserved_after.push(reserved);
    };
    let sync = || B::sync(device).map_err(|e| anyhow::anyhow!("{e:?}"));
    let loss = PolicyLossConfig {
        beta: a.beta,
        ..PolicyLossConfig::grpo()
    };
    let cfg = UpdateConfig {
        loss: &loss,
        mu: 1,
        grad_accum: a.grad_accum,
        grad_clip: 0.2,
        temperature: 1.0,
        tis_cap: None,
        lr: 1e-5,
        logprob_chunk_tokens: a.logprob_chunk_tokens,
        activation_checkpointing: !a.no_checkpointing,
        train_noise: None,
        comm: &qerl_train::dist::Single,
    };

    let start = Instant::now();
    let batch = rollout(&model.valid(), a, completion_len, step)?;
    sync()?;
    let rollout_s = start.elapsed().as_secs_f64();
    note_peak(&mut t);

    let start = Instant::now();
    let micro = batch.micro_batches(a.grad_accum, TRAIN_LENGTH_MULTIPLE);
    let fixed = FixedLogProbs::compute(&model.valid(), &micro, &cfg)?;
    sync()?;
    let reference_s = start.elapsed().as_secs_f64();
    note_peak(&mut t);

    let start = Instant::now();
    let global = GlobalNormalizer {
        sequences: batch.rows(),
        tokens: batch.tokens_counted(),
    };
    let (mut grads, stats) = accumulate_gradients(model, &micro, &fixed, global, &cfg, false)?;
    t.loss = stats.loss;
    t.grad_norm =
        qerl_rl::optim_schedule::clip_grad_norm::<Ad<B>, _>(model, &mut grads, cfg.grad_clip);
    *model = optim.step(cfg.lr, model.clone(), grads);
    sync()?;
    let update_s = start.elapsed().as_secs_f64();
    note_peak(&mut t);
    t.rollout_s = rollout_s;
    t.reference_s = reference_s;
    t.update_s = update_s;
    t.update_flops = micro
        .iter()
        .map(|m| update_flops(model.config(), a.lora_rank, m))
        .sum();
    Ok(t)
}

/// Doubles the completion length from `--completion-len` until a step runs out of memory or
/// passes `--max-context-limit`, then bisects to 256 tokens; returns the longest that fitted
/// (prompt + completion), 0 if none.
fn max_context<B>(
    model: &mut CausalLm<Ad<B>>,
    optim: &mut Optim<B>,
    a: &TrainArgs,
    device: &B::Device,
) -> Result<usize>
where
    B: QerlBackend,
{
    let intermediate = model.config().intermediate_size;
    let mut try_len = |len: usize| -> Result<bool> {
        // Past 32-bit indexing a step panics instead of running out of memory: the search
        // treats that length as not fitting, and says so.
        let tokens = a.prompt_len + len;
        if let Err(e) = qerl_train::limits::check_micro_batch(
            a.prompts * a.group,
            a.grad_accum,
            tokens,
            intermediate,
        ) {
            println!("completion {len}: past the tensor size limit ({e})");
            return Ok(false);
        }
        let r = guard(
            &format!("completion {len}"),
            || pool_text::<B>(device),
            || grpo_step(model, optim, a, len, 0, device),
        );
        if r.as_ref().is_err_and(runtime_lost) {
            return r.map(|_| false);
        }
        B::memory_cleanup(device);
        match r {
            Ok(t) => {
                println!("completion {len}: fits, {}", describe(&t));
                Ok(true)
            }
            Err(e) if e.downcast_ref::<OutOfMemory>().is_some() => {
                println!("completion {len}: out of memory");
                Ok(false)
            }
            Err(e) => Err(e),
        }
    };
    let (mut good, mut bad) = (0usize, None);
    let mut len = a.completion_len;
    while len <= a.max_context_limit {
        if try_len(len)? {
            good = len;
            len *= 2;
        } else {
            bad = Some(len);
            break;
        }
    }
    if let Some(mut hi) = bad {
        while hi - good > 256 {
            let mid = (good + hi) / 2 / 256 * 256;
            if mid <= good {
                break;
            }
            if try_len(mid)? {
                good = mid;
            } else {
                hi = mid;
            }
        }
    }
    Ok(if good == 0 { 0 } else { a.prompt_len + good })
}

/// Whether `e` is an out-of-memory error after which the runtime's server thread is gone, so
/// nothing more can run in this process.
fn runtime_lost(e: &anyhow::Error) -> bool {
    e.downcast_ref::<OutOfMemory>()
        .is_some_and(|o| o.runtime_lost)
}
