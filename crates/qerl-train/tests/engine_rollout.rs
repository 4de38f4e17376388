//! Rollouts through the engine (`QERL_ENGINE=1` turns it on for wgpu; CUDA uses it by
//! default): on the embedded model, greedy groups equal the burn path's, and sampled groups
//! keep the trainer's contract (tokens, log-probabilities, finish reasons, stop strings).

use qerl_model::{load, FinishReason, GenerationConfig, LoadOptions, SamplingParams, Tokenizer};
use qerl_nn::backends::Wgpu;
use qerl_train::engine_rollout::generate_rows;

fn model_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny-math")
}

#[test]
fn engine_rollouts_match_the_burn_path() {
    let device = qerl_kernels::runtime::wgpu_device_or_exit();
    let m = load::<Wgpu>(&model_dir(), &LoadOptions::default(), &device).unwrap();
    let tok = Tokenizer::from_file(&model_dir().join("tokenizer.json")).unwrap();
    let prompts: Vec<Vec<u32>> = [
        "Question: 12 + 35 = ?",
        "Question: Tom has 7 pens and buys 5. How many?",
    ]
    .iter()
    .map(|q| tok.encode(q, true).unwrap())
    .collect();
    let greedy = GenerationConfig {
        max_new_tokens: 24,
        sampling: SamplingParams::greedy(),
        eos_token_ids: vec![2],
        ..GenerationConfig::default()
    };
    std::env::set_var("QERL_ENGINE", "0");
    let burn = generate_rows(&m, &prompts, &greedy, Some(&tok), 0).unwrap();
    std::env::set_var("QERL_ENGINE", "1");
    let engine = generate_rows(&m, &prompts, &greedy, Some(&tok), 0).unwrap();
    for (e, b) in engine.iter().zip(&burn) {
        assert_eq!(e.tokens, b.tokens);
        assert_eq!(e.finish, b.finish);
        for (x, y) in e.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-3, "{x} vs {y}");
        }
    }
    // Sampled groups: same length bookkeeping as the burn path, a stop string ends a sample.
    let sampled = GenerationConfig {
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        },
        seed: 5,
        stop_strings: vec!["\n".into()],
        ..greedy.clone()
    };
    let group: Vec<Vec<u32>> = std::iter::repeat_n(prompts[1].clone(), 8).collect();
    let out = generate_rows(&m, &group, &sampled, Some(&tok), 16).unwrap();
    assert_eq!(out.len(), 8);
    for c in &out {
        assert_eq!(c.tokens.len(), c.logprobs.len());
        assert!(c.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
        match &c.finish {
            FinishReason::Eos(t) => assert_eq!(c.tokens.last(), Some(t)),
            FinishReason::Stop(s) => assert!(tok
                .decode_ids(&c.tokens, false)
                .unwrap()
                .contains(s.as_str())),
            FinishReason::Length => assert_eq!(c.tokens.len(), 24),
        }
    }
    // The same rows drawn again give the same samples (row ids key the random draws).
    let again = generate_rows(&m, &group, &sampled, Some(&tok), 16).unwrap();
    assert_eq!(out, again);
}
