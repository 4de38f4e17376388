//! The policy update of one rollout batch: the training batch layout, old / reference
//! log-probabilities, and `mu` optimizer steps with gradient accumulation and global-norm
//! clipping.
//!
//! Memory: micro-batches are bucketed by length ([`TrainBatch::micro_batches`]: rows sorted by
//! length, each micro-batch padded to its own longest sequence), and log-probabilities come
//! from the final hidden states of the counted completion tokens only, through the lm_head in
//! chunks of tokens ([`CausalLm::token_log_probs`]): no `[n, len, vocab]` logits in the forward
//! or the backward.

use anyhow::Result;
use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use qerl_model::{CausalLm, Entropy, LogProbOptions, QerlBackend, TokenBatch};
use qerl_rl::loss::{
    policy_loss, truncated_is_weights, GlobalNormalizer, PolicyLossConfig, PolicyLossInputs,
};

/// Training batches of the RL update are padded to a multiple of this many tokens (see
/// [`TrainBatch::padded_to_multiple`]).
pub const TRAIN_LENGTH_MULTIPLE: usize = 32;

/// Sequences (prompt + completion, right-padded to one length `len`) and, per predicted
/// position `t` (`0..len-1`, predicting token `t + 1`), what the loss needs. Row-major.
#[derive(Clone, Debug)]
pub struct TrainBatch {
    pub tokens: TokenBatch,
    /// `[n, len-1]` next token ids.
    pub targets: Vec<i64>,
    /// `[n, len-1]`: 1 on counted completion tokens.
    pub mask: Vec<f32>,
    /// `[n, len-1]`: the rollout's log-probabilities (0 off the completion).
    pub logp_rollout: Vec<f32>,
    /// `[n]`.
    pub advantages: Vec<f32>,
}

impl TrainBatch {
    /// `masked[i]`: whether completion `i` counts for nothing (e.g. truncated under DAPO).
    pub fn new(
        prompts: &[&[u32]],
        completions: &[(&[u32], &[f32])],
        advantages: Vec<f32>,
        masked: &[bool],
        pad: u32,
    ) -> Result<Self> {
        let seqs: Vec<Vec<u32>> = prompts
            .iter()
            .zip(completions)
            .map(|(p, (c, _))| p.iter().chain(c.iter()).copied().collect())
            .collect();
        let tokens = TokenBatch::new(&seqs, pad, qerl_model::Padding::Right)?;
        let (n, len) = (tokens.batch, tokens.len);
        anyhow::ensure!(len >= 2, "training sequences need at least two tokens");
        let t = len - 1;
        let mut targets = vec![pad as i64; n * t];
        let mut mask = vec![0f32; n * t];
        let mut logp_rollout = vec![0f32; n * t];
        for i in 0..n {
            for j in 0..t {
                targets[i * t + j] = tokens.ids[i * len + j + 1] as i64;
            }
            let (c, lp) = completions[i];
            let start = prompts[i].len() - 1;
            for (k, &l) in lp.iter().enumerate().take(c.len()) {
                logp_rollout[i * t + start + k] = l;
                if !masked[i] {
                    mask[i * t + start + k] = 1.0;
                }
            }
        }
        Ok(TrainBatch {
            tokens,
            targets,
            mask,
            logp_rollout,
            advantages,
        })
    }

    /// No rows: what a rank without samples in the global batch trains on (it still takes
    /// part in the gradient all-reduce and the optimizer step).
    pub fn empty() -> Self {
        TrainBatch {
            tokens: TokenBatch {
                batch: 0,
                len: 0,
                ids: Vec::new(),
                mask: Vec::new(),
            },
            targets: Vec::new(),
            mask: Vec::new(),
            logp_rollout: Vec::new(),
            advantages: Vec::new(),
        }
    }

    pub fn rows(&self) -> usize {
        self.tokens.batch
    }

    fn width(&self) -> usize {
        self.tokens.len - 1
    }

    /// Rows `r` as a batch of their own (same padded length).
    pub fn slice(&self, r: std::ops::Range<usize>) -> TrainBatch {
        let (len, t) = (self.tokens.len, self.width());
        TrainBatch {
            tokens: TokenBatch {
                batch: r.len(),
                len,
                ids: self.tokens.ids[r.start * len..r.end * len].to_vec(),
                mask: self.tokens.mask[r.start * len..r.end * len].to_vec(),
            },
            targets: self.targets[r.start * t..r.end * t].to_vec(),
            mask: self.mask[r.start * t..r.end * t].to_vec(),
            logp_rollout: self.logp_rollout[r.start * t..r.end * t].to_vec(),
            advantages: self.advantages[r].to_vec(),
        }
    }

