//! `qerl-kernel-bench`: times the qerl kernels on the linear shapes of Qwen2.5-7B and -32B.
//!
//! For every layer (fused qkv, o, fused gate/up, down), format and M it prints time, effective
//! bandwidth (packed weights, scales, activations in and out, each counted once) and TFLOP/s,
//! and writes the rows as JSON (`--json`) so that `benches/device_table.py` can put them beside
//! torch/cuBLAS bf16 measured in the same run on the same GPU.
//!
//! Times are device times (`ComputeClient::profile`, CUDA events on CUDA) over `--iters`
//! back-to-back launches after a warm-up, the median of `--repeats` such batches. Weights are
//! random valid codes and scales (the kernels' speed does not depend on the values), so no
//! host quantization is needed.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_bench::{random_weight, shapes};
use qerl_format::QuantFormat;
use qerl_kernels::{dequant, gemm, rms_norm, DeviceWeight};
use rand::{Rng, SeedableRng};

#[derive(Parser, Debug)]
#[command(about = "Times qerl's kernels on Qwen2.5 linear shapes")]
struct Args {
    /// Models whose shapes to run: qwen2.5-7b, qwen2.5-32b.
    #[arg(long, value_delimiter = ',', default_value = "qwen2.5-7b,qwen2.5-32b")]
    models: Vec<String>,
    /// Rows of the activation (tokens).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256,1024,4096")]
    m: Vec<usize>,
    /// Formats to time.
    #[arg(long, value_delimiter = ',', default_value = "nvfp4,mxfp4,nf4")]
    formats: Vec<QuantFormat>,
    /// Kernels: matmul, dx, lora, dequant, rmsnorm; `old` also times matmul and dx with the
    /// tensor-core path off (the portable tiled kernel) at the M listed in `--old-m`;
    /// `nosplit` times matmul, dx and LoRA (rank 16) with split-K off at the M in `--old-m`
    /// (nvfp4); `tc` times matmul at 8 < M <= 16 on the tensor-core path instead of the decode
    /// kernel; `strategies` times matmul, dX and LoRA (rank 16) at M > 16 (nvfp4) with each
    /// strategy alone (`@tc`: tensor-core kernel, tiles by cube count; `@cublas`: dequantize +
    /// cuBLAS) and its parts, `dense@cublas` (cuBLAS on an already decoded weight) and
    /// `dequant_rows` (the decode into it), beside the rows `matmul`, `dx`, `lora16` of `--strategy`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "matmul,dx,lora,dequant,rmsnorm"
    )]
    kernels: Vec<String>,
    /// The strategy of the plain rows above the decode kernel: tuned (CubeCL's autotuner over
    /// the tensor-core tiles and, where libcublas loads, dequantize + cuBLAS; the tuning cache
    /// is written under target/autotune), tc (tensor-core kernel, tiles by cube count), cublas.
    #[arg(long, default_value = "tuned", value_parser = ["tuned", "tc", "cublas"])]
    strategy: String,
    /// The strategies `strategies` times alone: tc, cublas.
    #[arg(long, value_delimiter = ',', default_value = "tc,cublas")]
    strategies: Vec<String>,
    /// Rows at which `old` times the tiled kernel.
    #[arg(long, value_delimiter = ',', default_value = "16,256,1024")]
    old_m: Vec<usize>,
    /// Launches per timed batch.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Timed batches (the median is reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Skip a case whose single launch takes longer than this many milliseconds.
    #[arg(long, default_value_t = 200.0)]
    max_ms: f64,
    /// Where to write the rows as JSON.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

struct Row {
    model: String,
    layer: &'static str,
    kernel: &'static str,
    format: String,
    m: usize,
    n: usize,
    k: usize,
    seconds: f64,
    bytes: f64,
    flops: f64,
}

impl Row {
    fn print(&self) {
        println!(
            "{:<12} {:<8} {:<8} {:<6} {:>5} {:>6} {:>6} {:>10.1} {:>7.3} {:>8.2}",
            self.model,
            self.layer,
            self.kernel,
            self.format,
            self.m,
            self.n,
            self.k,
            self.seconds * 1e6,
            self.bytes / self.seconds / 1e12,
            self.flops / self.seconds / 1e12,
        );
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "model": self.model, "layer": self.layer, "kernel": self.kernel,
            "format": self.format, "m": self.m, "n": self.n, "k": self.k,
            "us": self.seconds * 1e6,
            "tb_s": self.bytes / self.seconds / 1e12,
            "tflop_s": self.flops / self.seconds / 1e12,
        })
    }
}

