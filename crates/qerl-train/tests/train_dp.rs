//! Data-parallel training on the CPU through the in-process communicator: N ranks (threads),
//! each with its own policy, end with the adapter of one process on the same global batch and
//! seed (within float tolerance: only the order of sums differs); DAPO's dynamic sampling keeps
//! the same groups; a checkpoint of a 2-rank run resumes with 1 rank; a rank that leaves ends
//! the others' runs with a message naming it, and the last checkpoint stays usable.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use burn::backend::Autodiff;
use qerl_rl::metrics::StepMetrics;
use qerl_rl::reward::{Reward, RewardError, RewardSet};
use qerl_rl::TrainConfig;
use qerl_train::dist::local::local_world;
use qerl_train::peft::{read_safetensors, HostTensor};
use qerl_train::{run, RunOptions, RunOutcome, TrainSetup, Trainer};

use common::{examples, root, Digits};

type Ad = Autodiff<qerl_nn::backends::Cpu>;

/// [`Digits`], but 0 for every completion of the examples whose answer is `-`: their groups
/// are flat, so DAPO's dynamic sampling drops and refills them.
struct SomeFlat;

impl Reward for SomeFlat {
    fn name(&self) -> &str {
        "some_flat"
    }
    fn score(&self, completion: &str, answer: &str) -> Result<f32, RewardError> {
        if answer == "-" {
            return Ok(0.0);
        }
        Digits.score(completion, answer)
    }
}

fn digits() -> RewardSet {
    RewardSet::new().with(Digits, 1.0)
}

fn some_flat() -> RewardSet {
    RewardSet::new().with(SomeFlat, 1.0)
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
group_size = 4
batch_prompts = 3
temperature = 1.0
top_p = 1.0
max_completion_tokens = 4
[loss]
kind = "dapo"
mu = 2
dynamic_sampling = true
max_sampling_rounds = 3
mask_truncated = false
[optim]
lr = 1e-2
grad_accum = 2
warmup_ratio = 0.0
lr_decay = "constant"
weight_decay = 0.0
grad_clip = 1.0
[aqn]
schedule = "exponential"
num_stages = 2
rollouts_only = false
[train]
steps = 3
seed = 11
output_dir = "{}"
ckpt_interval = 2
"#,
        root()
            .join("tests/fixtures/compressed-tensors/qwen2_tied/nvfp4")
            .display(),
        out.display()
    );
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let c = TrainConfig::from_toml_with_overrides(&text, "test", &sets).unwrap();
    c.validate().unwrap();
    c.resolved()
}

fn setup(config: TrainConfig, rewards: RewardSet) -> TrainSetup {
    let tokenizer = qerl_model::Tokenizer::from_file(
        &root().join("tests/fixtures/tokenizers/tiny/tokenizer.json"),
    )
    .unwrap();
    let examples = examples(
        &["count", "write", "go", "now", "say it", "add", "list"],
        |i| if i % 3 == 0 { "-" } else { "0" },
    );
    TrainSetup {
        config,
        tokenizer,
        rewards,
        examples,
        chat: false,
    }
}

