//! End to end: `qerl generate` on the committed tiny checkpoints with the tiny byte-level
//! tokenizer (`--tokenizer`, the fixture directories have none).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use qerl_model::{generate, load, GenerationConfig, LoadOptions, SamplingParams};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn model(name: &str) -> String {
    repo()
        .join("tests/fixtures/compressed-tensors")
        .join(name)
        .display()
        .to_string()
}

fn tokenizer() -> String {
    repo()
        .join("tests/fixtures/tokenizers/tiny/tokenizer.json")
        .display()
        .to_string()
}

fn qerl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args(args)
        .output()
        .expect("run qerl")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `qerl generate ... --json` and parses stdout.
fn generate_json(extra: &[&str]) -> Value {
    let (m, t) = (model("llama_untied/bf16"), tokenizer());
    let mut args = vec!["generate", "--model", &m, "--tokenizer", &t, "--json"];
    args.extend_from_slice(extra);
    let out = qerl(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("tokens/s"),
        "{}",
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out.stdout)))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn greedy_batch_matches_the_library() {
    let doc = generate_json(&[
        "--prompt",
        "Hello, world!",
        "--prompt",
        "What is two plus two? Two plus",
        "--greedy",
        "--max-new-tokens",
        "12",
    ]);
    assert_eq!(doc["precision"], "bf16");
    assert_eq!(doc["device"], "cpu");
    assert_eq!(doc["sampling"]["temperature"], 0.0);
    let completions = doc["completions"].as_array().unwrap();
    assert_eq!(completions.len(), 2);
    let prompts: Vec<Vec<u32>> = completions.iter().map(|c| ids(&c["prompt_ids"])).collect();
    assert_ne!(prompts[0].len(), prompts[1].len());

    // the same prompts through the library, EOS from generation_config.json (token 2)
    let dir = PathBuf::from(model("llama_untied/bf16"));
    let m =
        load::<qerl_nn::backends::Cpu>(&dir, &LoadOptions::default(), &Default::default()).unwrap();
    let config = GenerationConfig {
        max_new_tokens: 12,
        sampling: SamplingParams::greedy(),
        eos_token_ids: vec![2],
        ..GenerationConfig::default()
    };
    let expected = generate(&m, &prompts, &config, None).unwrap();
    for (c, e) in completions.iter().zip(&expected) {
        assert_eq!(ids(&c["ids"]), e.tokens);
        let lps: Vec<f32> = c["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(lps, e.logprobs);
        let reason = c["finish_reason"].as_str().unwrap();
        assert!(
            reason == "length" || (reason == "eos" && e.tokens.last() == Some(&2)),
            "{reason}"
        );
        assert!(c["text"].is_string());
    }
}

#[test]
fn seeded_sampling_chat_and_stop_strings() {
    let base = [
        "--prompt",
        "Hi there",
        "--chat",
        "--max-new-tokens",
        "10",
        "--temperature",
        "1.0",
        "--top-p",
        "0.95",
    ];
    let run = |seed: &str| {
        let mut a = base.to_vec();
        a.extend_from_slice(&["--seed", seed]);
        let doc = generate_json(&a);
        ids(&doc["completions"][0]["ids"])
    };
    let (a, b, c) = (run("7"), run("7"), run("8"));
    assert_eq!(a, b);
    assert_ne!(a, c);
    // the chat prompt is ChatML: <|im_start|> = 1 ... <|im_start|>assistant\n
    let doc = generate_json(&base);
    let prompt = ids(&doc["completions"][0]["prompt_ids"]);
    assert_eq!(prompt[0], 1);
    assert_eq!(prompt.iter().filter(|&&t| t == 1).count(), 2);

    // a stop string taken from an earlier run's text ends the sequence there
    let full = generate_json(&[
        "--prompt",
        "The quick brown",
        "--greedy",
        "--max-new-tokens",
        "16",
    ]);
    let full_text = full["completions"][0]["text"].as_str().unwrap().to_string();
    let full_ids = ids(&full["completions"][0]["ids"]);
    let chars: Vec<char> = full_text.chars().collect();
    let i = (1..chars.len().saturating_sub(1))
        .find(|&i| chars[i].is_ascii_alphanumeric() && chars[i + 1].is_ascii_alphanumeric())
        .unwrap_or_else(|| panic!("no two ASCII letters in a row in {full_text:?}"));
    let stop: String = chars[i..i + 2].iter().collect();
    let doc = generate_json(&[
        "--prompt",
        "The quick brown",
        "--greedy",
        "--max-new-tokens",
        "16",
        "--stop",
        &stop,
    ]);
    let c = &doc["completions"][0];
    assert_eq!(c["finish_reason"], "stop", "{c}");
    assert_eq!(c["finish_detail"], stop.as_str());
    let got = ids(&c["ids"]);
    assert!(
        got.len() < full_ids.len() && full_ids.starts_with(&got),
        "{got:?} vs {full_ids:?}"
    );
    assert!(!c["text"].as_str().unwrap().contains(&stop));
}

#[test]
fn nvfp4_checkpoint_and_plain_output() {
    let (m, t) = (model("qwen2_tied/nvfp4"), tokenizer());
    let out = qerl(&[
        "generate",
        "--model",
        &m,
        "--tokenizer",
        &t,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "5",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["precision"], "nvfp4");
    assert_eq!(
        doc["completions"][0]["logprobs"].as_array().unwrap().len(),
        doc["completions"][0]["ids"].as_array().unwrap().len()
    );
    // plain text output, and the dequantized twin
    let out = qerl(&[
        "generate",
        "--model",
        &m,
        "--tokenizer",
        &t,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "5",
        "--precision",
        "bf16",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("bf16"), "{}", text(&out.stderr));
    assert!(!text(&out.stdout).is_empty());
}

#[test]
fn errors_are_clear() {
    let (m, t) = (model("llama_untied/bf16"), tokenizer());
    // no tokenizer.json in the model directory
    let out = qerl(&["generate", "--model", &m, "--prompt", "x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--tokenizer"),
        "{}",
        text(&out.stderr)
    );
    // --greedy and --temperature conflict (clap)
    let out = qerl(&[
        "generate",
        "--model",
        &m,
        "--tokenizer",
        &t,
        "--prompt",
        "x",
        "--greedy",
        "--temperature",
        "0.5",
    ]);
    assert_eq!(out.status.code(), Some(2));
    // bad sampling values
    let out = qerl(&[
        "generate",
        "--model",
        &m,
        "--tokenizer",
        &t,
        "--prompt",
        "x",
        "--top-p",
        "1.5",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("top_p"), "{}", text(&out.stderr));
    // a tokenizer with a larger vocabulary than the model
    let big = repo()
        .join("tests/fixtures/tokenizers/qwen2.5/tokenizer.json")
        .display()
        .to_string();
    let out = qerl(&[
        "generate",
        "--model",
        &m,
        "--tokenizer",
        &big,
        "--prompt",
        "Hello world",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("vocab_size 512"),
        "{}",
        text(&out.stderr)
    );
    // an unknown architecture names the file and key
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(Path::new(&m).join(f), tmp.path().join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(tmp.path().join("config.json"))
        .unwrap()
        .replace("LlamaForCausalLM", "GPT2LMHeadModel");
    std::fs::write(tmp.path().join("config.json"), cfg).unwrap();
    let dir = tmp.path().display().to_string();
    let out = qerl(&[
        "generate",
        "--model",
        &dir,
        "--tokenizer",
        &t,
        "--prompt",
        "x",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("config.json")
            && err.contains("architectures")
            && err.contains("GPT2LMHeadModel"),
        "{err}"
    );
}

#[cfg(feature = "wgpu")]
#[test]
fn greedy_on_wgpu_equals_cpu() {
    qerl_kernels::runtime::wgpu_device_or_exit();
    let run = |device: &str| {
        let doc = generate_json(&[
            "--prompt",
            "Hello, world!",
            "--greedy",
            "--max-new-tokens",
            "6",
            "--device",
            device,
        ]);
        assert_eq!(doc["device"], device);
        ids(&doc["completions"][0]["ids"])
    };
    assert_eq!(run("wgpu"), run("cpu"));
}
