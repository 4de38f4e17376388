//! The weights the engine reads: frozen products (4-bit [`DeviceWeight`]s or dense `F`),
//! biases, LoRA factors in the compute type, RMSNorm gains in f32.
//!
//! Handles are shared, not copied: an engine built from a training model holds the same device
//! buffers of the frozen weights as the model's layers (one copy of a 4-bit 32B model is
//! already 18 GB). The LoRA factors and norm gains, which change every optimizer step, are the
//! engine's own small copies, refreshed by the caller after each update.

use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_format::{e2m1::e2m1_table, fp8, QuantFormat};
use qerl_kernels::DeviceWeight;

use crate::kernels::fill::{fill_bits, fill_uniform};
use crate::shape::ModelShape;
use crate::EngineError;

/// A frozen `[n, k]` weight.
// Seven per layer: the size of a `DeviceWeight` (five handles) is not worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Frozen {
    /// 4 bits an element (NVFP4, MXFP4 or NF4), decoded inside the product kernels.
    Quant(DeviceWeight),
    /// Row-major `F` (a BF16 model).
    Dense(Handle),
}

/// A LoRA adapter in the compute type: `A [rank, k]`, `B [n, rank]`, `y += scale · x·Aᵀ·Bᵀ`.
#[derive(Clone, Debug)]
pub struct LoraWeights {
    pub a: Handle,
    pub b: Handle,
    pub rank: usize,
    pub scale: f32,
}

/// One linear layer of the decoder, `y [m, n] = x [m, k] · Wᵀ (+ bias) (+ LoRA)`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub n: usize,
    pub k: usize,
    pub weight: Frozen,
    pub bias: Option<Handle>,
    pub lora: Option<LoraWeights>,
}

/// One decoder layer.
#[derive(Clone, Debug)]
pub struct Layer {
    /// f32 gains `[hidden]`: RMSNorm weight plus the AQN vector when noise is on.
    pub attn_norm: Handle,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub mlp_norm: Handle,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// Every weight of a decoder.
#[derive(Clone, Debug)]
pub struct EngineWeights {
    pub shape: ModelShape,
    /// `[vocab, hidden]` in `F`.
    pub embed: Handle,
    pub layers: Vec<Layer>,
    /// f32 gains `[hidden]`.
    pub final_norm: Handle,
    /// `[vocab, hidden]` in `F`; `None`: tied to `embed`.
    pub lm_head: Option<Handle>,
}

/// How the benchmark's random frozen weights are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RandomPrecision {
    Nvfp4,
    Bf16,
}

impl EngineWeights {
    /// The lm_head matrix `[vocab, hidden]`.
    pub fn lm_head(&self) -> &Handle {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// The largest LoRA rank of any linear (0 without adapters).
    pub fn max_rank(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down])
            .filter_map(|l| l.lora.as_ref().map(|a| a.rank))
            .max()
            .unwrap_or(0)
    }

    /// A model of `shape` with random weights generated on the device (no host copy: a 7B
    /// model in well under a second): 4-bit NVFP4 codes with random E2M1 values and block
    /// scales, or dense `F` weights of a similar spread; LoRA adapters of `lora_rank` with
    /// non-zero `B`, so that the adapter's cost is measured as in training.
    pub fn random<R: Runtime, F: Float + CubeElement>(
        client: &ComputeClient<R>,
        shape: &ModelShape,
        precision: RandomPrecision,
        lora_rank: Option<usize>,
        seed: u32,
    ) -> Result<Self, EngineError> {
        shape.validate()?;
        let mut next = seed.wrapping_mul(0x9e37_79b9);
        let mut seed = || {
            next = next.wrapping_add(0x6d2b_79f5);
            next
        };
        let elem = std::mem::size_of::<F>();
        let dense = |len: usize, bound: f32, s: u32| {
            let h = client.empty(len * elem);
            fill_uniform::<R, F>(client, &h, len, s, bound);
            h
        };
        let gains = |len: usize| client.create_from_slice(f32::as_bytes(&vec![1.0f32; len]));
        let (h, i) = (shape.hidden, shape.intermediate);
        let mut linear = |n: usize, k: usize, bias: bool| -> Linear {
            let bound = 1.0 / (k as f32).sqrt();
            let weight = match precision {
                RandomPrecision::Bf16 => Frozen::Dense(dense(n * k, bound, seed())),
                RandomPrecision::Nvfp4 => Frozen::Quant(random_nvfp4(client, n, k, seed())),
            };
            Linear {
                n,
                k,
                weight,
                bias: bias.then(|| dense(n, 0.02, seed())),
                lora: lora_rank.map(|rank| LoraWeights {
                    a: dense(rank * k, bound, seed()),
                    b: dense(n * rank, 0.01, seed()),
                    rank,
                    scale: 2.0,
                }),
            }
        };
        let layers = (0..shape.layers)
            .map(|_| Layer {
                attn_norm: gains(h),
                q: linear(shape.q_dim(), h, shape.qkv_bias),
                k: linear(shape.kv_dim(), h, shape.qkv_bias),
                v: linear(shape.kv_dim(), h, shape.qkv_bias),
                o: linear(h, shape.q_dim(), shape.o_bias),
                mlp_norm: gains(h),
                gate: linear(i, h, shape.mlp_bias),
                up: linear(i, h, shape.mlp_bias),
                down: linear(h, i, shape.mlp_bias),
            })
            .collect();
        let embed = dense(shape.vocab * h, 0.05, seed());
        let lm_head = (!shape.tied_embeddings).then(|| dense(shape.vocab * h, 0.05, seed()));
        Ok(EngineWeights {
            shape: shape.clone(),
            embed,
            layers,
            final_norm: gains(h),
            lm_head,
        })
    }
}

/// Global scale of the random NVFP4 weights: block scales 0.25..0.47 (E4M3 bytes 0x28..0x2f)
/// over it and E2M1 values up to 6 give entries of about ±0.1, near a trained 7B's spread.
const RANDOM_GLOBAL_SCALE: f32 = 32.0;

/// An `[n, k]` NVFP4 weight with random codes and block scales, made on the device.
pub fn random_nvfp4<R: Runtime>(
    client: &ComputeClient<R>,
    n: usize,
    k: usize,
    seed: u32,
) -> DeviceWeight {
    let words = n * k / 8;
    let scale_words = (n * k / 16).div_ceil(4);
    let codes = client.empty(words * 4);
    fill_bits(client, &codes, words, seed, u32::MAX, 0);
    let scale_bytes = client.empty(scale_words * 4);
    fill_bits(
        client,
        &scale_bytes,
        scale_words,
        seed ^ 0x5bd1_e995,
        0x0707_0707,
        0x2828_2828,
    );
    let table = fp8::e4m3_table().map(|s| s / RANDOM_GLOBAL_SCALE);
    DeviceWeight {
        format: QuantFormat::Nvfp4,
        n,
        k,
        codes,
        scale_bytes,
        scale_table: client.create_from_slice(f32::as_bytes(&table)),
        code_table: client.create_from_slice(f32::as_bytes(&e2m1_table())),
    }
}
