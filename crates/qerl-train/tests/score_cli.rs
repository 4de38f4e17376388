//! End to end: `qerl score` prints every position's top-K next tokens with log-probabilities.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use qerl_model::{load, score, LoadOptions, Tokenizer};
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

const TEXT: &str = "What is two plus two? Two plus two is four.";

#[test]
fn json_matches_the_library_and_is_consistent() {
    let dir = repo().join("tests/fixtures/compressed-tensors/qwen2_tied/bf16");
    let tok_path = repo().join("tests/fixtures/tokenizers/tiny/tokenizer.json");
    let (m, t) = (dir.display().to_string(), tok_path.display().to_string());
    let out = qerl(&[
        "score",
        "--model",
        &m,
        "--tokenizer",
        &t,
        "--text",
        TEXT,
        "--top-k",
        "4",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let positions = doc["positions"].as_array().unwrap();

    let tok = Tokenizer::from_file(&tok_path).unwrap();
    let ids = tok.encode(TEXT, true).unwrap();
    assert_eq!(positions.len(), ids.len());
    let model =
        load::<qerl_nn::backends::Cpu>(&dir, &LoadOptions::default(), &Default::default()).unwrap();
    let expected = score(&model, &ids, 4).unwrap();
    let mut total = 0f64;
    for (i, (p, e)) in positions.iter().zip(&expected).enumerate() {
        assert_eq!(p["position"], i);
        assert_eq!(p["id"].as_u64().unwrap() as u32, ids[i]);
        assert_eq!(
            p["token"].as_str().unwrap(),
            tok.decode_ids(&[ids[i]], false).unwrap()
        );
        let top = p["top"].as_array().unwrap();
        assert_eq!(top.len(), 4);
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "best first: {lps:?}");
        assert!(lps.iter().all(|&l| l <= 0.0));
        for (t, (id, lp)) in top.iter().zip(&e.top) {
            assert_eq!(t["id"].as_u64().unwrap() as u32, *id);
            assert!((t["logprob"].as_f64().unwrap() - *lp as f64).abs() < 1e-6);
        }
        match e.logprob {
            None => assert!(p["logprob"].is_null() && i == 0),
            Some(lp) => {
                assert!((p["logprob"].as_f64().unwrap() - lp as f64).abs() < 1e-6);
                total += lp as f64;
                // the actual token's log-prob is at most the best candidate's of the position before
                let best_before = positions[i - 1]["top"][0]["logprob"].as_f64().unwrap();
                assert!(lp as f64 <= best_before + 1e-6);
            }
        }
    }
    assert!((doc["total_logprob"].as_f64().unwrap() - total).abs() < 1e-3);
}

#[test]
fn table_output_and_nvfp4_model() {
    let m = repo()
        .join("tests/fixtures/compressed-tensors/llama_untied/nvfp4")
        .display()
        .to_string();
    let t = repo()
        .join("tests/fixtures/tokenizers/tiny/tokenizer.json")
        .display()
        .to_string();
    let out = qerl(&[
        "score",
        "--model",
        &m,
        "--tokenizer",
        &t,
        "--text",
        "Hello world",
        "--top-k",
        "2",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].contains("top-2 next tokens"), "{stdout}");
    assert_eq!(lines.len(), 1 + 2, "{stdout}"); // "Hello", " world"
    assert!(
        lines[1].contains("\"Hello\"") && lines[1].contains(" - "),
        "{stdout}"
    );
    assert!(text(&out.stderr).contains("nvfp4"));
    // without --tokenizer: a clear error
    let out = qerl(&["score", "--model", &m, "--text", "x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no tokenizer.json"),
        "{}",
        text(&out.stderr)
    );
}