/// `lora_down`, then the product with the LoRA epilogue (scale 2): a LoRA linear's forward.
fn lora_product<R: Runtime>(
    c: &ComputeClient<R>,
    (x, m, k): (&Handle, usize, usize),
    w: &DeviceWeight,
    (a, b, t, rank): (&Handle, &Handle, &Handle, usize),
    y: &Handle,
) {
    type F = half::bf16;
    gemm::lora_down::<R, F>(c, x, a, t, m, k, rank).unwrap();
    let l = gemm::LoraEpilogue {
        t,
        b,
        rank,
        scale: 2.0,
    };
    gemm::matmul::<R, F>(c, x, m, w, None, Some(l), y).unwrap();
}

/// The row name of a product timed with one strategy alone.
fn strategy_row(product: &str, strategy: &str) -> &'static str {
    match (product, strategy) {
        ("matmul", "tc") => "matmul@tc",
        ("matmul", _) => "matmul@cublas",
        ("dx", "tc") => "dx@tc",
        ("dx", _) => "dx@cublas",
        (_, "tc") => "lora16@tc",
        _ => "lora16@cublas",
    }
}

/// Median device time of one launch of `f` (the first call, which may tune, is not timed).
fn time<R: Runtime>(
    client: &ComputeClient<R>,
    iters: usize,
    repeats: usize,
    mut f: impl FnMut() + Send,
) -> Result<f64> {
    f();
    cubecl::future::block_on(client.sync()).context("sync")?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let ((), d) = client
            .profile(
                || {
                    for _ in 0..iters {
                        f()
                    }
                },
                "bench",
            )
            .map_err(|e| anyhow::anyhow!("profile: {e:?}"))?;
        let ticks = cubecl::future::block_on(d.resolve());
        times.push(ticks.duration().as_secs_f64() / iters as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

fn random_activations<R: Runtime>(c: &ComputeClient<R>, len: usize, rng: &mut impl Rng) -> Handle {
    let v: Vec<half::bf16> = (0..len)
        .map(|_| half::bf16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect();
    c.create_from_slice(half::bf16::as_bytes(&v))
}

fn run<R: Runtime>(device: &R::Device, args: &Args) -> Result<Vec<Row>> {
    type F = half::bf16;
    let c = R::client(device);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut rows = Vec::new();
    let (iters, reps) = (args.iters, args.repeats);
    let want = |k: &str| args.kernels.iter().any(|x| x == k);
    gemm::set_strategy(match args.strategy.as_str() {
        "tc" => gemm::Strategy::TensorCores,
        "cublas" => gemm::Strategy::Cublas,
        _ => gemm::Strategy::Tuned,
    });
    println!(
        "{:<12} {:<8} {:<8} {:<6} {:>5} {:>6} {:>6} {:>10} {:>7} {:>8}",
        "model", "layer", "kernel", "format", "M", "N", "K", "us", "TB/s", "TFLOP/s"
    );
    for model in &args.models {
        for (layer, n, k) in shapes(model)? {
            for &format in &args.formats {
                let w = DeviceWeight::upload(&c, &random_weight(format, n, k, &mut rng))?;
                let scale_bytes = match format {
                    QuantFormat::Nf4 => 4 * n * k / format.block_size(),
                    _ => n * k / format.block_size(),
                } as f64;
                let weight_bytes = (n * k / 2) as f64 + scale_bytes;
                let mut push =
                    |kernel: &'static str, m: usize, seconds: f64, bytes: f64, flops: f64| {
                        let row = Row {
                            model: model.clone(),
                            layer,
                            kernel,
                            format: format.to_string(),
                            m,
                            n,
                            k,
                            seconds,
                            bytes,
                            flops,
                        };
                        row.print();
                        rows.push(row);
                    };
                if want("dequant") {
                    let out = c.empty(n * k * 2);
                    let s = time(&c, iters, reps, || {
                        dequant::dequantize::<R, F>(&c, &w, &out).unwrap()
                    })?;
                    push("dequant", 0, s, weight_bytes + (n * k * 2) as f64, 0.0);
                }
                let mut slow = false;
                for &m in &args.m {
                    if slow {
                        break;
                    }
                    let x = random_activations(&c, m * k, &mut rng);
                    let y = c.empty(m * n * 2);
                    let io = (2 * m * k + 2 * m * n) as f64;
                    let flops = 2.0 * (m * n * k) as f64;
                    if want("matmul") {
                        let s = time(&c, iters, reps, || {
                            gemm::matmul::<R, F>(&c, &x, m, &w, None, None, &y).unwrap()
                        })?;
                        push("matmul", m, s, weight_bytes + io, flops);
                        slow = s * 1e3 > args.max_ms;
                    }
                    if want("old") && format == QuantFormat::Nvfp4 && args.old_m.contains(&m) {
                        gemm::use_tensor_cores(false);
                        let dy = random_activations(&c, m * n, &mut rng);
                        let dx = c.empty(m * k * 2);
                        let s = time(&c, iters, reps, || {
                            gemm::matmul::<R, F>(&c, &x, m, &w, None, None, &y).unwrap()
                        })?;
                        push("matmul_old", m, s, weight_bytes + io, flops);
                        let s = time(&c, iters, reps, || {
                            gemm::matmul_transposed::<R, F>(&c, &dy, m, &w, &dx).unwrap()
                        })?;
                        push("dx_old", m, s, weight_bytes + io, flops);
                        gemm::use_tensor_cores(true);
                    }
                    if want("nosplit") && format == QuantFormat::Nvfp4 && args.old_m.contains(&m) {
                        gemm::force_splits(Some(1));
                        let dy = random_activations(&c, m * n, &mut rng);
                        let dx = c.empty(m * k * 2);
                        let s = time(&c, iters, reps, || {
                            gemm::matmul::<R, F>(&c, &x, m, &w, None, None, &y).unwrap()
                        })?;
                        push("matmul_nosplit", m, s, weight_bytes + io, flops);
                        let s = time(&c, iters, reps, || {
                            gemm::matmul_transposed::<R, F>(&c, &dy, m, &w, &dx).unwrap()
                        })?;
                        push("dx_nosplit", m, s, weight_bytes + io, flops);
                        if m >= 256 {
                            let rank = 16;
                            let a = random_activations(&c, rank * k, &mut rng);
                            let b = random_activations(&c, n * rank, &mut rng);
                            let t = c.empty(m * rank * 4);
                            let s = time(&c, iters, reps, || {
                                lora_product(&c, (&x, m, k), &w, (&a, &b, &t, rank), &y);
                            })?;
                            push("lora16_nosplit", m, s, weight_bytes + io, flops);
                        }
                        gemm::force_splits(None);
                    }
                    if want("tc") && format == QuantFormat::Nvfp4 && m > 8 && m <= 16 {
                        gemm::set_decode_max_m(8);
                        let s = time(&c, iters, reps, || {
                            gemm::matmul::<R, F>(&c, &x, m, &w, None, None, &y).unwrap()
                        })?;
                        push("matmul_tc", m, s, weight_bytes + io, flops);
                        gemm::set_decode_max_m(16);
                    }
                    if want("strategies") && format == QuantFormat::Nvfp4 && m > 16 {
                        let tuned_or_default = gemm::strategy()?;
                        let alone = |name: &str| args.strategies.iter().any(|s| s == name);
                        let mut strategies = Vec::new();
                        if alone("tc") {
                            strategies.push((gemm::Strategy::TensorCores, "tc"));
                        }
                        let cublas = gemm::cublas_usable::<R, F>(&c);
                        if cublas && alone("cublas") {
                            strategies.push((gemm::Strategy::Cublas, "cublas"));
                        }
                        let dy = random_activations(&c, m * n, &mut rng);
                        let dx = c.empty(m * k * 2);
                        let rank = 16;
                        let a = random_activations(&c, rank * k, &mut rng);
                        let b = random_activations(&c, n * rank, &mut rng);
                        let t = c.empty(m * rank * 4);
                        for (strategy, name) in strategies {
                            gemm::set_strategy(strategy);
                            let s = time(&c, iters, reps, || {
                                gemm::matmul::<R, F>(&c, &x, m, &w, None, None, &y).unwrap()
                            })?;
                            push(strategy_row("matmul", name), m, s, weight_bytes + io, flops);
                            let s = time(&c, iters, reps, || {
                                gemm::matmul_transposed::<R, F>(&c, &dy, m, &w, &dx).unwrap()
                            })?;
                            push(strategy_row("dx", name), m, s, weight_bytes + io, flops);
                            let s = time(&c, iters, reps, || {
                                lora_product(&c, (&x, m, k), &w, (&a, &b, &t, rank), &y);
                            })?;
                            push(strategy_row("lora16", name), m, s, weight_bytes + io, flops);
                        }
                        if cublas {
                            // The two halves of `@cublas`: the decode, and cuBLAS on its output.
                            let dense = c.empty(n * k * 2);
                            let s = time(&c, iters, reps, || {
                                qerl_kernels::dense::dequantize_rows::<R, F>(&c, &w, &dense, k)
                                    .unwrap()
                            })?;
                            push("dequant_rows", m, s, weight_bytes + (n * k * 2) as f64, 0.0);
                            let product = qerl_kernels::blas::DenseProduct {
                                a: &x,
                                a_t: false,
                                b: &dense,
                                b_t: true,
                                c: &y,
                                m,
                                n,
                                k,
                                alpha: 1.0,
                            };
                            let s = time(&c, iters, reps, || {
                                qerl_kernels::blas::products::<R, F>(&c, &[product]).unwrap();
                            })?;
                            push("dense@cublas", m, s, (2 * n * k) as f64 + io, flops);
                        }
                        gemm::set_strategy(tuned_or_default);
                    }
                    if want("dx") && format == QuantFormat::Nvfp4 {
                        let dy = random_activations(&c, m * n, &mut rng);
                        let dx = c.empty(m * k * 2);
                        let s = time(&c, iters, reps, || {
                            gemm::matmul_transposed::<R, F>(&c, &dy, m, &w, &dx).unwrap()
                        })?;
                        push("dx", m, s, weight_bytes + io, flops);
                    }
                    if want("lora") && format == QuantFormat::Nvfp4 && m >= 256 {
                        for rank in [16usize, 32, 64] {
                            let a = random_activations(&c, rank * k, &mut rng);
                            let b = random_activations(&c, n * rank, &mut rng);
                            let t = c.empty(m * rank * 4);
                            let s = time(&c, iters, reps, || {
                                lora_product(&c, (&x, m, k), &w, (&a, &b, &t, rank), &y);
                            })?;
                            let kernel = match rank {
                                16 => "lora16",
                                32 => "lora32",
                                _ => "lora64",
                            };
                            push(kernel, m, s, weight_bytes + io, flops);
                        }
                    }
                }
            }
        }
        if want("rmsnorm") {
            let d = shapes(model)?[1].1;
            for &m in &args.m {
                let x = random_activations(&c, m * d, &mut rng);
                let w = random_activations(&c, d, &mut rng);
                let z = random_activations(&c, d, &mut rng);
                let y = c.empty(m * d * 2);
                let rstd = c.empty(m * 4);
                let s = time(&c, iters, reps, || {
                    rms_norm::forward::<R, F>(&c, &x, &w, Some(&z), m, d, 1e-6, &y, &rstd).unwrap()
                })?;
                let row = Row {
                    model: model.clone(),
                    layer: "norm",
                    kernel: "rmsnorm",
                    format: "bf16".into(),
                    m,
                    n: d,
                    k: d,
                    seconds: s,
                    bytes: (4 * m * d + 4 * d + 4 * m) as f64,
                    flops: 0.0,
                };
                row.print();
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let started = std::time::Instant::now();
    #[cfg(feature = "cuda")]
    let rows = run::<cubecl::cuda::CudaRuntime>(&Default::default(), &args)?;
    #[cfg(not(feature = "cuda"))]
    let rows = run::<cubecl::wgpu::WgpuRuntime>(&Default::default(), &args)?;
    if let Some(path) = &args.json {
        let v: Vec<_> = rows.iter().map(Row::json).collect();
        std::fs::write(path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    eprintln!(
        "{} rows in {:.1?}; cuBLAS on cubecl's stream for {} stream(s)",
        rows.len(),
        Duration::from_secs_f64(started.elapsed().as_secs_f64()),
        qerl_kernels::blas::cubecl_streams_found()
    );
    Ok(())
}
