//! The training loop on the CPU with the tiny fixture models: the reward of a learnable task
//! rises, checkpoint + resume equals a straight run bit for bit, only LoRA (and trainable
//! norm) parameters change, and the saved PEFT adapter loads back into the same policy.

mod common;

use std::path::{Path, PathBuf};

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::Tensor;
use qerl_model::{load, load_with_adapter, Adapter, LoadOptions, TokenBatch, Tokenizer};
use qerl_rl::reward::{Reward, RewardError, RewardSet};
use qerl_rl::TrainConfig;
use qerl_train::{run, RunOptions, TrainSetup, Trainer};

use common::{examples, root, Digits};

type Cpu = qerl_nn::backends::Cpu;
type Ad = Autodiff<Cpu>;

fn model_dir(arch: &str, precision: &str) -> PathBuf {
    root().join(format!(
        "tests/fixtures/compressed-tensors/{arch}/{precision}"
    ))
}

/// A reward that fails on every completion containing `e`: must be scored 0 and counted.
struct Fragile;

impl Reward for Fragile {
    fn name(&self) -> &str {
        "fragile"
    }
    fn score(&self, completion: &str, _answer: &str) -> Result<f32, RewardError> {
        if completion.contains('e') {
            panic!("fragile reward hit an `e`");
        }
        Ok(0.0)
    }
}

fn config(out: &Path, sets: &[&str]) -> TrainConfig {
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
group_size = 8
batch_prompts = 2
temperature = 0.3
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
steps = 15
seed = 3
output_dir = "{}"
ckpt_interval = 0
"#,
        model_dir("qwen2_tied", "nvfp4").display(),
        out.display()
    );
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let c = TrainConfig::from_toml_with_overrides(&text, "test", &sets).unwrap();
    c.validate().unwrap();
    c.resolved()
}

fn setup(config: TrainConfig, rewards: RewardSet) -> TrainSetup {
    let tokenizer =
        Tokenizer::from_file(&root().join("tests/fixtures/tokenizers/tiny/tokenizer.json"))
            .unwrap();
    let examples = examples(&["count", "write", "go", "now", "say it"], |_| "0");
    TrainSetup {
        config,
        tokenizer,
        rewards,
        examples,
        chat: false,
    }
}

#[test]
fn reward_rises_on_a_learnable_task() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), &[]);
    let rewards = RewardSet::new().with(Digits, 1.0).with(Fragile, 0.0);
    let mut t = Trainer::<Ad>::new(setup(c, rewards), &Default::default()).unwrap();
    let out = run(&mut t, &RunOptions::default()).unwrap();
    let r: Vec<f32> = out.metrics.iter().map(|m| m.reward_mean).collect();
    println!("rewards per step: {r:?}");
    let failures: usize = out.metrics.iter().map(|m| m.reward_failures).sum();
    println!("failures of the fragile reward (scored 0): {failures}");
    assert!(
        failures > 0,
        "the fragile reward failed somewhere and the run went on"
    );
    let k = 5;
    let first = r[..k].iter().sum::<f32>() / k as f32;
    let last = r[r.len() - k..].iter().sum::<f32>() / k as f32;
    println!("mean reward: first {k} steps {first:.3}, last {k} steps {last:.3}");
    assert!(last > first + 0.15, "the reward rose: {first} -> {last}");
    assert!(out.plot_path.is_file() && out.metrics_path.is_file());
    assert_eq!(
        qerl_rl::metrics::read_jsonl(&out.metrics_path)
            .unwrap()
            .len(),
        15
    );
}

/// The adapter's weights (LoRA and, as `modules_to_save`, the trained norms) and config.
fn adapter_bytes(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    (
        std::fs::read(dir.join("adapter_model.safetensors")).unwrap(),
        std::fs::read(dir.join("adapter_config.json")).unwrap(),
    )
}

