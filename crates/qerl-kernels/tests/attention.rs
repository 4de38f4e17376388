//! The fused attention kernels against a host f64 reference on fresh random inputs: forward
//! (`out`, `lse`) and backward (`dq`, `dk`, `dv`) with right and left padding, grouped-query
//! heads, and sequence lengths that are not multiples of the tiles. The reference's gradient is
//! itself checked against finite differences of its forward.
//!
//! wgpu (lavapipe in CI): f32 and f16; CUDA (`--features cuda -- --ignored cuda`): bf16, f16,
//! f32. Outputs are filled with NaN before each launch. Error bound: the relative Frobenius
//! error per tensor. The reference takes the inputs rounded to `F`, so what remains is the
//! output rounding plus f32 accumulation: f32 1e-5 (forward) / 1e-4 (backward, which also reads
//! the rounded `out`); f16 2e-3 / 1e-2; bf16 1e-2 / 4e-2 (unit roundoffs 2^-11 and 2^-8; the
//! backward's `dP − D` cancels a few bits).

use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_kernels::attention::{self, AttentionShape};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

fn fresh_rng() -> (StdRng, u64) {
    let seed: u64 = rand::rng().random();
    (StdRng::seed_from_u64(seed), seed)
}

fn normal(rng: &mut StdRng, len: usize, std: f64) -> Vec<f64> {
    let d = Normal::new(0.0, std).unwrap();
    (0..len).map(|_| d.sample(rng)).collect()
}

/// Values rounded to `F` (what the device sees), widened back to f64.
fn rounded<F: Float>(v: &[f64]) -> Vec<f64> {
    v.iter()
        .map(|&x| F::from(x).unwrap().to_f64().unwrap())
        .collect()
}

fn upload<R: Runtime, F: Float + CubeElement>(c: &ComputeClient<R>, v: &[f64]) -> Handle {
    let xs: Vec<F> = v.iter().map(|&x| F::from(x).unwrap()).collect();
    c.create_from_slice(F::as_bytes(&xs))
}

fn poisoned<R: Runtime, F: Float + CubeElement>(c: &ComputeClient<R>, len: usize) -> Handle {
    c.create_from_slice(F::as_bytes(&vec![F::from(f32::NAN).unwrap(); len]))
}

fn read<R: Runtime, F: Float + CubeElement>(c: &ComputeClient<R>, h: &Handle) -> Vec<f64> {
    let bytes = c.read_one(h.clone()).expect("read back");
    F::from_bytes(&bytes)
        .iter()
        .map(|x| x.to_f64().unwrap())
        .collect()
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64, seed: u64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: element {i} is {} (unwritten?), seed {seed}",
            got[i]
        );
    }
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum::<f64>().max(1e-300);
    let rel = (num / den).sqrt();
    assert!(
        rel <= tol,
        "{what}: relative error {rel:.3e} > {tol:.1e}, seed {seed}"
    );
}

/// Host reference of one problem, in f64.
#[derive(Clone)]
struct Problem {
    shape: AttentionShape,
    ranges: Vec<(usize, usize)>,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    d_out: Vec<f64>,
}

struct Reference {
    out: Vec<f64>,
    /// `None` for a query that sees no key.
    lse: Vec<Option<f64>>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

impl Problem {
    fn sees(&self, b: usize, i: usize, j: usize) -> bool {
        let (s, e) = self.ranges[b];
        j >= s && j < e && j <= i
    }

    /// The weights `P` of query row `(b, h, i)` over all keys, and the log-sum-exp.
    fn probs(&self, q: &[f64], k: &[f64], b: usize, h: usize, i: usize) -> (Vec<f64>, Option<f64>) {
        let s = &self.shape;
        let (n, d) = (s.seq, s.head_dim);
        let kvh = h / (s.heads / s.kv_heads);
        let qrow = &q[((b * s.heads + h) * n + i) * d..][..d];
        let kbase = (b * s.kv_heads + kvh) * n * d;
        let scores: Vec<Option<f64>> = (0..n)
            .map(|j| {
                self.sees(b, i, j).then(|| {
                    let krow = &k[kbase + j * d..][..d];
                    s.scale as f64 * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>()
                })
            })
            .collect();
        let m = scores
            .iter()
            .flatten()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            return (vec![0.0; n], None);
        }
        let sum: f64 = scores.iter().flatten().map(|x| (x - m).exp()).sum();
        let lse = m + sum.ln();
        let p = scores
            .iter()
            .map(|x| x.map_or(0.0, |x| (x - lse).exp()))
            .collect();
        (p, Some(lse))
    }

