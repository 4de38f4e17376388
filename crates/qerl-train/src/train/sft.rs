//! Supervised training of a small Qwen2 model from scratch, with the project's own model code:
//! how `models/tiny-math` is made (`qerl sft`).
//!
//! 1. [`init_model_dir`] writes a Hugging Face directory with random weights (config.json,
//!    model.safetensors, the tokenizer, a ChatML tokenizer_config.json, generation_config.json).
//! 2. The model is loaded dense, every weight made trainable
//!    ([`CausalLm::set_base_trainable`]), on an f32 backend.
//! 3. [`train`]: AdamW with warmup + cosine decay and global-norm clipping on the cross-entropy
//!    of the completion tokens only (prompt tokens are context, not targets).
//! 4. The caller saves it with [`qerl_model::export::save_pretrained`].

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use qerl_model::export::{write_atomic, write_safetensors, ExportDtype, NamedTensor};
use qerl_model::{CausalLm, ChatTemplate, LogProbOptions, ModelConfig, QerlBackend, Tokenizer};
use qerl_rl::optim_schedule::{clip_grad_norm, LrDecay, LrSchedule};
use qerl_rl::prompt::PromptTemplate;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

use crate::bpe::chatml_tokenizer_config;
use crate::rollout::encode_prompts;
use crate::update::TrainBatch;

/// The decoder's size.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    pub max_positions: usize,
}

impl ModelShape {
    /// Parameters of a tied-embedding Qwen2 model of this shape.
    pub fn parameters(&self, vocab: usize) -> usize {
        let (h, i) = (self.hidden, self.intermediate);
        let kv = h / self.heads * self.kv_heads;
        let attn = h * h + 2 * h * kv + h * h + h + 2 * kv;
        vocab * h + self.layers * (attn + 3 * h * i + 2 * h) + h
    }
}

/// The config.json of a tied-embedding Qwen2 model of `shape` for `tokenizer`.
pub fn qwen2_config(shape: &ModelShape, tokenizer: &Tokenizer) -> Result<serde_json::Value> {
    anyhow::ensure!(
        shape.hidden.is_multiple_of(shape.heads)
            && shape.heads.is_multiple_of(shape.kv_heads.max(1)),
        "hidden ({}) must be a multiple of heads ({}), and heads of kv_heads ({})",
        shape.hidden,
        shape.heads,
        shape.kv_heads
    );
    let id = |t: &str| {
        tokenizer
            .token_to_id(t)
            .with_context(|| format!("the tokenizer has no `{t}` token"))
    };
    let (eot, im_end) = (id("<|endoftext|>")?, id("<|im_end|>")?);
    Ok(serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": tokenizer.vocab_size(),
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": true,
        "use_sliding_window": false,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": eot,
        "eos_token_id": im_end,
        "torch_dtype": "float32",
    }))
}

/// Random initial weights: N(0, 0.02) for embeddings and linears, the residual-stream outputs
/// (o_proj, down_proj) scaled down by `sqrt(2 · layers)` as GPT-2 does, norms 1, biases 0.
pub fn random_weights(config: &ModelConfig, seed: u64) -> Vec<NamedTensor> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut normal = |n: usize, std: f32| -> Vec<f32> {
        let d = Normal::new(0.0f32, std).expect("a positive std");
        (0..n).map(|_| d.sample(&mut rng)).collect()
    };
    let (v, h) = (config.vocab_size, config.hidden_size);
    let residual = 0.02 / (2.0 * config.num_hidden_layers as f32).sqrt();
    let mut out: Vec<NamedTensor> = vec![(
        "model.embed_tokens.weight".into(),
        vec![v, h],
        normal(v * h, 0.02),
    )];
    for l in 0..config.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            out.push((format!("{p}.{norm}.weight"), vec![h], vec![1.0; h]));
        }
        for (name, d_out, d_in, bias) in config.linears() {
            let std = if name.ends_with("o_proj") || name.ends_with("down_proj") {
                residual
            } else {
                0.02
            };
            out.push((
                format!("{p}.{name}.weight"),
                vec![d_out, d_in],
                normal(d_out * d_in, std),
            ));
            if bias {
                out.push((format!("{p}.{name}.bias"), vec![d_out], vec![0.0; d_out]));
            }
        }
    }
    out.push(("model.norm.weight".into(), vec![h], vec![1.0; h]));
    out
}

