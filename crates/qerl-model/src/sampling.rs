//! Next-token sampling on the device: greedy, temperature, top-k, top-p.
//!
//! All on the backend with burn ops, in f32 whatever the model's float type:
//!
//! 1. `l = logits / T` (greedy when `T == 0`: `argmax(logits)`).
//! 2. top-k: tokens below the k-th largest `l` get `-inf` (ties with it are kept, as in
//!    transformers' `TopKLogitsWarper`).
//! 3. top-p: a token is kept when the probability of the tokens strictly more likely than it is
//!    below `p` (transformers' `TopPLogitsWarper`; the most likely token is always kept). The
//!    cut is found without sorting: a bisection on the threshold value, [`TOP_P_STEPS`] steps
//!    over `[max - 64, max]`, each a masked sum over the vocabulary.
//! 4. inverse-CDF sampling of `softmax(l)`: the token whose cumulative-probability interval
//!    holds `u · total`, with `u` in (0, 1) drawn on the host from a seeded [`Rng`] (one number
//!    per sequence and step, so results depend only on the seed, not on the backend's random
//!    state). The search is two-level, over blocks of [`CDF_BLOCK`] tokens and then inside the
//!    chosen block, because burn's cumulative sum on CubeCL backends costs `O(n²)` in the
//!    length of the scanned dimension.
//!
//! The returned log-probability of a token is `log_softmax(logits / T)[token]` **before** the
//! top-k/top-p truncation (at `T = 1` for greedy): the log-likelihood of the token under the
//! tempered policy, what RL objectives (PPO/GRPO ratios) compare with the training forward's
//! `log_softmax(logits / T)`.

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};

use crate::error::{ModelError, Result};

/// Tokens per block of the two-level inverse-CDF search.
pub const CDF_BLOCK: usize = 256;

