//! Learning-rate schedule and global gradient-norm clipping.
//!
//! AdamW itself comes from `burn::optim::AdamWConfig` (see the crate docs for the settings).

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// Shape of the learning rate after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrDecay {
    /// Half a cosine from the peak down to `min_lr_ratio * peak` (QeRL scripts:
    /// `--lr-scheduler-type cosine`).
    #[default]
    Cosine,
    /// Straight line from the peak down to `min_lr_ratio * peak`.
    Linear,
    /// Stay at the peak.
    Constant,
}

/// Linear warmup then decay, as Hugging Face's `get_cosine_schedule_with_warmup` /
/// `get_linear_schedule_with_warmup` (what TRL, and so QeRL, use):
///
/// ```text
/// step < warmup:  lr = peak * step / warmup                     (step 0 gives 0)
/// otherwise:      p  = (step - warmup) / max(1, total - warmup)
///                 cosine: lr = peak * (m + (1 - m) * (1 + cos(pi * p)) / 2)
///                 linear: lr = peak * (m + (1 - m) * (1 - p))
/// ```
///
/// with `m = min_lr_ratio` (0 in Hugging Face) and `p` clamped to `[0, 1]`. `step` is the 0-based
/// index of the optimizer step about to be taken.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub peak_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub decay: LrDecay,
    pub min_lr_ratio: f64,
}

impl LrSchedule {
    /// A schedule with `warmup_steps = ceil(warmup_ratio * total_steps)` (Hugging Face's rule for
    /// `--warmup-ratio`).
    pub fn with_warmup_ratio(
        peak_lr: f64,
        warmup_ratio: f64,
        total_steps: usize,
        decay: LrDecay,
    ) -> Self {
        Self {
            peak_lr,
            warmup_steps: (warmup_ratio * total_steps as f64).ceil() as usize,
            total_steps,
            decay,
            min_lr_ratio: 0.0,
        }
    }

    /// The learning rate of optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.peak_lr * step as f64 / self.warmup_steps.max(1) as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let p = ((step - self.warmup_steps) as f64 / span).clamp(0.0, 1.0);
        let m = self.min_lr_ratio;
        let factor = match self.decay {
            LrDecay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
            LrDecay::Linear => 1.0 - p,
            LrDecay::Constant => 1.0,
        };
        self.peak_lr * (m + (1.0 - m) * factor)
    }
}

struct SquaredNorm<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    acc: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            // in f32: a half-precision sum of squares overflows (f16) or loses the small terms
            let s = g.cast(burn::tensor::DType::F32).square().sum();
            self.acc = Some(match self.acc.take() {
                Some(a) => a + s,
                None => s,
            });
        }
    }
}

struct Scale<'a> {
    grads: &'a mut GradientsParams,
    coef: f32,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, g.mul_scalar(self.coef));
        }
    }
}

/// The global L2 norm of all gradients of `module`'s float parameters in `grads`.
pub fn grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
) -> f32 {
    let mut v = SquaredNorm::<B> { grads, acc: None };
    module.visit(&mut v);
    match v.acc {
        Some(t) => crate::loss::host(t.sqrt())[0],
        None => 0.0,
    }
}

/// Clips the gradients in place so that their **global** L2 norm is at most `max_norm`
/// (PyTorch `clip_grad_norm_` semantics: one factor `max_norm / (norm + 1e-6)` for every
/// gradient, applied only when `norm > max_norm`). Returns the norm before clipping.
///
/// A non-finite norm leaves the gradients untouched: skip that optimizer step.
pub fn clip_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f32,
) -> f32 {
    let norm = grad_norm::<B, M>(module, grads);
    if norm.is_finite() && max_norm > 0.0 && norm > max_norm {
        let coef = max_norm / (norm + 1e-6);
        let mut s = Scale { grads, coef };
        module.visit(&mut s);
    }
    norm
}
