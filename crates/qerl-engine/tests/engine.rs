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
use cubecl::server::Handle;
use qerl_engine::{
    Completion, Engine, EngineConfig, EngineWeights, Frozen, Layer, Linear, LoraWeights,
    ModelShape, Request, Sampling,
};
use qerl_format::{QuantFormat, QuantizedWeight, SourceDtype};
use qerl_kernels::DeviceWeight;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type R = cubecl::wgpu::WgpuRuntime;

fn client() -> ComputeClient<R> {
    R::client(&qerl_kernels::runtime::wgpu_device_or_exit())
}

fn shape() -> ModelShape {
    let head_dim = 16;
    ModelShape {
        name: "test".into(),
        vocab: 97,
        hidden: 64,
        intermediate: 96,
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim,
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        tied_embeddings: false,
        rms_eps: 1e-6,
        inv_freq: (0..head_dim / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / head_dim as f32))
            .collect(),
        max_positions: 256,
    }
}

/// A linear on the host: the frozen weight as the device sees it (dequantized), bias, LoRA.
struct HostLinear {
    n: usize,
    k: usize,
    w: Vec<f32>,
    bias: Option<Vec<f32>>,
    lora: Option<(Vec<f32>, Vec<f32>, usize, f32)>,
}

impl HostLinear {
    fn apply(&self, x: &[f64]) -> Vec<f64> {
        let t: Option<Vec<f64>> = self.lora.as_ref().map(|(a, _, r, _)| {
            (0..*r)
                .map(|j| (0..self.k).map(|c| x[c] * a[j * self.k + c] as f64).sum())
                .collect()
        });
        (0..self.n)
            .map(|o| {
                let mut y: f64 = (0..self.k)
                    .map(|c| x[c] * self.w[o * self.k + c] as f64)
                    .sum();
                if let Some(b) = &self.bias {
                    y += b[o] as f64;
                }
                if let (Some((_, b, r, s)), Some(t)) = (&self.lora, &t) {
                    let l: f64 = (0..*r).map(|j| t[j] * b[o * r + j] as f64).sum();
                    y += *s as f64 * l;
                }
                y
            })
            .collect()
    }
}

struct HostLayer {
    attn_norm: Vec<f32>,
    mlp_norm: Vec<f32>,
    lin: Vec<HostLinear>, // q k v o gate up down
}

struct HostModel {
    s: ModelShape,
    embed: Vec<f32>,
    lm_head: Vec<f32>,
    final_norm: Vec<f32>,
    layers: Vec<HostLayer>,
}

fn rms(x: &[f64], g: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(g).map(|(v, &g)| v * r * g as f64).collect()
}

fn rope(x: &mut [f64], pos: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    for (i, &f) in inv_freq.iter().enumerate() {
        let a = (pos as f32 * f) as f64;
        let (s, c) = a.sin_cos();
        let (x1, x2) = (x[i], x[i + half]);
        x[i] = x1 * c - x2 * s;
        x[i + half] = x2 * c + x1 * s;
    }
}

impl HostModel {
    /// Log-softmax of the next token after `ids`, recomputed from scratch.
    fn next_logprobs(&self, ids: &[u32]) -> Vec<f64> {
        let s = &self.s;
        let (d, hd) = (s.hidden, s.head_dim);
        let mut h: Vec<Vec<f64>> = ids
            .iter()
            .map(|&t| {
                (0..d)
                    .map(|c| self.embed[t as usize * d + c] as f64)
                    .collect()
            })
            .collect();
        for l in &self.layers {
            let xn: Vec<Vec<f64>> = h.iter().map(|x| rms(x, &l.attn_norm, s.rms_eps)).collect();
            let mut q: Vec<Vec<f64>> = xn.iter().map(|x| l.lin[0].apply(x)).collect();
            let mut k: Vec<Vec<f64>> = xn.iter().map(|x| l.lin[1].apply(x)).collect();
            let v: Vec<Vec<f64>> = xn.iter().map(|x| l.lin[2].apply(x)).collect();
            for (p, (qp, kp)) in q.iter_mut().zip(k.iter_mut()).enumerate() {
                for hq in 0..s.q_heads {
                    rope(&mut qp[hq * hd..(hq + 1) * hd], p, &s.inv_freq);
                }
                for hk in 0..s.kv_heads {
                    rope(&mut kp[hk * hd..(hk + 1) * hd], p, &s.inv_freq);
                }
            }
            let group = s.q_heads / s.kv_heads;
            for p in 0..ids.len() {
                let mut att = vec![0f64; s.q_dim()];
                for hq in 0..s.q_heads {
                    let hk = hq / group;
                    let qv = &q[p][hq * hd..(hq + 1) * hd];
                    let scores: Vec<f64> = (0..=p)
                        .map(|j| {
                            let kv = &k[j][hk * hd..(hk + 1) * hd];
                            qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for c in 0..hd {
                        att[hq * hd + c] =
                            (0..=p).map(|j| e[j] / z * v[j][hk * hd + c]).sum::<f64>();
                    }
                }
                let o = l.lin[3].apply(&att);
                for c in 0..d {
                    h[p][c] += o[c];
                }
            }
            for x in h.iter_mut() {
                let xn = rms(x, &l.mlp_norm, s.rms_eps);
                let g = l.lin[4].apply(&xn);
                let u = l.lin[5].apply(&xn);
                let a: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                let dn = l.lin[6].apply(&a);
                for c in 0..d {
                    x[c] += dn[c];
                }
            }
        }
        let xf = rms(h.last().unwrap(), &self.final_norm, s.rms_eps);
        let logits: Vec<f64> = (0..s.vocab)
            .map(|t| (0..d).map(|c| xf[c] * self.lm_head[t * d + c] as f64).sum())
            .collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let lse = m + logits.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        logits.iter().map(|x| x - lse).collect()
    }

    fn greedy(&self, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f64>) {
        let mut ids = prompt.to_vec();
        let (mut toks, mut lps) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let lp = self.next_logprobs(&ids);
            let (t, &best) = lp
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.partial_cmp(b.1).unwrap())
                .unwrap();
            ids.push(t as u32);
            toks.push(t as u32);
            lps.push(best);
        }
        (toks, lps)
    }
}