    /// Right-padded to a length that is a multiple of `multiple` (padding is masked out of
    /// attention and of the loss): every new shape costs a kernel compilation and an autotune
    /// pass on a GPU, so batches are bucketed.
    pub fn padded_to_multiple(self, multiple: usize, pad: u32) -> TrainBatch {
        let batch = self;
        let (n, len) = (batch.tokens.batch, batch.tokens.len);
        let new_len = len.div_ceil(multiple.max(1)) * multiple.max(1);
        if new_len == len {
            return batch;
        }
        let widen = |v: &[i64], w: usize, nw: usize, fill: i64| -> Vec<i64> {
            v.chunks(w)
                .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(fill, nw - w)))
                .collect()
        };
        let widen_f = |v: &[f32], w: usize, nw: usize| -> Vec<f32> {
            v.chunks(w)
                .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0.0, nw - w)))
                .collect()
        };
        let ids: Vec<u32> = batch
            .tokens
            .ids
            .chunks(len)
            .flat_map(|row| {
                row.iter()
                    .copied()
                    .chain(std::iter::repeat_n(pad, new_len - len))
            })
            .collect();
        let mask: Vec<bool> = batch
            .tokens
            .mask
            .chunks(len)
            .flat_map(|row| {
                row.iter()
                    .copied()
                    .chain(std::iter::repeat_n(false, new_len - len))
            })
            .collect();
        let (t, nt) = (len - 1, new_len - 1);
        TrainBatch {
            tokens: qerl_model::TokenBatch {
                batch: n,
                len: new_len,
                ids,
                mask,
            },
            targets: widen(&batch.targets, t, nt, pad as i64),
            mask: widen_f(&batch.mask, t, nt),
            logp_rollout: widen_f(&batch.logp_rollout, t, nt),
            advantages: batch.advantages,
        }
    }

    /// Contiguous micro-batches, `parts` of them at most.
    pub fn split(&self, parts: usize) -> Vec<TrainBatch> {
        let n = self.rows();
        let per = n.div_ceil(parts.max(1)).max(1);
        (0..n)
            .step_by(per)
            .map(|s| self.slice(s..(s + per).min(n)))
            .collect()
    }

    /// Real tokens (prompt + completion) of each row.
    pub fn lengths(&self) -> Vec<usize> {
        self.tokens.lengths()
    }

    /// Rows `rows` (in that order) as a batch of their own, cut to `len` tokens a row
    /// (at least every chosen row's length, at most the batch's).
    pub fn gather(&self, rows: &[usize], len: usize) -> TrainBatch {
        let (old_len, t) = (self.tokens.len, self.width());
        let len = len.clamp(2, old_len);
        let nt = len - 1;
        let (mut ids, mut mask) = (Vec::new(), Vec::new());
        let (mut targets, mut loss_mask, mut logp) = (Vec::new(), Vec::new(), Vec::new());
        for &r in rows {
            ids.extend_from_slice(&self.tokens.ids[r * old_len..r * old_len + len]);
            mask.extend_from_slice(&self.tokens.mask[r * old_len..r * old_len + len]);
            targets.extend_from_slice(&self.targets[r * t..r * t + nt]);
            loss_mask.extend_from_slice(&self.mask[r * t..r * t + nt]);
            logp.extend_from_slice(&self.logp_rollout[r * t..r * t + nt]);
            debug_assert!(self.mask[r * t + nt..(r + 1) * t].iter().all(|&m| m == 0.0));
        }
        TrainBatch {
            tokens: TokenBatch {
                batch: rows.len(),
                len,
                ids,
                mask,
            },
            targets,
            mask: loss_mask,
            logp_rollout: logp,
            advantages: rows.iter().map(|&r| self.advantages[r]).collect(),
        }
    }

    /// `parts` micro-batches at most, bucketed by length: the rows sorted by length (stable),
    /// cut into runs of `ceil(n / parts)` rows, each run padded only to its own longest
    /// sequence rounded up to `multiple` (the kernels see few shapes), not to the batch's.
    /// The losses of the micro-batches still sum to the batch's under a [`GlobalNormalizer`].
    pub fn micro_batches(&self, parts: usize, multiple: usize) -> Vec<TrainBatch> {
        let n = self.rows();
        if n == 0 {
            return Vec::new();
        }
        let lengths = self.lengths();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&r| lengths[r]);
        let per = n.div_ceil(parts.max(1)).max(1);
        let multiple = multiple.max(1);
        order
            .chunks(per)
            .map(|rows| {
                let longest = rows.iter().map(|&r| lengths[r]).max().unwrap_or(2);
                self.gather(rows, longest.div_ceil(multiple) * multiple)
            })
            .collect()
    }

    /// Flat `[n, len-1]` indices of the counted completion tokens (at least one: position 0
    /// when none counts, so that the loss keeps its graph; its mask is 0).
    fn counted_positions(&self) -> Vec<usize> {
        let picked: Vec<usize> = (0..self.mask.len())
            .filter(|&k| self.mask[k] > 0.0)
            .collect();
        if picked.is_empty() && !self.mask.is_empty() {
            vec![0]
        } else {
            picked
        }
    }

    pub fn tokens_counted(&self) -> f32 {
        self.mask.iter().sum()
    }

    /// An `[n, len-1]` f32 tensor. The loss runs in f32 whatever the backend's float type
    /// (log-probabilities are cast up): every operand must be f32 too, since burn's CubeCL
    /// backends do not promote mixed dtypes (an f32 `-` bf16 reads the bf16 buffer as f32).
    fn t2<B: burn::tensor::backend::Backend>(&self, v: &[f32], d: &B::Device) -> Tensor<B, 2> {
        f32_tensor(v.to_vec(), [self.rows(), self.width()], d)
    }

    #[cfg(test)]
    fn targets<B: burn::tensor::backend::Backend>(&self, d: &B::Device) -> Tensor<B, 2, Int> {
        Tensor::from_data(
            TensorData::new(self.targets.clone(), [self.rows(), self.width()]),
            d,
        )
    }
}

