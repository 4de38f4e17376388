//! Activation checkpointing per decoder layer ([`CausalLm::hidden_states_checkpointed`] +
//! [`LayerCheckpoints::backward`]): the same loss and the same gradients for every trainable
//! parameter as the plain training forward, with AQN noise and padding; and, on wgpu, fewer live
//! bytes held between the forward and the backward.

mod common;

use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use qerl_model::{
    load, CausalLm, LoadOptions, LoraConfig, LoraSpec, Padding, Precision, QerlBackend, TokenBatch,
};
use serde_json::json;

const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// A random model with LoRA on every linear (B non-zero, so that A gets gradients),
/// trainable norms and AQN noise on every norm.
fn model<B: AutodiffBackend<InnerBackend: QerlBackend> + QerlBackend>(
    config: serde_json::Value,
    precision: Precision,
    dev: &B::Device,
) -> CausalLm<B> {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(dir.path(), &config, 11);
    let options = LoadOptions {
        precision: Some(precision),
        lora: Some(LoraSpec {
            config: LoraConfig {
                rank: 4,
                alpha: 8.0,
            },
            targets: TARGETS.iter().map(|t| t.to_string()).collect(),
        }),
        trainable_norms: true,
    };
    let mut m = load::<B>(dir.path(), &options, dev).unwrap();
    let layers = m.layers.len();
    for i in 0..layers {
        for t in TARGETS {
            let module = if ["gate_proj", "up_proj", "down_proj"].contains(&t) {
                format!("model.layers.{i}.mlp.{t}")
            } else {
                format!("model.layers.{i}.self_attn.{t}")
            };
            let linear = m.linear_mut(&module).unwrap();
            let lora = linear.lora().unwrap();
            let (a, b) = (lora.a.val(), lora.b.val());
            let b = b.random_like(burn::tensor::Distribution::Uniform(-0.1, 0.1));
            linear.set_lora_weights(a.detach().require_grad(), b.detach().require_grad());
        }
    }
    let hidden = m.config().hidden_size;
    let mut rng = qerl_model::sampling::Rng::new(5);
    for norm in m.norms_mut() {
        let z: Vec<f32> = (0..hidden)
            .map(|_| 0.05 * (rng.next_open01() * 2.0 - 1.0))
            .collect();
        norm.set_noise(Some(Tensor::from_data(TensorData::new(z, [hidden]), dev)));
    }
    m
}

/// Two right-padded sequences of different lengths.
fn batch(vocab: u32, len: usize) -> TokenBatch {
    let a: Vec<u32> = (0..len as u32).map(|i| (7 * i + 3) % vocab).collect();
    let b: Vec<u32> = (0..(len as u32 * 2 / 3))
        .map(|i| (5 * i + 11) % vocab)
        .collect();
    TokenBatch::new(&[a, b], 0, Padding::Right).unwrap()
}

/// Sum of `log p(next token)` over the real tokens of `hidden [n, s, h]`.
fn log_likelihood<B: QerlBackend>(
    m: &CausalLm<B>,
    hidden: Tensor<B, 3>,
    b: &TokenBatch,
) -> Tensor<B, 1> {
    let logits = m.logits(hidden);
    let [n, s, v] = logits.dims();
    let lp = log_softmax(logits.slice([0..n, 0..s - 1, 0..v]), 2);
    let mut next = vec![0i64; n * (s - 1)];
    let mut mask = vec![0f32; n * (s - 1)];
    for r in 0..n {
        for t in 0..s - 1 {
            next[r * (s - 1) + t] = b.ids[r * s + t + 1] as i64;
            mask[r * (s - 1) + t] = f32::from(u8::from(b.mask[r * s + t + 1]));
        }
    }
    let dev = lp.device();
    let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(next, [n, s - 1, 1]), &dev);
    let mask = Tensor::<B, 2>::from_data(TensorData::new(mask, [n, s - 1]), &dev);
    (lp.gather(2, idx).reshape([n, s - 1]) * mask).sum()
}

/// Every float parameter's gradient, in visiting order.
struct Collect<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    out: Vec<(ParamId, Option<Vec<f32>>)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let g = param
            .grad(self.grads)
            .map(|g| g.into_data().convert::<f32>().iter::<f32>().collect());
        self.out.push((param.id, g));
    }
}

