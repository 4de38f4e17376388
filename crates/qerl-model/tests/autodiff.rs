//! The model under `Autodiff<B>`: the training forward gives gradients to the LoRA adapters
//! (and trainable norms) only, and they match finite differences of the log-likelihood.

mod common;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use common::Cpu;
use qerl_model::{load, CausalLm, LoadOptions, LoraConfig, LoraSpec, TokenBatch};

type Ad = Autodiff<Cpu>;

/// Sum of `log p(token_t | tokens_<t)` over a sequence: the RL objective's building block.
fn log_likelihood<B: qerl_model::QerlBackend>(m: &CausalLm<B>, ids: &[u32]) -> Tensor<B, 1> {
    let logits = m.forward(&TokenBatch::single(ids).unwrap()).unwrap();
    let [_, s, v] = logits.dims();
    let lp = log_softmax(logits.reshape([s, v]), 1).slice([0..s - 1, 0..v]);
    let next: Vec<i64> = ids[1..].iter().map(|&t| t as i64).collect();
    let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(next, [s - 1, 1]), &lp.device());
    lp.gather(1, idx).sum()
}

#[test]
fn lora_and_norm_gradients_under_autodiff() {
    let r = common::Reference::load("llama3_rope");
    let options = LoadOptions {
        lora: Some(LoraSpec {
            config: LoraConfig {
                rank: 4,
                alpha: 8.0,
            },
            targets: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
        }),
        trainable_norms: true,
        ..LoadOptions::default()
    };
    let dev = Default::default();
    let mut m = load::<Ad>(&r.model_dir(false), &options, &dev).unwrap();
    // make B non-zero so that A gets a gradient too
    let layer = &mut m.layers[1].self_attn.v_proj;
    let lora = layer.lora().unwrap();
    let (a, b) = (lora.a.val(), lora.b.val());
    let b = b.clone().add_scalar(0.01) + b;
    layer.set_lora_weights(a.detach().require_grad(), b.detach().require_grad());

    let ids = [5u32, 17, 300, 44, 9, 120, 7];
    let ll = log_likelihood(&m, &ids);
    let grads = ll.backward();
    let v = &m.layers[1].self_attn.v_proj;
    let ga = v.lora().unwrap().a.grad(&grads).expect("dA");
    let gb = v.lora().unwrap().b.grad(&grads).expect("dB");
    assert!(m.layers[0]
        .self_attn
        .q_proj
        .lora()
        .unwrap()
        .b
        .grad(&grads)
        .is_some());
    assert!(
        m.layers[0].input_layernorm.weight.grad(&grads).is_some(),
        "trainable norm"
    );
    assert!(m.embed_tokens.grad(&grads).is_none(), "frozen embeddings");
    assert!(m.layers[0].self_attn.k_proj.lora().is_none());

    // central finite differences of one entry of A and of B of layer 1's v_proj
    let inner = m.valid();
    let ga: Vec<f32> = ga.into_data().iter::<f32>().collect();
    let gb: Vec<f32> = gb.into_data().iter::<f32>().collect();
    let eps = 1e-2f32;
    let shifted = |which: &str, index: usize, delta: f32| -> f64 {
        let mut probe = inner.clone();
        let layer = &mut probe.layers[1].self_attn.v_proj;
        let lora = layer.lora().unwrap();
        let (ad, bd) = (lora.a.dims(), lora.b.dims());
        let mut a: Vec<f32> = lora.a.val().into_data().iter::<f32>().collect();
        let mut b: Vec<f32> = lora.b.val().into_data().iter::<f32>().collect();
        if which == "A" {
            a[index] += delta;
        } else {
            b[index] += delta;
        }
        layer.set_lora_weights(
            Tensor::from_data(TensorData::new(a, ad), &dev),
            Tensor::from_data(TensorData::new(b, bd), &dev),
        );
        log_likelihood(&probe, &ids).into_scalar() as f64
    };
    for (which, index, analytic) in [("A", 5usize, ga[5]), ("B", 3, gb[3]), ("B", 40, gb[40])] {
        let numeric =
            (shifted(which, index, eps) - shifted(which, index, -eps)) / (2.0 * eps as f64);
        println!(
            "d ll / d {which}[{index}]: autodiff {analytic:.5}, central difference {numeric:.5}"
        );
        assert!(
            (numeric - analytic as f64).abs() < 2e-3 + 1e-2 * numeric.abs(),
            "{which}[{index}]"
        );
    }
}
