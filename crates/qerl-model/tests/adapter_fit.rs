//! An adapter must fit the model it is loaded onto, checked before any LoRA matrix is
//! allocated: its `target_modules` and `layers_to_transform` select exactly the modules it has
//! weights for, on layers the model has, with the shapes its rank gives. A misspelled target or
//! an adapter of another model is refused naming the file and the key, not applied by whatever
//! tensors happen to match.

mod common;

use std::path::Path;

use common::{small_config, write_model, write_safetensors, Cpu};
use qerl_model::{load_with_adapter, Adapter, LoadOptions};
use serde_json::{json, Value};

/// A 2-layer model in `dir/base` and an adapter in `dir/adapter` with weights of rank 4 for
/// `modules` on `layers` and the config `config`.
fn setup(dir: &Path, layers: &[usize], modules: &[(&str, usize, usize)], config: Value) {
    write_model(&dir.join("base"), &small_config(json!({})), 7);
    let r = 4;
    let mut lora = Vec::new();
    for layer in layers {
        for (module, d_out, d_in) in modules {
            let name = format!("base_model.model.model.layers.{layer}.{module}");
            lora.push((
                format!("{name}.lora_A.weight"),
                vec![0.01; r * d_in],
                vec![r, *d_in],
            ));
            lora.push((
                format!("{name}.lora_B.weight"),
                vec![0.01; d_out * r],
                vec![*d_out, r],
            ));
        }
    }
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    write_safetensors(&adapter.join("adapter_model.safetensors"), &lora);
    std::fs::write(adapter.join("adapter_config.json"), config.to_string()).unwrap();
}

fn load(dir: &Path) -> Result<(), String> {
    let adapter = Adapter::open(&dir.join("adapter")).map_err(|e| e.to_string())?;
    load_with_adapter::<Cpu>(
        &dir.join("base"),
        &LoadOptions::default(),
        Some(&adapter),
        &Default::default(),
    )
    .map(|_| ())
    .map_err(|e| e.to_string())
}

const Q: (&str, usize, usize) = ("self_attn.q_proj", 32, 32);
const DOWN: (&str, usize, usize) = ("mlp.down_proj", 32, 48);

fn cfg(extra: Value) -> Value {
    let mut c = json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none",
                       "target_modules": ["q_proj", "down_proj"]});
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

#[test]
fn a_fitting_adapter_loads() {
    let tmp = tempfile::tempdir().unwrap();
    setup(tmp.path(), &[0, 1], &[Q, DOWN], cfg(json!({})));
    load(tmp.path()).unwrap();
    // layers_to_transform that selects exactly the layers with weights
    setup(
        tmp.path(),
        &[1],
        &[Q, DOWN],
        cfg(json!({"layers_to_transform": [1]})),
    );
    load(tmp.path()).unwrap();
}

#[test]
fn a_misspelled_target_is_named_with_the_valid_names() {
    let tmp = tempfile::tempdir().unwrap();
    setup(
        tmp.path(),
        &[0, 1],
        &[Q],
        cfg(json!({"target_modules": ["q_prj"]})),
    );
    let e = load(tmp.path()).unwrap_err();
    for w in [
        "adapter_config.json",
        "target_modules",
        "q_prj",
        "q_proj, k_proj",
    ] {
        assert!(e.contains(w), "`{w}` not in: {e}");
    }
}

#[test]
fn weights_the_targets_do_not_select_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // down_proj weights, but only q_proj targeted
    setup(
        tmp.path(),
        &[0, 1],
        &[Q, DOWN],
        cfg(json!({"target_modules": ["q_proj"]})),
    );
    let e = load(tmp.path()).unwrap_err();
    assert!(
        e.contains("target_modules") && e.contains("mlp.down_proj"),
        "{e}"
    );
    // layer 1 has weights, layers_to_transform names layer 0 only
    setup(
        tmp.path(),
        &[0, 1],
        &[Q, DOWN],
        cfg(json!({"layers_to_transform": [0]})),
    );
    let e = load(tmp.path()).unwrap_err();
    assert!(
        e.contains("layers_to_transform") && e.contains("model.layers.1"),
        "{e}"
    );
    // a layer the model does not have
    setup(
        tmp.path(),
        &[0, 1],
        &[Q, DOWN],
        cfg(json!({"layers_to_transform": [0, 1, 5]})),
    );
    let e = load(tmp.path()).unwrap_err();
    assert!(
        e.contains("layers_to_transform") && e.contains("2 layers"),
        "{e}"
    );
}

#[test]
fn an_adapter_of_another_model_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // made for a 1-layer model: the targets select layer 1 too, which has no weights
    setup(tmp.path(), &[0], &[Q, DOWN], cfg(json!({})));
    let e = load(tmp.path()).unwrap_err();
    assert!(
        e.contains("model.layers.1") && e.contains("another model"),
        "{e}"
    );
    // made for a deeper model: weights of a layer this one does not have
    setup(tmp.path(), &[0, 1, 2], &[Q, DOWN], cfg(json!({})));
    let e = load(tmp.path()).unwrap_err();
    assert!(
        e.contains("model.layers.2") && e.contains("2 layers"),
        "{e}"
    );
}

#[test]
fn a_huge_rank_is_refused_before_anything_is_allocated() {
    let tmp = tempfile::tempdir().unwrap();
    setup(
        tmp.path(),
        &[0, 1],
        &[Q, DOWN],
        cfg(json!({"r": 1_000_000_000_000u64})),
    );
    let e = load(tmp.path()).unwrap_err();
    assert!(
        e.contains("lora_A.weight") && e.contains("1000000000000") && e.contains("adapter_model"),
        "{e}"
    );
}
