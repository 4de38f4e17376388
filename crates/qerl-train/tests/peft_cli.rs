//! Adapters with trained norms in PEFT's format, both ways, through `qerl score --adapter`:
//! adapters written by PEFT itself (tests/fixtures/peft, made by tools/make_peft_fixture.py)
//! give PEFT's log-probs; norms in an adapter act exactly as the same norms in the model; a
//! NaN-filled norm changes the result (the norms are used); an adapter qerl writes scores as
//! the model it was written from, in the new layout and in the old one (`norms.safetensors`),
//! and a checkpoint of the old layout resumes.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use burn::backend::Autodiff;
use qerl_model::{load, LoadOptions, LoraConfig, LoraSpec, Tokenizer};
use qerl_rl::reward::RewardSet;
use qerl_rl::TrainConfig;
use qerl_train::peft::{self, AdapterMeta, HostTensor};
use qerl_train::{run, RunOptions, TrainSetup, Trainer};
use safetensors::Dtype;
use serde_json::{json, Value};

use common::{examples, root, Digits};

type Cpu = qerl_nn::backends::Cpu;

fn tokenizer() -> PathBuf {
    root().join("tests/fixtures/tokenizers/tiny/tokenizer.json")
}

fn fixture_model(arch: &str) -> PathBuf {
    root().join(format!("tests/fixtures/compressed-tensors/{arch}/bf16"))
}

/// `qerl score --json` of `text`: (token ids, every position's log-prob of its token after
/// the first) or the error output.
fn score(model: &Path, adapter: Option<&Path>, text: &str) -> Result<(Vec<u32>, Vec<f64>), String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_qerl"));
    cmd.args(["score", "--json", "--top-k", "1", "--text", text]);
    cmd.arg("--model")
        .arg(model)
        .arg("--tokenizer")
        .arg(tokenizer());
    if let Some(a) = adapter {
        cmd.arg("--adapter").arg(a);
    }
    let out = cmd.output().unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let positions = doc["positions"].as_array().unwrap();
    let ids = positions
        .iter()
        .map(|p| p["id"].as_u64().unwrap() as u32)
        .collect();
    // NaN prints as null
    let lps = positions[1..]
        .iter()
        .map(|p| p["logprob"].as_f64().unwrap_or(f64::NAN))
        .collect();
    Ok((ids, lps))
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Raw tensors of a safetensors file: name -> (dtype, shape, bytes).
type Raw = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn read_raw(path: &Path) -> Raw {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn write_raw(path: &Path, tensors: &Raw) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn f32_raw(values: &[f32]) -> (Dtype, Vec<usize>, Vec<u8>) {
    (
        Dtype::F32,
        vec![values.len()],
        values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    )
}

#[test]
fn peft_written_adapters_give_peft_logprobs() {
    for name in ["qwen2_tied_norms", "llama_untied_rslora"] {
        let dir = root().join("tests/fixtures/peft").join(name);
        let reference: Value =
            serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
        let base = root().join(reference["base"].as_str().unwrap());
        for t in reference["texts"].as_array().unwrap() {
            let (ids, lps) = score(&base, Some(&dir), t["text"].as_str().unwrap()).unwrap();
            let want_ids: Vec<u32> = serde_json::from_value(t["ids"].clone()).unwrap();
            let want: Vec<f64> = serde_json::from_value(t["logprobs"].clone()).unwrap();
            assert_eq!(ids, want_ids, "{name}: tokenization");
            let d = max_diff(&lps, &want);
            println!("{name}: max |log-prob - PEFT's| = {d:.2e}");
            assert!(d < 1e-4, "{name}: {d}");
        }
    }
}

/// The LoRA of the qwen2 PEFT fixture plus norms with values bf16 holds exactly, as
/// `modules_to_save` in an adapter and, for comparison, in a copy of the model.
#[test]
fn norms_in_the_adapter_act_as_norms_in_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let peft_dir = root().join("tests/fixtures/peft/qwen2_tied_norms");
    let lora: Raw = read_raw(&peft_dir.join("adapter_model.safetensors"))
        .into_iter()
        .filter(|(n, _)| n.contains(".lora_"))
        .collect();
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(peft_dir.join("adapter_config.json")).unwrap())
            .unwrap();
    let write_adapter = |dir: &Path, tensors: &Raw, config: &Value| {
        std::fs::create_dir_all(dir).unwrap();
        write_raw(&dir.join("adapter_model.safetensors"), tensors);
        std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    };
    config["modules_to_save"] = Value::Null;
    let lora_only = tmp.path().join("lora-only");
    write_adapter(&lora_only, &lora, &config);

    let base = fixture_model("qwen2_tied");
    let mut model = read_raw(&base.join("model.safetensors"));
    let mut with_norms = lora.clone();
    let mut nan_norms = lora.clone();
    let mut k = 0;
    for (name, (dtype, shape, bytes)) in model.iter_mut() {
        if !name.ends_with("norm.weight") {
            continue;
        }
        assert_eq!(*dtype, Dtype::BF16);
        let values: Vec<f32> = (0..shape[0])
            .map(|i| 1.0 + ((i + k) % 16) as f32 / 16.0)
            .collect();
        k += 5;
        // bf16 is the top half of an f32: exact for these values
        *bytes = values
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        with_norms.insert(format!("base_model.model.{name}"), f32_raw(&values));
        nan_norms.insert(
            format!("base_model.model.{name}"),
            f32_raw(&vec![f32::NAN; shape[0]]),
        );
    }
    assert_eq!(k, 5 * 5, "2 layers x 2 norms + the final norm");
    let model_dir = tmp.path().join("model");
    std::fs::create_dir_all(&model_dir).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(base.join(f), model_dir.join(f)).unwrap();
    }
    write_raw(&model_dir.join("model.safetensors"), &model);
    config["modules_to_save"] =
        json!(["input_layernorm", "post_attention_layernorm", "model.norm"]);
    let adapter = tmp.path().join("with-norms");
    write_adapter(&adapter, &with_norms, &config);
    let nan = tmp.path().join("nan-norms");
    write_adapter(&nan, &nan_norms, &config);

    let text = "What is two plus two? Two plus two is four.";
    let (_, direct) = score(&model_dir, Some(&lora_only), text).unwrap();
    let (_, via_adapter) = score(&base, Some(&adapter), text).unwrap();
    let d = max_diff(&direct, &via_adapter);
    assert!(d < 1e-6, "norms in the adapter vs in the model: {d}");
    let (_, lora_alone) = score(&base, Some(&lora_only), text).unwrap();
    assert!(
        max_diff(&lora_alone, &via_adapter) > 1e-3,
        "the norms matter"
    );
    // NaN norms: NaN log-probs, or a refusal; never the log-probs of other norms
    match score(&base, Some(&nan), text) {
        Ok((_, lps)) => assert!(lps.iter().all(|l| l.is_nan()), "{lps:?}"),
        Err(e) => assert!(e.contains("norm"), "{e}"),
    }
}