    fn forward(&self, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<Option<f64>>) {
        let s = &self.shape;
        let (n, d) = (s.seq, s.head_dim);
        let mut out = vec![0.0; q.len()];
        let mut lses = Vec::new();
        for b in 0..s.batch {
            for h in 0..s.heads {
                let vbase = (b * s.kv_heads + h / (s.heads / s.kv_heads)) * n * d;
                for i in 0..n {
                    let (p, lse) = self.probs(q, k, b, h, i);
                    lses.push(lse);
                    let o = &mut out[((b * s.heads + h) * n + i) * d..][..d];
                    for (j, pj) in p.iter().enumerate() {
                        for (c, oc) in o.iter_mut().enumerate() {
                            *oc += pj * v[vbase + j * d + c];
                        }
                    }
                }
            }
        }
        (out, lses)
    }

    fn reference(&self) -> Reference {
        let s = &self.shape;
        let (n, d) = (s.seq, s.head_dim);
        let (out, lse) = self.forward(&self.q, &self.k, &self.v);
        let (mut dq, mut dk, mut dv) = (
            vec![0.0; self.q.len()],
            vec![0.0; self.k.len()],
            vec![0.0; self.v.len()],
        );
        let scale = s.scale as f64;
        for b in 0..s.batch {
            for h in 0..s.heads {
                let kvbase = (b * s.kv_heads + h / (s.heads / s.kv_heads)) * n * d;
                for i in 0..n {
                    let row = ((b * s.heads + h) * n + i) * d;
                    let (p, _) = self.probs(&self.q, &self.k, b, h, i);
                    let go = &self.d_out[row..][..d];
                    let dp: Vec<f64> = (0..n)
                        .map(|j| (0..d).map(|c| go[c] * self.v[kvbase + j * d + c]).sum())
                        .collect();
                    let dd: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                    for j in 0..n {
                        let ds = p[j] * (dp[j] - dd);
                        for c in 0..d {
                            dq[row + c] += scale * ds * self.k[kvbase + j * d + c];
                            dk[kvbase + j * d + c] += scale * ds * self.q[row + c];
                            dv[kvbase + j * d + c] += p[j] * go[c];
                        }
                    }
                }
            }
        }
        Reference {
            out,
            lse,
            dq,
            dk,
            dv,
        }
    }
}

/// `(batch, heads, kv_heads, seq, head_dim, left padding)`: GQA groups of 1 to 4, lengths off
/// the tiles, one head size of 128 (Qwen2.5's).
const CASES: [(usize, usize, usize, usize, usize, bool); 5] = [
    (1, 3, 3, 8, 8, false),
    (2, 4, 2, 37, 16, false),
    (3, 6, 2, 50, 32, false),
    (2, 4, 1, 33, 64, true),
    (2, 2, 1, 19, 128, false),
];

fn problem<F: Float>(rng: &mut StdRng, case: (usize, usize, usize, usize, usize, bool)) -> Problem {
    let (batch, heads, kv_heads, seq, head_dim, left) = case;
    // The first row is full; the others get random lengths (one of length 1 when there are 3).
    let ranges = (0..batch)
        .map(|b| {
            let len = match b {
                0 => seq,
                2 => 1,
                _ => rng.random_range(1..seq),
            };
            if left {
                (seq - len, seq)
            } else {
                (0, len)
            }
        })
        .collect();
    let shape = AttentionShape {
        batch,
        heads,
        kv_heads,
        seq,
        head_dim,
        scale: (head_dim as f32).powf(-0.5),
    };
    let qn = batch * heads * seq * head_dim;
    let kn = batch * kv_heads * seq * head_dim;
    Problem {
        shape,
        ranges,
        q: rounded::<F>(&normal(rng, qn, 1.0)),
        k: rounded::<F>(&normal(rng, kn, 1.0)),
        v: rounded::<F>(&normal(rng, kn, 1.0)),
        d_out: rounded::<F>(&normal(rng, qn, 1.0)),
    }
}

fn supported<R: Runtime, F: Float>(c: &ComputeClient<R>) -> bool {
    let ok = c.properties().supports_type(F::as_type_native_unchecked());
    if !ok {
        eprintln!("skipped: this device has no {}", std::any::type_name::<F>());
    }
    ok
}

pub fn forward_backward<R: Runtime, F: Float + CubeElement>(
    device: &R::Device,
    tol_fwd: f64,
    tol_bwd: f64,
) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    // On CUDA, bf16/f16 take cuBLAS: once as planned (every item in one chunk at these shapes),
    // once a chunk per item (the offsets of later chunks).
    #[cfg(feature = "cuda")]
    let chunkings = [None, Some(1)];
    #[cfg(not(feature = "cuda"))]
    let chunkings = [None];
    for chunking in chunkings {
        #[cfg(feature = "cuda")]
        attention::blas::set_items_per_chunk(chunking);
        check_cases::<R, F>(&c, tol_fwd, tol_bwd, chunking);
    }
    #[cfg(feature = "cuda")]
    attention::blas::set_items_per_chunk(None);
}