/// Bisection steps of the top-p threshold search.
pub const TOP_P_STEPS: usize = 40;
/// Width of the logit window the top-p search covers below the maximum (tokens further below
/// have relative probability under e^-64).
const TOP_P_WINDOW: f32 = 64.0;

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` keeps all.
    pub top_k: usize,
    /// Keep the most likely tokens up to cumulative probability `top_p`; `1` keeps all.
    pub top_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Self::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks the ranges: `temperature >= 0`, `0 < top_p <= 1`.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(ModelError::Input(format!(
                "temperature {} must be a finite number >= 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::Input(format!(
                "top_p {} must be in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// SplitMix64: a small, fast, seedable generator whose stream is fixed by this code (not by a
/// dependency's version).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The generator of sequence `index` of a batch seeded with `seed`.
    pub fn for_sequence(seed: u64, index: usize) -> Self {
        let mut r = Rng(seed ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in the open interval (0, 1), 24 random bits.
    pub fn next_open01(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
}

/// One sampling step's result, on the device: token ids `[batch]` and their log-probabilities
/// `[batch]` (f32, see the module docs).
pub struct Sampled<B: Backend> {
    pub ids: Tensor<B, 1, Int>,
    pub logprobs: Tensor<B, 1>,
}

fn expand<B: Backend>(col: Tensor<B, 2>, like: &Tensor<B, 2>) -> Tensor<B, 2> {
    col.expand(like.dims())
}

/// `l` with every token below the k-th largest value set to `-inf` (`k == 0` or `k >= vocab`:
/// unchanged).
pub fn top_k_filter<B: Backend>(l: Tensor<B, 2>, k: usize) -> Tensor<B, 2> {
    let vocab = l.dims()[1];
    if k == 0 || k >= vocab {
        return l;
    }
    let kth = l.clone().topk(k, 1).min_dim(1);
    let below = l.clone().lower(expand(kth, &l));
    l.mask_fill(below, f32::NEG_INFINITY)
}

/// `l` with the tokens outside the top-`p` nucleus of `softmax(l)` set to `-inf` (`p >= 1`:
/// unchanged).
pub fn top_p_filter<B: Backend>(l: Tensor<B, 2>, p: f32) -> Tensor<B, 2> {
    if p >= 1.0 {
        return l;
    }
    let probs = softmax(l.clone(), 1);
    let mut hi = l.clone().max_dim(1);
    let mut lo = hi.clone().sub_scalar(TOP_P_WINDOW);
    for _ in 0..TOP_P_STEPS {
        let mid = (lo.clone() + hi.clone()).mul_scalar(0.5);
        let at_or_below = l.clone().lower_equal(expand(mid.clone(), &l));
        // probability of the tokens strictly above mid
        let mass = probs.clone().mask_fill(at_or_below, 0.0).sum_dim(1);
        let kept_enough = mass.lower_elem(p);
        hi = hi.mask_where(kept_enough.clone(), mid.clone());
        lo = lo.mask_where(kept_enough.bool_not(), mid);
    }
    let outside = l.clone().lower(expand(hi, &l));
    l.mask_fill(outside, f32::NEG_INFINITY)
}

/// For each row of `probs [batch, vocab]` (non-negative, not all zero) and `u [batch, 1]` in
/// (0, 1): the token `i` with `c[i-1] <= u · c[vocab-1] < c[i]`, `c` the cumulative sum (so a
/// token of probability 0 is never chosen), `[batch, 1]`. Two levels: the block of
/// [`CDF_BLOCK`] tokens, then the token inside it.
pub fn inverse_cdf<B: Backend>(probs: Tensor<B, 2>, u: Tensor<B, 2>) -> Tensor<B, 2, Int> {
    let [batch, vocab] = probs.dims();
    let blocks = vocab.div_ceil(CDF_BLOCK);
    let padded = blocks * CDF_BLOCK;
    let probs = if padded > vocab {
        let zeros = Tensor::<B, 2>::zeros([batch, padded - vocab], (&probs.device(), DType::F32));
        Tensor::cat(vec![probs, zeros], 1)
    } else {
        probs
    };
    let per_block: Tensor<B, 3> = probs.reshape([batch, blocks, CDF_BLOCK]);
    let mass = per_block.clone().sum_dim(2).reshape([batch, blocks]);
    let cdf = mass.clone().cumsum(1);
    let total = cdf.clone().slice([0..batch, blocks - 1..blocks]);
    let target = u * total;
    let block = count_at_or_below(cdf.clone(), target.clone()).clamp(0, blocks as i64 - 1);
    let before = (cdf - mass).gather(1, block.clone());
    let index = block
        .clone()
        .reshape([batch, 1, 1])
        .expand([batch, 1, CDF_BLOCK]);
    let inner: Tensor<B, 2> = per_block.gather(1, index).reshape([batch, CDF_BLOCK]);
    let rest = (target - before).clamp_min(0.0);
    let within = count_at_or_below(inner.cumsum(1), rest).clamp(0, CDF_BLOCK as i64 - 1);
    (block.mul_scalar(CDF_BLOCK as i64) + within).clamp(0, vocab as i64 - 1)
}

/// Per row, how many entries of `cdf [batch, n]` are `<= x [batch, 1]`: `[batch, 1]`.
fn count_at_or_below<B: Backend>(cdf: Tensor<B, 2>, x: Tensor<B, 2>) -> Tensor<B, 2, Int> {
    let x = expand(x, &cdf);
    cdf.lower_equal(x).int().sum_dim(1)
}

/// Samples one token per row of `logits [batch, vocab]`. `uniform` holds one number in (0, 1)
/// per row (unused when greedy).
pub fn sample<B: Backend>(
    logits: Tensor<B, 2>,
    params: &SamplingParams,
    uniform: &[f32],
) -> Sampled<B> {
    let logits = logits.cast(DType::F32);
    let batch = logits.dims()[0];
    if params.is_greedy() {
        let ids = logits.clone().argmax(1);
        let logprobs = log_softmax(logits, 1).gather(1, ids.clone());
        return Sampled {
            ids: ids.reshape([batch]),
            logprobs: logprobs.reshape([batch]),
        };
    }
    assert_eq!(uniform.len(), batch, "one uniform number per row");
    let l = logits.div_scalar(params.temperature);
    let full = log_softmax(l.clone(), 1);
    let filtered = top_p_filter(top_k_filter(l, params.top_k), params.top_p);
    let probs = softmax(filtered, 1);
    let device = probs.device();
    let u = Tensor::<B, 2>::from_data(
        TensorData::new(uniform.to_vec(), [batch, 1]),
        (&device, DType::F32),
    );
    let ids = inverse_cdf(probs, u);
    let logprobs = full.gather(1, ids.clone());
    Sampled {
        ids: ids.reshape([batch]),
        logprobs: logprobs.reshape([batch]),
    }
}
