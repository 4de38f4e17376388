//! PEFT adapters with trained RMSNorms (`modules_to_save`), per-module ranks and alphas
//! (`rank_pattern`, `alpha_pattern`) and rsLoRA: loading one gives the same logits as a model
//! whose weights have the LoRA updates merged and the norms replaced; what qerl cannot hold is
//! refused naming the key; the norms file of older qerl checkpoints is applied too.

mod common;

use std::path::{Path, PathBuf};

use common::{host, max_abs_diff, Cpu};
use qerl_model::{load, load_with_adapter, Adapter, CausalLm, LoadOptions, TokenBatch};
use serde_json::{json, Value};

type Tensors = Vec<(String, Vec<f32>, Vec<usize>)>;

const PREFIX: &str = "base_model.model.";

/// A LoRA on `module` of rank `r`, scaled by `scale`, with random A and B.
struct Lora {
    module: String,
    r: usize,
    scale: f32,
}

struct Case {
    _tmp: tempfile::TempDir,
    base: PathBuf,
    adapter: PathBuf,
    merged: PathBuf,
}

fn rand(rng: &mut qerl_model::sampling::Rng, n: usize, scale: f32, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|_| offset + scale * (rng.next_open01() - 0.5))
        .collect()
}

/// Writes a random base model, an adapter (`config`, the LoRAs, and `norms`: module name ->
/// tensor name in the adapter file) and the merged model the adapter should equal.
fn case(config: Value, loras: &[Lora], norms: &[(&str, String)]) -> Case {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    let model_config = common::small_config(json!({}));
    let tensors = common::write_model(&base, &model_config, 7);
    let mut merged = tensors.clone();
    let mut adapter_tensors: Tensors = Vec::new();
    let mut rng = qerl_model::sampling::Rng::new(11);
    for l in loras {
        let w = merged
            .iter_mut()
            .find(|t| t.0 == format!("{}.weight", l.module))
            .unwrap();
        let (d_out, d_in, r) = (w.2[0], w.2[1], l.r);
        let (a, b) = (
            rand(&mut rng, r * d_in, 1.0, 0.0),
            rand(&mut rng, d_out * r, 1.0, 0.0),
        );
        for o in 0..d_out {
            for i in 0..d_in {
                let ba: f32 = (0..r).map(|k| b[o * r + k] * a[k * d_in + i]).sum();
                w.1[o * d_in + i] += l.scale * ba;
            }
        }
        adapter_tensors.push((
            format!("{PREFIX}{}.lora_A.weight", l.module),
            a,
            vec![r, d_in],
        ));
        adapter_tensors.push((
            format!("{PREFIX}{}.lora_B.weight", l.module),
            b,
            vec![d_out, r],
        ));
    }
    for (module, tensor) in norms {
        let w = merged
            .iter_mut()
            .find(|t| t.0 == format!("{module}.weight"))
            .unwrap();
        w.1 = rand(&mut rng, w.1.len(), 1.0, 1.0);
        adapter_tensors.push((tensor.clone(), w.1.clone(), w.2.clone()));
    }
    let adapter = tmp.path().join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    common::write_safetensors(&adapter.join("adapter_model.safetensors"), &adapter_tensors);
    std::fs::write(adapter.join("adapter_config.json"), config.to_string()).unwrap();
    let merged_dir = tmp.path().join("merged");
    common::write_model(&merged_dir, &model_config, 7);
    common::write_safetensors(&merged_dir.join("model.safetensors"), &merged);
    Case {
        _tmp: tmp,
        base,
        adapter,
        merged: merged_dir,
    }
}

fn logits(m: &CausalLm<Cpu>) -> Vec<f32> {
    let batch = TokenBatch::single(&[3, 1, 4, 1, 5, 9, 2, 6]).unwrap();
    host(m.forward(&batch).unwrap())
}

fn with_adapter(base: &Path, adapter: &Path) -> qerl_model::Result<CausalLm<Cpu>> {
    let a = Adapter::open(adapter)?;
    load_with_adapter::<Cpu>(base, &LoadOptions::default(), Some(&a), &Default::default())
}

fn plain(dir: &Path) -> CausalLm<Cpu> {
    load::<Cpu>(dir, &LoadOptions::default(), &Default::default()).unwrap()
}

fn norm_tensor(module: &str) -> String {
    format!("{PREFIX}{module}.weight")
}

/// Every norm of the 2-layer test model.
fn all_norms() -> Vec<&'static str> {
    vec![
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
    ]
}

