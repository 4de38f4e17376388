//! config.json / generation_config.json parsing, and the errors of bad configs and of
//! checkpoints that do not match their config: each names the file and the key or tensor.

mod common;

use std::path::Path;

use common::{small_config, write_model, Cpu};
use qerl_model::{
    config::eos_token_ids, load, Architecture, GenerationDefaults, LoadOptions, ModelConfig,
    ModelError, Precision, RopeScaling, TokenBatch,
};
use serde_json::json;

fn parse(v: serde_json::Value) -> Result<ModelConfig, ModelError> {
    ModelConfig::from_json(&v, Path::new("/models/x/config.json"))
}

/// The error's message names the file and every one of `words`.
fn assert_err(e: impl std::fmt::Display, words: &[&str]) {
    let msg = e.to_string();
    for w in words {
        assert!(msg.contains(w), "`{w}` not in: {msg}");
    }
}

#[test]
fn fixture_configs() {
    let ct = common::repo().join("tests/fixtures/compressed-tensors");
    let llama = ModelConfig::from_dir(&ct.join("llama_untied/bf16")).unwrap();
    assert_eq!(llama.arch, Architecture::Llama);
    assert_eq!(
        (
            llama.num_attention_heads,
            llama.num_key_value_heads,
            llama.head_dim
        ),
        (4, 2, 16)
    );
    assert_eq!(
        (llama.rope_theta, &llama.rope_scaling),
        (10000.0, &RopeScaling::None)
    );
    assert!(!llama.tie_word_embeddings && !llama.qkv_bias && !llama.o_bias && !llama.mlp_bias);
    assert_eq!(llama.eos_token_ids, vec![2]);
    assert_eq!(llama.rms_norm_eps, 1e-6);

    let qwen = ModelConfig::from_dir(&ct.join("qwen2_tied/bf16")).unwrap();
    assert_eq!(qwen.arch, Architecture::Qwen2);
    assert!(qwen.tie_word_embeddings && qwen.qkv_bias && !qwen.o_bias && !qwen.mlp_bias);

    let dir = common::parity_dir().join("llama3_rope");
    let l3 = ModelConfig::from_dir(&dir).unwrap();
    assert_eq!(
        (l3.num_key_value_heads, l3.head_dim, l3.q_dim()),
        (1, 32, 128)
    );
    assert!(l3.qkv_bias && l3.o_bias && l3.mlp_bias);
    assert_eq!(l3.eos_token_ids, vec![2, 3]);
    assert_eq!(l3.rope_theta, 500000.0);
    assert_eq!(
        l3.rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0
        }
    );
    let defaults = GenerationDefaults::from_dir(&dir).unwrap();
    assert_eq!(defaults.eos_token_ids, Some(vec![2, 3]));
    assert_eq!(eos_token_ids(&l3, &defaults), vec![2, 3]);
}

#[test]
fn transformers_4_layout_and_defaults() {
    // Qwen2.5-style: rope_theta at the top level, rope_scaling null, no head_dim.
    let c = parse(json!({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "rope_theta": 1000000.0, "rope_scaling": null,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "use_sliding_window": false,
        "eos_token_id": 151645, "bos_token_id": null
    }))
    .unwrap();
    assert_eq!(
        (c.head_dim, c.rope_theta, c.rope_scaling),
        (64, 1e6, RopeScaling::None)
    );
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (None, vec![151645])
    );
    // rope_scaling with the old `type` key
    let c = parse(small_config(
        json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ))
    .unwrap();
    assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
    // model_type instead of architectures; num_key_value_heads defaults to the head count
    let mut v = small_config(json!({}));
    v.as_object_mut().unwrap().remove("architectures");
    v.as_object_mut().unwrap().remove("num_key_value_heads");
    let c = parse(v).unwrap();
    assert_eq!((c.arch, c.num_key_value_heads), (Architecture::Llama, 4));
}

