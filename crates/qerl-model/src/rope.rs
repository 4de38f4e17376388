//! Rotary position embedding in the Hugging Face "rotate half" convention.
//!
//! A head vector `x` of size `d` is split into halves `x1 = x[..d/2]`, `x2 = x[d/2..]`; with
//! `f[i] = pos * inv_freq[i]` and `c = cos(f ++ f)`, `s = sin(f ++ f)`:
//! `rope(x) = x * c + (-x2 ++ x1) * s`. (burn's `RotaryEncoding` rotates interleaved pairs
//! `(x[2i], x[2i+1])` instead, which does not match HF checkpoints.)
//!
//! `inv_freq` follows transformers' `ROPE_INIT_FUNCTIONS` for `default`, `linear` and `llama3`,
//! computed in f32 the way it does (then the angles `pos * inv_freq` in f32, their cosine and
//! sine rounded to f32). The rotation itself is [`qerl_nn::rope_heads`] (one kernel each way
//! on the CubeCL backends).

use burn::tensor::{backend::Backend, Tensor, TensorData};

use crate::config::{ModelConfig, RopeScaling};

/// The RoPE frequencies of one model.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    inv_freq: Vec<f32>,
    head_dim: usize,
}

impl Rope {
    pub fn new(config: &ModelConfig) -> Self {
        Self::with(config.head_dim, config.rope_theta, &config.rope_scaling)
    }

    /// Frequencies for head size `head_dim` (even), base `theta`.
    pub fn with(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Self {
        let base = theta as f32;
        let default = (0..head_dim / 2).map(|i| {
            // torch: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), all in f32.
            let exponent = (2 * i) as f32 / head_dim as f32;
            1.0f32 / base.powf(exponent)
        });
        let inv_freq = match *scaling {
            RopeScaling::None => default.collect(),
            RopeScaling::Linear { factor } => default.map(|f| f / factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_len,
            } => {
                let (factor, low, high, old_len) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                    old_len as f32,
                );
                let low_freq_wavelen = old_len / low;
                let high_freq_wavelen = old_len / high;
                default
                    .map(|f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen > low_freq_wavelen {
                            f / factor
                        } else if wavelen < high_freq_wavelen {
                            f
                        } else {
                            let smooth = (old_len / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        Rope { inv_freq, head_dim }
    }

    /// `inv_freq[i]` for `i < head_dim / 2`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `(cos, sin)`, each `[batch, 1, seq, head_dim]`, for `positions` (`batch * seq`,
    /// row-major), in the backend's float type.
    pub fn tables<B: Backend>(
        &self,
        positions: &[usize],
        batch: usize,
        seq: usize,
        device: &B::Device,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        assert_eq!(positions.len(), batch * seq, "one position per token");
        let (d, half) = (self.head_dim, self.head_dim / 2);
        let mut cos = vec![0f32; batch * seq * d];
        let mut sin = vec![0f32; batch * seq * d];
        for (t, &pos) in positions.iter().enumerate() {
            let row = t * d;
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let angle = (pos as f32 * f) as f64;
                let (s, c) = (angle.sin() as f32, angle.cos() as f32);
                cos[row + i] = c;
                cos[row + half + i] = c;
                sin[row + i] = s;
                sin[row + half + i] = s;
            }
        }
        let shape = [batch, 1, seq, d];
        (
            Tensor::from_data(TensorData::new(cos, shape), device),
            Tensor::from_data(TensorData::new(sin, shape), device),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn default_frequencies_and_rotation() {
        let rope = Rope::with(4, 10000.0, &RopeScaling::None);
        assert_eq!(rope.inv_freq(), &[1.0, 0.01]);
        let dev = Default::default();
        let (cos, sin) = rope.tables::<NdArray>(&[0, 3], 1, 2, &dev);
        // [batch 1, seq 2, one head of 4]
        let x =
            Tensor::<NdArray, 3>::from_floats([[[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]]], &dev);
        let y: Vec<f32> = qerl_nn::rope_heads(x, &cos, &sin, 1)
            .into_data()
            .to_vec()
            .unwrap();
        // position 0: identity
        assert_eq!(&y[..4], &[1.0, 2.0, 3.0, 4.0]);
        // position 3: pairs (x[i], x[i+2]) rotated by 3 * inv_freq[i]
        for (i, (a, b)) in [(1.0f64, 3.0f64), (2.0, 4.0)].into_iter().enumerate() {
            let t = 3.0 * [1.0, 0.01][i];
            let (c, s) = (f64::cos(t), f64::sin(t));
            assert!((y[4 + i] as f64 - (a * c - b * s)).abs() < 1e-6);
            assert!((y[6 + i] as f64 - (b * c + a * s)).abs() < 1e-6);
        }
    }

    #[test]
    fn llama3_keeps_high_and_divides_low_frequencies() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0,
        };
        let plain = Rope::with(32, 500000.0, &RopeScaling::None);
        let scaled = Rope::with(32, 500000.0, &scaling);
        let (p, s) = (plain.inv_freq(), scaled.inv_freq());
        assert_eq!(p[0], s[0]);
        assert!((s[15] - p[15] / 8.0).abs() <= f32::EPSILON * p[15]);
        assert!(
            p.iter().zip(s).any(|(a, b)| b < a && *b > a / 8.0),
            "a blended band"
        );
    }
}