#[test]
fn modules_to_save_and_patterns_equal_the_merged_model() {
    // `norm` names every RMSNorm (PEFT matches by name suffix); one is saved under the
    // wrapper's longer name. down_proj gets r = 2 from rank_pattern, q_proj of layer 1 alpha
    // 16 from alpha_pattern (first matching key wins: the layer-1 key comes first).
    let config = json!({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none",
        "target_modules": ["q_proj", "down_proj"],
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {"model.layers.1.self_attn.q_proj": 16, "q_proj": 4},
        "modules_to_save": ["norm"],
    });
    let loras = [
        ("model.layers.0.self_attn.q_proj", 4, 4.0 / 4.0),
        ("model.layers.1.self_attn.q_proj", 4, 16.0 / 4.0),
        ("model.layers.0.mlp.down_proj", 2, 8.0 / 2.0),
        ("model.layers.1.mlp.down_proj", 2, 8.0 / 2.0),
    ]
    .map(|(m, r, scale)| Lora {
        module: m.into(),
        r,
        scale,
    });
    let mut norms: Vec<(&str, String)> = all_norms()
        .into_iter()
        .map(|m| (m, norm_tensor(m)))
        .collect();
    norms[1].1 =
        format!("{PREFIX}model.layers.0.post_attention_layernorm.modules_to_save.default.weight");
    let c = case(config, &loras, &norms);
    let adapter = Adapter::open(&c.adapter).unwrap();
    assert!(adapter.has_norms());
    assert_eq!(
        adapter
            .lora_config("model.layers.0.mlp.down_proj")
            .unwrap()
            .rank,
        2
    );
    let got = logits(&with_adapter(&c.base, &c.adapter).unwrap());
    let want = logits(&plain(&c.merged));
    let d = max_abs_diff(&got, &want);
    assert!(d < 1e-4, "adapter vs merged: {d}");
    assert!(max_abs_diff(&got, &logits(&plain(&c.base))) > 1e-2);
}

#[test]
fn rslora_and_the_final_norm_alone() {
    let config = json!({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": true,
        "target_modules": ["v_proj"], "modules_to_save": ["model.norm"],
    });
    let loras = [0, 1].map(|i| Lora {
        module: format!("model.layers.{i}.self_attn.v_proj"),
        r: 4,
        scale: 8.0 / 2.0,
    });
    let c = case(config, &loras, &[("model.norm", norm_tensor("model.norm"))]);
    let d = max_abs_diff(
        &logits(&with_adapter(&c.base, &c.adapter).unwrap()),
        &logits(&plain(&c.merged)),
    );
    assert!(d < 1e-4, "rsLoRA adapter vs merged: {d}");
}

/// A checkpoint of an earlier qerl: LoRA in the adapter, every norm in `norms.safetensors`
/// under checkpoint names.
#[test]
fn the_norms_file_of_older_checkpoints_is_applied() {
    let config =
        json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]});
    let loras = [0, 1].map(|i| Lora {
        module: format!("model.layers.{i}.self_attn.q_proj"),
        r: 4,
        scale: 2.0,
    });
    let norms: Vec<(&str, String)> = all_norms()
        .into_iter()
        .map(|m| (m, norm_tensor(m)))
        .collect();
    let c = case(config, &loras, &norms);
    // move the norms out of the adapter file into norms.safetensors
    let file = c.adapter.join("adapter_model.safetensors");
    let (mut lora, mut legacy): (Tensors, Tensors) = (Vec::new(), Vec::new());
    for t in read(&file) {
        match t.0.strip_prefix(PREFIX).filter(|n| !n.contains("lora_")) {
            Some(name) => legacy.push((name.to_string(), t.1, t.2)),
            None => lora.push(t),
        }
    }
    assert_eq!(legacy.len(), 5);
    common::write_safetensors(&file, &lora);
    common::write_safetensors(&c.adapter.join("norms.safetensors"), &legacy);
    let d = max_abs_diff(
        &logits(&with_adapter(&c.base, &c.adapter).unwrap()),
        &logits(&plain(&c.merged)),
    );
    assert!(d < 1e-4, "old layout vs merged: {d}");

    // deleted norms of a checkpoint whose state says they were trained: refused
    std::fs::remove_file(c.adapter.join("norms.safetensors")).unwrap();
    std::fs::write(
        c.adapter.join("trainer_state.json"),
        json!({"step": 1, "trained_norms": true}).to_string(),
    )
    .unwrap();
    let e = Adapter::open(&c.adapter).unwrap_err().to_string();
    assert!(
        e.contains("trainer_state.json") && e.contains("trained_norms"),
        "{e}"
    );

    // a NaN-filled norm is used: the logits become NaN
    let nan: Tensors = legacy
        .iter()
        .map(|(n, v, s)| (n.clone(), vec![f32::NAN; v.len()], s.clone()))
        .collect();
    common::write_safetensors(&c.adapter.join("norms.safetensors"), &nan);
    match with_adapter(&c.base, &c.adapter) {
        Ok(m) => assert!(logits(&m).iter().all(|x| x.is_nan())),
        Err(e) => assert!(e.to_string().contains("norm"), "{e}"),
    }
}