#[test]
fn bad_configs_name_file_and_key() {
    let file = "/models/x/config.json";
    let cases = [
        (
            json!({"architectures": ["Qwen3ForCausalLM"]}),
            vec!["architectures", "Qwen3ForCausalLM"],
        ),
        (json!({"hidden_size": null}), vec!["hidden_size", "missing"]),
        (
            json!({"num_attention_heads": "4"}),
            vec!["num_attention_heads", "not a non-negative integer"],
        ),
        (
            json!({"num_key_value_heads": 3}),
            vec!["num_key_value_heads", "does not divide"],
        ),
        (
            json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}),
            vec!["rope_parameters.rope_type", "yarn"],
        ),
        (
            json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}),
            vec!["rope_parameters.low_freq_factor", "missing"],
        ),
        (json!({"hidden_act": "gelu"}), vec!["hidden_act", "silu"]),
        (json!({"eos_token_id": "</s>"}), vec!["eos_token_id"]),
        (json!({"rms_norm_eps": -1.0}), vec!["rms_norm_eps"]),
        (json!({"head_dim": 7}), vec!["head_dim", "even"]),
        (
            json!({"tie_word_embeddings": "yes"}),
            vec!["tie_word_embeddings"],
        ),
    ];
    for (change, words) in cases {
        let e = parse(small_config(change.clone())).expect_err(&change.to_string());
        let mut words = words;
        words.push(file);
        assert_err(e, &words);
    }
    let e = parse(json!({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": true}))
        .unwrap_err();
    assert_err(e, &[file, "use_sliding_window"]);
    // invalid JSON names the file
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("config.json"), "{ not json").unwrap();
    assert_err(
        ModelConfig::from_dir(tmp.path()).unwrap_err(),
        &["config.json", "not valid JSON"],
    );
    std::fs::write(
        tmp.path().join("generation_config.json"),
        r#"{"eos_token_id": [2, -1]}"#,
    )
    .unwrap();
    assert_err(
        GenerationDefaults::from_dir(tmp.path()).unwrap_err(),
        &["generation_config.json", "eos_token_id"],
    );
}

#[test]
fn checkpoint_that_does_not_match_its_config() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Default::default();
    let opts = LoadOptions::default();
    let dir = tmp.path().join("m");
    let config = small_config(json!({}));
    let tensors = write_model(&dir, &config, 1);
    load::<Cpu>(&dir, &opts, &dev).unwrap();

    // a missing tensor
    let partial: Vec<_> = tensors
        .iter()
        .filter(|t| t.0 != "model.layers.1.mlp.up_proj.weight")
        .cloned()
        .collect();
    common::write_safetensors(&dir.join("model.safetensors"), &partial);
    assert_err(
        load::<Cpu>(&dir, &opts, &dev).unwrap_err(),
        &["model.layers.1.mlp.up_proj.weight", "has no tensor", "m`"],
    );

    // a mismatched shape: config says intermediate 64, weights are 48 wide
    common::write_safetensors(&dir.join("model.safetensors"), &tensors);
    let wrong = small_config(json!({"intermediate_size": 64}));
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&wrong).unwrap()).unwrap();
    assert_err(
        load::<Cpu>(&dir, &opts, &dev).unwrap_err(),
        &[
            "model.layers.0.mlp.gate_proj.weight",
            "model.safetensors",
            "[48, 32]",
            "[64, 32]",
        ],
    );

    // tensors the architecture does not have (a Qwen3 q_norm, an unexpected bias)
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec(&config).unwrap(),
    )
    .unwrap();
    let mut extra = tensors.clone();
    extra.push((
        "model.layers.0.self_attn.q_norm.weight".into(),
        vec![1.0; 8],
        vec![8],
    ));
    extra.push((
        "model.layers.0.self_attn.q_proj.bias".into(),
        vec![0.0; 32],
        vec![32],
    ));
    common::write_safetensors(&dir.join("model.safetensors"), &extra);
    assert_err(
        load::<Cpu>(&dir, &opts, &dev).unwrap_err(),
        &["q_norm.weight", "q_proj.bias", "LlamaForCausalLM"],
    );

    // a missing bias the config asks for
    common::write_safetensors(&dir.join("model.safetensors"), &tensors);
    let biased = small_config(json!({"attention_bias": true}));
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec(&biased).unwrap(),
    )
    .unwrap();
    assert_err(
        load::<Cpu>(&dir, &opts, &dev).unwrap_err(),
        &["model.layers.0.self_attn.q_proj.bias"],
    );

    // an untied model without lm_head
    let no_head: Vec<_> = tensors
        .iter()
        .filter(|t| t.0 != "lm_head.weight")
        .cloned()
        .collect();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec(&config).unwrap(),
    )
    .unwrap();
    common::write_safetensors(&dir.join("model.safetensors"), &no_head);
    assert_err(
        load::<Cpu>(&dir, &opts, &dev).unwrap_err(),
        &["lm_head.weight", "tie_word_embeddings"],
    );

    // no weights at all
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert_err(
        load::<Cpu>(&dir, &opts, &dev).unwrap_err(),
        &["model.safetensors"],
    );
}

