//! The engine over loaded burn models (weights shared) on the parity fixtures, wgpu f32:
//! greedy continuations equal transformers' (the fixtures' references) and the burn path's,
//! for dense and NVFP4 weights, with end tokens and stop strings handled as the burn path does.

#[path = "../../qerl-model/tests/common/mod.rs"]
mod common;

use common::Reference;
use qerl_model::{
    generate, load, Decode, FinishReason, GenerationConfig, LoadOptions, SamplingParams,
};
use qerl_nn::backends::Wgpu;

fn greedy(max_new_tokens: usize, eos: Vec<u32>) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        eos_token_ids: eos,
        ..GenerationConfig::default()
    }
}

/// Decodes token `t` as `t<id> `.
struct Ids;
impl Decode for Ids {
    fn decode(&self, ids: &[u32]) -> qerl_model::Result<String> {
        Ok(ids.iter().map(|t| format!("t{t} ")).collect())
    }
}

#[test]
fn greedy_continuations_equal_transformers_and_the_burn_path() {
    let device = qerl_kernels::runtime::wgpu_device_or_exit();
    for name in ["llama3_rope", "qwen2_tied"] {
        let r = Reference::load(name);
        let (prompts, conts, n) = r.greedy();
        let m = load::<Wgpu>(&r.model_dir(false), &LoadOptions::default(), &device).unwrap();
        let out =
            qerl_engine::from_model::generate(&m, &prompts, &greedy(n, vec![]), None, 0).unwrap();
        let burn = generate(&m, &prompts, &greedy(n, vec![]), None).unwrap();
        for ((e, b), want) in out.iter().zip(&burn).zip(&conts) {
            assert_eq!(&e.tokens, want, "{name}: engine vs transformers");
            assert_eq!(e.tokens, b.tokens, "{name}: engine vs burn");
            for (x, y) in e.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-3, "{name}: logprob {x} vs {y}");
            }
        }
    }
}

#[test]
fn nvfp4_weights_are_shared_and_decode_like_the_burn_path() {
    let device = qerl_kernels::runtime::wgpu_device_or_exit();
    let r = Reference::load("qwen2_tied");
    let (prompts, _, n) = r.greedy();
    let m = load::<Wgpu>(&r.model_dir(true), &LoadOptions::default(), &device).unwrap();
    let out = qerl_engine::from_model::generate(&m, &prompts, &greedy(n, vec![]), None, 0).unwrap();
    let burn = generate(&m, &prompts, &greedy(n, vec![]), None).unwrap();
    for (e, b) in out.iter().zip(&burn) {
        assert_eq!(e.tokens, b.tokens);
    }
}

#[test]
fn end_tokens_and_stop_strings_end_completions_as_the_burn_path_does() {
    let device = qerl_kernels::runtime::wgpu_device_or_exit();
    let r = Reference::load("llama3_rope");
    let (prompts, conts, _) = r.greedy();
    let m = load::<Wgpu>(&r.model_dir(false), &LoadOptions::default(), &device).unwrap();
    let out = qerl_engine::from_model::generate(&m, &prompts, &greedy(16, vec![7, 101]), None, 0)
        .unwrap();
    assert_eq!(out[0].tokens, conts[0][..3]);
    assert_eq!(out[0].finish, FinishReason::Eos(101));
    assert_eq!(out[2].finish, FinishReason::Length);
    let stop = format!("t{} t{}", conts[1][4], conts[1][5]);
    let config = GenerationConfig {
        stop_strings: vec![stop.clone()],
        ..greedy(16, vec![])
    };
    let out = qerl_engine::from_model::generate(&m, &prompts, &config, Some(&Ids), 0).unwrap();
    assert_eq!(out[1].tokens, conts[1][..6]);
    assert_eq!(out[1].finish, FinishReason::Stop(stop));
    assert_eq!(out[1].logprobs.len(), 6);
}