/// Writes a fresh model directory `dir` of `shape` with random weights and the tokenizer at
/// `tokenizer_file` (copied in unless it is already `dir/tokenizer.json`).
pub fn init_model_dir(
    dir: &Path,
    shape: &ModelShape,
    tokenizer_file: &Path,
    seed: u64,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create `{}`", dir.display()))?;
    let tok_dst = dir.join("tokenizer.json");
    if tokenizer_file != tok_dst {
        std::fs::copy(tokenizer_file, &tok_dst).with_context(|| {
            format!(
                "cannot copy `{}` to `{}`",
                tokenizer_file.display(),
                tok_dst.display()
            )
        })?;
    }
    let tokenizer = Tokenizer::from_file(&tok_dst)?;
    let config = qwen2_config(shape, &tokenizer)?;
    let config_path = dir.join("config.json");
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).expect("JSON");
    write_atomic(&config_path, pretty(&config).as_bytes())?;
    let generation = serde_json::json!({
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["bos_token_id"],
        "bos_token_id": config["bos_token_id"],
    });
    write_atomic(
        &dir.join("generation_config.json"),
        pretty(&generation).as_bytes(),
    )?;
    write_atomic(
        &dir.join("tokenizer_config.json"),
        pretty(&chatml_tokenizer_config()).as_bytes(),
    )?;
    let parsed = ModelConfig::from_json(&config, &config_path)?;
    write_safetensors(
        &dir.join("model.safetensors"),
        &random_weights(&parsed, seed),
        ExportDtype::F32,
    )?;
    Ok(())
}

/// One supervised example: the prompt (context) and the completion (the targets, ending with
/// the end-of-turn token).
#[derive(Clone, Debug, PartialEq)]
pub struct SftExample {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
}

/// Encodes `(question, answer)` pairs: the prompt as the trainer and `qerl eval` render it
/// (`template`, then ChatML), the completion as the answer's tokens then `eos`.
pub fn encode_examples(
    pairs: &[(String, String)],
    tokenizer: &Tokenizer,
    chat: &ChatTemplate,
    template: &PromptTemplate,
    eos: u32,
) -> Result<Vec<SftExample>> {
    let questions: Vec<String> = pairs.iter().map(|(q, _)| q.clone()).collect();
    let prompts = encode_prompts(&questions, template, Some(chat), tokenizer, 0)?;
    pairs
        .iter()
        .zip(prompts)
        .map(|((_, a), prompt)| {
            let mut completion = tokenizer.encode(a, false)?;
            completion.push(eos);
            Ok(SftExample { prompt, completion })
        })
        .collect()
}

/// Optimisation settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SftOptions {
    pub steps: usize,
    /// Sequences per step.
    pub batch: usize,
    pub lr: f64,
    pub warmup_steps: usize,
    pub weight_decay: f32,
    pub grad_clip: f32,
    pub seed: u64,
    /// Wall-clock budget of the training loop in seconds: after a few steps (the first ones
    /// compile kernels), the step count is cut to what fits, and the cosine schedule is
    /// stretched over that count, so a run on unknown hardware still ends its decay.
    pub time_budget_s: Option<f64>,
}

/// Steps timed before the budget is applied (the first ones pay for kernel compilation).
const BUDGET_WARMUP: usize = 10;
const BUDGET_MEASURE: usize = 10;

/// What one step reports.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SftLog {
    pub step: usize,
    /// Mean cross-entropy per completion token (nats).
    pub loss: f32,
    pub grad_norm: f32,
    pub lr: f64,
    /// Completion tokens of the step.
    pub tokens: usize,
    pub seconds: f64,
    /// The step count the run aims at (below `SftOptions::steps` when the time budget cut it).
    pub total_steps: usize,
}

/// The masked mean cross-entropy of the completion tokens of `batch` (the lm_head, trainable
/// here through the tied embeddings, applied to the completion tokens only, in chunks).
pub fn batch_loss<B: QerlBackend>(
    model: &CausalLm<B>,
    batch: &TrainBatch,
) -> Result<burn::tensor::Tensor<B, 1>> {
    let (n, t) = (batch.rows(), batch.tokens.len - 1);
    let (logp, _) = crate::update::log_probs(model, batch, &LogProbOptions::default(), true)?;
    let mask = burn::tensor::Tensor::<B, 2>::from_data(
        burn::tensor::TensorData::new(batch.mask.clone(), [n, t]),
        (&model.device(), burn::tensor::DType::F32),
    );
    Ok((logp * mask)
        .sum()
        .neg()
        .div_scalar(batch.tokens_counted().max(1.0)))
}