fn random(rng: &mut u64, n: usize, scale: f32, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            offset + scale * (((*rng >> 40) as f32 / (1u64 << 24) as f32) - 0.5)
        })
        .collect()
}

/// Moves the norms of a qerl adapter into `norms.safetensors` (checkpoint names) and drops
/// `modules_to_save`: the layout qerl wrote before.
fn to_old_layout(dir: &Path) {
    let file = dir.join("adapter_model.safetensors");
    let (mut lora, mut norms) = (Raw::new(), Raw::new());
    for (n, t) in read_raw(&file) {
        if n.contains(".lora_") {
            lora.insert(n, t);
        } else {
            norms.insert(n.strip_prefix("base_model.model.").unwrap().to_string(), t);
        }
    }
    assert_eq!(norms.len(), 5);
    write_raw(&file, &lora);
    write_raw(&dir.join("norms.safetensors"), &norms);
    let path = dir.join("adapter_config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("modules_to_save");
    std::fs::write(&path, config.to_string()).unwrap();
}

#[test]
fn a_qerl_written_adapter_round_trips() {
    let base = fixture_model("llama_untied");
    let options = LoadOptions {
        lora: Some(LoraSpec {
            config: LoraConfig {
                rank: 4,
                alpha: 8.0,
            },
            targets: vec!["q_proj".into(), "up_proj".into()],
        }),
        trainable_norms: true,
        ..LoadOptions::default()
    };
    let mut model = load::<Cpu>(&base, &options, &Default::default()).unwrap();
    let mut rng = 5u64;
    let lora: BTreeMap<String, HostTensor> = peft::lora_tensors(&model)
        .into_iter()
        .map(|(k, (t, _))| {
            let values = random(&mut rng, t.values.len(), 0.5, 0.0);
            (
                k,
                HostTensor {
                    shape: t.shape,
                    values,
                },
            )
        })
        .collect();
    let norms: BTreeMap<String, HostTensor> = peft::norm_tensors(&model)
        .into_iter()
        .map(|(k, (t, _))| {
            let values = random(&mut rng, t.values.len(), 0.6, 1.0);
            (
                k,
                HostTensor {
                    shape: t.shape,
                    values,
                },
            )
        })
        .collect();
    peft::load_trained(&mut model, &lora, Some(&norms), &BTreeMap::new()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("adapter");
    std::fs::create_dir_all(&dir).unwrap();
    let meta = AdapterMeta {
        rank: 4,
        alpha: 8.0,
        targets: vec!["q_proj".into(), "up_proj".into()],
        base_model: base.display().to_string(),
        norms: true,
    };
    peft::write_adapter(&model, &meta, &dir).unwrap();
    let config: Value =
        serde_json::from_slice(&std::fs::read(dir.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        config["modules_to_save"],
        json!(["input_layernorm", "post_attention_layernorm", "model.norm"])
    );
    let saved = peft::read_safetensors(&dir.join("adapter_model.safetensors")).unwrap();
    assert_eq!(
        saved["base_model.model.model.layers.1.post_attention_layernorm.weight"],
        norms["model.layers.1.post_attention_layernorm.weight"]
    );

    let text = "Tom has 3 apples and buys 4 more.";
    let tok = Tokenizer::from_file(&tokenizer()).unwrap();
    let ids = tok.encode(text, true).unwrap();
    let want: Vec<f64> = qerl_model::score(&model, &ids, 1)
        .unwrap()
        .iter()
        .skip(1)
        .map(|s| s.logprob.unwrap() as f64)
        .collect();
    let (_, got) = score(&base, Some(&dir), text).unwrap();
    let d = max_diff(&got, &want);
    assert!(
        d < 1e-5,
        "qerl-written adapter vs the model it was written from: {d}"
    );
    let (_, without) = score(&base, None, text).unwrap();
    assert!(max_diff(&without, &want) > 1e-3);

    let (lora_new, norms_new) = peft::read_trained(&dir, true).unwrap();
    to_old_layout(&dir);
    let (got_old, _) = (score(&base, Some(&dir), text).unwrap().1, ());
    assert_eq!(got_old, got, "the old layout scores the same");
    let (lora_old, norms_old) = peft::read_trained(&dir, true).unwrap();
    assert_eq!((lora_new, norms_new.clone()), (lora_old, norms_old));
    assert_eq!(norms_new.unwrap(), norms);
}

fn train_config(out: &Path) -> TrainConfig {
    let text = format!(
        r#"
[model]
dir = "{}"
precision = "nvfp4"
[lora]
rank = 4
alpha = 8.0
train_norms = true
[data]
dataset = "gsm8k"
max_prompt_tokens = 32
[rollout]
group_size = 4
batch_prompts = 2
temperature = 1.0
top_p = 1.0
max_completion_tokens = 4
[loss]
kind = "grpo"
beta = 0.0
[optim]
lr = 3e-2
warmup_ratio = 0.0
lr_decay = "constant"
weight_decay = 0.0
grad_clip = 1.0
[aqn]
schedule = "none"
[train]
steps = 3
seed = 3
output_dir = "{}"
ckpt_interval = 0
"#,
        root()
            .join("tests/fixtures/compressed-tensors/qwen2_tied/nvfp4")
            .display(),
        out.display()
    );
    let c = TrainConfig::from_toml_with_overrides(&text, "test", &[]).unwrap();
    c.validate().unwrap();
    c.resolved()
}

fn setup(config: TrainConfig) -> TrainSetup {
    TrainSetup {
        config,
        tokenizer: Tokenizer::from_file(&tokenizer()).unwrap(),
        rewards: RewardSet::new().with(Digits, 1.0),
        examples: examples(&["count", "write", "go", "now"], |_| "0"),
        chat: false,
    }
}

/// A checkpoint in the old layout resumes to the same state as the same checkpoint in the
/// new one, and the run goes on to the same adapter.
#[test]
fn a_checkpoint_of_the_old_layout_resumes() {
    type Ad = Autodiff<Cpu>;
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut t = Trainer::<Ad>::new(setup(train_config(a.path())), &Default::default()).unwrap();
    let options = RunOptions {
        max_steps: Some(2),
        ..Default::default()
    };
    let half = run(&mut t, &options).unwrap();
    drop(t);
    let ckpt = half.checkpoint.unwrap();
    let name = ckpt.file_name().unwrap();
    // the same checkpoint, old layout, in run directory b
    let old = b.path().join(name);
    std::fs::create_dir_all(&old).unwrap();
    for f in std::fs::read_dir(&ckpt).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, old.join(f.file_name().unwrap())).unwrap();
    }
    to_old_layout(&old);
    std::fs::write(
        b.path().join("latest"),
        format!("{}\n", name.to_string_lossy()),
    )
    .unwrap();

    let ends: Vec<PathBuf> = [a.path(), b.path()]
        .into_iter()
        .map(|dir| {
            let c = train_config(dir);
            let mut t = Trainer::<Ad>::resume(setup(c), dir, &Default::default()).unwrap();
            assert_eq!(t.state.step, 2);
            run(&mut t, &RunOptions::default())
                .unwrap()
                .checkpoint
                .unwrap()
        })
        .collect();
    assert_eq!(
        std::fs::read(ends[0].join("adapter_model.safetensors")).unwrap(),
        std::fs::read(ends[1].join("adapter_model.safetensors")).unwrap(),
        "old and new layouts resume to the same run"
    );
    assert!(
        !ends[1].join("norms.safetensors").exists(),
        "new checkpoints use the new layout"
    );
}