/// Runs `world` ranks as threads to the end; returns every rank's outcome (or error text).
fn run_world(
    world: usize,
    config: &TrainConfig,
    rewards: fn() -> RewardSet,
    max_steps: &[Option<usize>],
) -> Vec<Result<RunOutcome, String>> {
    let comms = local_world(world, Duration::from_secs(120));
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let c = config.clone();
            let max_steps = max_steps.get(rank).copied().flatten();
            std::thread::spawn(move || {
                let mut t = Trainer::<Ad>::new(setup(c, rewards()), &Default::default())
                    .unwrap()
                    .with_communicator(Box::new(comm));
                let options = RunOptions {
                    max_steps,
                    ..Default::default()
                };
                run(&mut t, &options).map_err(|e| format!("{e:#}"))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn trained(ckpt: &Path) -> BTreeMap<String, HostTensor> {
    // LoRA and the trained norms (`modules_to_save`) are both in the adapter's file
    read_safetensors(&ckpt.join("adapter_model.safetensors")).unwrap()
}

/// Largest |a - b| over all tensors (same names and shapes required).
fn max_diff(a: &BTreeMap<String, HostTensor>, b: &BTreeMap<String, HostTensor>) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .flat_map(|(k, x)| {
            let y = &b[k];
            assert_eq!(x.shape, y.shape, "{k}");
            x.values.iter().zip(&y.values).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

fn assert_same_metrics(a: &[StepMetrics], b: &[StepMetrics]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.step, y.step);
        assert_eq!(
            x.reward_mean, y.reward_mean,
            "same samples at step {}",
            x.step
        );
        assert_eq!(x.completion_len_mean, y.completion_len_mean);
        assert_eq!(x.zero_std_frac, y.zero_std_frac);
        assert_eq!(
            (x.groups_dropped, x.sampling_rounds),
            (y.groups_dropped, y.sampling_rounds),
            "the same dynamic-sampling decisions"
        );
        for (p, q) in [
            (x.loss, y.loss),
            (x.grad_norm, y.grad_norm),
            (x.kl, y.kl),
            (x.entropy, y.entropy),
            (
                x.clip_frac_low + x.clip_frac_high,
                y.clip_frac_low + y.clip_frac_high,
            ),
        ] {
            assert!(
                (p - q).abs() <= 1e-4 * (1.0 + p.abs()),
                "step {}: {p} vs {q}",
                x.step
            );
        }
    }
}

/// Adapter values move by about `lr` per step; float noise in the gradient sums is orders
/// below that.
const TOL: f32 = 1e-4;

#[test]
fn two_ranks_equal_one_and_resume_with_one() {
    let (one, two, resumed) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let single = run_world(1, &config(one.path(), &[]), some_flat, &[])
        .remove(0)
        .unwrap();
    let mut ranks = run_world(2, &config(two.path(), &[]), some_flat, &[]);
    let rank1 = ranks.pop().unwrap().unwrap();
    let rank0 = ranks.pop().unwrap().unwrap();
    assert!(rank1.checkpoint.is_none(), "rank 1 writes nothing");
    assert_same_metrics(&single.metrics, &rank0.metrics);
    assert_same_metrics(&single.metrics, &rank1.metrics);
    let logged = qerl_rl::metrics::read_jsonl(&rank0.metrics_path).unwrap();
    assert_eq!(logged.len(), 3, "rank 0 logged each step once");
    let dropped: Vec<_> = single.metrics.iter().map(|m| m.groups_dropped).collect();
    let rounds: Vec<_> = single.metrics.iter().map(|m| m.sampling_rounds).collect();
    println!("dynamic sampling: groups dropped per step {dropped:?}, rounds {rounds:?}");
    let norms: Vec<_> = single.metrics.iter().map(|m| m.grad_norm).collect();
    println!("gradient norms per step: {norms:?}");
    assert!(
        dropped.iter().sum::<usize>() > 0,
        "flat groups were dropped (and the ranks agreed on it)"
    );

    let (a, b) = (
        trained(single.checkpoint.as_ref().unwrap()),
        trained(rank0.checkpoint.as_ref().unwrap()),
    );
    let d = max_diff(&a, &b);
    println!("max |adapter difference|, 1 rank vs 2 ranks after 3 steps: {d:e}");
    assert!(d < TOL, "{d}");
    let moved = a
        .iter()
        .filter(|(k, _)| k.ends_with("lora_B.weight"))
        .flat_map(|(_, t)| t.values.iter().map(|v| v.abs()))
        .fold(0f32, f32::max);
    assert!(moved > 1e-3, "the runs trained something: {moved}");

    // the 2-rank checkpoint of step 2 resumes with 1 rank and ends where 1 rank ends
    let ckpt2 = two.path().join("checkpoint-000002");
    let c = config(resumed.path(), &[]);
    let mut t = Trainer::<Ad>::resume(setup(c, some_flat()), &ckpt2, &Default::default()).unwrap();
    assert_eq!(t.state.step, 2);
    let rest = run(&mut t, &RunOptions::default()).unwrap();
    assert_eq!(rest.steps, 3);
    let d = max_diff(&a, &trained(rest.checkpoint.as_ref().unwrap()));
    println!("max |adapter difference|, 1 rank vs 2 ranks then 1 rank: {d:e}");
    assert!(d < TOL, "{d}");
}

#[test]
fn three_ranks_with_an_idle_rank_equal_one() {
    // 2 prompts over 3 ranks: rank 2 holds no sample, and still sums gradients and steps
    let sets = [
        "rollout.batch_prompts=2",
        "loss.kind=\"grpo\"",
        "loss.mu=1",
        "train.steps=2",
    ];
    let (one, three) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let single = run_world(1, &config(one.path(), &sets), digits, &[])
        .remove(0)
        .unwrap();
    let ranks = run_world(3, &config(three.path(), &sets), digits, &[]);
    let ranks: Vec<RunOutcome> = ranks.into_iter().map(Result::unwrap).collect();
    for r in &ranks {
        assert_same_metrics(&single.metrics, &r.metrics);
    }
    let d = max_diff(
        &trained(single.checkpoint.as_ref().unwrap()),
        &trained(ranks[0].checkpoint.as_ref().unwrap()),
    );
    println!("max |adapter difference|, 1 rank vs 3 ranks: {d:e}");
    assert!(d < TOL, "{d}");
}

#[test]
fn a_rank_that_leaves_is_named_and_the_checkpoint_survives() {
    let out = tempfile::tempdir().unwrap();
    let c = config(out.path(), &["train.steps=4", "train.ckpt_interval=1"]);
    // rank 1 stops after one step (its thread ends: its communicator is dropped)
    let results = run_world(2, &c, digits, &[None, Some(1)]);
    assert!(results[1].is_ok());
    let err = results[0].as_ref().unwrap_err();
    assert!(err.contains("rank 1 left the run"), "{err}");
    let ckpt = out.path().join("checkpoint-000001");
    assert_eq!(
        std::fs::read_to_string(out.path().join("latest"))
            .unwrap()
            .trim(),
        "checkpoint-000001"
    );
    let mut t = Trainer::<Ad>::resume(setup(c, digits()), &ckpt, &Default::default()).unwrap();
    assert_eq!(t.state.step, 1);
    let rest = run(
        &mut t,
        &RunOptions {
            max_steps: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(rest.steps, 2);
}

#[test]
fn rollout_rows_follow_the_global_batch() {
    use qerl_model::{generate, load, GenerationConfig, LoadOptions, SamplingParams};
    let generate_rows =
        |m: &qerl_model::CausalLm<qerl_nn::backends::Cpu>,
         p: &[Vec<u32>],
         c: &GenerationConfig,
         first: usize| { qerl_model::generate_from_row(m, p, c, None, first) };
    let dir = root().join("tests/fixtures/compressed-tensors/qwen2_tied/nvfp4");
    let model =
        load::<qerl_nn::backends::Cpu>(&dir, &LoadOptions::default(), &Default::default()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| (0..2 + i % 3).map(|j| 7 + 31 * i + j).collect())
        .collect();
    let config = GenerationConfig {
        max_new_tokens: 6,
        sampling: SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
        },
        seed: 99,
        ..GenerationConfig::default()
    };
    // first row 0: exactly qerl_model::generate
    let whole = generate_rows(&model, &prompts, &config, 0).unwrap();
    assert_eq!(whole, generate(&model, &prompts, &config, None).unwrap());
    // a rank's slice draws what the same rows draw in the whole batch
    let tail = generate_rows(&model, &prompts[2..], &config, 2).unwrap();
    let tokens = |c: &[qerl_model::Completion]| -> Vec<Vec<u32>> {
        c.iter().map(|x| x.tokens.clone()).collect()
    };
    assert_eq!(tokens(&tail), tokens(&whole[2..]));
    // and not what rows numbered from 0 would draw
    let unshifted = generate_rows(&model, &prompts[2..], &config, 0).unwrap();
    assert_ne!(tokens(&unshifted), tokens(&whole[2..]));
}
