//! [`random_model`] is a function of its seed: two models from one seed hold the same values
//! (the host-drawn 4-bit weights and the backend-drawn embeddings, lm_head and LoRA factors),
//! so a benchmark's gradient norm on identical inputs is the same from process to process.

use burn::tensor::{Tensor, TensorData};
use qerl_model::random::{random_model, RandomModel};
use qerl_model::{CausalLm, LoraConfig, ModelConfig, Precision};

type B = qerl_nn::backends::Cpu;

fn tiny() -> ModelConfig {
    let json = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": false, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2
    });
    ModelConfig::from_json(&json, std::path::Path::new("tiny")).unwrap()
}

fn build(seed: u64) -> CausalLm<B> {
    let spec = RandomModel {
        precision: Precision::Nvfp4,
        lora: Some(LoraConfig {
            rank: 4,
            alpha: 4.0,
        }),
        trainable_norms: true,
        seed,
    };
    random_model::<B>(&tiny(), &spec, &Default::default()).unwrap()
}

/// The values a seed decides: embeddings, lm_head, every layer's LoRA factors and the
/// dequantized weight of one projection.
fn drawn(m: &CausalLm<B>) -> Vec<TensorData> {
    let mut out = vec![m.embed_tokens.val().into_data()];
    out.extend(m.lm_head.as_ref().map(|h| h.val().into_data()));
    for layer in &m.layers {
        for lin in [&layer.self_attn.q_proj, &layer.mlp.down_proj] {
            let lora = lin.lora().expect("LoRA on every linear");
            out.push(lora.a.val().into_data());
            out.push(lora.b.val().into_data());
        }
    }
    let w: Tensor<B, 2> = m.layers[0].self_attn.o_proj.merged_weight();
    out.push(w.into_data());
    out
}

#[test]
fn one_seed_one_model() {
    let (a, b) = (drawn(&build(7)), drawn(&build(7)));
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x, y, "tensor {i} differs between two models of seed 7");
    }
    let c = drawn(&build(8));
    assert_ne!(a[0], c[0], "seeds 7 and 8 drew the same embeddings");
}
