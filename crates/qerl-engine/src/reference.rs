//! A host f64 reference decoder, recomputing every sequence from scratch without a cache,
//! and random models built on both sides: what the engine's tests and the rollout benchmark's
//! correctness check compare the engine against.

use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_format::{QuantFormat, QuantizedWeight, SourceDtype};
use qerl_kernels::DeviceWeight;

use crate::shape::ModelShape;
use crate::weights::{EngineWeights, Frozen, Layer, Linear, LoraWeights};

/// SplitMix64: a small seeded generator, so the library needs no random-number crate.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    fn uniform(&mut self, len: usize, bound: f32) -> Vec<f32> {
        (0..len)
            .map(|_| (2.0 * self.unit() - 1.0) * bound)
            .collect()
    }
}

/// The test shape: two layers, grouped queries, biases on q/k/v, a linear without adapter.
pub fn test_shape() -> ModelShape {
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
pub struct HostLinear {
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

pub struct HostLayer {
    attn_norm: Vec<f32>,
    mlp_norm: Vec<f32>,
    lin: Vec<HostLinear>, // q k v o gate up down
}

pub struct HostModel {
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
    pub fn shape(&self) -> &ModelShape {
        &self.s
    }

    /// Log-softmax of the next token after `ids`, recomputed from scratch.
    pub fn next_logprobs(&self, ids: &[u32]) -> Vec<f64> {
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

    pub fn greedy(&self, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f64>) {
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

fn up_as<R: Runtime, F: Float + CubeElement>(c: &ComputeClient<R>, v: &[f32]) -> Handle {
    let v: Vec<F> = v
        .iter()
        .map(|&x| F::from(x).expect("an f32 converts to every float type"))
        .collect();
    c.create_from_slice(F::as_bytes(&v))
}

/// A random model, on the host and on the device; `quant`: the frozen linears in NVFP4.
/// A random model of `s`, on the host (f32 values, the 4-bit weights dequantized) and on the
/// device in `F` (the values rounded to it); `quant`: the frozen linears in NVFP4.
pub fn random_model<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    s: &ModelShape,
    seed: u64,
    quant: bool,
) -> (HostModel, EngineWeights) {
    random_model_of_rank::<R, F>(c, s, seed, quant, 4)
}

/// [`random_model`] with LoRA adapters of rank `rank` (the benchmark's is 16).
pub fn random_model_of_rank<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    s: &ModelShape,
    seed: u64,
    quant: bool,
    rank: usize,
) -> (HostModel, EngineWeights) {
    let s = s.clone();
    let mut rng = SplitMix(seed);
    let up = |c: &ComputeClient<R>, v: &[f32]| up_as::<R, F>(c, v);
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
            let w = rng.uniform(n * k, bound);
            let w = round_to::<F>(&w);
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
            let bias = bias.then(|| round_to::<F>(&rng.uniform(n, 0.1)));
            // An adapter on every linear but `o` (a linear without one).
            let lora = (idx != 3).then(|| {
                let r = rank;
                (
                    rng.uniform(r * k, bound),
                    rng.uniform(n * r, 0.2),
                    r,
                    // 0.5 at rank 4: the same size of LoRA term at every rank.
                    2.0 / r as f32,
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
        let attn_norm: Vec<f32> = (0..d).map(|_| 0.8 + 0.4 * rng.unit()).collect();
        let mlp_norm: Vec<f32> = (0..d).map(|_| 0.8 + 0.4 * rng.unit()).collect();
        let mut it = dev.into_iter();
        let mut nx = || it.next().unwrap();
        dev_layers.push(Layer {
            attn_norm: up_f32(c, &attn_norm),
            q: nx(),
            k: nx(),
            v: nx(),
            o: nx(),
            mlp_norm: up_f32(c, &mlp_norm),
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
    let embed = round_to::<F>(&rng.uniform(s.vocab * d, 1.0));
    let lm_head = round_to::<F>(&rng.uniform(s.vocab * d, 0.5));
    let final_norm: Vec<f32> = (0..d).map(|_| 0.8 + 0.4 * rng.unit()).collect();
    let weights = EngineWeights {
        shape: s.clone(),
        embed: up(c, &embed),
        layers: dev_layers,
        final_norm: up_f32(c, &final_norm),
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

/// Norm gains: f32 on the device whatever the compute type.
fn up_f32<R: Runtime>(c: &ComputeClient<R>, v: &[f32]) -> Handle {
    c.create_from_slice(f32::as_bytes(v))
}

/// `v` rounded to `F` and back.
fn round_to<F: Float>(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| F::from(x).map_or(f32::NAN, |y| y.to_f64().map_or(f32::NAN, |z| z as f32)))
        .collect()
}

/// What [`check_engine`] measured: tokens equal to the reference's greedy ones, out of all,
/// and the largest log-probability difference over the positions before the first mismatch.
#[derive(Clone, Copy, Debug)]
pub struct CheckReport {
    pub tokens_equal: usize,
    pub tokens: usize,
    pub first_tokens_equal: usize,
    pub requests: usize,
    pub max_logprob_diff: f64,
    /// Decode steps captured as CUDA graphs and replayed (CUDA sm_90; `QERL_GRAPH=0` turns them
    /// off).
    pub graph_steps: (usize, usize),
    /// Requests whose tokens a second `generate` of the same requests on the same engine
    /// repeated (greedy: all of them; that call replays the first's graphs).
    pub repeated: usize,
}

/// A decode-batch shape for the check: wide enough (`K` 512, every segment a multiple of 128
/// columns) that on CUDA the decode-batch products run as split segment launches, whose gate/up
/// K-slices go straight into SiLU·mul past 8 rows.
pub fn wide_test_shape() -> ModelShape {
    let head_dim = 64;
    ModelShape {
        name: "test-wide".into(),
        hidden: 512,
        intermediate: 256,
        q_heads: 8,
        kv_heads: 2,
        head_dim,
        inv_freq: (0..head_dim / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / head_dim as f32))
            .collect(),
        ..test_shape()
    }
}

/// Runs the engine greedily on random models and compares with the host reference: one of
/// [`test_shape`] (two slots for five requests, 5-token prefill passes, so refills and
/// multi-pass prompts happen; plus four samples of one prompt), then two of
/// [`wide_test_shape`]: decoding 12 rows at a time (16 requests, 24-token prefill passes,
/// LoRA rank 4), and up to 40 (40 requests, rank 16: on sm_90 the warpgroup product from 33
/// rows, every product's K-slices added by the kernel after it).
pub fn check_engine<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    seed: u64,
    quant: bool,
) -> Result<CheckReport, crate::EngineError> {
    let mut report = CheckReport {
        tokens_equal: 0,
        tokens: 0,
        first_tokens_equal: 0,
        requests: 0,
        max_logprob_diff: 0.0,
        graph_steps: (0, 0),
        repeated: 0,
    };
    let r = &mut report;
    check_shape::<R, F>(client, &test_shape(), (2, 5, 5, 4), seed, quant, r)?;
    check_shape::<R, F>(client, &wide_test_shape(), (12, 24, 16, 4), seed, quant, r)?;
    check_shape::<R, F>(client, &wide_test_shape(), (40, 64, 40, 16), seed, quant, r)?;
    Ok(report)
}

/// One model of `shape` in [`check_engine`]: `(slots, prefill rows, requests, LoRA rank)`, the
/// requests followed by four samples of one prompt; adds to `report`.
fn check_shape<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: &ModelShape,
    (slots, prefill_rows, requests, rank): (usize, usize, u32, usize),
    seed: u64,
    quant: bool,
    report: &mut CheckReport,
) -> Result<(), crate::EngineError> {
    use crate::engine::{Engine, EngineConfig, Request, Sampling};
    let (host, weights) = random_model_of_rank::<R, F>(client, shape, seed, quant, rank);
    let mut rng = SplitMix(seed ^ 0x5eed);
    let vocab = shape.vocab as u64;
    let mut reqs: Vec<Request> = (0..requests)
        .map(|i| Request {
            id: 100 + i,
            prompt: (0..1 + rng.next() % 11)
                .map(|_| (rng.next() % vocab) as u32)
                .collect(),
            max_new_tokens: 1 + (rng.next() % 8) as usize,
        })
        .collect();
    let shared: Vec<u32> = (0..7).map(|_| (rng.next() % vocab) as u32).collect();
    reqs.extend((0..4).map(|i| Request {
        id: 200 + i,
        prompt: shared.clone(),
        max_new_tokens: 6,
    }));
    let config = EngineConfig {
        slots,
        capacity: 32,
        prefill_rows,
        check_every: 2,
    };
    let mut engine = Engine::<R, F>::new(client.clone(), weights, config)?;
    let sampling = Sampling {
        temperature: 0.0,
        seed: 1,
        eos: vec![],
        truncation: Default::default(),
    };
    let got = engine.generate(&reqs, &sampling)?;
    // Again on the same engine: its decode steps replay the graphs the first call captured.
    let again = engine.generate(&reqs, &sampling)?;
    report.repeated += got
        .iter()
        .zip(&again)
        .filter(|(a, b)| a.tokens == b.tokens)
        .count();
    let (captured, replayed, _) = engine.graph_report();
    report.graph_steps.0 += captured;
    report.graph_steps.1 += replayed;
    report.requests += reqs.len();
    for (r, g) in reqs.iter().zip(&got) {
        let (want, lps) = host.greedy(&r.prompt, r.max_new_tokens);
        report.tokens += want.len();
        report.tokens_equal += want.iter().zip(&g.tokens).filter(|(a, b)| a == b).count();
        report.first_tokens_equal += usize::from(want.first() == g.tokens.first());
        for ((a, b), (wa, ga)) in g.logprobs.iter().zip(&lps).zip(want.iter().zip(&g.tokens)) {
            report.max_logprob_diff = report.max_logprob_diff.max((*a as f64 - b).abs());
            if wa != ga {
                break;
            }
        }
    }
    Ok(())
}