#[test]
fn resume_equals_a_straight_run() {
    // DAPO (dynamic sampling, overlong shaping), mu = 2, grad accumulation, AQN also in the
    // training forward, TIS: every piece of state a resume must restore.
    let sets = [
        "train.steps=4",
        "loss.kind=\"dapo\"",
        "loss.mu=2",
        "loss.overlong_buffer=2",
        "loss.tis_cap=2.0",
        "optim.grad_accum=2",
        "optim.warmup_ratio=0.25",
        "optim.lr_decay=\"cosine\"",
        "aqn.schedule=\"exponential\"",
        "aqn.num_stages=2",
        "aqn.rollouts_only=false",
        "rollout.group_size=4",
        "rollout.temperature=1.0",
    ];
    let rewards = || RewardSet::new().with(Digits, 1.0);
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ca = config(a.path(), &sets);
    let mut t = Trainer::<Ad>::new(setup(ca, rewards()), &Default::default()).unwrap();
    let straight = run(&mut t, &RunOptions::default()).unwrap();
    assert_eq!(straight.steps, 4);

    let cb = config(b.path(), &sets);
    let mut t = Trainer::<Ad>::new(setup(cb.clone(), rewards()), &Default::default()).unwrap();
    let half = run(
        &mut t,
        &RunOptions {
            max_steps: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(half.steps, 2);
    drop(t);
    let mut t = Trainer::<Ad>::resume(setup(cb, rewards()), b.path(), &Default::default()).unwrap();
    assert_eq!(t.state.step, 2);
    let rest = run(&mut t, &RunOptions::default()).unwrap();
    assert_eq!(rest.steps, 4);

    let (ckpt_a, ckpt_b) = (straight.checkpoint.unwrap(), rest.checkpoint.unwrap());
    assert_eq!(ckpt_a.file_name(), ckpt_b.file_name());
    assert_eq!(
        adapter_bytes(&ckpt_a),
        adapter_bytes(&ckpt_b),
        "bitwise equal adapters and norms"
    );
    let ma = qerl_rl::metrics::read_jsonl(&straight.metrics_path).unwrap();
    let mb = qerl_rl::metrics::read_jsonl(&rest.metrics_path).unwrap();
    assert_eq!(ma.len(), 4);
    assert_eq!(mb.len(), 4);
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(
            (x.step, x.reward_mean, x.loss),
            (y.step, y.reward_mean, y.loss)
        );
    }
    // B moved away from zero: the run trained something
    let st = qerl_train::peft::read_safetensors(&ckpt_a.join("adapter_model.safetensors")).unwrap();
    let b_max = st
        .iter()
        .filter(|(k, _)| k.ends_with("lora_B.weight"))
        .flat_map(|(_, t)| t.values.iter().map(|v| v.abs()))
        .fold(0f32, f32::max);
    assert!(b_max > 0.0);
}

fn logits<B: qerl_model::QerlBackend>(m: &qerl_model::CausalLm<B>, base: bool) -> Vec<f32> {
    let b = TokenBatch::single(&[5, 17, 300, 44, 9, 120]).unwrap();
    let l: Tensor<B, 3> = if base {
        m.forward_base(&b).unwrap()
    } else {
        m.forward(&b).unwrap()
    };
    l.into_data().iter::<f32>().collect()
}

fn frozen_weights_untouched(precision: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(
        tmp.path(),
        &[
            "train.steps=2",
            &format!("model.precision=\"{precision}\""),
            "lora.train_norms=false",
            "rollout.group_size=4",
        ],
    );
    let dir = c.model.dir.clone();
    let mut t = Trainer::<Ad>::new(
        setup(c, RewardSet::new().with(Digits, 1.0)),
        &Default::default(),
    )
    .unwrap();
    let out = run(&mut t, &RunOptions::default()).unwrap();
    assert!(out.metrics.iter().any(|m| m.grad_norm > 0.0));
    let trained = t.model().valid();
    let options = LoadOptions {
        precision: Some(precision.parse().unwrap()),
        ..LoadOptions::default()
    };
    let fresh = load::<Cpu>(&dir, &options, &Default::default()).unwrap();
    assert_eq!(
        logits(&trained, true),
        logits(&fresh, false),
        "base model unchanged"
    );
    assert_ne!(
        logits(&trained, false),
        logits(&fresh, false),
        "the adapter changed the policy"
    );
    let host = |p: &burn::module::Param<Tensor<Cpu, 2>>| -> Vec<f32> {
        p.val().into_data().iter::<f32>().collect()
    };
    assert_eq!(host(&trained.embed_tokens), host(&fresh.embed_tokens));
    for (l1, l2) in trained.layers.iter().zip(&fresh.layers) {
        if precision == "bf16" {
            let (d1, d2) = (
                l1.mlp.down_proj.dense.as_ref().unwrap(),
                l2.mlp.down_proj.dense.as_ref().unwrap(),
            );
            assert_eq!(host(d1), host(d2), "dense frozen weight untouched");
        }
    }

    // The saved PEFT adapter loads back (qerl_model::Adapter) into the same policy.
    let ckpt = out.checkpoint.unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["task_type"], "CAUSAL_LM");
    assert_eq!(cfg["r"], 4);
    let adapter = Adapter::open(&ckpt).unwrap();
    assert!(adapter
        .modules()
        .any(|m| m == "model.layers.1.mlp.down_proj"));
    let reloaded =
        load_with_adapter::<Cpu>(&dir, &options, Some(&adapter), &Default::default()).unwrap();
    assert_eq!(
        logits(&reloaded, false),
        logits(&trained, false),
        "adapter round trip"
    );
}

