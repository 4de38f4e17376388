//! AQN: a fresh channel-wise Gaussian vector per RMSNorm per rollout step, folded into the
//! norm's weight (`w + z`). Norm `2i` is layer `i`'s `input_layernorm` (its noise reaches
//! q/k/v), `2i + 1` its `post_attention_layernorm` (gate/up), the last one the final norm.

use burn::tensor::{Tensor, TensorData};
use qerl_model::{CausalLm, QerlBackend};

/// The noise vectors of rollout step `step` (one per norm, in [`CausalLm::norms_mut`] order);
/// `None` when `sigma` is 0 (no noise at all, not a zero vector).
pub fn step_noise(
    seed: u64,
    step: usize,
    norms: usize,
    dim: usize,
    sigma: f32,
) -> Option<Vec<Vec<f32>>> {
    (sigma > 0.0).then(|| {
        (0..norms)
            .map(|k| qerl_rl::aqn::noise_vector(seed, step, k, dim, sigma))
            .collect()
    })
}

/// Sets (or with `None` clears) the noise of every norm of `model`.
pub fn set_noise<B: QerlBackend>(model: &mut CausalLm<B>, noise: Option<&[Vec<f32>]>) {
    let device = model.device();
    for (k, norm) in model.norms_mut().into_iter().enumerate() {
        let z = noise.map(|n| {
            let v = n[k].clone();
            let d = v.len();
            Tensor::<B, 1>::from_data(TensorData::new(v, [d]), &device)
        });
        norm.set_noise(z);
    }
}
