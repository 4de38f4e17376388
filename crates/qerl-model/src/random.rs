//! A [`CausalLm`] with random weights built in memory, for benchmarks of the training path
//! (`qerl bench train`): no checkpoint is written or read.
//!
//! Every distinct decoder linear shape (q, k/v, o, gate/up, down) gets one random host weight,
//! quantized once; each layer uploads its own copy, so the device holds exactly what a loaded
//! model of that shape holds (the layers' values are equal, which changes no kernel's time).
//! Embeddings and lm_head are drawn on the device. Dense (`Precision::Bf16`) linears are drawn
//! on the device too.

use std::collections::HashMap;

use burn::tensor::{Distribution, Tensor};
use qerl_format::{QuantizedWeight, SourceDtype};
use qerl_nn::{LoraConfig, NoisyRmsNorm, Nvfp4Linear, Precision, QerlBackend};

use crate::attention::Attention;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::model::{CausalLm, DecoderLayer, Mlp};
use crate::sampling::Rng;

/// What [`random_model`] builds.
#[derive(Clone, Debug)]
pub struct RandomModel {
    pub precision: Precision,
    /// LoRA on every decoder linear (`None`: no adapters).
    pub lora: Option<LoraConfig>,
    pub trainable_norms: bool,
    pub seed: u64,
}

/// A model of `config`'s shape with random weights: linear weights uniform in
/// `±1/sqrt(d_input)`, norms 1, embeddings and lm_head uniform in `±0.05`, biases 0. LoRA `A`
/// as PEFT initialises it and `B` small and non-zero, so that both get gradients.
///
/// Everything follows from `spec.seed`: the host weights from their own generator, the tensors
/// drawn on the device from the backend's generator, which this seeds (process-wide). Unseeded,
/// embeddings, lm_head and the LoRA factors differed from process to process, and so did a
/// benchmark step's gradient norm on identical inputs.
pub fn random_model<B: QerlBackend>(
    config: &ModelConfig,
    spec: &RandomModel,
    device: &B::Device,
) -> Result<CausalLm<B>> {
    B::seed(device, spec.seed);
    let (v, h) = (config.vocab_size, config.hidden_size);
    let uniform = |shape: [usize; 2], bound: f64| {
        Tensor::<B, 2>::random(shape, Distribution::Uniform(-bound, bound), device)
    };
    let mut host: HashMap<(usize, usize), QuantizedWeight> = HashMap::new();
    let mut rng = Rng::new(spec.seed);
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let mut linears = Vec::with_capacity(7);
        for (suffix, d_out, d_in, has_bias) in config.linears() {
            let name = format!("model.layers.{i}.{suffix}");
            let bias = has_bias.then(|| vec![0f32; d_out]);
            let bound = 1.0 / (d_in as f64).sqrt();
            let nn = |e: qerl_nn::NnError| ModelError::Nn(format!("{name}: {e}"));
            let mut linear = match spec.precision.format() {
                None => Nvfp4Linear::from_dense_tensor(
                    &name,
                    uniform([d_out, d_in], bound),
                    bias.as_deref(),
                    spec.lora,
                    device,
                )
                .map_err(nn)?,
                Some(format) => {
                    let weight = match host.get(&(d_out, d_in)) {
                        Some(w) => w.clone(),
                        None => {
                            let values: Vec<f32> = (0..d_out * d_in)
                                .map(|_| (bound as f32) * (2.0 * rng.next_open01() - 1.0))
                                .collect();
                            let w = QuantizedWeight::quantize(
                                format,
                                &name,
                                &values,
                                &[d_out, d_in],
                                SourceDtype::BF16,
                            )
                            .map_err(|e| ModelError::Nn(format!("{name}: {e}")))?;
                            host.insert((d_out, d_in), w.clone());
                            w
                        }
                    };
                    Nvfp4Linear::from_quantized(&name, weight, bias.as_deref(), spec.lora, device)
                        .map_err(nn)?
                }
            };
            if let Some(lora) = linear.lora() {
                let a = lora.a.val();
                let b = lora.b.val().random_like(Distribution::Uniform(-1e-3, 1e-3));
                linear.set_lora_weights(a, b.require_grad());
            }
            linears.push(linear);
        }
        let mut it = linears.into_iter();
        let mut next = || it.next().expect("seven linears");
        let norm = || {
            NoisyRmsNorm::new(
                Tensor::<B, 1>::ones([h], device),
                config.rms_norm_eps,
                spec.trainable_norms,
            )
        };
        layers.push(DecoderLayer {
            input_layernorm: norm(),
            self_attn: Attention {
                q_proj: next(),
                k_proj: next(),
                v_proj: next(),
                o_proj: next(),
                num_heads: config.num_attention_heads,
                num_kv_heads: config.num_key_value_heads,
                head_dim: config.head_dim,
            },
            post_attention_layernorm: norm(),
            mlp: Mlp {
                gate_proj: next(),
                up_proj: next(),
                down_proj: next(),
            },
        });
    }
    let final_norm = NoisyRmsNorm::new(
        Tensor::<B, 1>::ones([h], device),
        config.rms_norm_eps,
        spec.trainable_norms,
    );
    let lm_head = (!config.tie_word_embeddings).then(|| uniform([v, h], 0.05));
    Ok(CausalLm::from_parts(
        uniform([v, h], 0.05),
        layers,
        final_norm,
        lm_head,
        config.clone(),
    ))
}