fn gradients<B: AutodiffBackend + QerlBackend>(
    m: &CausalLm<B>,
    grads: &B::Gradients,
) -> Vec<(ParamId, Option<Vec<f32>>)> {
    let mut c = Collect {
        grads,
        out: Vec::new(),
    };
    m.visit(&mut c);
    c.out
}

/// Loss and gradients of the plain pass and of the checkpointed one.
fn compare<B: AutodiffBackend<InnerBackend: QerlBackend> + QerlBackend>(
    m: &CausalLm<B>,
    b: &TokenBatch,
    tolerance: f32,
) {
    let plain = log_likelihood(m, m.hidden_states(b, true).unwrap(), b);
    let plain_value = common::host(plain.clone())[0];
    let plain_grads = gradients(m, &plain.backward());

    let (hidden, checkpoints) = m.hidden_states_checkpointed(b, true).unwrap();
    let loss = log_likelihood(m, hidden, b);
    let value = common::host(loss.clone())[0];
    let mut grads = loss.backward();
    checkpoints.backward(m, &mut grads);
    let ckpt_grads = gradients(m, &grads);

    assert!(
        (plain_value - value).abs() <= 1e-5 * plain_value.abs().max(1.0),
        "loss {plain_value} vs {value}"
    );
    assert_eq!(plain_grads.len(), ckpt_grads.len());
    let mut compared = 0;
    for ((id, p), (id2, c)) in plain_grads.iter().zip(&ckpt_grads) {
        assert_eq!(id, id2);
        match (p, c) {
            (None, None) => {}
            (Some(p), Some(c)) => {
                let scale = p.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
                let worst = common::max_abs_diff(p, c) / scale;
                assert!(worst <= tolerance, "param {id}: relative error {worst:.2e}");
                compared += 1;
            }
            _ => panic!("param {id}: gradient in one pass only ({p:?} vs {c:?})"),
        }
    }
    // every layer: 7 x (A, B) + 2 norms; plus the final norm
    let layers = m.layers.len();
    assert_eq!(
        compared,
        layers * 16 + 1,
        "trainable parameters with a gradient"
    );
}

#[test]
fn checkpointed_layers_give_the_same_gradients_on_the_cpu() {
    type Ad = Autodiff<common::Cpu>;
    let dev = Default::default();
    for precision in [Precision::Nvfp4, Precision::Bf16] {
        let m = model::<Ad>(
            common::small_config(json!({"num_hidden_layers": 3})),
            precision,
            &dev,
        );
        compare(&m, &batch(96, 9), 1e-4);
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    use qerl_nn::backends::Wgpu;

    type Ad = Autodiff<Wgpu>;

    #[test]
    fn checkpointed_layers_give_the_same_gradients_on_wgpu() {
        let dev = qerl_nn::backends::wgpu_device_or_exit();
        let m = model::<Ad>(
            common::small_config(json!({"num_hidden_layers": 3})),
            Precision::Nvfp4,
            &dev,
        );
        compare(&m, &batch(96, 9), 1e-4);
    }

    /// Bytes of live device buffers held between the forward and the backward (the graph's
    /// saved activations), plain against checkpointed, on a model whose activations dominate.
    #[test]
    fn checkpointing_holds_fewer_bytes_until_the_backward() {
        let dev = qerl_nn::backends::wgpu_device_or_exit();
        let config = common::small_config(json!({
            "num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
            "max_position_embeddings": 512
        }));
        let m = model::<Ad>(config, Precision::Nvfp4, &dev);
        let b = batch(64, 192);
        let in_use = || <Ad as QerlBackend>::memory_usage(&dev).unwrap().0;

        let before = in_use();
        let plain = m.hidden_states(&b, true).unwrap();
        let plain_held = in_use() - before;
        drop(plain.sum().backward());

        let before = in_use();
        let (hidden, checkpoints) = m.hidden_states_checkpointed(&b, true).unwrap();
        let ckpt_held = in_use() - before;
        let mut grads = hidden.sum().backward();
        checkpoints.backward(&m, &mut grads);

        println!(
            "6 layers, 2 x 192 tokens, hidden 64, intermediate 256: held until the backward \
             {plain_held} bytes plain, {ckpt_held} checkpointed ({:.1}x less)",
            plain_held as f64 / ckpt_held.max(1) as f64
        );
        assert!(
            ckpt_held * 4 < plain_held,
            "{ckpt_held} vs {plain_held} bytes"
        );
    }
}
