//! Per-token log-probabilities and entropies from logits, for the training forward.
//!
//! Logits are divided by the sampling temperature first, as TRL's `GRPOTrainer` does: the ratio
//! `pi_new / pi_old` must compare the distributions the tokens were actually sampled from.

use burn::tensor::{activation, backend::Backend, Int, Tensor};

/// Log-probability of each chosen token: `logits [batch, T, V]`, `tokens [batch, T]` (the token
/// at position `t` is the one the logits at `t` predict) → `[batch, T]`.
pub fn token_log_probs<B: Backend>(
    logits: Tensor<B, 3>,
    tokens: Tensor<B, 2, Int>,
    temperature: f32,
) -> Tensor<B, 2> {
    let logits = scale(logits, temperature);
    let logp = activation::log_softmax(logits, 2);
    logp.gather(2, tokens.unsqueeze_dim::<3>(2))
        .squeeze_dim::<2>(2)
}

/// Entropy of the (temperature-scaled) next-token distribution at each position:
/// `logits [batch, T, V]` → `[batch, T]`, in nats.
pub fn token_entropy<B: Backend>(logits: Tensor<B, 3>, temperature: f32) -> Tensor<B, 2> {
    let logits = scale(logits, temperature);
    let logp = activation::log_softmax(logits, 2);
    let p = logp.clone().exp();
    (p * logp).sum_dim(2).squeeze_dim::<2>(2).neg()
}

fn scale<B: Backend>(logits: Tensor<B, 3>, temperature: f32) -> Tensor<B, 3> {
    if temperature > 0.0 && temperature != 1.0 {
        logits.div_scalar(temperature)
    } else {
        logits
    }
}

/// `sum(values * mask) / max(sum(mask), 1)` on the host, e.g. the policy entropy metric.
pub fn masked_mean<B: Backend>(values: Tensor<B, 2>, mask: Tensor<B, 2>) -> f32 {
    let v = crate::loss::host(values.detach());
    let m = crate::loss::host(mask);
    let (s, n) = v.iter().zip(&m).fold((0.0f64, 0.0f64), |(s, n), (&v, &m)| {
        (s + (v * m) as f64, n + m as f64)
    });
    (s / n.max(1.0)) as f32
}