#[test]
fn only_lora_changes_nvfp4() {
    frozen_weights_untouched("nvfp4");
}

#[test]
fn only_lora_changes_bf16() {
    frozen_weights_untouched("bf16");
}

/// `train.eval_interval`: held-out accuracy at step 0, every N steps and at the last step, one
/// line each in `eval.jsonl`; a time budget stops at a step boundary with a checkpoint.
#[test]
fn held_out_accuracy_every_eval_interval_and_time_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let held = tmp.path().join("held.jsonl");
    std::fs::write(
        &held,
        "{\"question\": \"count\", \"answer\": \"1 + 1 = 2\\n#### 2\"}\n\
         {\"question\": \"go\", \"answer\": \"#### 0\"}\n\
         {\"question\": \"say it\", \"answer\": \"#### 7\"}\n",
    )
    .unwrap();
    let dataset = format!("eval.dataset=\"{}\"", held.display());
    let out = tmp.path().join("run");
    let c = config(
        &out,
        &[
            "train.steps=3",
            "train.eval_interval=2",
            &dataset,
            "eval.temperature=0.0",
            "eval.max_completion_tokens=4",
        ],
    );
    let rewards = RewardSet::new().with(Digits, 1.0);
    let mut t = Trainer::<Ad>::new(setup(c, rewards), &Default::default()).unwrap();
    let o = run(&mut t, &RunOptions::default()).unwrap();
    // the CPU reports the process's peak resident set
    assert!(o
        .metrics
        .iter()
        .all(|m| m.peak_memory_bytes.is_some_and(|b| b > 1 << 20)));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(out.join("eval.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 2, 3]);
    for l in &lines {
        assert_eq!(l["questions"], 3, "{l}");
        let acc = l["accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc), "{l}");
    }

    // A budget already spent: one step, then a clean stop with a checkpoint.
    let out2 = tmp.path().join("budget");
    let c = config(&out2, &["train.steps=5"]);
    let mut t = Trainer::<Ad>::new(
        setup(c, RewardSet::new().with(Digits, 1.0)),
        &Default::default(),
    )
    .unwrap();
    let o = run(
        &mut t,
        &RunOptions {
            time_budget: Some(0.0),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(o.out_of_time && !o.interrupted);
    assert_eq!(o.steps, 1);
    assert!(o
        .checkpoint
        .is_some_and(|c| c.join("adapter_model.safetensors").is_file()));
}
