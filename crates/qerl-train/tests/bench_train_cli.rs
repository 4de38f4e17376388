//! End to end: `qerl bench train` on the tiny shape (CPU): two GRPO steps for NVFP4 and BF16
//! LoRA, with and without activation checkpointing, the table, and the context search ending
//! at its limit (nothing runs out of memory on the host).

use std::process::Command;

fn bench(extra: &[&str]) -> String {
    let mut args = vec![
        "bench",
        "train",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--prompts",
        "2",
        "--group",
        "2",
        "--prompt-len",
        "8",
        "--completion-len",
        "8",
        "--grad-accum",
        "2",
    ];
    args.extend_from_slice(extra);
    let out = Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args(&args)
        .output()
        .expect("run qerl");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "qerl {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The table row of `weights`, split into cells.
fn row(stdout: &str, weights: &str) -> Vec<String> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&format!("| tiny | {weights} |")))
        .unwrap_or_else(|| panic!("no {weights} row in:\n{stdout}"));
    line.trim_matches('|')
        .split('|')
        .map(|c| c.trim().to_string())
        .collect()
}

#[test]
fn two_steps_of_both_precisions_and_the_context_search() {
    let out = bench(&["--max-context", "--max-context-limit", "32"]);
    for step in 0..2 {
        for w in ["nvfp4", "bf16"] {
            let head = format!("{w} step {step}: rollout ");
            let line = out.lines().find(|l| l.starts_with(&head));
            let line = line.unwrap_or_else(|| panic!("no `{head}` line in {out}"));
            // which phase raised the memory, and the update's loss and gradient norm
            assert!(
                line.contains("(after rollout / reference / update: "),
                "{line}"
            );
            let norm: f64 = line
                .rsplit("gradient norm ")
                .next()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no gradient norm in {line}"));
            assert!(norm.is_finite() && norm > 0.0, "{line}");
        }
    }
    for w in ["nvfp4", "bf16"] {
        let cells = row(&out, w);
        assert_eq!(cells[2], "2 x 2");
        assert_eq!(cells[3], "8 + 8");
        let step: f64 = cells[4].parse().unwrap();
        let parts: f64 = cells[5..8].iter().map(|c| c.parse::<f64>().unwrap()).sum();
        assert!(step > 0.0 && (step - parts).abs() < 0.02, "{cells:?}");
        assert!(cells[8].parse::<f64>().unwrap() >= 0.0, "TFLOP/s {cells:?}");
        // completions 8, 16, 32 fit; 32 is the limit: 8 prompt + 32 completion tokens
        assert_eq!(cells[11], "40", "{cells:?}");
    }
    assert!(out.contains("completion 32: fits"), "{out}");
    assert!(!out.contains("completion 64"), "{out}");
}

#[test]
fn without_checkpointing_and_with_synthetic_rollouts() {
    let out = bench(&[
        "--no-checkpointing",
        "--rollout",
        "synthetic",
        "--precision",
        "nvfp4",
    ]);
    assert!(out.contains("checkpointing false"), "{out}");
    let cells = row(&out, "nvfp4");
    assert_eq!(cells[11], "-");
    assert!(!out.contains("| tiny | bf16 |"), "{out}");
}

#[test]
fn bad_arguments_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args(["bench", "train", "--shape", "qwen9", "--device", "cpu"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown shape `qwen9`"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
