//! End to end on the CPU: `qerl sft` makes a tiny model from nothing (tokenizer, random
//! weights, supervised training, checkpoint, held-out accuracy), and the checkpoint loads back.

use std::path::Path;
use std::process::Command;

use qerl_model::{load, LoadOptions, TokenBatch, Tokenizer};

fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn sft_makes_a_model_that_learns_and_loads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny");
    let args = [
        "sft",
        "--out",
        out.to_str().unwrap(),
        "--vocab-size",
        "300",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate",
        "64",
        "--problems",
        "300",
        "--rl-problems",
        "30",
        "--test-problems",
        "20",
        "--steps",
        "40",
        "--batch",
        "16",
        "--lr",
        "3e-3",
        "--warmup",
        "5",
        "--eval-limit",
        "4",
        "--eval-max-new-tokens",
        "16",
        "--shortcut-fraction",
        "0.5",
        "--device",
        "cpu",
        "--quiet",
    ];
    let o = Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "qerl sft failed: {stderr}");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "data/train.jsonl",
        "data/test.jsonl",
        "sft_log.jsonl",
        "sft_eval.json",
    ] {
        assert!(out.join(f).is_file(), "{f} written");
    }
    assert!(
        !out.read_dir().unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".tmp")),
        "no temporary files left"
    );

    // The tokenizer: ChatML specials first, digits one per token.
    let tok = Tokenizer::from_file(&out.join("tokenizer.json")).unwrap();
    for (i, t) in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
    {
        assert_eq!(tok.token_to_id(t), Some(i as u32), "{t}");
    }
    assert_eq!(tok.encode("2048", false).unwrap().len(), 4);
    assert_eq!(tok.vocab_size(), 300);

    // The loss fell.
    let log = read_jsonl(&out.join("sft_log.jsonl"));
    assert_eq!(log.len(), 40);
    let loss = |r: &[serde_json::Value]| {
        r.iter().map(|v| v["loss"].as_f64().unwrap()).sum::<f64>() / r.len() as f64
    };
    let (first, last) = (loss(&log[..5]), loss(&log[35..]));
    println!("loss: first 5 steps {first:.3}, last 5 {last:.3}");
    assert!(first > 4.0, "starts near ln(300) = 5.7: {first}");
    assert!(last < 0.6 * first, "the loss fell: {first} -> {last}");

    // Held-out problems are not among the RL prompts.
    let q = |f: &str| -> std::collections::HashSet<String> {
        read_jsonl(&out.join(f))
            .iter()
            .map(|v| v["question"].as_str().unwrap().to_string())
            .collect()
    };
    let (train, test) = (q("data/train.jsonl"), q("data/test.jsonl"));
    assert_eq!((train.len(), test.len()), (30, 20));
    assert!(train.is_disjoint(&test));

    // The summary names what was evaluated.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("sft_eval.json")).unwrap()).unwrap();
    let eval = summary["eval"].as_array().unwrap();
    assert_eq!(eval.len(), 2);
    assert_eq!(eval[0]["questions"], 4);
    assert_eq!(summary["shortcut_fraction"], 0.5);
    for e in eval {
        let share = e["shortcut"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&share), "{e}");
    }
    assert!(summary["parameters"].as_u64().unwrap() > 10_000);

    // The bf16 checkpoint loads as an ordinary dense model and scores a text.
    let model =
        load::<qerl_nn::backends::Cpu>(&out, &LoadOptions::default(), &Default::default()).unwrap();
    let ids = tok.encode("Ava has 3 apples.", false).unwrap();
    let logits = model.forward(&TokenBatch::single(&ids).unwrap()).unwrap();
    assert_eq!(logits.dims(), [1, ids.len(), 300]);
    assert!(logits.into_data().iter::<f32>().all(|v| v.is_finite()));
}

/// Padding a training batch to a bucket length changes neither the loss nor the gradient's
/// target set: padding is masked out of attention and of the loss.
#[test]
fn padding_to_a_bucket_leaves_the_loss_unchanged() {
    use qerl_train::sft::{batch_loss, SftExample};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = root.join("tests/fixtures/compressed-tensors/qwen2_tied/bf16");
    let model =
        load::<qerl_nn::backends::Cpu>(&dir, &LoadOptions::default(), &Default::default()).unwrap();
    let examples = [
        SftExample {
            prompt: vec![5, 17, 300, 44],
            completion: vec![9, 120, 7],
        },
        SftExample {
            prompt: vec![8, 3],
            completion: vec![77, 78, 79, 80, 81],
        },
    ];
    let refs: Vec<&SftExample> = examples.iter().collect();
    let prompts: Vec<&[u32]> = refs.iter().map(|e| e.prompt.as_slice()).collect();
    let zeros = [vec![0.0; 3], vec![0.0; 5]];
    let comps: Vec<(&[u32], &[f32])> = refs
        .iter()
        .zip(&zeros)
        .map(|(e, z)| (e.completion.as_slice(), z.as_slice()))
        .collect();
    let tight = qerl_train::update::TrainBatch::new(&prompts, &comps, vec![0.0; 2], &[false; 2], 0)
        .unwrap();
    assert_eq!(tight.tokens.len, 7);
    let padded = tight.clone().padded_to_multiple(16, 0);
    assert_eq!(padded.tokens.len, 16);
    assert_eq!(padded.tokens_counted(), tight.tokens_counted());
    let value = |b| {
        batch_loss(&model, &b)
            .unwrap()
            .into_data()
            .iter::<f32>()
            .next()
            .unwrap()
    };
    let (a, b) = (value(tight), value(padded));
    assert!((a - b).abs() < 1e-5 * a.abs().max(1.0), "{a} vs {b}");
    assert!(a > 1.0, "a random model's cross-entropy: {a}");
}