fn uniform(rng: &mut StdRng, len: usize, bound: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-bound..bound)).collect()
}

fn up(c: &ComputeClient<R>, v: &[f32]) -> Handle {
    c.create_from_slice(f32::as_bytes(v))
}

/// A random model, on the host and on the device; `quant`: the frozen linears in NVFP4.
fn random_model(c: &ComputeClient<R>, seed: u64, quant: bool) -> (HostModel, EngineWeights) {
    let s = shape();
    let mut rng = StdRng::seed_from_u64(seed);
    let (d, i) = (s.hidden, s.intermediate);
    let mut layers = Vec::new();
    let mut dev_layers = Vec::new();
    for _ in 0..s.layers {
        let dims = [
            (s.q_dim(), d, true),
            (s.kv_dim(), d, true),
            (s.kv_dim(), d, true),
            (d, s.q_dim(), false),
            (i, d, false),
            (i, d, false),
            (d, i, false),
        ];
        let mut lin = Vec::new();
        let mut dev = Vec::new();
        for (idx, (n, k, bias)) in dims.into_iter().enumerate() {
            let bound = 1.5 / (k as f32).sqrt();
            let w = uniform(&mut rng, n * k, bound);
            let (w_host, weight) = if quant {
                let q = QuantizedWeight::quantize(
                    QuantFormat::Nvfp4,
                    "w",
                    &w,
                    &[n, k],
                    SourceDtype::F32,
                )
                .unwrap();
                (
                    q.dequantize(),
                    Frozen::Quant(DeviceWeight::upload(c, &q).unwrap()),
                )
            } else {
                (w.clone(), Frozen::Dense(up(c, &w)))
            };
            let bias = bias.then(|| uniform(&mut rng, n, 0.1));
            // Rank 4 on every linear but `o` (a linear without an adapter), rank 4 everywhere else.
            let lora = (idx != 3).then(|| {
                let r = 4;
                (
                    uniform(&mut rng, r * k, bound),
                    uniform(&mut rng, n * r, 0.2),
                    r,
                    0.5f32,
                )
            });
            dev.push(Linear {
                n,
                k,
                weight,
                bias: bias.as_ref().map(|b| up(c, b)),
                lora: lora.as_ref().map(|(a, b, r, sc)| LoraWeights {
                    a: up(c, a),
                    b: up(c, b),
                    rank: *r,
                    scale: *sc,
                }),
            });
            lin.push(HostLinear {
                n,
                k,
                w: w_host,
                bias,
                lora,
            });
        }
        let attn_norm: Vec<f32> = (0..d).map(|_| rng.random_range(0.8..1.2)).collect();
        let mlp_norm: Vec<f32> = (0..d).map(|_| rng.random_range(0.8..1.2)).collect();
        let mut it = dev.into_iter();
        let mut nx = || it.next().unwrap();
        dev_layers.push(Layer {
            attn_norm: up(c, &attn_norm),
            q: nx(),
            k: nx(),
            v: nx(),
            o: nx(),
            mlp_norm: up(c, &mlp_norm),
            gate: nx(),
            up: nx(),
            down: nx(),
        });
        layers.push(HostLayer {
            attn_norm,
            mlp_norm,
            lin,
        });
    }
    let embed = uniform(&mut rng, s.vocab * d, 1.0);
    let lm_head = uniform(&mut rng, s.vocab * d, 0.5);
    let final_norm: Vec<f32> = (0..d).map(|_| rng.random_range(0.8..1.2)).collect();
    let weights = EngineWeights {
        shape: s.clone(),
        embed: up(c, &embed),
        layers: dev_layers,
        final_norm: up(c, &final_norm),
        lm_head: Some(up(c, &lm_head)),
    };
    (
        HostModel {
            s,
            embed,
            lm_head,
            final_norm,
            layers,
        },
        weights,
    )
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
    }
}

#[test]
fn greedy_generation_matches_the_host_reference_dense_and_nvfp4() {
    let c = client();
    let seed: u64 = rand::rng().random();
    for quant in [false, true] {
        let (host, weights) = random_model(&c, seed, quant);
        let mut rng = StdRng::seed_from_u64(seed ^ 7);
        let reqs = requests(&mut rng, 5, host.s.vocab as u32);
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
