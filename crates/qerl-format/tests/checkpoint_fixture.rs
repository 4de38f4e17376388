//! Small random Hugging Face checkpoints for the checkpoint tests (also included by
//! qerl-train's CLI test through `#[path]`). Not a test by itself.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::Normal;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

pub const HIDDEN: usize = 64;
pub const INTERMEDIATE: usize = 160;
pub const LAYERS: usize = 2;
pub const VOCAB: usize = 96;
pub const KV_DIM: usize = 32;

/// One tensor of a fixture: `values` already hold what `dtype` stores (rounded).
#[derive(Clone, Debug)]
pub struct Spec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl Spec {
    /// Little-endian bytes in `dtype` (BF16, F16, F32 or I32).
    pub fn bytes(&self) -> Vec<u8> {
        match self.dtype {
            Dtype::BF16 => self
                .values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            Dtype::F16 => self
                .values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            Dtype::F32 => self.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::I32 => self
                .values
                .iter()
                .flat_map(|v| (*v as i32).to_le_bytes())
                .collect(),
            other => panic!("fixture cannot store {other:?}"),
        }
    }

    /// Replaces the values with `n` random ones of spread `std` (rounded to the dtype).
    pub fn randomize(&mut self, rng: &mut StdRng, std: f32) {
        let n: usize = self.shape.iter().product();
        let normal = Normal::new(0.0f32, std).unwrap();
        self.values = (0..n)
            .map(|_| round(self.dtype, rng.sample(normal)))
            .collect();
        // A few outliers so that block scales differ a lot.
        for i in (0..n).step_by(97) {
            self.values[i] = round(self.dtype, self.values[i] * 8.0);
        }
    }
}

pub fn round(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::BF16 => bf16::from_f32(x).to_f32(),
        Dtype::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// The linear weight names of the fixture model, in q, k, v, o, gate, up, down order per layer.
pub fn linear_names() -> Vec<String> {
    let mut names = Vec::new();
    for l in 0..LAYERS {
        for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            names.push(format!("model.layers.{l}.self_attn.{p}.weight"));
        }
        for p in ["gate_proj", "up_proj", "down_proj"] {
            names.push(format!("model.layers.{l}.mlp.{p}.weight"));
        }
    }
    names
}

/// A Qwen2-like decoder: embeddings, 2 layers (q/k/v with biases, GQA k/v of 32 rows), norms,
/// untied lm_head; all tensors `dtype`, random with per-tensor spreads.
pub fn model(dtype: Dtype, seed: u64) -> Vec<Spec> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut specs = Vec::new();
    let mut add = |rng: &mut StdRng, name: String, shape: Vec<usize>, std: f32| {
        let mut s = Spec {
            name,
            dtype,
            shape,
            values: Vec::new(),
        };
        s.randomize(rng, std);
        specs.push(s);
    };
    add(
        &mut rng,
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        0.05,
    );
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        add(
            &mut rng,
            format!("{p}.input_layernorm.weight"),
            vec![HIDDEN],
            1.0,
        );
        add(
            &mut rng,
            format!("{p}.post_attention_layernorm.weight"),
            vec![HIDDEN],
            1.0,
        );
        let attn = [
            ("q", HIDDEN, 0.02),
            ("k", KV_DIM, 0.05),
            ("v", KV_DIM, 0.01),
            ("o", HIDDEN, 0.03),
        ];
        for (i, (n, out, std)) in attn.into_iter().enumerate() {
            let std = std * (1.0 + 0.3 * (l + i) as f32);
            add(
                &mut rng,
                format!("{p}.self_attn.{n}_proj.weight"),
                vec![out, HIDDEN],
                std,
            );
            if n != "o" {
                add(
                    &mut rng,
                    format!("{p}.self_attn.{n}_proj.bias"),
                    vec![out],
                    0.1,
                );
            }
        }
        let mlp = [
            ("gate", INTERMEDIATE, HIDDEN, 0.02),
            ("up", INTERMEDIATE, HIDDEN, 0.04),
            ("down", HIDDEN, INTERMEDIATE, 0.03),
        ];
        for (n, out, inp, std) in mlp {
            add(
                &mut rng,
                format!("{p}.mlp.{n}_proj.weight"),
                vec![out, inp],
                std * (1.0 + l as f32),
            );
        }
    }
    add(&mut rng, "model.norm.weight".into(), vec![HIDDEN], 1.0);
    add(&mut rng, "lm_head.weight".into(), vec![VOCAB, HIDDEN], 0.05);
    specs
}

pub fn config(dtype: Dtype) -> serde_json::Value {
    json!({
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": false,
        "torch_dtype": if dtype == Dtype::BF16 { "bfloat16" } else { "float32" },
        "vocab_size": VOCAB,
    })
}

/// Non-weight files the fixture directory holds (name, content).
pub fn extra_files() -> Vec<(&'static str, &'static str)> {
    vec![
        ("tokenizer.json", "{\"version\": \"1.0\", \"model\": {}}"),
        ("tokenizer_config.json", "{\"model_max_length\": 4096}"),
        ("generation_config.json", "{\"do_sample\": true}\n"),
        (
            "chat_template.jinja",
            "{% for m in messages %}{{ m.content }}{% endfor %}",
        ),
        ("merges.txt", "#version: 0.2\nĠ t\n"),
    ]
}

/// Which shard file each tensor goes to: `model.safetensors` for one shard, otherwise
/// round-robin over `model-0000i-of-0000n.safetensors` (so q, k and v of a layer are split).
pub fn shard_of(specs: &[Spec], shards: usize) -> BTreeMap<String, String> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let file = if shards == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{shards:05}.safetensors", i % shards + 1)
            };
            (s.name.clone(), file)
        })
        .collect()
}

/// Writes a checkpoint directory: config.json, shards (+ index when `shards > 1`), extra files
/// and a hidden `.cache/` that must not be copied.
pub fn write(dir: &Path, specs: &[Spec], shards: usize, dtype: Dtype) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config(dtype)).unwrap(),
    )
    .unwrap();
    let files = shard_of(specs, shards);
    let bytes: HashMap<&str, Vec<u8>> =
        specs.iter().map(|s| (s.name.as_str(), s.bytes())).collect();
    let mut by_file: BTreeMap<&str, Vec<&Spec>> = BTreeMap::new();
    for s in specs {
        by_file.entry(files[&s.name].as_str()).or_default().push(s);
    }
    let mut total = 0;
    for (file, members) in &by_file {
        let views: Vec<(String, TensorView)> = members
            .iter()
            .map(|s| {
                let data = &bytes[s.name.as_str()];
                total += data.len();
                (
                    s.name.clone(),
                    TensorView::new(s.dtype, s.shape.clone(), data).unwrap(),
                )
            })
            .collect();
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(meta), &dir.join(file)).unwrap();
    }
    if shards > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": files});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index).unwrap(),
        )
        .unwrap();
    }
    for (name, content) in extra_files() {
        std::fs::write(dir.join(name), content).unwrap();
    }
    std::fs::create_dir_all(dir.join(".cache")).unwrap();
    std::fs::write(dir.join(".cache/lock"), "x").unwrap();
}