/// Sequence lengths of a training batch are rounded up to a multiple of this: every new shape
/// costs a kernel compilation and an autotune pass on a GPU (minutes over a run whose steps
/// take milliseconds), so the run sees a handful of shapes.
pub const LENGTH_MULTIPLE: usize = 64;

/// Batches of `examples` as training batches (completion tokens counted, prompts not),
/// padded to a multiple of [`LENGTH_MULTIPLE`].
pub fn make_batch(examples: &[&SftExample], pad: u32) -> Result<TrainBatch> {
    let prompts: Vec<&[u32]> = examples.iter().map(|e| e.prompt.as_slice()).collect();
    let zeros: Vec<Vec<f32>> = examples
        .iter()
        .map(|e| vec![0.0; e.completion.len()])
        .collect();
    let completions: Vec<(&[u32], &[f32])> = examples
        .iter()
        .zip(&zeros)
        .map(|(e, z)| (e.completion.as_slice(), z.as_slice()))
        .collect();
    let batch = TrainBatch::new(
        &prompts,
        &completions,
        vec![0.0; examples.len()],
        &vec![false; examples.len()],
        pad,
    )?;
    Ok(batch.padded_to_multiple(LENGTH_MULTIPLE, pad))
}

/// Trains `model` on `data` for `opt.steps` steps (fewer under a time budget) of `opt.batch`
/// examples drawn in shuffled epochs; `on_step` sees each step's log. Stops early (returning the model as it is) when
/// `stop()` says so.
pub fn train<B>(
    mut model: CausalLm<B>,
    data: &[SftExample],
    opt: &SftOptions,
    pad: u32,
    mut on_step: impl FnMut(&SftLog),
    stop: impl Fn() -> bool,
) -> Result<CausalLm<B>>
where
    B: AutodiffBackend + QerlBackend,
    B::InnerBackend: QerlBackend,
{
    anyhow::ensure!(!data.is_empty(), "no training examples");
    let mut optim = AdamWConfig::new()
        .with_weight_decay(opt.weight_decay)
        .init::<B, CausalLm<B>>();
    let mut schedule = LrSchedule {
        peak_lr: opt.lr,
        warmup_steps: opt.warmup_steps,
        total_steps: opt.steps,
        decay: LrDecay::Cosine,
        min_lr_ratio: 0.1,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(opt.seed);
    let mut order: Vec<usize> = Vec::new();
    let t0 = Instant::now();
    let mut measure_from = t0;
    let mut step = 0;
    while step < schedule.total_steps {
        if stop() {
            break;
        }
        if let Some(budget) = opt.time_budget_s {
            if step == BUDGET_WARMUP {
                measure_from = Instant::now();
            } else if step == BUDGET_WARMUP + BUDGET_MEASURE {
                let per_step = measure_from.elapsed().as_secs_f64() / BUDGET_MEASURE as f64;
                let left = (budget - t0.elapsed().as_secs_f64()).max(0.0);
                let fits = step + (left / per_step.max(1e-9)) as usize;
                if fits < schedule.total_steps {
                    schedule.total_steps = fits.max(step + 1);
                    schedule.warmup_steps = schedule.warmup_steps.min(schedule.total_steps / 2);
                }
            }
        }
        let start = Instant::now();
        let picked: Vec<&SftExample> = (0..opt.batch.max(1))
            .map(|_| {
                if order.is_empty() {
                    order = (0..data.len()).collect();
                    order.shuffle(&mut rng);
                }
                &data[order.pop().expect("refilled")]
            })
            .collect();
        let batch = make_batch(&picked, pad)?;
        let loss = batch_loss(&model, &batch)?;
        let value = loss
            .clone()
            .into_data()
            .iter::<f32>()
            .next()
            .unwrap_or(f32::NAN);
        anyhow::ensure!(
            value.is_finite(),
            "the loss is {value} at step {step}: lower the learning rate (--lr)"
        );
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let grad_norm = clip_grad_norm::<B, _>(&model, &mut grads, opt.grad_clip);
        let lr = schedule.lr(step);
        if grad_norm.is_finite() {
            model = optim.step(lr, model, grads);
        }
        on_step(&SftLog {
            step,
            loss: value,
            grad_norm,
            lr,
            tokens: batch.tokens_counted() as usize,
            seconds: start.elapsed().as_secs_f64(),
            total_steps: schedule.total_steps,
        });
        step += 1;
    }
    Ok(model)
}