/// `log p(target)` per position `[n, len-1]` (and the entropy when asked), LoRA on or off;
/// 0 off the counted completion tokens.
pub(crate) fn log_probs<B: QerlBackend>(
    model: &CausalLm<B>,
    b: &TrainBatch,
    opts: &LogProbOptions,
    lora: bool,
) -> Result<(Tensor<B, 2>, Option<Tensor<B, 2>>)> {
    let hidden = model.hidden_states(&b.tokens, lora)?;
    completion_log_probs(model, hidden, b, opts)
}

/// [`log_probs`] from the final hidden states `[n, len, hidden]` of `b`: only the counted
/// completion tokens go through the lm_head (in chunks), and the results are scattered back
/// to `[n, len-1]` (zeros elsewhere; the entropy, detached, unless `opts.entropy` is off).
fn completion_log_probs<B: QerlBackend>(
    model: &CausalLm<B>,
    hidden: Tensor<B, 3>,
    b: &TrainBatch,
    opts: &LogProbOptions,
) -> Result<(Tensor<B, 2>, Option<Tensor<B, 2>>)> {
    let (n, len, t) = (b.rows(), b.tokens.len, b.width());
    let picked = b.counted_positions();
    let rows: Vec<usize> = picked.iter().map(|&k| k / t * len + k % t).collect();
    let targets: Vec<u32> = picked.iter().map(|&k| b.targets[k] as u32).collect();
    let (lp, ent) = model.token_log_probs(hidden, &rows, &targets, opts)?;
    // `[n * t]` positions read from `[picked.len() + 1]` values, the last a zero
    let device = model.device();
    let mut from = vec![picked.len() as i64; n * t];
    for (i, &k) in picked.iter().enumerate() {
        from[k] = i as i64;
    }
    let from = Tensor::<B, 1, Int>::from_data(TensorData::new(from, [n * t]), &device);
    let zero = f32_tensor::<B, 1>(vec![0.0], [1], &device);
    let scatter = |v: Tensor<B, 1>| {
        Tensor::cat(vec![v, zero.clone()], 0)
            .select(0, from.clone())
            .reshape([n, t])
    };
    let ent = (opts.entropy != Entropy::Off).then(|| scatter(ent.detach()));
    Ok((scatter(lp), ent))
}

/// An f32 tensor on `d`, whatever the backend's default float type.
fn f32_tensor<B: burn::tensor::backend::Backend, const D: usize>(
    v: Vec<f32>,
    shape: [usize; D],
    d: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(v, shape), (d, burn::tensor::DType::F32))
}

fn host<B: burn::tensor::backend::Backend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// What one update pass reports.
#[derive(Clone, Debug, Default)]
pub struct UpdateStats {
    pub loss: f32,
    pub clip_frac_low: f32,
    pub clip_frac_high: f32,
    pub kl: f32,
    pub entropy: f32,
    /// Global gradient norm before clipping, of the last of the `mu` steps.
    pub grad_norm: f32,
}

