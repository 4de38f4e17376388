//! End to end: `qerl convert` on a synthetic GGUF (the tokenizer and model it writes load and
//! generate) and on SmolLM2-135M-Instruct Q4_1 (logits against an independent numpy reference,
//! then `qerl quantize` to NVFP4 and a chat answer). The SmolLM2 test needs the 98 MB GGUF:
//! `tools/fetch_smollm2.sh` puts it at target/smollm2/, or set `QERL_SMOLLM2_GGUF`; without it
//! the test prints why and passes.

#[path = "../../qerl-format/tests/gguf_common/mod.rs"]
mod gguf_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use qerl_model::{load, score, ChatTemplate, LoadOptions, Tokenizer};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
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

fn run_ok(args: &[&str]) -> String {
    let out = qerl(args);
    assert!(
        out.status.success(),
        "qerl {args:?}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

#[test]
fn synthetic_gguf_converts_to_a_model_that_loads_tokenizes_and_generates() {
    let (bytes, _, _) = gguf_common::tiny_llama();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny.gguf");
    std::fs::write(&gguf, bytes).unwrap();
    let out = tmp.path().join("hf");
    let (g, o) = (gguf.display().to_string(), out.display().to_string());
    let stdout = run_ok(&["convert", &g, &o]);
    assert!(
        stdout.contains("un-permuted the RoPE rows of 4 q/k tensors"),
        "{stdout}"
    );

    let tok = Tokenizer::for_model(&out, None).unwrap();
    let ids = tok.encode("hello world 42", true).unwrap();
    assert_eq!(tok.decode_ids(&ids, false).unwrap(), "hello world 42");
    let merged = |t: &str| tok.token_to_id(t).unwrap();
    assert_eq!(&ids[..2], &[merged("hell"), merged("o")]);
    assert_eq!(
        ids[2],
        merged(&format!("{}w", gguf_common::byte_char(b' ')))
    );
    // Digits are split one by one (the `smollm` pre-tokenizer).
    assert_eq!(&ids[ids.len() - 2..], &[merged("4"), merged("2")]);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    ChatTemplate::for_model(&out).unwrap();

    let model =
        load::<qerl_nn::backends::Cpu>(&out, &LoadOptions::default(), &Default::default()).unwrap();
    let scores = score(&model, &ids, 3).unwrap();
    assert_eq!(scores.len(), ids.len());
    let gen = run_ok(&[
        "generate",
        "--model",
        &o,
        "--chat",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "4",
        "--greedy",
        "--json",
    ]);
    let doc: Value = serde_json::from_str(&gen).unwrap();
    assert!(!doc["completions"][0]["ids"].as_array().unwrap().is_empty());

    // A second conversion into the same directory is refused.
    let again = qerl(&["convert", &g, &o]);
    assert!(!again.status.success());
    assert!(text(&again.stderr).contains("refusing to overwrite"));
}

#[test]
fn synthetic_qwen2_gguf_converts_to_a_model_that_loads_and_generates() {
    let (bytes, _, _) = gguf_common::tiny_model("qwen2");
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny-qwen2.gguf");
    std::fs::write(&gguf, bytes).unwrap();
    let out = tmp.path().join("hf");
    let o = out.display().to_string();
    let stdout = run_ok(&["convert", gguf.to_str().unwrap(), &o]);
    assert!(
        stdout.contains("Qwen2ForCausalLM") && stdout.contains("rows of 0 q/k"),
        "{stdout}"
    );
    let tok = Tokenizer::for_model(&out, None).unwrap();
    let ids = tok.encode("hello world 42", true).unwrap();
    assert_eq!(tok.decode_ids(&ids, false).unwrap(), "hello world 42");
    let model =
        load::<qerl_nn::backends::Cpu>(&out, &LoadOptions::default(), &Default::default()).unwrap();
    assert!(model.config.qkv_bias);
    assert_eq!(score(&model, &ids, 3).unwrap().len(), ids.len());
    run_ok(&[
        "generate",
        "--model",
        &o,
        "--prompt",
        "hello",
        "--max-new-tokens",
        "3",
        "--greedy",
    ]);
}

#[test]
fn a_bad_gguf_is_reported_by_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("bad.gguf");
    let (bytes, _, _) = gguf_common::tiny_llama();
    std::fs::write(&gguf, &bytes[..bytes.len() / 2]).unwrap();
    let out = tmp.path().join("hf");
    let result = qerl(&["convert", gguf.to_str().unwrap(), out.to_str().unwrap()]);
    assert!(!result.status.success());
    let err = text(&result.stderr);
    assert!(
        err.contains("bad.gguf") && err.contains("truncated"),
        "{err}"
    );
    assert!(!out.exists());
}

/// The SmolLM2 GGUF if it is here, else `None` after saying how to get it.
fn smollm2() -> Option<PathBuf> {
    let path = std::env::var_os("QERL_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if path.is_file() {
        return Some(path);
    }
    eprintln!(
        "skipping: no SmolLM2 GGUF at {} (run tools/fetch_smollm2.sh, or set QERL_SMOLLM2_GGUF)",
        path.display()
    );
    None
}

/// The converted SmolLM2's next-token log-probabilities (qerl, CPU, f32) against a float64 numpy
/// forward pass in llama.cpp's convention on gguf-py's dequantization
/// (tests/fixtures/gguf/smollm2_q4_1_reference.json, made by tools/gguf_oracle.py).
#[test]
fn smollm2_matches_the_independent_reference_and_answers_in_nvfp4() {
    let Some(gguf) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dense = tmp.path().join("smollm2");
    let (g, d) = (gguf.display().to_string(), dense.display().to_string());
    run_ok(&["convert", &g, &d]);

    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/fixtures/gguf/smollm2_q4_1_reference.json"))
            .unwrap(),
    )
    .unwrap();
    let want_ids: Vec<u32> = reference["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let tok = Tokenizer::for_model(&dense, None).unwrap();
    let ids = tok
        .encode(reference["text"].as_str().unwrap(), true)
        .unwrap();
    assert_eq!(ids, want_ids, "tokenization of the reference text");

    let model =
        load::<qerl_nn::backends::Cpu>(&dense, &LoadOptions::default(), &Default::default())
            .unwrap();
    let scores = score(&model, &ids, 10).unwrap();
    let (mut worst, mut shared) = (0f64, 0);
    for (i, (ours, want)) in scores
        .iter()
        .zip(reference["positions"].as_array().unwrap())
        .enumerate()
    {
        let want: Vec<(u32, f64)> = want["top"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap()))
            .collect();
        assert_eq!(ours.top[0].0, want[0].0, "top-1 at position {i}");
        for &(id, lp) in &ours.top {
            if let Some(&(_, w)) = want.iter().find(|(wid, _)| *wid == id) {
                worst = worst.max((lp as f64 - w).abs());
                shared += 1;
            }
        }
    }
    eprintln!(
        "SmolLM2: top-1 agrees at all {} positions; max |log-prob difference| {worst:.2e} over {shared} shared top-10 entries",
        scores.len()
    );
    assert!(worst < 2e-3, "log-probabilities differ by {worst}");
    assert!(shared >= 8 * scores.len());

    let nvfp4 = tmp.path().join("smollm2-nvfp4");
    let n = nvfp4.display().to_string();
    run_ok(&["quantize", &d, &n]);
    let gen = run_ok(&[
        "generate",
        "--model",
        &n,
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "12",
        "--greedy",
        "--json",
    ]);
    let doc: Value = serde_json::from_str(&gen).unwrap();
    assert_eq!(doc["precision"], "nvfp4");
    let answer = doc["completions"][0]["text"].as_str().unwrap();
    eprintln!("SmolLM2 NVFP4: {answer:?}");
    assert!(answer.contains("Paris"), "{answer}");
}
