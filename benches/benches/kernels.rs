//! `cargo bench -p qerl-bench`: qerl's kernels on the runtime this build has, each beside a
//! baseline timed in the same process, so the ratio is what to read:
//!
//! * W4A16 product (`gemm::matmul`) and its dX (`gemm::matmul_transposed`), NVFP4 weight,
//!   against burn's dense matmul of the same shape and element type;
//! * `dequant::dequantize` against a burn element-wise op writing the same dense output;
//! * noisy RMSNorm (`rms_norm::forward`, with the AQN noise vector) against burn's `RmsNorm`.
//!
//! wgpu by default (f32; on a machine without a GPU that is Mesa's lavapipe on the CPU, so the
//! shapes are small); `--features cuda` runs bf16 on an NVIDIA GPU with Qwen2.5-7B's shapes.
//! Every timed call waits for the device, so a call's time is its whole cost. The H100 table
//! with cuBLAS beside it is `qerl-kernel-bench` + `device_table.py` (docs/benchmarks/kernels.md).

use std::hint::black_box;

use burn::nn::RmsNormConfig;
use burn::tensor::{backend::Backend, Distribution, Tensor};

use criterion::{criterion_group, criterion_main, Criterion};
use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_bench::random_weight;
use qerl_format::QuantFormat;
use qerl_kernels::{dequant, gemm, rms_norm, DeviceWeight};
use rand::{Rng, SeedableRng};

#[cfg(feature = "cuda")]
mod runtime {
    pub type R = cubecl::cuda::CudaRuntime;
    pub type F = half::bf16;
    pub type B = burn::backend::Cuda<half::bf16, i32>;
    /// `(M, N, K)`: Qwen2.5-7B's o and gate_up projections, decode-sized and prefill-sized M.
    pub const PRODUCTS: &[(usize, usize, usize)] = &[
        (16, 3584, 3584),
        (1024, 3584, 3584),
        (16, 37888, 3584),
        (1024, 37888, 3584),
    ];
    pub const NORMS: &[(usize, usize)] = &[(1024, 3584), (4096, 3584)];
    pub fn elem(v: f32) -> F {
        half::bf16::from_f32(v)
    }
}

#[cfg(not(feature = "cuda"))]
mod runtime {
    pub type R = cubecl::wgpu::WgpuRuntime;
    pub type F = f32;
    pub type B = burn::backend::Wgpu<f32, i32>;
    /// Small enough for lavapipe on a CPU.
    pub const PRODUCTS: &[(usize, usize, usize)] = &[(4, 512, 512), (64, 512, 512)];
    pub const NORMS: &[(usize, usize)] = &[(64, 512)];
    pub fn elem(v: f32) -> F {
        v
    }
}

use runtime::{B, F, NORMS, PRODUCTS, R};

fn wait(client: &ComputeClient<R>) {
    cubecl::future::block_on(client.sync()).expect("device sync");
}

fn random_handle(client: &ComputeClient<R>, len: usize, rng: &mut impl Rng) -> Handle {
    let v: Vec<F> = (0..len)
        .map(|_| runtime::elem(rng.random_range(-1.0f32..1.0)))
        .collect();
    client.create_from_slice(F::as_bytes(&v))
}

fn products(c: &mut Criterion) {
    let device = <R as Runtime>::Device::default();
    let client = R::client(&device);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut dequantized = Vec::new();
    for &(m, n, k) in PRODUCTS {
        let w = random_weight(QuantFormat::Nvfp4, n, k, &mut rng);
        let w = DeviceWeight::upload(&client, &w).expect("upload");
        let x = random_handle(&client, m * k, &mut rng);
        let dy = random_handle(&client, m * n, &mut rng);
        let y = client.empty(m * n * size_of::<F>());
        let dx = client.empty(m * k * size_of::<F>());
        let xt = Tensor::<B, 2>::random([m, k], Distribution::Default, &device);
        let wt = Tensor::<B, 2>::random([k, n], Distribution::Default, &device);
        let dyt = Tensor::<B, 2>::random([m, n], Distribution::Default, &device);
        let wtt = Tensor::<B, 2>::random([n, k], Distribution::Default, &device);

        let mut g = c.benchmark_group(format!("matmul M={m} N={n} K={k}"));
        g.bench_function("qerl nvfp4", |b| {
            b.iter(|| {
                gemm::matmul::<R, F>(&client, &x, m, &w, None, None, &y).expect("matmul");
                wait(&client);
            })
        });
        g.bench_function("burn dense (baseline)", |b| {
            b.iter(|| {
                let out = xt.clone().matmul(wt.clone());
                B::sync(&device).expect("sync");
                black_box(out)
            })
        });
        g.finish();

        let mut g = c.benchmark_group(format!("dX M={m} N={n} K={k}"));
        g.bench_function("qerl nvfp4", |b| {
            b.iter(|| {
                gemm::matmul_transposed::<R, F>(&client, &dy, m, &w, &dx).expect("dX");
                wait(&client);
            })
        });
        g.bench_function("burn dense (baseline)", |b| {
            b.iter(|| {
                let out = dyt.clone().matmul(wtt.clone());
                B::sync(&device).expect("sync");
                black_box(out)
            })
        });
        g.finish();

        if dequantized.contains(&(n, k)) {
            continue;
        }
        dequantized.push((n, k));
        let mut g = c.benchmark_group(format!("dequantize N={n} K={k}"));
        let dense = client.empty(n * k * size_of::<F>());
        g.bench_function("qerl nvfp4", |b| {
            b.iter(|| {
                dequant::dequantize::<R, F>(&client, &w, &dense).expect("dequantize");
                wait(&client);
            })
        });
        g.bench_function("burn x + 1, same output (baseline)", |b| {
            b.iter(|| {
                let out = wtt.clone().add_scalar(1.0);
                B::sync(&device).expect("sync");
                black_box(out)
            })
        });
        g.finish();
    }
}

fn norms(c: &mut Criterion) {
    let device = <R as Runtime>::Device::default();
    let client = R::client(&device);
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    for &(rows, dim) in NORMS {
        let x = random_handle(&client, rows * dim, &mut rng);
        let w = random_handle(&client, dim, &mut rng);
        let z = random_handle(&client, dim, &mut rng);
        let y = client.empty(rows * dim * size_of::<F>());
        let rstd = client.empty(rows * 4);
        let xt = Tensor::<B, 2>::random([rows, dim], Distribution::Default, &device);
        let norm = RmsNormConfig::new(dim).init::<B>(&device);

        let mut g = c.benchmark_group(format!("rmsnorm rows={rows} D={dim}"));
        g.bench_function("qerl noisy (w + z)", |b| {
            b.iter(|| {
                rms_norm::forward::<R, F>(&client, &x, &w, Some(&z), rows, dim, 1e-6, &y, &rstd)
                    .expect("rms_norm");
                wait(&client);
            })
        });
        g.bench_function("burn RmsNorm (baseline)", |b| {
            b.iter(|| {
                let out = norm.forward(xt.clone());
                B::sync(&device).expect("sync");
                black_box(out)
            })
        });
        g.finish();
    }
}

criterion_group!(benches, products, norms);
criterion_main!(benches);
