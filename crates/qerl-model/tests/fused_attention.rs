//! The fused attention path ([`AttentionPath::Fused`]) against the decomposed one (scores and
//! probabilities with matmuls and an f32 bias, the reference): on a tiny random model with
//! grouped-query heads and LoRA on every linear, the same training loss and the same gradient
//! for every trainable parameter on a right-padded batch, and the same prefill logits on a
//! left-padded one; on the CPU (the burn-op default of the op) and on wgpu (the CubeCL kernels).

mod common;

use std::sync::Mutex;

use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use qerl_model::{
    load, set_attention_path, AttentionPath, CausalLm, LoadOptions, LoraConfig, LoraSpec, Padding,
    Precision, QerlBackend, TokenBatch,
};
use serde_json::json;

/// The attention path is process-wide: the tests of this binary take turns.
static PATH: Mutex<()> = Mutex::new(());

const TARGETS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];

/// Two layers, 4 query heads over 1 kv head of 16 channels, LoRA (B non-zero) on the attention
/// linears.
fn model<B: QerlBackend>(dev: &B::Device) -> CausalLm<B> {
    let config = common::small_config(json!({
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
        "intermediate_size": 64
    }));
    let dir = tempfile::tempdir().unwrap();
    common::write_model(dir.path(), &config, 23);
    let options = LoadOptions {
        precision: Some(Precision::Nvfp4),
        lora: Some(LoraSpec {
            config: LoraConfig {
                rank: 4,
                alpha: 8.0,
            },
            targets: TARGETS.iter().map(|t| t.to_string()).collect(),
        }),
        trainable_norms: false,
    };
    let mut m = load::<B>(dir.path(), &options, dev).unwrap();
    for i in 0..m.layers.len() {
        for t in TARGETS {
            let linear = m
                .linear_mut(&format!("model.layers.{i}.self_attn.{t}"))
                .unwrap();
            let lora = linear.lora().unwrap();
            let (a, b) = (lora.a.val(), lora.b.val());
            let b = b.random_like(burn::tensor::Distribution::Uniform(-0.2, 0.2));
            linear.set_lora_weights(a.detach().require_grad(), b.detach().require_grad());
        }
    }
    m
}

/// Sequences of 21, 14 and 5 tokens (off any tile size).
fn sequences(vocab: u32) -> Vec<Vec<u32>> {
    [(21u32, 7u32, 3u32), (14, 5, 11), (5, 3, 1)]
        .iter()
        .map(|&(n, a, c)| (0..n).map(|i| (a * i + c) % vocab).collect())
        .collect()
}

/// Sum of `log p(next token)` over the real tokens.
fn log_likelihood<B: QerlBackend>(m: &CausalLm<B>, b: &TokenBatch) -> Tensor<B, 1> {
    let logits = m.forward(b).unwrap();
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

struct Collect<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    out: Vec<(ParamId, Vec<f32>)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = param.grad(self.grads) {
            let g = g.into_data().convert::<f32>().iter::<f32>().collect();
            self.out.push((param.id, g));
        }
    }
}

/// The loss and every parameter gradient under `path`.
fn loss_and_grads<B: AutodiffBackend + QerlBackend>(
    m: &CausalLm<B>,
    b: &TokenBatch,
    path: AttentionPath,
) -> (f32, Vec<(ParamId, Vec<f32>)>) {
    set_attention_path(path);
    let loss = log_likelihood(m, b);
    let value = common::host(loss.clone())[0];
    let grads = loss.backward();
    let mut c = Collect {
        grads: &grads,
        out: Vec::new(),
    };
    m.visit(&mut c);
    (value, c.out)
}

fn compare_training<B: AutodiffBackend + QerlBackend>(dev: &B::Device, tol: f32) {
    let m = model::<B>(dev);
    let b = TokenBatch::new(&sequences(96), 0, Padding::Right).unwrap();
    let (want, want_grads) = loss_and_grads(&m, &b, AttentionPath::Decomposed);
    let (got, got_grads) = loss_and_grads(&m, &b, AttentionPath::Fused);
    assert!(
        (want - got).abs() <= tol * want.abs().max(1.0),
        "loss: decomposed {want}, fused {got}"
    );
    // 2 layers x 4 linears x (A, B)
    assert_eq!(want_grads.len(), 16, "parameters with a gradient");
    assert_eq!(got_grads.len(), want_grads.len());
    for ((id, w), (id2, g)) in want_grads.iter().zip(&got_grads) {
        assert_eq!(id, id2);
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let worst = common::max_abs_diff(w, g) / scale;
        assert!(worst <= tol, "param {id}: relative error {worst:.2e}");
    }
}

/// Prefill of a left-padded batch (some queries see no key at all): the last column's logits.
fn compare_prefill<B: QerlBackend>(dev: &B::Device, tol: f32) {
    let m = model::<B>(dev);
    let b = TokenBatch::new(&sequences(96), 0, Padding::Left).unwrap();
    let run = |path| {
        set_attention_path(path);
        let mut cache = m.new_cache(b.batch, b.len + 4);
        let logits = common::host(m.prefill(&b, &mut cache).unwrap());
        // one decode step after it reads the cache the prefill wrote
        let next = common::host(m.decode(&[5, 6, 7], &mut cache).unwrap());
        (logits, next)
    };
    let (want, want_next) = run(AttentionPath::Decomposed);
    let (got, got_next) = run(AttentionPath::Fused);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        common::max_abs_diff(&want, &got) <= tol * scale,
        "prefill logits"
    );
    assert!(
        common::max_abs_diff(&want_next, &got_next) <= tol * scale,
        "decode after prefill"
    );
}

#[test]
fn fused_attention_matches_the_decomposed_path_on_the_cpu() {
    let _turn = PATH.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Default::default();
    compare_training::<Autodiff<common::Cpu>>(&dev, 1e-4);
    compare_prefill::<common::Cpu>(&dev, 1e-4);
}

#[cfg(feature = "wgpu")]
#[test]
fn fused_attention_matches_the_decomposed_path_on_wgpu() {
    let _turn = PATH.lock().unwrap_or_else(|e| e.into_inner());
    let dev = qerl_nn::backends::wgpu_device_or_exit();
    compare_training::<Autodiff<qerl_nn::backends::Wgpu>>(&dev, 1e-4);
    compare_prefill::<qerl_nn::backends::Wgpu>(&dev, 1e-4);
}