fn check_cases<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    tol_fwd: f64,
    tol_bwd: f64,
    chunking: Option<usize>,
) {
    let c = c.clone();
    let (mut rng, seed) = fresh_rng();
    for case in CASES {
        let p = problem::<F>(&mut rng, case);
        let want = p.reference();
        let s = p.shape;
        let (qn, kn, rows) = (p.q.len(), p.k.len(), s.batch * s.heads * s.seq);
        let (q, k, v) = (
            upload::<R, F>(&c, &p.q),
            upload::<R, F>(&c, &p.k),
            upload::<R, F>(&c, &p.v),
        );
        let bounds = attention::upload_bounds(&c, &p.ranges, s.seq);
        let out = poisoned::<R, F>(&c, qn);
        let lse = poisoned::<R, f32>(&c, rows);
        attention::forward::<R, F>(&c, &s, &q, &k, &v, &bounds, &out, &lse).unwrap();
        let what = format!("{case:?} {:?}, items a chunk {chunking:?}", p.ranges);
        let got_out = read::<R, F>(&c, &out);
        assert_close(&format!("out {what}"), &got_out, &want.out, tol_fwd, seed);
        let got_lse = read::<R, f32>(&c, &lse);
        for (i, (g, w)) in got_lse.iter().zip(&want.lse).enumerate() {
            match w {
                Some(w) => assert!(
                    (g - w).abs() <= 1e-4 * (1.0 + w.abs()) + 8.0 * tol_fwd,
                    "lse[{i}] {g} vs {w} {what}, seed {seed}"
                ),
                None => assert!(*g < -1e29, "lse[{i}] of a blind query: {g} {what}"),
            }
        }

        let d_out = upload::<R, F>(&c, &p.d_out);
        let (dq, dk, dv) = (
            poisoned::<R, F>(&c, qn),
            poisoned::<R, F>(&c, kn),
            poisoned::<R, F>(&c, kn),
        );
        attention::backward::<R, F>(
            &c, &s, &q, &k, &v, &bounds, &out, &lse, &d_out, &dq, &dk, &dv,
        )
        .unwrap();
        for (name, h, w) in [
            ("dq", &dq, &want.dq),
            ("dk", &dk, &want.dk),
            ("dv", &dv, &want.dv),
        ] {
            let got = read::<R, F>(&c, h);
            assert_close(&format!("{name} {what}"), &got, w, tol_bwd, seed);
        }
    }
}

/// The reference's gradients equal central differences of `Σ out ⊙ d_out`.
#[test]
fn reference_gradients_match_finite_differences() {
    let (mut rng, seed) = fresh_rng();
    let mut p = problem::<f64>(&mut rng, (2, 4, 2, 6, 4, false));
    p.ranges[1] = (0, 4);
    let want = p.reference();
    let loss = |p: &Problem| -> f64 {
        let (out, _) = p.forward(&p.q, &p.k, &p.v);
        out.iter().zip(&p.d_out).map(|(a, b)| a * b).sum()
    };
    let h = 1e-6;
    let check = |grad: &[f64], pick: &dyn Fn(&mut Problem) -> &mut Vec<f64>, name: &str| {
        for (i, g) in grad.iter().enumerate() {
            let (mut plus, mut minus) = (p.clone(), p.clone());
            pick(&mut plus)[i] += h;
            pick(&mut minus)[i] -= h;
            let fd = (loss(&plus) - loss(&minus)) / (2.0 * h);
            assert!(
                (fd - g).abs() < 1e-6,
                "{name}[{i}]: fd {fd} vs {g}, seed {seed}"
            );
        }
    };
    check(&want.dq, &|p| &mut p.q, "dq");
    check(&want.dk, &|p| &mut p.k, "dk");
    check(&want.dv, &|p| &mut p.v, "dv");
}

macro_rules! suite {
    ($name:ident, $runtime:ty, $device:expr, $float:ty, $fwd:expr, $bwd:expr $(, #[$attr:meta])?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $(#[$attr])? #[test]
            fn attention_forward_backward() {
                super::forward_backward::<$runtime, $float>(&$device, $fwd, $bwd)
            }
        }
    };
}

#[cfg(feature = "wgpu")]
suite!(
    wgpu_f32,
    cubecl::wgpu::WgpuRuntime,
    qerl_kernels::runtime::wgpu_device_or_exit(),
    f32,
    1e-5,
    1e-4
);
#[cfg(feature = "wgpu")]
suite!(
    wgpu_f16,
    cubecl::wgpu::WgpuRuntime,
    qerl_kernels::runtime::wgpu_device_or_exit(),
    half::f16,
    2e-3,
    1e-2
);

#[cfg(feature = "cuda")]
suite!(cuda_bf16, cubecl::cuda::CudaRuntime, cubecl::cuda::CudaDevice::new(0), half::bf16, 1e-2, 4e-2,
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored cuda"]);
#[cfg(feature = "cuda")]
suite!(cuda_f16, cubecl::cuda::CudaRuntime, cubecl::cuda::CudaDevice::new(0), half::f16, 2e-3, 1e-2,
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored cuda"]);
#[cfg(feature = "cuda")]
suite!(cuda_f32, cubecl::cuda::CudaRuntime, cubecl::cuda::CudaDevice::new(0), f32, 1e-5, 1e-4,
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored cuda"]);
