//! qerl never clobbers what it was not asked to overwrite, and fails early naming the cause
//! (issue "Runs that never clobber data"): `--resume` writes into the directory it is given and
//! follows no `latest` out of it; a fresh run refuses a directory that holds a run unless told
//! `--overwrite`; two runs cannot share a directory; an output that is an input is refused; a
//! misspelled LoRA target and sizes past the model's are refused before any work.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

fn qerl(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run qerl");
    println!(
        "qerl {args:?}\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `qerl train` on the tiny config into `run` (2 steps, a checkpoint every step), then `extra`.
fn train(run: &Path, extra: &[&str]) -> Output {
    let t = tokenizer();
    let out_dir = format!("train.output_dir=\"{}\"", run.display());
    let mut args = vec![
        "train",
        "--config",
        "configs/tiny-cpu.toml",
        "--tokenizer",
        &t,
        "--quiet",
        "--device",
        "cpu",
        "--set",
        &out_dir,
        "--set",
        "train.steps=2",
        "--set",
        "train.ckpt_interval=1",
        "--set",
        "train.eval_interval=0",
        "--set",
        "rollout.max_completion_tokens=4",
        "--set",
        "data.max_prompt_tokens=16",
        "--set",
        "loss.dynamic_sampling=false",
    ];
    args.extend_from_slice(extra);
    qerl(&args)
}

/// `qerl train --resume dir` (on the CPU, quietly).
fn resume(dir: &Path) -> Output {
    let t = tokenizer();
    qerl(&[
        "train",
        "--resume",
        dir.to_str().unwrap(),
        "--tokenizer",
        &t,
        "--quiet",
        "--device",
        "cpu",
    ])
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

fn bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn resume_writes_into_the_directory_given_and_no_latest_leads_out() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("A"), tmp.path().join("B"));
    assert!(train(&a, &["--max-steps", "1"]).status.success());
    assert!(a.join("checkpoint-000001").is_dir());
    copy_dir(&a, &b);
    // the copy's config.toml still names A as its output_dir
    let out = resume(&b);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(b.join("checkpoint-000002").is_dir(), "B goes on in B");
    assert!(!a.join("checkpoint-000002").exists(), "A is left alone");
    assert_eq!(bytes(&b.join("latest")), b"checkpoint-000002\n");

    // a checkpoint directory given: its run directory goes on
    let c = tmp.path().join("C");
    copy_dir(&a, &c);
    let out = resume(&c.join("checkpoint-000001"));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(c.join("checkpoint-000002").is_dir() && !a.join("checkpoint-000002").exists());

    // `latest` may name only a directory inside the run directory
    let d = tmp.path().join("D");
    std::fs::create_dir_all(&d).unwrap();
    let outside = a.join("checkpoint-000001");
    for target in [
        "../A/checkpoint-000001".to_string(),
        "../..".to_string(),
        outside.display().to_string(),
    ] {
        std::fs::write(d.join("latest"), format!("{target}\n")).unwrap();
        let out = resume(&d);
        let err = stderr(&out);
        assert!(!out.status.success(), "latest = {target} was followed");
        assert!(
            err.contains("latest")
                && err.contains(&target)
                && err.contains("not a checkpoint inside"),
            "{err}"
        );
    }
    // nor through a symbolic link
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(&outside, d.join("checkpoint-000001")).unwrap();
        std::fs::write(d.join("latest"), "checkpoint-000001\n").unwrap();
        let out = resume(&d);
        assert!(!out.status.success());
        assert!(stderr(&out).contains("leads outside"), "{}", stderr(&out));
    }
    assert!(!a.join("checkpoint-000002").exists());
}

#[test]
fn a_fresh_run_refuses_a_directory_that_holds_a_run_unless_told_to_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    assert!(train(&run, &[]).status.success());
    let ckpt1 = bytes(&run.join("checkpoint-000001/adapter_model.safetensors"));
    let metrics = bytes(&run.join("metrics.jsonl"));
    std::fs::write(run.join("notes.txt"), "mine").unwrap();

    let out = train(&run, &["--set", "train.steps=1"]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("not empty") && err.contains("--overwrite") && err.contains("--resume"),
        "{err}"
    );
    assert_eq!(
        bytes(&run.join("checkpoint-000001/adapter_model.safetensors")),
        ckpt1
    );
    assert_eq!(bytes(&run.join("metrics.jsonl")), metrics);

    // --overwrite: the old run's files go (no checkpoint 2 left mixed in), others stay
    let out = train(&run, &["--set", "train.steps=1", "--overwrite"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(run.join("checkpoint-000001").is_dir());
    assert!(!run.join("checkpoint-000002").exists());
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count(),
        1
    );
    assert_eq!(bytes(&run.join("notes.txt")), b"mine");
}