/// Everything the update needs besides the model and optimizer.
pub struct UpdateConfig<'a> {
    pub loss: &'a PolicyLossConfig,
    pub mu: usize,
    pub grad_accum: usize,
    pub grad_clip: f32,
    pub temperature: f32,
    pub tis_cap: Option<f32>,
    pub lr: f64,
    /// Completion tokens per chunk of the lm_head + log-softmax (0: from a memory budget, see
    /// [`LogProbOptions::rows`]).
    pub logprob_chunk_tokens: usize,
    /// Recompute each decoder layer in the backward instead of keeping its activations
    /// ([`CausalLm::hidden_states_checkpointed`]).
    pub activation_checkpointing: bool,
    /// AQN noise of the training forward (`aqn.rollouts_only = false`), one vector per norm.
    pub train_noise: Option<&'a [Vec<f32>]>,
    /// The ranks sharing the batch: the loss is normalised by the global batch and the
    /// gradients summed over ranks before clipping ([`crate::dist::Single`]: this batch alone).
    pub comm: &'a dyn crate::dist::Communicator,
}

impl UpdateConfig<'_> {
    fn log_prob_options(&self, entropy: bool) -> LogProbOptions {
        LogProbOptions {
            temperature: self.temperature,
            chunk_rows: self.logprob_chunk_tokens,
            entropy: if entropy {
                Entropy::Metric
            } else {
                Entropy::Off
            },
        }
    }
}

/// The log-probabilities that stay fixed over the `mu` passes, one `[n, len-1]` vector per
/// micro-batch: the policy's before any update (`mu > 1`) and the reference policy's (LoRA off,
/// when the loss has a KL term). `model` is the policy without a graph, with the training
/// forward's noise set.
pub struct FixedLogProbs {
    pub old: Option<Vec<Vec<f32>>>,
    pub reference: Option<Vec<Vec<f32>>>,
}

impl FixedLogProbs {
    pub fn compute<B: QerlBackend>(
        model: &CausalLm<B>,
        micro: &[TrainBatch],
        cfg: &UpdateConfig,
    ) -> Result<Self> {
        let opts = cfg.log_prob_options(false);
        let pass = |lora: bool| -> Result<Vec<Vec<f32>>> {
            micro
                .iter()
                .map(|m| Ok(host(log_probs(model, m, &opts, lora)?.0)))
                .collect()
        };
        let old = if cfg.mu > 1 { Some(pass(true)?) } else { None };
        let reference = if cfg.loss.beta != 0.0 {
            Some(pass(false)?)
        } else {
            None
        };
        Ok(FixedLogProbs { old, reference })
    }
}

/// One pass over the micro-batches: the gradients of the loss (normalised by `global`),
/// summed over the micro-batches (before the all-reduce and clipping), and the pass's
/// statistics (the loss, and clip fractions and KL as global token means; the entropy too when
/// `entropy`).
pub fn accumulate_gradients<B>(
    model: &CausalLm<B>,
    micro: &[TrainBatch],
    fixed: &FixedLogProbs,
    global: GlobalNormalizer,
    cfg: &UpdateConfig,
    entropy: bool,
) -> Result<(GradientsParams, UpdateStats)>
where
    B: crate::trainer::TrainBackend,
{
    // burn 0.21's autodiff: the cleanup at the end of every `backward()` sweeps the graphs of
    // every thread and can free steps of a graph another thread is still building, so that
    // thread's backward silently loses a gradient (tracel-ai/burn#5573). Ranks that are threads
    // of one process (`dist::local`) therefore take turns here; nothing inside communicates,
    // and a single-threaded run never waits.
    static AUTODIFF: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = AUTODIFF.lock().unwrap_or_else(|e| e.into_inner());
    let device = model.device();
    let denom = global.tokens.max(1.0);
    let opts = cfg.log_prob_options(entropy);
    let mut acc = GradientsAccumulator::<CausalLm<B>>::new();
    let mut stats = UpdateStats::default();
    for (i, m) in micro.iter().enumerate() {
        let (logp_new, ent, checkpoints) = if cfg.activation_checkpointing {
            let (hidden, checkpoints) = model.hidden_states_checkpointed(&m.tokens, true)?;
            let (lp, ent) = completion_log_probs(model, hidden, m, &opts)?;
            (lp, ent, Some(checkpoints))
        } else {
            let (lp, ent) = log_probs(model, m, &opts, true)?;
            (lp, ent, None)
        };
        let mask = m.t2::<B>(&m.mask, &device);
        if let Some(e) = ent {
            let v = host(e);
            stats.entropy += v.iter().zip(&m.mask).map(|(e, k)| e * k).sum::<f32>() / denom;
        }
        let logp_old = match &fixed.old {
            Some(old) => m.t2::<B>(&old[i], &device),
            None => logp_new.clone().detach(),
        };
        let is_weights = cfg.tis_cap.map(|cap| {
            truncated_is_weights(logp_old.clone(), m.t2::<B>(&m.logp_rollout, &device), cap)
        });
        let inputs = PolicyLossInputs {
            logp_new,
            logp_old,
            logp_ref: fixed.reference.as_ref().map(|r| m.t2::<B>(&r[i], &device)),
            advantages: f32_tensor(m.advantages.clone(), [m.rows()], &device),
            mask,
            is_weights,
        };
        let out = policy_loss(inputs, cfg.loss, Some(global))?;
        let w = out.stats.tokens / denom;
        stats.loss += out.stats.loss;
        stats.clip_frac_low += out.stats.clip_frac_low * w;
        stats.clip_frac_high += out.stats.clip_frac_high * w;
        stats.kl += out.stats.mean_kl * w;
        let mut grads = out.loss.backward();
        if let Some(checkpoints) = checkpoints {
            checkpoints.backward(model, &mut grads);
        }
        acc.accumulate(model, GradientsParams::from_grads(grads, model));
    }
    Ok((acc.grads(), stats))
}

