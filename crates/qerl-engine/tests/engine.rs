//! The engine against a host f64 reference decoder on a small random model (wgpu, f32: lavapipe
//! runs it on the CPU), and its batching invariants.
//!
//! Every fused kernel is on the path: add + RMSNorm (with the gathered final norm), the fused
//! LoRA down-projections, bias and LoRA epilogues (4-bit and dense products), RoPE + KV write,
//! grouped-query attention over the cache, SiLU·mul, the lm_head, sampling, the prompt's cache
//! copied to the other samples, chunked prefill and slot refills. The reference recomputes every
//! sequence from scratch without a cache. Tolerances: f32 activations, so log-probabilities
//! agree to ~1e-4 (checked at 2e-3); tokens must be equal.

use cubecl::prelude::*;
use qerl_engine::reference::{check_engine, test_shape, HostModel};
use qerl_engine::{Completion, Engine, EngineConfig, EngineWeights, Request, Sampling};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type R = cubecl::wgpu::WgpuRuntime;

fn client() -> ComputeClient<R> {
    R::client(&qerl_kernels::runtime::wgpu_device_or_exit())
}

fn random_model(c: &ComputeClient<R>, seed: u64, quant: bool) -> (HostModel, EngineWeights) {
    qerl_engine::reference::random_model::<R, f32>(c, &test_shape(), seed, quant)
}

fn requests(rng: &mut StdRng, n: usize, vocab: u32) -> Vec<Request> {
    (0..n)
        .map(|i| Request {
            id: 100 + i as u32,
            prompt: (0..rng.random_range(1..12))
                .map(|_| rng.random_range(0..vocab))
                .collect(),
            max_new_tokens: rng.random_range(1..9),
        })
        .collect()
}

fn check_against_reference(host: &HostModel, reqs: &[Request], got: &[Completion]) {
    for (r, g) in reqs.iter().zip(got) {
        assert_eq!(g.id, r.id);
        let (want, lps) = host.greedy(&r.prompt, r.max_new_tokens);
        assert_eq!(g.tokens, want, "request {} tokens", r.id);
        for (a, b) in g.logprobs.iter().zip(&lps) {
            assert!(
                (*a as f64 - b).abs() < 2e-3,
                "request {}: logprob {a} vs {b}",
                r.id
            );
        }
    }
}

fn greedy() -> Sampling {
    Sampling {
        temperature: 0.0,
        seed: 1,
        eos: vec![],
        truncation: Default::default(),
    }
}

#[test]
fn greedy_generation_matches_the_host_reference_dense_and_nvfp4() {
    let c = client();
    let seed: u64 = rand::rng().random();
    for quant in [false, true] {
        let (host, weights) = random_model(&c, seed, quant);
        let mut rng = StdRng::seed_from_u64(seed ^ 7);
        let reqs = requests(&mut rng, 5, host.shape().vocab as u32);
        // Two slots for five requests: slots are refilled; 5-token prefill passes: long
        // prompts span passes.
        let config = EngineConfig {
            slots: 2,
            capacity: 32,
            prefill_rows: 5,
            check_every: 2,
        };
        let mut engine = Engine::<R, f32>::new(c.clone(), weights, config).unwrap();
        let got = engine.generate(&reqs, &greedy()).unwrap();
        eprintln!("seed {seed} quant {quant}: {:?}", engine.stats);
        check_against_reference(&host, &reqs, &got);
    }
}

#[test]
fn samples_of_one_prompt_share_its_prefill_and_match_the_reference() {
    let c = client();
    let seed: u64 = rand::rng().random();
    let (host, weights) = random_model(&c, seed, false);
    let prompt = vec![5u32, 17, 3, 88, 41, 9, 60];
    let reqs: Vec<Request> = (0..4)
        .map(|i| Request {
            id: i,
            prompt: prompt.clone(),
            max_new_tokens: 6,
        })
        .collect();
    let config = EngineConfig {
        slots: 4,
        capacity: 16,
        prefill_rows: 64,
        check_every: 4,
    };
    let mut engine = Engine::<R, f32>::new(c, weights, config).unwrap();
    let got = engine.generate(&reqs, &greedy()).unwrap();
    assert_eq!(
        engine.stats.prefill_tokens,
        prompt.len(),
        "one prefill for four samples"
    );
    check_against_reference(&host, &reqs, &got);
}

#[test]
fn a_sampled_sequence_does_not_depend_on_its_batch() {
    let c = client();
    let seed: u64 = rand::rng().random();
    let (_, weights) = random_model(&c, seed, true);
    let mut rng = StdRng::seed_from_u64(seed);
    let reqs = requests(&mut rng, 6, 97);
    let sampling = Sampling {
        temperature: 1.0,
        seed: 42,
        eos: vec![3, 4],
        truncation: Default::default(),
    };
    let config = EngineConfig {
        slots: 3,
        capacity: 32,
        prefill_rows: 16,
        check_every: 1,
    };
    let mut engine = Engine::<R, f32>::new(c, weights, config).unwrap();
    let together = engine.generate(&reqs, &sampling).unwrap();
    for (r, t) in reqs.iter().zip(&together) {
        let alone = engine.generate(std::slice::from_ref(r), &sampling).unwrap();
        assert_eq!(alone[0].tokens, t.tokens, "seed {seed}, request {}", r.id);
        for (a, b) in alone[0].logprobs.iter().zip(&t.logprobs) {
            assert!((a - b).abs() < 1e-4, "seed {seed}, request {}", r.id);
        }
        assert!(t.tokens.len() <= r.max_new_tokens);
        if let Some(p) = t.tokens.iter().position(|x| [3, 4].contains(x)) {
            assert_eq!(p + 1, t.tokens.len(), "stops at the first end token");
            assert!(t.stopped);
        }
    }
    // Some tokens differ between two seeds (the draw is random).
    let other = engine
        .generate(
            &reqs,
            &Sampling {
                seed: 43,
                ..sampling.clone()
            },
        )
        .unwrap();
    assert_ne!(
        together
            .iter()
            .map(|c| c.tokens.clone())
            .collect::<Vec<_>>(),
        other.iter().map(|c| c.tokens.clone()).collect::<Vec<_>>()
    );
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    let c = client();
    let (_, weights) = random_model(&c, 1, false);
    let config = EngineConfig {
        slots: 2,
        capacity: 8,
        prefill_rows: 8,
        check_every: 1,
    };
    let mut engine = Engine::<R, f32>::new(c, weights, config).unwrap();
    let long = Request {
        id: 1,
        prompt: vec![1; 6],
        max_new_tokens: 3,
    };
    let err = engine.generate(&[long], &greedy()).unwrap_err().to_string();
    assert!(err.contains("capacity of 8"), "{err}");
    let oov = Request {
        id: 1,
        prompt: vec![97],
        max_new_tokens: 1,
    };
    let err = engine.generate(&[oov], &greedy()).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
}

#[test]
fn the_benchmark_check_passes_on_wgpu() {
    let c = client();
    for quant in [false, true] {
        let r = check_engine::<R, f32>(&c, 11, quant).unwrap();
        assert_eq!(r.tokens_equal, r.tokens, "{r:?}");
        assert_eq!(r.repeated, r.requests, "{r:?}");
        assert!(r.max_logprob_diff < 2e-3, "{r:?}");
    }
}