#[test]
fn hidden_size_not_a_multiple_of_16_in_nvfp4() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Default::default();
    let dir = tmp.path().join("h40");
    let config = small_config(
        json!({"hidden_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2}),
    );
    write_model(&dir, &config, 2);
    // runs in bf16
    let m = load::<Cpu>(&dir, &LoadOptions::default(), &dev).unwrap();
    let logits = m.forward(&TokenBatch::single(&[1, 2, 3]).unwrap()).unwrap();
    assert_eq!(logits.dims(), [1, 3, 96]);
    // refuses NVFP4 with a message naming the file, the key and the fix
    let nvfp4 = LoadOptions {
        precision: Some(Precision::Nvfp4),
        ..LoadOptions::default()
    };
    let e = load::<Cpu>(&dir, &nvfp4, &dev).unwrap_err();
    println!("{e}");
    assert!(matches!(e, ModelError::Precision { .. }));
    assert_err(
        e,
        &[
            "config.json",
            "hidden_size is 40",
            "multiple of 16",
            "NVFP4",
            "bf16",
        ],
    );
    // intermediate_size too
    let dir2 = tmp.path().join("i40");
    write_model(&dir2, &small_config(json!({"intermediate_size": 40})), 3);
    assert_err(
        load::<Cpu>(&dir2, &nvfp4, &dev).unwrap_err(),
        &["intermediate_size is 40", "down_proj"],
    );
}

#[test]
fn a_quantized_checkpoint_runs_only_as_itself_or_its_twin() {
    let dir = common::repo().join("tests/fixtures/compressed-tensors/qwen2_tied/nvfp4");
    let opts = LoadOptions {
        precision: Some(Precision::Nf4),
        ..LoadOptions::default()
    };
    let e = load::<Cpu>(&dir, &opts, &Default::default()).unwrap_err();
    assert_err(e, &["config.json", "nvfp4", "nf4"]);
}

/// Rewrites one tensor's bytes in a safetensors file.
fn patch_tensor(path: &Path, name: &str, patch: impl Fn(&mut Vec<u8>)) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let mut data = v.data().to_vec();
            if n == name {
                patch(&mut data);
            }
            (n, v.dtype(), v.shape().to_vec(), data)
        })
        .collect();
    assert!(owned.iter().any(|t| t.0 == name), "no tensor {name}");
    let views: Vec<_> = owned
        .iter()
        .map(|(n, d, s, b)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn non_finite_weights_are_refused_with_tensor_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Default::default();
    let dir = tmp.path().join("m");
    let config = small_config(json!({}));
    let mut tensors = write_model(&dir, &config, 3);
    load::<Cpu>(&dir, &LoadOptions::default(), &dev).unwrap();
    let nvfp4 = LoadOptions {
        precision: Some(Precision::Nvfp4),
        ..LoadOptions::default()
    };
    // NaN in a linear (dense and quantized at load), +inf in the embeddings, -inf in a norm
    let cases = [
        ("model.layers.1.mlp.up_proj.weight", 17, f32::NAN),
        ("model.embed_tokens.weight", 5, f32::INFINITY),
        (
            "model.layers.0.input_layernorm.weight",
            3,
            f32::NEG_INFINITY,
        ),
    ];
    for (name, index, value) in cases {
        let t = tensors.iter_mut().find(|t| t.0 == name).unwrap();
        let old = t.1[index];
        t.1[index] = value;
        common::write_safetensors(&dir.join("model.safetensors"), &tensors);
        for opts in [&LoadOptions::default(), &nvfp4] {
            let e = load::<Cpu>(&dir, opts, &dev).unwrap_err();
            assert!(matches!(e, ModelError::NonFinite { .. }), "{e}");
            assert_err(
                e,
                &[
                    name,
                    "model.safetensors",
                    &format!("index {index}"),
                    &format!("{value}"),
                ],
            );
        }
        let t = tensors.iter_mut().find(|t| t.0 == name).unwrap();
        t.1[index] = old;
    }
    common::write_safetensors(&dir.join("model.safetensors"), &tensors);

    // a quantized checkpoint: a NaN block scale (E4M3 0x7f) and an infinite global scale
    let q = tmp.path().join("q");
    qerl_format::checkpoint::quantize_checkpoint(
        &dir,
        &q,
        qerl_format::QuantFormat::Nvfp4,
        &mut |_| {},
    )
    .unwrap();
    load::<Cpu>(&q, &LoadOptions::default(), &dev).unwrap();
    let module = "model.layers.1.self_attn.k_proj";
    let file = q.join("model.safetensors");
    patch_tensor(&file, &format!("{module}.weight_scale"), |b| b[2] = 0x7f);
    assert_err(
        load::<Cpu>(&q, &LoadOptions::default(), &dev).unwrap_err(),
        &[
            module,
            "weight_scale",
            "NaN",
            "block 2",
            "model.safetensors",
        ],
    );
    patch_tensor(&file, &format!("{module}.weight_scale"), |b| b[2] = 0x30);
    load::<Cpu>(&q, &LoadOptions::default(), &dev).unwrap();
    patch_tensor(&file, &format!("{module}.weight_global_scale"), |b| {
        b.copy_from_slice(&f32::INFINITY.to_le_bytes())
    });
    assert_err(
        load::<Cpu>(&q, &LoadOptions::default(), &dev).unwrap_err(),
        &[module, "weight_global_scale", "inf", "model.safetensors"],
    );
}
