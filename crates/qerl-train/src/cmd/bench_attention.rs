//! `qerl bench attention`: the fused attention op ([`qerl_nn::causal_attention`]) against the
//! decomposed one the model used before (scores with a matmul in the float type, an f32 bias,
//! softmax, probabilities cast back, a second matmul; burn's autodiff for the backward), on one
//! device: first a correctness check with right padding and grouped-query heads at a small
//! shape (lengths off the tiles), then forward and forward + backward time and the bytes the
//! forward holds for the backward at a training shape (default: Qwen2.5-7B, 16 x 320).

use std::time::Instant;

use anyhow::{bail, Result};
use burn::backend::Autodiff;
use burn::tensor::activation::softmax;
use burn::tensor::{DType, Distribution, Tensor, TensorData};
use clap::Args as ClapArgs;
use qerl_nn::{causal_attention, causal_mask, QerlBackend};

use super::generate::DeviceArg;

#[derive(ClapArgs, Debug)]
pub struct AttentionArgs {
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Padded sequence length; rows get lengths from `seq` down to `seq / 2`.
    #[arg(long, default_value_t = 320)]
    pub seq: usize,
    #[arg(long, default_value_t = 28)]
    pub heads: usize,
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Timed iterations (after two warm-up ones).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Activation types on CUDA: bf16, f32 (comma-separated); wgpu and cpu run f32.
    #[arg(long, default_value = "bf16,f32", value_delimiter = ',')]
    pub dtype: Vec<String>,
    #[arg(long, value_enum, default_value = "cuda")]
    pub device: DeviceArg,
    /// Skip the correctness check.
    #[arg(long)]
    pub no_check: bool,
}

pub fn run(a: AttentionArgs) -> Result<()> {
    if a.batch == 0 || a.seq == 0 || a.kv_heads == 0 || !a.heads.is_multiple_of(a.kv_heads) {
        bail!("--batch and --seq must be positive and --heads a multiple of --kv-heads");
    }
    for dtype in &a.dtype {
        if dtype != "bf16" && dtype != "f32" {
            bail!("--dtype: `{dtype}` is not bf16 or f32");
        }
        match a.device {
            DeviceArg::Cpu => bench::<qerl_nn::backends::Cpu>(&a, "f32", &Default::default())?,
            #[cfg(feature = "wgpu")]
            DeviceArg::Wgpu => {
                let device = qerl_kernels::runtime::wgpu_device()?;
                bench::<qerl_nn::backends::Wgpu>(&a, "f32", &device)?
            }
            #[cfg(feature = "cuda")]
            DeviceArg::Cuda if dtype == "bf16" => {
                bench::<qerl_nn::backends::Cuda>(&a, "bf16", &Default::default())?
            }
            #[cfg(feature = "cuda")]
            DeviceArg::Cuda => bench::<qerl_nn::backends::CudaF32>(&a, "f32", &Default::default())?,
            #[allow(unreachable_patterns)]
            other => bail!("this build of qerl has no {other:?} support (see --features)"),
        }
        if a.device != DeviceArg::Cuda {
            break; // one float type off CUDA
        }
    }
    Ok(())
}

/// Right padding: row `r` of `batch` holds `seq - r·(seq / 2)/(batch - 1)` tokens.
fn ranges(batch: usize, seq: usize) -> Vec<(usize, usize)> {
    (0..batch)
        .map(|r| (0, seq - r * (seq / 2) / batch.saturating_sub(1).max(1)))
        .collect()
}

/// The model's former attention: `q [b, h, s, d]`, `k`, `v [b, kv, s, d]` -> `[b, h, s, d]`.
fn decomposed<B: QerlBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    ranges: &[(usize, usize)],
    scale: f32,
) -> Tensor<B, 4> {
    let [b, h, s, d] = q.dims();
    let kv = k.dims()[1];
    let g = h / kv;
    let bias = causal_mask(ranges, s, 0.0, -1.0e30);
    let bias = Tensor::<B, 5>::from_data(
        TensorData::new(bias, [b, 1, 1, s, s]),
        (&q.device(), DType::F32),
    );
    let dtype = q.dtype();
    let scores = q
        .reshape([b, kv, g * s, d])
        .matmul(k.swap_dims(2, 3))
        .mul_scalar(scale);
    let scores = scores.reshape([b, kv, g, s, s]).cast(DType::F32) + bias;
    let probs = softmax(scores, 4).cast(dtype).reshape([b, kv, g * s, s]);
    probs.matmul(v).reshape([b, h, s, d])
}

type Inputs<B> = [Tensor<B, 4>; 4];

/// Random `q`, `k`, `v` and an upstream gradient, in the backend's float type.
fn inputs<B: QerlBackend>(
    b: usize,
    h: usize,
    kv: usize,
    s: usize,
    d: usize,
    dev: &B::Device,
) -> Inputs<B> {
    let n = Distribution::Normal(0.0, 1.0);
    [
        Tensor::random([b, h, s, d], n, dev),
        Tensor::random([b, kv, s, d], n, dev),
        Tensor::random([b, kv, s, d], n, dev),
        Tensor::random([b, h, s, d], n, dev),
    ]
}

