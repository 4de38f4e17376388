//! The policy update of one rollout batch: the training batch layout, old / reference
//! log-probabilities, and `mu` optimizer steps with gradient accumulation and global-norm
//! clipping.

use anyhow::Result;
use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use qerl_model::{CausalLm, QerlBackend, TokenBatch};
use qerl_rl::logprob::{token_entropy, token_log_probs};
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

    pub fn tokens_counted(&self) -> f32 {
        self.mask.iter().sum()
    }

    /// An `[n, len-1]` f32 tensor. The loss runs in f32 whatever the backend's float type
    /// (log-probabilities are cast up): every operand must be f32 too, since burn's CubeCL
    /// backends do not promote mixed dtypes (an f32 `-` bf16 reads the bf16 buffer as f32).
    fn t2<B: burn::tensor::backend::Backend>(&self, v: &[f32], d: &B::Device) -> Tensor<B, 2> {
        f32_tensor(v.to_vec(), [self.rows(), self.width()], d)
    }

    fn targets<B: burn::tensor::backend::Backend>(&self, d: &B::Device) -> Tensor<B, 2, Int> {
        Tensor::from_data(
            TensorData::new(self.targets.clone(), [self.rows(), self.width()]),
            d,
        )
    }
}

/// `log p(target)` per position `[n, len-1]` (and the logits' entropy when asked), LoRA on
/// or off.
fn log_probs<B: QerlBackend>(
    model: &CausalLm<B>,
    b: &TrainBatch,
    temperature: f32,
    lora: bool,
    entropy: bool,
) -> Result<(Tensor<B, 2>, Option<Tensor<B, 2>>)> {
    let logits = if lora {
        model.forward(&b.tokens)?
    } else {
        model.forward_base(&b.tokens)?
    };
    let [n, s, v] = logits.dims();
    let logits = logits
        .slice([0..n, 0..s - 1, 0..v])
        .cast(burn::tensor::DType::F32);
    let ent = entropy.then(|| token_entropy(logits.clone().detach(), temperature));
    let lp = token_log_probs(logits, b.targets::<B>(&model.device()), temperature);
    Ok((lp, ent))
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
    /// AQN noise of the training forward (`aqn.rollouts_only = false`), one vector per norm.
    pub train_noise: Option<&'a [Vec<f32>]>,
    /// The ranks sharing the batch: the loss is normalised by the global batch and the
    /// gradients summed over ranks before clipping ([`crate::dist::Single`]: this batch alone).
    pub comm: &'a dyn crate::dist::Communicator,
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
    let micro = batch.split(cfg.grad_accum);
    let mut global = GlobalNormalizer {
        sequences: batch.rows(),
        tokens: batch.tokens_counted(),
    };
    if cfg.comm.world_size() > 1 {
        let mut counts = [batch.rows() as f32, batch.tokens_counted()];
        cfg.comm.all_reduce_sum(&mut counts)?;
        global = GlobalNormalizer {
            sequences: counts[0] as usize,
            tokens: counts[1],
        };
    }
    let device = model.device();
    // Old and reference log-probabilities before any update, without a graph.
    let needs_old = cfg.mu > 1;
    let needs_ref = cfg.loss.beta != 0.0;
    let (mut old, mut reference) = (Vec::new(), Vec::new());
    if needs_old || needs_ref {
        let mut inner = model.valid();
        crate::noise::set_noise(&mut inner, cfg.train_noise);
        for m in &micro {
            if needs_old {
                old.push(host(log_probs(&inner, m, cfg.temperature, true, false)?.0));
            }
            if needs_ref {
                reference.push(host(log_probs(&inner, m, cfg.temperature, false, false)?.0));
            }
        }
    }
    *stats = UpdateStats::default();
    let denom = global.tokens.max(1.0);
    for pass in 0..cfg.mu {
        let mut acc = GradientsAccumulator::<CausalLm<B>>::new();
        let (mut loss, mut low, mut high, mut kl) = (0f32, 0f32, 0f32, 0f32);
        for (i, m) in micro.iter().enumerate() {
            let (logp_new, ent) = log_probs(&model, m, cfg.temperature, true, pass == 0)?;
            let mask = m.t2::<B>(&m.mask, &device);
            if let Some(e) = ent {
                let v = host(e);
                stats.entropy += v.iter().zip(&m.mask).map(|(e, k)| e * k).sum::<f32>() / denom;
            }
            let logp_old = if needs_old {
                m.t2::<B>(&old[i], &device)
            } else {
                logp_new.clone().detach()
            };
            let is_weights = cfg.tis_cap.map(|cap| {
                truncated_is_weights(logp_old.clone(), m.t2::<B>(&m.logp_rollout, &device), cap)
            });
            let inputs = PolicyLossInputs {
                logp_new,
                logp_old,
                logp_ref: needs_ref.then(|| m.t2::<B>(&reference[i], &device)),
                advantages: f32_tensor(m.advantages.clone(), [m.rows()], &device),
                mask,
                is_weights,
            };
            let out = policy_loss(inputs, cfg.loss, Some(global))?;
            let w = out.stats.tokens / denom;
            loss += out.stats.loss;
            low += out.stats.clip_frac_low * w;
            high += out.stats.clip_frac_high * w;
            kl += out.stats.mean_kl * w;
            let grads = GradientsParams::from_grads(out.loss.backward(), &model);
            acc.accumulate(&model, grads);
        }
        let mut grads = acc.grads();
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
            ) = (loss, low, high, kl);
        } else {
            // the clip fractions of later passes are the ones where clipping acts
            stats.clip_frac_low = low;
            stats.clip_frac_high = high;
        }
        if norm.is_finite() {
            model = optim.step(cfg.lr, model, grads);
        }
    }
    Ok(model)
}
