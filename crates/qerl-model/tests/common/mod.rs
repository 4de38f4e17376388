//! Shared by the integration tests: fixture paths, the transformers references, comparisons.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, Tensor};
use qerl_model::QerlBackend;
use serde_json::Value;

pub type Cpu = qerl_nn::backends::Cpu;

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

pub fn parity_dir() -> PathBuf {
    repo().join("tests/fixtures/parity")
}

/// A model fixture's transformers reference (tests/fixtures/parity/<name>.json + .safetensors).
pub struct Reference {
    pub json: Value,
    pub tensors: HashMap<String, (Vec<f32>, Vec<usize>)>,
}

impl Reference {
    pub fn load(name: &str) -> Self {
        let dir = parity_dir();
        let json: Value =
            serde_json::from_slice(&std::fs::read(dir.join(format!("{name}.json"))).unwrap())
                .unwrap();
        let bytes = std::fs::read(dir.join(format!("{name}.safetensors"))).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                assert_eq!(view.dtype(), safetensors::Dtype::F32);
                let values = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                (name, (values, view.shape().to_vec()))
            })
            .collect();
        Reference { json, tensors }
    }

    /// The checkpoint directory of the reference (`model` or `nvfp4.model`).
    pub fn model_dir(&self, nvfp4: bool) -> PathBuf {
        let v = if nvfp4 {
            &self.json["nvfp4"]["model"]
        } else {
            &self.json["model"]
        };
        repo().join(v.as_str().unwrap())
    }

    /// `(token ids, logits [len, vocab] row-major)` of each logits sequence.
    pub fn logits(&self, nvfp4: bool) -> Vec<(Vec<u32>, Vec<f32>)> {
        let prefix = if nvfp4 { "nvfp4_logits" } else { "logits" };
        self.json["logits"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, item)| {
                (
                    ids(&item["ids"]),
                    self.tensors[&format!("{prefix}.{i}")].0.clone(),
                )
            })
            .collect()
    }

    pub fn greedy(&self) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, usize) {
        let g = &self.json["greedy"];
        let list = |v: &Value| v.as_array().unwrap().iter().map(ids).collect::<Vec<_>>();
        (
            list(&g["prompts"]),
            list(&g["continuations"]),
            g["max_new_tokens"].as_u64().unwrap() as usize,
        )
    }
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// Row-major f32 values of a tensor.
pub fn host<B: QerlBackend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().iter::<f32>().collect()
}

/// Largest |a - b|.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Writes `tensors` (name -> (f32 values, shape)) as one F32 `model.safetensors` in `dir`.
pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<f32>, Vec<usize>)]) {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(n, v, s)| {
            (
                n.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                s.clone(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(n, b, s)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Every tensor a config calls for, with small random values (deterministic in `seed`).
pub fn random_tensors(config: &Value, seed: u64) -> Vec<(String, Vec<f32>, Vec<usize>)> {
    let c = qerl_model::ModelConfig::from_json(config, Path::new("config.json")).unwrap();
    let mut rng = qerl_model::sampling::Rng::new(seed);
    let mut rand = |n: usize, scale: f32, offset: f32| -> Vec<f32> {
        (0..n)
            .map(|_| offset + scale * (rng.next_open01() * 2.0 - 1.0))
            .collect()
    };
    let (v, h) = (c.vocab_size, c.hidden_size);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        rand(v * h, 1.0, 0.0),
        vec![v, h],
    )];
    for i in 0..c.num_hidden_layers {
        for (suffix, d_out, d_in, bias) in c.linears() {
            let name = format!("model.layers.{i}.{suffix}");
            out.push((
                format!("{name}.weight"),
                rand(d_out * d_in, 1.0 / (d_in as f32).sqrt(), 0.0),
                vec![d_out, d_in],
            ));
            if bias {
                out.push((format!("{name}.bias"), rand(d_out, 0.05, 0.0), vec![d_out]));
            }
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            out.push((
                format!("model.layers.{i}.{norm}.weight"),
                rand(h, 0.1, 1.0),
                vec![h],
            ));
        }
    }
    out.push(("model.norm.weight".into(), rand(h, 0.1, 1.0), vec![h]));
    if !c.tie_word_embeddings {
        out.push(("lm_head.weight".into(), rand(v * h, 0.3, 0.0), vec![v, h]));
    }
    out
}

/// A small Llama config (hidden 32, 2 layers, GQA 4/2, vocab 96) with `changes` merged in.
pub fn small_config(changes: Value) -> Value {
    let mut c = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2
    });
    for (k, v) in changes.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

/// Writes a random checkpoint for `config` into `dir`.
pub fn write_model(dir: &Path, config: &Value, seed: u64) -> Vec<(String, Vec<f32>, Vec<usize>)> {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(config).unwrap(),
    )
    .unwrap();
    let tensors = random_tensors(config, seed);
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    tensors
}