/// The normaliser of the global batch this rank's `batch` is part of.
fn global_normalizer(
    batch: &TrainBatch,
    comm: &dyn crate::dist::Communicator,
) -> Result<GlobalNormalizer> {
    let mut counts = [batch.rows() as f32, batch.tokens_counted()];
    if comm.world_size() > 1 {
        comm.all_reduce_sum(&mut counts)?;
    }
    Ok(GlobalNormalizer {
        sequences: counts[0] as usize,
        tokens: counts[1],
    })
}

/// `mu` optimizer steps on `batch` (this rank's part of the global batch); returns the new
/// model. Every rank calls it, with an empty batch if it holds no samples.
pub fn update<B>(
    mut model: CausalLm<B>,
    optim: &mut OptimizerAdaptor<AdamW, CausalLm<B>, B>,
    batch: &TrainBatch,
    cfg: &UpdateConfig,
    stats: &mut UpdateStats,
) -> Result<CausalLm<B>>
where
    B: crate::trainer::TrainBackend,
{
    let micro = batch.micro_batches(cfg.grad_accum, TRAIN_LENGTH_MULTIPLE);
    let global = global_normalizer(batch, cfg.comm)?;
    // Old and reference log-probabilities before any update, without a graph.
    let fixed = if cfg.mu > 1 || cfg.loss.beta != 0.0 {
        let mut inner = model.valid();
        crate::noise::set_noise(&mut inner, cfg.train_noise);
        FixedLogProbs::compute(&inner, &micro, cfg)?
    } else {
        FixedLogProbs {
            old: None,
            reference: None,
        }
    };
    *stats = UpdateStats::default();
    for pass in 0..cfg.mu {
        let (mut grads, pass_stats) =
            accumulate_gradients(&model, &micro, &fixed, global, cfg, pass == 0)?;
        crate::dp::all_reduce_grads::<B, _>(&model, &mut grads, cfg.comm)?;
        let norm =
            qerl_rl::optim_schedule::clip_grad_norm::<B, _>(&model, &mut grads, cfg.grad_clip);
        stats.grad_norm = norm;
        if pass == 0 {
            (
                stats.loss,
                stats.clip_frac_low,
                stats.clip_frac_high,
                stats.kl,
                stats.entropy,
            ) = (
                pass_stats.loss,
                pass_stats.clip_frac_low,
                pass_stats.clip_frac_high,
                pass_stats.kl,
                pass_stats.entropy,
            );
        } else {
            // the clip fractions of later passes are the ones where clipping acts
            stats.clip_frac_low = pass_stats.clip_frac_low;
            stats.clip_frac_high = pass_stats.clip_frac_high;
        }
        if norm.is_finite() {
            model = optim.step(cfg.lr, model, grads);
        }
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    //! Bucketed micro-batches and the chunked log-probabilities against the padded, unfused
    //! update, on the CPU with the tiny Qwen2 fixture (tied embeddings, vocabulary 512).

    use super::*;
    use crate::load_options::load_options;
    use burn::backend::Autodiff;
    use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
    use burn::tensor::backend::AutodiffBackend;
    use qerl_model::load;
    use qerl_rl::config::{LoraConfig, ModelConfig, Precision};
    use qerl_rl::logprob::{token_entropy, token_log_probs};
    use rand::{Rng, SeedableRng};

    type Cpu = qerl_nn::backends::Cpu;
    type Ad = Autodiff<Cpu>;

    /// The fixture with LoRA on every linear (B made non-zero so that A has a gradient too)
    /// and trainable norms.
    fn model() -> CausalLm<Ad> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/compressed-tensors/qwen2_tied/nvfp4");
        let model_config = ModelConfig {
            dir: dir.clone(),
            precision: Precision::Nvfp4,
        };
        let lora_config = LoraConfig {
            rank: 4,
            alpha: 8.0,
            ..LoraConfig::default()
        };
        let options = load_options(&model_config, &lora_config);
        let mut m = load::<Ad>(&dir, &options, &Default::default()).unwrap();
        let names: Vec<String> = (0..m.layers.len())
            .flat_map(|i| {
                ["self_attn.v_proj", "mlp.down_proj", "mlp.up_proj"]
                    .map(|n| format!("model.layers.{i}.{n}"))
            })
            .collect();
        for (j, name) in names.iter().enumerate() {
            let lin = m.linear_mut(name).unwrap();
            let lora = lin.lora().unwrap();
            let (a, b) = (lora.a.val(), lora.b.val());
            let b = b.clone().add_scalar(0.02 * (j as f32 + 1.0)) + b;
            lin.set_lora_weights(a.detach().require_grad(), b.detach().require_grad());
        }
        m
    }

    /// Seven sequences of 3 to 75 tokens (prompt 2-9, completion 1-66; one masked, one
    /// prompt-only), padded to 96 as the trainer pads them.
    fn batch(vocab: usize) -> TrainBatch {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let shapes = [(4, 10), (2, 66), (9, 20), (3, 1), (5, 40), (6, 0), (7, 30)];
        let mut tok =
            |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(1..vocab as u32)).collect() };
        let prompts: Vec<Vec<u32>> = shapes.iter().map(|&(p, _)| tok(p)).collect();
        let comps: Vec<Vec<u32>> = shapes.iter().map(|&(_, c)| tok(c)).collect();
        let lps: Vec<Vec<f32>> = comps
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (0..c.len())
                    .map(|j| -0.1 - 0.37 * ((i * 7 + j) % 5) as f32)
                    .collect()
            })
            .collect();
        let p: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let c: Vec<(&[u32], &[f32])> = comps
            .iter()
            .zip(&lps)
            .map(|(c, l)| (c.as_slice(), l.as_slice()))
            .collect();
        let adv = vec![0.9, -1.2, 0.3, 1.5, -0.4, 0.0, -0.8];
        let masked = [false, false, false, false, true, false, false];
        TrainBatch::new(&p, &c, adv, &masked, 0)
            .unwrap()
            .padded_to_multiple(TRAIN_LENGTH_MULTIPLE, 0)
    }

    fn config<'a>(loss: &'a PolicyLossConfig, chunk: usize) -> UpdateConfig<'a> {
        UpdateConfig {
            loss,
            mu: 2,
            grad_accum: 3,
            grad_clip: 1.0,
            temperature: 0.7,
            tis_cap: Some(2.0),
            lr: 0.0,
            logprob_chunk_tokens: chunk,
            activation_checkpointing: false,
            train_noise: None,
            comm: &crate::dist::Single,
        }
    }

    /// Largest relative error (Frobenius) over the float parameters' gradients, and how many
    /// parameters had one on both sides.
    struct GradDiff<'a> {
        a: &'a GradientsParams,
        b: &'a GradientsParams,
        worst: f64,
        compared: usize,
    }

    impl<B: AutodiffBackend> ModuleVisitor<B> for GradDiff<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let (ga, gb) = (
                self.a.get::<B::InnerBackend, D>(param.id),
                self.b.get::<B::InnerBackend, D>(param.id),
            );
            match (ga, gb) {
                (Some(ga), Some(gb)) => {
                    let ga: Vec<f32> = ga.into_data().iter::<f32>().collect();
                    let gb: Vec<f32> = gb.into_data().iter::<f32>().collect();
                    let num: f64 = ga
                        .iter()
                        .zip(&gb)
                        .map(|(x, y)| ((x - y) as f64).powi(2))
                        .sum();
                    let den: f64 = gb.iter().map(|y| (*y as f64).powi(2)).sum();
                    self.worst = self.worst.max((num / den.max(1e-30)).sqrt());
                    self.compared += 1;
                }
                (None, None) => {}
                (a, b) => panic!("gradient on one side only: {} {}", a.is_some(), b.is_some()),
            }
        }
    }

    fn grad_diff(m: &CausalLm<Ad>, a: &GradientsParams, b: &GradientsParams) -> (f64, usize) {
        let mut v = GradDiff {
            a,
            b,
            worst: 0.0,
            compared: 0,
        };
        m.visit(&mut v);
        (v.worst, v.compared)
    }

    fn close(a: f32, b: f32, tol: f32, what: &str) {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1e-3),
            "{what}: {a} vs {b}"
        );
    }

    #[test]
    fn micro_batches_are_bucketed_by_length() {
        let b = batch(512);
        assert_eq!(b.tokens.len, 96);
        let lengths = b.lengths();
        let micro = b.micro_batches(3, TRAIN_LENGTH_MULTIPLE);
        // rows sorted by length, 3 + 3 + 1, each padded to its own longest (rounded to 32)
        assert_eq!(
            micro.iter().map(TrainBatch::rows).collect::<Vec<_>>(),
            [3, 3, 1]
        );
        assert_eq!(
            micro.iter().map(|m| m.tokens.len).collect::<Vec<_>>(),
            [32, 64, 96]
        );
        let mut sorted = lengths.clone();
        sorted.sort();
        let got: Vec<usize> = micro.iter().flat_map(TrainBatch::lengths).collect();
        assert_eq!(got, sorted);
        let counted: f32 = micro.iter().map(TrainBatch::tokens_counted).sum();
        assert_eq!(counted, b.tokens_counted());
        // every row is the original row, cut
        let mut order: Vec<usize> = (0..b.rows()).collect();
        order.sort_by_key(|&r| lengths[r]);
        let mut k = 0;
        for m in &micro {
            let (len, t) = (m.tokens.len, m.tokens.len - 1);
            for i in 0..m.rows() {
                let r = order[k];
                k += 1;
                assert_eq!(
                    m.tokens.ids[i * len..(i + 1) * len],
                    b.tokens.ids[r * 96..r * 96 + len]
                );
                assert_eq!(m.targets[i * t..(i + 1) * t], b.targets[r * 95..r * 95 + t]);
                assert_eq!(m.mask[i * t..(i + 1) * t], b.mask[r * 95..r * 95 + t]);
                assert_eq!(
                    m.logp_rollout[i * t..(i + 1) * t],
                    b.logp_rollout[r * 95..r * 95 + t]
                );
                assert_eq!(m.advantages[i], b.advantages[r]);
            }
        }
        // one micro-batch: the batch itself, sorted
        let one = b.micro_batches(1, TRAIN_LENGTH_MULTIPLE);
        assert_eq!((one.len(), one[0].tokens.len), (1, 96));
        assert!(TrainBatch::empty().micro_batches(4, 32).is_empty());
    }

    /// The unfused computation the update used before: logits of every position, f32,
    /// log-softmax, gather, and the entropy from a second full pass.
    fn unfused<B: QerlBackend>(
        model: &CausalLm<B>,
        b: &TrainBatch,
        temperature: f32,
        lora: bool,
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let logits = if lora {
            model.forward(&b.tokens).unwrap()
        } else {
            model.forward_base(&b.tokens).unwrap()
        };
        let [n, s, v] = logits.dims();
        let logits = logits
            .slice([0..n, 0..s - 1, 0..v])
            .cast(burn::tensor::DType::F32);
        let ent = token_entropy(logits.clone().detach(), temperature);
        let lp = token_log_probs(logits, b.targets::<B>(&model.device()), temperature);
        (lp, ent)
    }

    #[test]
    fn chunked_log_probs_equal_the_unfused_ones() {
        let m = model();
        let b = batch(m.config().vocab_size);
        let dev = m.device();
        for (chunk, temperature) in [(1, 0.7), (7, 1.0), (64, 0.7), (0, 1.3)] {
            for part in b.split(2) {
                let mask = part.t2::<Ad>(&part.mask, &dev);
                let opts = LogProbOptions {
                    temperature,
                    chunk_rows: chunk,
                    entropy: Entropy::Metric,
                };
                let (lp, ent) = log_probs(&m, &part, &opts, true).unwrap();
                let (rlp, rent) = unfused(&m, &part, temperature, true);
                let host_masked = |t: Tensor<Ad, 2>| -> Vec<f32> {
                    host(t.detach())
                        .iter()
                        .zip(&part.mask)
                        .map(|(v, k)| v * k)
                        .collect()
                };
                let (a, r) = (host_masked(lp.clone()), host_masked(rlp.clone()));
                for (x, y) in a.iter().zip(&r) {
                    close(*x, *y, 1e-5, "log p");
                }
                let (a, r) = (host_masked(ent.unwrap()), host_masked(rent));
                for (x, y) in a.iter().zip(&r) {
                    close(*x, *y, 1e-5, "entropy");
                }
                // gradients of a masked weighted sum
                let w = f32_tensor::<Ad, 2>(
                    (0..part.mask.len())
                        .map(|k| ((k * 13) % 7) as f32 - 3.0)
                        .collect(),
                    [part.rows(), part.width()],
                    &dev,
                );
                let ga = GradientsParams::from_grads(
                    (lp * mask.clone() * w.clone()).sum().backward(),
                    &m,
                );
                let gr = GradientsParams::from_grads((rlp * mask * w).sum().backward(), &m);
                let (worst, compared) = grad_diff(&m, &ga, &gr);
                assert!(compared >= 2 * 14, "LoRA A and B of 14 linears: {compared}");
                assert!(worst < 1e-4, "chunk {chunk}: gradient rel err {worst}");
            }
        }
        // the reference policy (LoRA off, no graph)
        let inner = m.valid();
        let part = &b.split(1)[0];
        let opts = LogProbOptions {
            temperature: 0.7,
            chunk_rows: 5,
            entropy: Entropy::Off,
        };
        let (lp, _) = log_probs(&inner, part, &opts, false).unwrap();
        let (rlp, _) = unfused(&inner, part, 0.7, false);
        for ((x, y), k) in host(lp).iter().zip(host(rlp)).zip(&part.mask) {
            close(x * k, y * k, 1e-5, "reference log p");
        }
    }

    #[test]
    fn bucketed_update_equals_the_padded_one() {
        let m = model();
        let b = batch(m.config().vocab_size);
        let global = global_normalizer(&b, &crate::dist::Single).unwrap();
        for loss in [PolicyLossConfig::grpo(), PolicyLossConfig::dapo(), {
            let mut l = PolicyLossConfig::dr_grpo(64);
            l.beta = 0.02;
            l
        }] {
            let cfg = config(&loss, 5);
            let run = |micro: &[TrainBatch]| {
                let fixed = FixedLogProbs::compute(&m.valid(), micro, &cfg).unwrap();
                assert_eq!(fixed.reference.is_some(), loss.beta != 0.0);
                accumulate_gradients(&m, micro, &fixed, global, &cfg, true).unwrap()
            };
            let padded = b.split(cfg.grad_accum);
            assert!(padded.iter().all(|p| p.tokens.len == 96));
            let bucketed = b.micro_batches(cfg.grad_accum, TRAIN_LENGTH_MULTIPLE);
            let (gp, sp) = run(&padded);
            let (gb, sb) = run(&bucketed);
            let what = format!("{:?}", loss.aggregation);
            close(sb.loss, sp.loss, 1e-5, &what);
            close(sb.entropy, sp.entropy, 1e-5, &what);
            close(sb.kl, sp.kl, 1e-4, &what);
            assert!(sp.entropy > 0.1 && sp.loss != 0.0, "{what}: {sp:?}");
            let (worst, compared) = grad_diff(&m, &gb, &gp);
            assert!(compared >= 2 * 14, "{compared}");
            assert!(worst < 1e-4, "{what}: gradient rel err {worst}");
            // and one micro-batch of the whole batch: the global normaliser sums the same loss
            let (g1, s1) = run(&b.micro_batches(1, TRAIN_LENGTH_MULTIPLE));
            close(s1.loss, sp.loss, 1e-5, &what);
            let (worst, _) = grad_diff(&m, &g1, &gp);
            assert!(
                worst < 1e-4,
                "{what}, one micro-batch: gradient rel err {worst}"
            );
        }
    }

    #[test]
    fn update_runs_on_buckets_with_the_chunked_loss() {
        // the whole update (mu = 2) once: finite statistics, the policy moves
        let m = model();
        let b = batch(m.config().vocab_size);
        let loss = PolicyLossConfig::grpo();
        let mut cfg = config(&loss, 3);
        cfg.lr = 1e-2;
        let mut optim = burn::optim::AdamWConfig::new().init::<Ad, CausalLm<Ad>>();
        let before = host(
            log_probs(&m.valid(), &b, &cfg.log_prob_options(false), true)
                .unwrap()
                .0,
        );
        let mut stats = UpdateStats::default();
        let m = update(m, &mut optim, &b, &cfg, &mut stats).unwrap();
        assert!(
            stats.grad_norm.is_finite() && stats.grad_norm > 0.0,
            "{stats:?}"
        );
        assert!(stats.entropy > 0.1 && stats.loss.is_finite(), "{stats:?}");
        let after = host(
            log_probs(&m.valid(), &b, &cfg.log_prob_options(false), true)
                .unwrap()
                .0,
        );
        assert_ne!(before, after);
    }
}
