//! AQN, adaptive quantization noise: the sigma schedule and the noise vectors.
//!
//! QeRL adds a channel-wise Gaussian vector `z ~ N(0, sigma^2 I)` (one value per hidden channel)
//! to the weight of every RMSNorm: `y = x / rms(x) * (w + z)`. Because the norm weight multiplies
//! every channel of the following (quantized) linear's input, this acts like extra multiplicative
//! noise on the quantized weights, raising policy entropy for exploration. A fresh `z` is drawn
//! per norm per rollout step; sigma decays over training.
//!
//! Schedules are **staged** (paper Eq. 8, reference `trl_trainer/noise_scheduler.py` and
//! `grpo_trainer.py` of NVlabs/QeRL): the run is cut into `K` equal intervals of
//! `total_steps / K` steps; interval 0 adds no noise (the quantization noise of NVFP4 alone);
//! intervals `k = 1..K-1` use
//!
//! ```text
//! exponential: sigma_k = sigma_start * (sigma_end / sigma_start)^((k-1)/(K-2))
//! ```
//!
//! so interval 1 uses `sigma_start` and interval `K-1` uses `sigma_end`. The other shapes use the
//! same stages with `t = (k-1)/(K-2)` in `[0, 1]`:
//! `linear` = `start + (end-start) t`, `cosine` = `end + (start-end) (1 + cos(pi t)) / 2`,
//! `logarithmic` = `start - (start-end) ln(1 + 9t) / ln(10)` (falls fast, then flattens),
//! `none` = 0 everywhere.

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use serde::{Deserialize, Serialize};

/// The shape of the sigma decay across stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SigmaSchedule {
    /// Geometric decay from `sigma_start` to `sigma_end` (the paper's).
    #[default]
    Exponential,
    Linear,
    Cosine,
    Logarithmic,
    /// No noise at all.
    None,
}

/// A staged AQN schedule. Defaults: exponential, `sigma_start` 1e-2, `sigma_end` 5e-4, `K` = 10.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AqnSchedule {
    pub kind: SigmaSchedule,
    pub sigma_start: f32,
    pub sigma_end: f32,
    /// `K`: number of equal intervals, the first of which is noise-free. At least 2.
    pub num_stages: usize,
}

impl Default for AqnSchedule {
    fn default() -> Self {
        Self {
            kind: SigmaSchedule::Exponential,
            sigma_start: 1e-2,
            sigma_end: 5e-4,
            num_stages: 10,
        }
    }
}

impl AqnSchedule {
    /// The stage (`0..K`) that optimizer step `step` (0-based) of a `total_steps` run falls in.
    /// Steps past the end stay in the last stage.
    pub fn stage(&self, step: usize, total_steps: usize) -> usize {
        let k = self.num_stages.max(1);
        if total_steps == 0 {
            return 0;
        }
        let step = step.min(total_steps);
        let per_stage = total_steps as f64 / k as f64;
        ((step as f64 / per_stage).floor() as usize).min(k - 1)
    }

    /// Sigma of stage `k` (0 for stage 0 and for `None`).
    pub fn stage_sigma(&self, k: usize) -> f32 {
        if k == 0 || self.kind == SigmaSchedule::None || self.num_stages < 2 {
            return 0.0;
        }
        let k = k.min(self.num_stages - 1);
        // t in [0, 1] over stages 1..=K-1; with K = 2 there is one noisy stage at sigma_start.
        let t = if self.num_stages > 2 {
            (k - 1) as f64 / (self.num_stages - 2) as f64
        } else {
            0.0
        };
        let (s, e) = (self.sigma_start as f64, self.sigma_end as f64);
        let v = match self.kind {
            SigmaSchedule::Exponential => s * (e / s).powf(t),
            SigmaSchedule::Linear => s + (e - s) * t,
            SigmaSchedule::Cosine => e + (s - e) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()),
            SigmaSchedule::Logarithmic => s - (s - e) * (1.0 + 9.0 * t).ln() / 10f64.ln(),
            SigmaSchedule::None => 0.0,
        };
        v as f32
    }

    /// Sigma for optimizer step `step` (0-based) of a `total_steps` run.
    pub fn sigma(&self, step: usize, total_steps: usize) -> f32 {
        self.stage_sigma(self.stage(step, total_steps))
    }

    /// The sigma of every stage, `[K]` (the first is 0).
    pub fn stage_sigmas(&self) -> Vec<f32> {
        (0..self.num_stages).map(|k| self.stage_sigma(k)).collect()
    }
}

/// Mixes the run seed, the step and the norm index into one RNG seed (SplitMix64 finaliser), so
/// each (seed, step, norm) gets an independent stream whatever order the norms are visited in.
fn mix_seed(seed: u64, step: u64, norm: u64) -> u64 {
    let mut z = seed
        ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ norm.wrapping_mul(0xD1B5_4A32_D192_ED03).rotate_left(17);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `dim` independent draws of `N(0, sigma^2)` from `rng`. All zeros when `sigma <= 0`.
pub fn gaussian_vector<R: rand::Rng + ?Sized>(rng: &mut R, dim: usize, sigma: f32) -> Vec<f32> {
    if sigma <= 0.0 || !sigma.is_finite() {
        return vec![0.0; dim];
    }
    let normal = Normal::new(0.0f32, sigma).expect("sigma is finite and positive");
    (0..dim).map(|_| normal.sample(rng)).collect()
}

/// The AQN noise vector `[dim]` for RMSNorm number `norm` at rollout step `step`: deterministic
/// in `(seed, step, norm)`, scaled by `sigma`. Add it to that norm's weight for the rollout
/// (and, with `aqn.rollouts_only = false`, for the training forward of the same step).
pub fn noise_vector(seed: u64, step: usize, norm: usize, dim: usize, sigma: f32) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(mix_seed(seed, step as u64, norm as u64));
    gaussian_vector(&mut rng, dim, sigma)
}