#[test]
fn two_runs_cannot_share_a_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let lock = qerl_train::run_dir::RunDirLock::acquire(&run).unwrap();
    let out = train(&run, &[]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("in use by another qerl run") && err.contains(&std::process::id().to_string()),
        "{err}"
    );
    assert!(!run.join("metrics.jsonl").exists());
    // leftovers of a killed run are removed under the lock; the lock itself is no run
    std::fs::create_dir_all(run.join(".checkpoint-000001.tmp-4242")).unwrap();
    drop(lock);
    let out = train(&run, &["--set", "train.steps=1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!run.join(".checkpoint-000001.tmp-4242").exists());
}

#[test]
fn an_output_that_is_an_input_is_refused_before_it_is_opened() {
    let tmp = tempfile::tempdir().unwrap();
    let completions = tmp.path().join("c.jsonl");
    let line = "{\"id\": \"0\", \"completion\": \"#### 72\", \"answer\": \"72\"}\n";
    std::fs::write(&completions, line).unwrap();
    // the same file under another spelling
    let alias = tmp.path().join(".").join("c.jsonl");
    for output in [&completions, &alias] {
        let out = qerl(&[
            "reward",
            "--dataset",
            "gsm8k",
            "--completions",
            completions.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
        ]);
        assert!(!out.status.success());
        assert!(stderr(&out).contains("--completions"), "{}", stderr(&out));
        assert_eq!(std::fs::read_to_string(&completions).unwrap(), line);
    }

    let dataset = tmp.path().join("d.jsonl");
    let question = "{\"question\": \"1+1?\", \"answer\": \"#### 2\"}\n";
    std::fs::write(&dataset, question).unwrap();
    let t = tokenizer();
    let out = qerl(&[
        "eval",
        "--model",
        "tests/fixtures/compressed-tensors/qwen2_tied/nvfp4",
        "--tokenizer",
        &t,
        "--dataset",
        dataset.to_str().unwrap(),
        "--output",
        dataset.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--dataset"), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&dataset).unwrap(), question);
}

#[test]
fn a_misspelled_lora_target_and_sizes_past_the_model_are_refused_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    for (set, words) in [
        (
            "lora.targets=[\"q_prj\"]",
            &["lora.targets", "q_prj", "q_proj, k_proj"][..],
        ),
        ("lora.rank=100000000", &["lora.rank", "100000000"][..]),
        (
            "lora.rank=65",
            &["lora.rank", "hidden_size", "config.json"][..],
        ),
        (
            "rollout.max_completion_tokens=100000000",
            &[
                "rollout.max_completion_tokens",
                "max_position_embeddings",
                "config.json",
            ][..],
        ),
    ] {
        let out = train(&run, &["--set", set]);
        let err = stderr(&out);
        assert!(!out.status.success(), "{set} was accepted");
        for w in words {
            assert!(err.contains(w), "{set}: `{w}` not in: {err}");
        }
        assert!(!run.join("metrics.jsonl").exists(), "{set}: work was done");
    }

    let (m, t) = (
        "tests/fixtures/compressed-tensors/qwen2_tied/nvfp4",
        tokenizer(),
    );
    let out = qerl(&[
        "generate",
        "--model",
        m,
        "--tokenizer",
        &t,
        "--prompt",
        "hi",
        "--max-new-tokens",
        "1000000000000",
    ]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("max_new_tokens") && err.contains("max_position_embeddings = 256"),
        "{err}"
    );
    // a prompt longer than the context (256 positions)
    let long = "count to ten and back again ".repeat(100);
    let out = qerl(&[
        "generate",
        "--model",
        m,
        "--tokenizer",
        &t,
        "--prompt",
        &long,
        "--max-new-tokens",
        "2",
    ]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("longer than the model's context") && err.contains("config.json"),
        "{err}"
    );
}
