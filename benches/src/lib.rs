//! Shared by `qerl-kernel-bench` (the H100 table) and the criterion benches: the Qwen2.5 layer
//! shapes and random 4-bit weights (the kernels' speed does not depend on the values).

use anyhow::{bail, Result};
use qerl_format::{Mxfp4Weight, Nf4Weight, Nvfp4Weight, QuantFormat, QuantizedWeight};
use rand::Rng;

/// `(layer, n, k)` of a model's decoder linears, q/k/v and gate/up fused as served.
pub fn shapes(model: &str) -> Result<Vec<(&'static str, usize, usize)>> {
    Ok(match model {
        // hidden 3584, intermediate 18944, 28 heads, 4 KV heads of 128.
        "qwen2.5-7b" => vec![
            ("qkv", 3584 + 2 * 512, 3584),
            ("o", 3584, 3584),
            ("gate_up", 2 * 18944, 3584),
            ("down", 3584, 18944),
        ],
        // hidden 5120, intermediate 27648, 40 heads, 8 KV heads of 128.
        "qwen2.5-32b" => vec![
            ("qkv", 5120 + 2 * 1024, 5120),
            ("o", 5120, 5120),
            ("gate_up", 2 * 27648, 5120),
            ("down", 5120, 27648),
        ],
        other => bail!("unknown model `{other}` (qwen2.5-7b, qwen2.5-32b)"),
    })
}

/// A weight of random codes and plausible scales.
pub fn random_weight(
    format: QuantFormat,
    n: usize,
    k: usize,
    rng: &mut impl Rng,
) -> QuantizedWeight {
    let mut packed = vec![0u8; n * k / 2];
    rng.fill(&mut packed[..]);
    let blocks = n * k / format.block_size();
    match format {
        QuantFormat::Nvfp4 => {
            let scales = (0..blocks)
                .map(|_| rng.random_range(0x28u8..0x50))
                .collect();
            QuantizedWeight::Nvfp4(
                Nvfp4Weight::from_parts("w", n, k, packed, scales, 448.0).unwrap(),
            )
        }
        QuantFormat::Mxfp4 => {
            let scales = (0..blocks).map(|_| rng.random_range(118u8..124)).collect();
            QuantizedWeight::Mxfp4(Mxfp4Weight::from_parts("w", n, k, packed, scales).unwrap())
        }
        QuantFormat::Nf4 => {
            let absmax = (0..blocks)
                .map(|_| rng.random_range(0.01f32..0.1))
                .collect();
            QuantizedWeight::Nf4(Nf4Weight::from_parts("w", n, k, packed, absmax).unwrap())
        }
    }
}
