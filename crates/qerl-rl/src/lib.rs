//! RL building blocks for QeRL: everything the `qerl train`, `qerl eval` and `qerl reward` loops
//! need that is not the model itself.
//!
//! QeRL (arXiv 2510.11696) post-trains an LLM with GRPO/DAPO on verifiable math rewards, with the
//! base weights frozen in NVFP4, LoRA adapters trained in higher precision, and AQN: a channel-wise
//! Gaussian vector added to every RMSNorm weight, its scale decayed over training.
//!
//! | module | what |
//! | --- | --- |
//! | [`reward`] | the [`reward::Reward`] trait, GSM8K / MATH-500 answer checkers, a format reward, and [`reward::RewardSet`], which never lets one bad sample stop a run |
//! | [`data`] | JSONL loaders (GSM8K, MATH-500, any file with configurable fields), the vendored data under `data/`, a seeded prompt sampler |
//! | [`eval`] | strict / flexible verdicts and pass@1 over K samples for `qerl eval` and `qerl reward` |
//! | [`prompt`] | chat prompts: system instruction + question |
//! | [`aqn`] | AQN sigma schedules (paper Eq. 8 and alternatives) and seeded channel-wise noise vectors |
//! | [`advantage`] | group advantages (GRPO, Dr. GRPO), DAPO dynamic sampling, overlong shaping, truncation masks |
//! | [`loss`] | the clipped policy-gradient loss on burn tensors (GRPO / DAPO / Dr. GRPO aggregation, k3 KL, truncated IS) |
//! | [`logprob`] | per-token log-probabilities and entropies from logits |
//! | [`optim_schedule`] | warmup + cosine learning rate, global grad-norm clipping |
//! | [`config`] | the `qerl train` TOML config: serde structs, defaults, `--set key=value`, validation |
//! | [`synth`] | synthetic GSM8K-style problems (1-4 steps, worked solutions, `#### N`), disjoint splits |
//! | [`metrics`] | [`metrics::StepMetrics`], a JSONL writer and a PNG plot of a run |
//!
//! # Notes for the training loop (burn 0.21)
//!
//! * **Optimizer.** `burn::optim::AdamWConfig::new().with_beta_1(0.9).with_beta_2(0.99)
//!   .with_epsilon(1e-8).with_weight_decay(0.1).init::<B, M>()` gives an
//!   `OptimizerAdaptor<AdamW, M, B>`; step with `optim.step(lr as f64, model, grads)` where
//!   `grads = GradientsParams::from_grads(loss.backward(), &model)`. Note burn's defaults differ
//!   from PyTorch's (`epsilon` 1e-5, `weight_decay` 1e-4): set both explicitly
//!   ([`config::OptimConfig`] carries the values). Frozen parameters (the NVFP4 codes held as
//!   `Param<Tensor<B, 2, Int>>`) get no gradient and are skipped by the optimizer.
//! * **Gradient clipping.** `AdamWConfig::with_grad_clipping(Some(GradientClippingConfig::Norm(x)))`
//!   clips *each parameter tensor separately* (burn-optim 0.21, `optim/simple/adaptor.rs`), which
//!   is not what PyTorch's `clip_grad_norm_` (and so TRL/QeRL's `max_grad_norm`) does. Use
//!   [`optim_schedule::clip_grad_norm`] on the `GradientsParams` before `optim.step` instead: it
//!   scales all gradients by one factor so that their global L2 norm is at most `max_norm`, and
//!   returns the norm before clipping (worth logging).
//! * **Gradient accumulation.** `burn::optim::GradientsAccumulator::new()`, then
//!   `accumulator.accumulate(&model, grads)` per micro-batch and `accumulator.grads()` before the
//!   step. It sums, so give each micro-batch loss the whole batch's normaliser
//!   ([`loss::GlobalNormalizer`]) and the sum equals the full-batch loss.
//! * **Learning rate.** burn's own schedulers exist (`burn::lr_scheduler::cosine`), but
//!   [`optim_schedule::LrSchedule`] reproduces the Hugging Face warmup + cosine shape that QeRL's
//!   scripts use, as a plain function of the step.
//! * **mu > 1 updates per rollout batch.** Compute `logp_old` once after the rollout (no grad),
//!   keep it for all `mu` updates, and pass it to [`loss::policy_loss`] with the fresh
//!   `logp_new`; with `mu = 1` pass `logp_new.clone().detach()` and the ratio is exactly 1.
//! * **Seeds.** `train.seed` ([`config::RunConfig::seed`]) seeds everything; [`aqn::noise_vector`] derives
//!   an independent stream per (seed, step, norm) so noise does not depend on call order.

pub mod advantage;
pub mod aqn;
pub mod config;
pub mod data;
pub mod eval;
pub mod logprob;
pub mod loss;
pub mod metrics;
pub mod optim_schedule;
pub mod prompt;
pub mod reward;
pub mod synth;

pub use advantage::{AdvantageError, AdvantageKind};
pub use aqn::{AqnSchedule, SigmaSchedule};
pub use config::{ConfigError, TrainConfig};
pub use data::{DataError, DatasetKind, Example, FieldSpec};
pub use loss::{LossAggregation, PolicyLossConfig, PolicyLossOutput, PolicyLossStats};
pub use metrics::{MetricsError, StepMetrics};
pub use reward::{Reward, RewardError, RewardSet};