fn read(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let values = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (n, values, v.shape().to_vec())
        })
        .collect()
}

/// The error of loading an adapter with `config` and the norm weights of `norms`.
fn error(config: Value, norms: &[(&str, String)]) -> String {
    let c = case(config, &[], norms);
    match with_adapter(&c.base, &c.adapter) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn what_qerl_cannot_hold_is_refused_naming_the_key() {
    // no LoRA weights and no targets: only the key under test is wrong
    let base = || json!({"peft_type": "LORA", "r": 4});
    let with = |key: &str, v: Value| {
        let mut c = base();
        c[key] = v;
        c
    };
    let all: Vec<(&str, String)> = all_norms()
        .into_iter()
        .map(|m| (m, norm_tensor(m)))
        .collect();
    // (adapter config, norm weights in the file, what the error must name)
    type Refusal<'a> = (Value, Vec<(&'a str, String)>, Vec<&'a str>);
    let cases: Vec<Refusal> = vec![
        (
            with("modules_to_save", json!(["lm_head"])),
            vec![],
            vec!["modules_to_save", "`lm_head`"],
        ),
        (
            with("modules_to_save", json!(["embed_tokens", "norm"])),
            all.clone(),
            vec!["modules_to_save", "model.embed_tokens"],
        ),
        (
            with("modules_to_save", json!(["mlp"])),
            vec![],
            vec!["modules_to_save", "model.layers.0.mlp"],
        ),
        (
            with("modules_to_save", json!(["q_norm"])),
            vec![],
            vec!["modules_to_save", "`q_norm`", "matches no module"],
        ),
        (
            with("modules_to_save", json!("norm")),
            vec![],
            vec!["modules_to_save", "not a list"],
        ),
        // a listed module without its weight
        (
            with("modules_to_save", json!(["input_layernorm"])),
            vec![(
                "model.layers.0.input_layernorm",
                norm_tensor("model.layers.0.input_layernorm"),
            )],
            vec![
                "base_model.model.model.layers.1.input_layernorm.weight",
                "input_layernorm",
            ],
        ),
        // a saved weight that modules_to_save does not name
        (
            base(),
            vec![("model.norm", norm_tensor("model.norm"))],
            vec!["base_model.model.model.norm.weight", "modules_to_save"],
        ),
        (
            with("peft_type", json!("IA3")),
            vec![],
            vec!["adapter_config.json", "peft_type"],
        ),
        (
            with("use_dora", json!(true)),
            vec![],
            vec!["adapter_config.json", "use_dora"],
        ),
        (with("lora_bias", json!(true)), vec![], vec!["lora_bias"]),
        (
            with("layer_replication", json!([[0, 1]])),
            vec![],
            vec!["layer_replication"],
        ),
        (
            with("rank_pattern", json!({"q_proj": 0})),
            vec![],
            vec!["rank_pattern.q_proj"],
        ),
        (
            with("alpha_pattern", json!({"q_proj(": 4})),
            vec![],
            vec!["alpha_pattern.q_proj("],
        ),
    ];
    for (config, norms, needles) in cases {
        let e = error(config.clone(), &norms);
        for n in needles {
            assert!(e.contains(n), "{config}: `{n}` not in: {e}");
        }
    }

    // a norm weight of the wrong shape names the tensor
    let c = case(with("modules_to_save", json!(["model.norm"])), &[], &[]);
    common::write_safetensors(
        &c.adapter.join("adapter_model.safetensors"),
        &[(norm_tensor("model.norm"), vec![1.0; 7], vec![7])],
    );
    let e = with_adapter(&c.base, &c.adapter).unwrap_err().to_string();
    assert!(
        e.contains("base_model.model.model.norm.weight") && e.contains("[7]"),
        "{e}"
    );

    // norms both as modules_to_save and in an old-style norms file: ambiguous
    let c = case(
        with("modules_to_save", json!(["model.norm"])),
        &[],
        &[("model.norm", norm_tensor("model.norm"))],
    );
    common::write_safetensors(
        &c.adapter.join("norms.safetensors"),
        &[("model.norm.weight".into(), vec![1.0; 32], vec![32])],
    );
    let e = Adapter::open(&c.adapter).unwrap_err().to_string();
    assert!(
        e.contains("norms.safetensors") && e.contains("ambiguous"),
        "{e}"
    );

    // a pickled adapter is named, not read
    std::fs::rename(
        c.adapter.join("adapter_model.safetensors"),
        c.adapter.join("adapter_model.bin"),
    )
    .unwrap();
    let e = Adapter::open(&c.adapter).unwrap_err().to_string();
    assert!(
        e.contains("adapter_model.bin") && e.contains("pickle"),
        "{e}"
    );
}
