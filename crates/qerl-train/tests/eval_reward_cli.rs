//! `qerl eval` on the tiny fixture with a trained-looking adapter, then `qerl reward` on its
//! output; and `qerl train` from the command line (tiny config, 1 step).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn qerl(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    println!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn train_then_eval_with_the_adapter_then_reward() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let tok = root().join("tests/fixtures/tokenizers/tiny/tokenizer.json");
    let out = qerl(&[
        "train",
        "--config",
        "configs/tiny-cpu.toml",
        "--tokenizer",
        tok.to_str().unwrap(),
        "--quiet",
        "--set",
        &format!("train.output_dir=\"{}\"", run.display()),
        "--set",
        "train.steps=1",
        "--set",
        "rollout.max_completion_tokens=4",
        "--set",
        "data.max_prompt_tokens=16",
        "--set",
        "loss.dynamic_sampling=false",
    ]);
    assert!(out.status.success());
    let ckpt = run.join("checkpoint-000001");
    assert!(ckpt.join("adapter_model.safetensors").is_file());
    assert!(run.join("metrics.png").is_file());
    let evals = tmp.path().join("eval.jsonl");
    let out = qerl(&[
        "eval",
        "--model",
        "tests/fixtures/compressed-tensors/qwen2_tied/nvfp4",
        "--adapter",
        ckpt.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--dataset",
        "gsm8k",
        "--limit",
        "2",
        "--samples",
        "2",
        "--max-new-tokens",
        "4",
        "--output",
        evals.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("pass@1 strict"));
    let lines = std::fs::read_to_string(&evals).unwrap();
    assert_eq!(lines.lines().count(), 4, "2 questions x 2 samples");
    let scored = tmp.path().join("scored.jsonl");
    let out = qerl(&[
        "reward",
        "--dataset",
        "gsm8k",
        "--completions",
        evals.to_str().unwrap(),
        "--output",
        scored.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let first: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&scored)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert!(first["reward"].is_number() && first["rewards"]["gsm8k"].is_number());
    // resume continues the run
    let out = qerl(&[
        "train",
        "--resume",
        run.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--quiet",
        "--set",
        "train.steps=2",
    ]);
    assert!(out.status.success());
    assert!(run
        .join("checkpoint-000002")
        .join("optimizer.mpk")
        .is_file());
}

#[test]
fn a_bad_gemm_strategy_is_named_before_any_work() {
    let out = Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args([
            "reward",
            "--dataset",
            "gsm8k",
            "--completions",
            "none.jsonl",
        ])
        .env("QERL_GEMM", "fastest")
        .current_dir(root())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("QERL_GEMM=fastest") && err.contains("auto, tc, tuned or cublas"),
        "{err}"
    );
    assert!(
        !err.contains("none.jsonl"),
        "the strategy is checked first: {err}"
    );
}

#[test]
fn reward_explain_says_what_was_read_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let completions = dir.path().join("c.jsonl");
    std::fs::write(
        &completions,
        concat!(
            r#"{"id": "a", "answer": "2\\sqrt{113}", "completion": "So the area is $\\boxed{\\sqrt{452}}$."}"#,
            "\n",
            r#"{"id": "b", "answer": "7", "completion": "The answer is 8."}"#,
            "\n"
        ),
    )
    .unwrap();
    let out = qerl(&[
        "reward",
        "--dataset",
        "math500",
        "--completions",
        completions.to_str().unwrap(),
        "--explain",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("line 1 (id a)") && text.contains("line 2 (id b)"),
        "{text}"
    );
    assert!(
        text.contains("extracted:") && text.contains("why:"),
        "{text}"
    );
    assert!(text.contains("\\sqrt{452}"), "{text}");
}