/// `(out, dq, dk, dv)` of one path under autodiff, as host f32.
fn run_path<B: QerlBackend>(x: &Inputs<B>, ranges: &[(usize, usize)], fused: bool) -> [Vec<f32>; 4]
where
    Autodiff<B>: QerlBackend,
{
    let lift = |t: &Tensor<B, 4>| Tensor::<Autodiff<B>, 4>::from_inner(t.clone()).require_grad();
    let (q, k, v) = (lift(&x[0]), lift(&x[1]), lift(&x[2]));
    let scale = (x[0].dims()[3] as f32).powf(-0.5);
    let out = if fused {
        causal_attention(q.clone(), k.clone(), v.clone(), ranges, scale)
    } else {
        decomposed(q.clone(), k.clone(), v.clone(), ranges, scale)
    };
    let grads = (out.clone() * Tensor::from_inner(x[3].clone()))
        .sum()
        .backward();
    let host = |t: Tensor<B, 4>| {
        t.cast(DType::F32)
            .into_data()
            .iter::<f32>()
            .collect::<Vec<_>>()
    };
    [
        host(out.inner()),
        host(q.grad(&grads).expect("dq")),
        host(k.grad(&grads).expect("dk")),
        host(v.grad(&grads).expect("dv")),
    ]
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| ((g - w) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

fn bench<B: QerlBackend>(a: &AttentionArgs, dtype: &str, dev: &B::Device) -> Result<()>
where
    Autodiff<B>: QerlBackend,
{
    let sync = || B::sync(dev).map_err(|e| anyhow::anyhow!("{e:?}"));
    let (h, kv, d) = (a.heads, a.kv_heads, a.head_dim);
    if !a.no_check {
        // Lengths off the tiles, one sequence of a single token.
        let (b, s) = (3, 77);
        let r = vec![(0, 77), (0, 40), (0, 1)];
        let x = inputs::<B>(b, h.min(8), kv.min(h.min(8)), s, d, dev);
        let want = run_path(&x, &r, false);
        let got = run_path(&x, &r, true);
        // The decomposed path rounds scores and probabilities to the float type.
        let tol = if dtype == "bf16" { 5e-2 } else { 1e-3 };
        let mut line = format!(
            "check {dtype} [{b}, {}, {s}, {d}] kv {}:",
            h.min(8),
            kv.min(h.min(8))
        );
        let mut worst = 0f64;
        for (name, (g, w)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            if let Some(i) = g.iter().position(|v| !v.is_finite()) {
                bail!("fused {name}[{i}] is {}", g[i]);
            }
            let e = rel_err(g, w);
            worst = worst.max(e);
            line += &format!(" {name} {e:.2e}");
        }
        println!("{line} (relative to the decomposed path; bound {tol:.0e})");
        if worst > tol {
            bail!("fused attention differs from the decomposed path: {worst:.2e} > {tol:.0e}");
        }
    }

    let (b, s) = (a.batch, a.seq);
    let r = ranges(b, s);
    let x = inputs::<B>(b, h, kv, s, d, dev);
    let scale = (d as f32).powf(-0.5);
    let causal_flops = 4.0
        * (b * h * d) as f64
        * r.iter()
            .map(|&(_, e)| (e * (e + 1) / 2) as f64)
            .sum::<f64>();
    println!(
        "{dtype} b {b} s {s} heads {h} kv {kv} d {d}, lengths {}..{}: path, forward ms, forward+backward ms, \
         bytes held for the backward",
        r.last().map_or(0, |x| x.1),
        s
    );
    for fused in [true, false] {
        let lift =
            |t: &Tensor<B, 4>| Tensor::<Autodiff<B>, 4>::from_inner(t.clone()).require_grad();
        let forward = |q: Tensor<Autodiff<B>, 4>, k, v| {
            if fused {
                causal_attention(q, k, v, &r, scale)
            } else {
                decomposed(q, k, v, &r, scale)
            }
        };
        let (mut fwd, mut both, mut held) = (0f64, 0f64, 0u64);
        for it in 0..a.iters + 2 {
            let (q, k, v) = (lift(&x[0]), lift(&x[1]), lift(&x[2]));
            sync()?;
            let before = <B as QerlBackend>::memory_usage(dev).map_or(0, |m| m.0);
            let t0 = Instant::now();
            let out = forward(q.clone(), k, v);
            sync()?;
            let t1 = Instant::now();
            let after = <B as QerlBackend>::memory_usage(dev).map_or(0, |m| m.0);
            let grads = (out * Tensor::from_inner(x[3].clone())).sum().backward();
            drop(q.grad(&grads));
            sync()?;
            let t2 = Instant::now();
            if it >= 2 {
                fwd += (t1 - t0).as_secs_f64();
                both += (t2 - t0).as_secs_f64();
                held = held.max(after.saturating_sub(before));
            }
        }
        let n = a.iters.max(1) as f64;
        let (fwd, both) = (fwd / n * 1e3, both / n * 1e3);
        println!(
            "  {:<10} {fwd:9.3} {both:9.3} {:>12}  (forward {:.1} TFLOP/s of the causal work)",
            if fused { "fused" } else { "decomposed" },
            held,
            causal_flops / (fwd * 1e-3) / 1e12
        );
    }
    Ok(())
}
