//! The smaller refusals of issue "Runs that never clobber data" (item 7), end to end: a config
//! that is a device is refused at once, naming it; a full disk names the file; Ctrl-C ends a
//! run with status 130 after its checkpoint; `--samples 0` and `--batch 0` are refused. And
//! `qerl warmup` (issue "Start fast") on the tiny fixture.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn tokenizer() -> String {
    repo()
        .join("tests/fixtures/tokenizers/tiny/tokenizer.json")
        .display()
        .to_string()
}

fn fixture() -> String {
    repo()
        .join("tests/fixtures/compressed-tensors/qwen2_tied/nvfp4")
        .display()
        .to_string()
}

fn qerl(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run qerl");
    println!(
        "qerl {args:?}: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The tiny CPU run's arguments into `run`, for `steps` steps.
fn train_args(run: &Path, steps: usize) -> Vec<String> {
    [
        "train",
        "--config",
        "configs/tiny-cpu.toml",
        "--tokenizer",
        &tokenizer(),
        "--quiet",
        "--device",
        "cpu",
        "--set",
        &format!("train.output_dir=\"{}\"", run.display()),
        "--set",
        &format!("train.steps={steps}"),
        "--set",
        "train.ckpt_interval=0",
        "--set",
        "train.eval_interval=0",
        "--set",
        "rollout.max_completion_tokens=4",
        "--set",
        "data.max_prompt_tokens=16",
        "--set",
        "loss.dynamic_sampling=false",
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn a_config_that_is_a_device_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let zero = tmp.path().join("run.toml");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let t = Instant::now();
    let out = qerl(&[
        "train",
        "--config",
        zero.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(zero.to_str().unwrap()) && err.contains("not a regular file"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(20));

    // a model directory whose config.json is /dev/zero
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::os::unix::fs::symlink("/dev/zero", model.join("config.json")).unwrap();
    let out = qerl(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--tokenizer",
        &tokenizer(),
        "--prompt",
        "hi",
    ]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("config.json") && err.contains("not a regular file"),
        "{err}"
    );
}

#[test]
fn a_full_disk_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let completions = tmp.path().join("completions.jsonl");
    let line = r#"{"completion": "so the answer is 4. #### 4", "answer": "4"}"#;
    std::fs::write(&completions, format!("{line}\n").repeat(2000)).unwrap();
    let out = qerl(&[
        "reward",
        "--dataset",
        "gsm8k",
        "--completions",
        completions.to_str().unwrap(),
        "--output",
        "/dev/full",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("`/dev/full`") && err.contains("No space"),
        "{err}"
    );
}

#[test]
fn zero_samples_or_batch_are_refused() {
    for flag in ["--samples", "--batch"] {
        let out = qerl(&[
            "eval",
            "--model",
            &fixture(),
            "--tokenizer",
            &tokenizer(),
            "--dataset",
            "gsm8k",
            flag,
            "0",
        ]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(err.contains(flag) && err.contains("at least 1"), "{err}");
    }
}

#[test]
fn ctrl_c_ends_a_run_with_130_after_its_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let mut child = Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args(train_args(&run, 10_000))
        .current_dir(repo())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // wait for the first step's metrics line
    let metrics = run.join("metrics.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |s| s.lines().count() < 1) {
        assert!(
            start.elapsed() < Duration::from_secs(600),
            "no step in time"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "qerl train ended early"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: sending a signal to our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(
        run.join("latest").is_file(),
        "a checkpoint is written first"
    );
}

#[test]
fn warmup_runs_the_kernels_once_and_names_the_cache() {
    let out = qerl(&["warmup", "--model", &fixture(), "--device", "cpu"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("[1/2]") && err.contains("[2/2]") && err.contains("GB/s"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("kernel cache:"), "{stdout}");

    // with one training step of a config
    let fx = fixture();
    let mut args = vec![
        "warmup",
        "--model",
        &fx,
        "--device",
        "cpu",
        "--train",
        "configs/tiny-cpu.toml",
    ];
    let tok = tokenizer();
    args.extend(["--tokenizer", &tok]);
    for set in [
        "rollout.max_completion_tokens=4",
        "data.max_prompt_tokens=16",
        "loss.dynamic_sampling=false",
    ] {
        args.extend(["--set", set]);
    }
    let out = qerl(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("[3/3] one training step"));
}

#[cfg(feature = "wgpu")]
#[test]
fn warmup_on_wgpu() {
    qerl_kernels::runtime::wgpu_device_or_exit();
    let out = qerl(&["warmup", "--model", &fixture(), "--device", "wgpu"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("kernel cache:") && stdout.contains("autotune cache:"),
        "{stdout}"
    );
}
