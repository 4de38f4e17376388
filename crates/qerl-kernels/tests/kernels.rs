//! The kernel suite: every kernel against a host f64 reference on fresh random inputs.
//!
//! One generic body per kernel, instantiated per runtime and float type by `suite!` (wgpu: f32
//! and f16, which lavapipe runs on a CPU; CUDA: bf16, f16, f32, `#[ignore]`d because they need a
//! GPU: run them there with `--ignored cuda`). Outputs are filled with NaN before each launch, so
//! an element a kernel forgets to write fails the check. Sizes are awkward on purpose: M in
//! {1, 3, 17, 64}; N and K multiples of 16 but (where the format allows) not of 64.
//!
//! Error bounds, as the relative Frobenius error ‖out − ref‖ / ‖ref‖, come from the output type:
//! products accumulate in f32, so the output rounding dominates: f32 1e-5, f16 2e-3 (unit
//! roundoff 2^-11), bf16 1e-2 (unit roundoff 2^-8). Dequantization is checked for exact equality.

use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_format::{QuantFormat, QuantizedWeight, SourceDtype};
use qerl_kernels::rope::{self, RopeShape};
use qerl_kernels::{dequant, gemm, rms_norm, silu_mul, DeviceWeight};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

/// A fresh seed per call, printed on failure, so every run draws new inputs.
fn fresh_rng() -> (StdRng, u64) {
    let seed: u64 = rand::rng().random();
    (StdRng::seed_from_u64(seed), seed)
}

fn normal(rng: &mut StdRng, len: usize, std: f32) -> Vec<f32> {
    let d = Normal::new(0.0f32, std).unwrap();
    (0..len).map(|_| d.sample(rng)).collect()
}

/// A weight with Gaussian entries, a few outliers (so block scales differ) and one zero block.
fn random_weight(rng: &mut StdRng, format: QuantFormat, n: usize, k: usize) -> QuantizedWeight {
    let mut w = normal(rng, n * k, 0.05);
    for _ in 0..(n * k / 97).max(1) {
        let i = rng.random_range(0..n * k);
        w[i] *= 20.0;
    }
    let b = format.block_size();
    w[..b].iter_mut().for_each(|v| *v = 0.0);
    QuantizedWeight::quantize(format, "test.weight", &w, &[n, k], SourceDtype::F32).unwrap()
}

fn to_f<F: Float>(v: &[f32]) -> Vec<F> {
    v.iter().map(|&x| F::from(x).unwrap()).collect()
}

/// Values as the device sees them: rounded to `F`, widened to f64.
fn rounded<F: Float>(v: &[f32]) -> Vec<f64> {
    to_f::<F>(v).iter().map(|x| x.to_f64().unwrap()).collect()
}

fn upload<R: Runtime, F: Float + CubeElement>(c: &ComputeClient<R>, v: &[f32]) -> Handle {
    c.create_from_slice(F::as_bytes(&to_f::<F>(v)))
}

/// A buffer of `len` NaNs.
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

/// Checks every element was written and the relative Frobenius error is within `tol`.
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64, seed: u64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: element {i} is {} (unwritten or overflow), seed {seed}",
            got[i]
        );
    }
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    let rel = (num / den).sqrt();
    assert!(
        rel <= tol,
        "{what}: relative error {rel:.3e} > {tol:.1e}, seed {seed}"
    );
}

/// Shapes `(N, K)` per format: multiples of 16 and, where the block allows, not of 64.
fn shapes(format: QuantFormat) -> Vec<(usize, usize)> {
    match format {
        QuantFormat::Nvfp4 => vec![(48, 80), (112, 208)],
        QuantFormat::Mxfp4 => vec![(80, 96), (48, 160)],
        // NF4 blocks run over the flattened weight: with K = 160 they straddle rows.
        QuantFormat::Nf4 => vec![(48, 192), (48, 160)],
    }
}

// 1, 3 and 8 take the decode kernel where warps exist; 17 and 64 the tiled one.
const MS: [usize; 5] = [1, 3, 8, 17, 64];

fn supported<R: Runtime, F: Float>(c: &ComputeClient<R>) -> bool {
    let ok = c.properties().supports_type(F::as_type_native_unchecked());
    if !ok {
        eprintln!("skipped: this device has no {}", std::any::type_name::<F>());
    }
    ok
}

pub fn dequantize<R: Runtime, F: Float + CubeElement>(device: &R::Device) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    for format in QuantFormat::ALL {
        for (n, k) in shapes(format) {
            let w = random_weight(&mut rng, format, n, k);
            let dw = DeviceWeight::upload(&c, &w).unwrap();
            let out = poisoned::<R, F>(&c, n * k);
            dequant::dequantize::<R, F>(&c, &dw, &out).unwrap();
            let got = read::<R, F>(&c, &out);
            let want = rounded::<F>(&w.dequantize());
            // Same f32 product as the host, then one rounding to F: exact.
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g == e,
                    "{format} [{n},{k}] element {i}: got {g}, want {e}, seed {seed}"
                );
            }
        }
    }
}

/// f64 reference of `X·deq(W)ᵀ + bias + s·(X·Aᵀ)·Bᵀ`.
struct LoraRef<'a> {
    a: &'a [f64],
    b: &'a [f64],
    rank: usize,
    scale: f64,
}

fn matmul_ref(
    x: &[f64],
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    bias: Option<&[f64]>,
    lora: Option<&LoraRef>,
) -> Vec<f64> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        let t: Vec<f64> = lora.map_or(vec![], |l| {
            (0..l.rank)
                .map(|j| (0..k).map(|kk| x[i * k + kk] * l.a[j * k + kk]).sum())
                .collect()
        });
        for j in 0..n {
            let mut acc: f64 = (0..k).map(|kk| x[i * k + kk] * w[j * k + kk] as f64).sum();
            if let Some(b) = bias {
                acc += b[j];
            }
            if let Some(l) = lora {
                acc += l.scale * (0..l.rank).map(|r| t[r] * l.b[j * l.rank + r]).sum::<f64>();
            }
            y[i * n + j] = acc;
        }
    }
    y
}

/// dX = dY·deq(W) through `matmul_transposed` for a fresh random dY (output poisoned first),
/// against the f64 reference on the rounded dY.
#[allow(clippy::too_many_arguments)]
fn check_dx<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    rng: &mut StdRng,
    dw: &DeviceWeight,
    deq: &[f32],
    (m, n, k): (usize, usize, usize),
    what: &str,
    tol: f64,
    seed: u64,
) {
    let dy = normal(rng, m * n, 1.0);
    let dx = poisoned::<R, F>(c, m * k);
    let dyh = upload::<R, F>(c, &dy);
    gemm::matmul_transposed::<R, F>(c, &dyh, m, dw, &dx).unwrap();
    let g = rounded::<F>(&dy);
    let mut want = vec![0.0; m * k];
    for i in 0..m {
        for kk in 0..k {
            want[i * k + kk] = (0..n).map(|j| g[i * n + j] * deq[j * k + kk] as f64).sum();
        }
    }
    assert_close(what, &read::<R, F>(c, &dx), &want, tol, seed);
}

pub fn matmul<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    for format in QuantFormat::ALL {
        for (n, k) in shapes(format) {
            let w = random_weight(&mut rng, format, n, k);
            let dw = DeviceWeight::upload(&c, &w).unwrap();
            let deq = w.dequantize();
            for m in MS {
                let x = normal(&mut rng, m * k, 1.0);
                let bias = normal(&mut rng, n, 0.5);
                for with_bias in [false, true] {
                    let y = poisoned::<R, F>(&c, m * n);
                    let xh = upload::<R, F>(&c, &x);
                    let bh = upload::<R, F>(&c, &bias);
                    let b_arg = with_bias.then_some(&bh);
                    gemm::matmul::<R, F>(&c, &xh, m, &dw, b_arg, None, &y).unwrap();
                    let rb = rounded::<F>(&bias);
                    let want = matmul_ref(
                        &rounded::<F>(&x),
                        &deq,
                        m,
                        n,
                        k,
                        with_bias.then_some(&rb[..]),
                        None,
                    );
                    let what = format!("matmul {format} M={m} N={n} K={k} bias={with_bias}");
                    assert_close(&what, &read::<R, F>(&c, &y), &want, tol, seed);
                }
            }
        }
    }
}

/// `T = X·Aᵀ` (into NaN-filled memory), then the product with bias and the LoRA epilogue into
/// a poisoned output, read back.
fn lora_forward<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    dw: &DeviceWeight,
    xh: &Handle,
    m: usize,
    (ah, bh, rank, scale): (&Handle, &Handle, usize, f32),
    bias: &Handle,
) -> Vec<f64> {
    let (n, k) = (dw.n, dw.k);
    let t = c.create_from_slice(f32::as_bytes(&vec![f32::NAN; m * rank]));
    gemm::lora_down::<R, F>(c, xh, ah, &t, m, k, rank).unwrap();
    let y = poisoned::<R, F>(c, m * n);
    let lora = gemm::LoraEpilogue {
        t: &t,
        b: bh,
        rank,
        scale,
    };
    gemm::matmul::<R, F>(c, xh, m, dw, Some(bias), Some(lora), &y).unwrap();
    read::<R, F>(c, &y)
}

pub fn matmul_lora<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    for format in QuantFormat::ALL {
        let (n, k) = shapes(format)[0];
        let w = random_weight(&mut rng, format, n, k);
        let dw = DeviceWeight::upload(&c, &w).unwrap();
        let deq = w.dequantize();
        for (m, rank) in [(1, 8), (17, 16), (64, 32)] {
            let x = normal(&mut rng, m * k, 1.0);
            let a = normal(&mut rng, rank * k, 0.1);
            let b = normal(&mut rng, n * rank, 0.1);
            let bias = normal(&mut rng, n, 0.5);
            let scale = 32.0 / rank as f32;
            let (xh, ah, bh, biash) = (
                upload::<R, F>(&c, &x),
                upload::<R, F>(&c, &a),
                upload::<R, F>(&c, &b),
                upload::<R, F>(&c, &bias),
            );
            let got = lora_forward::<R, F>(&c, &dw, &xh, m, (&ah, &bh, rank, scale), &biash);
            let (ra, rb) = (rounded::<F>(&a), rounded::<F>(&b));
            let lref = LoraRef {
                a: &ra,
                b: &rb,
                rank,
                scale: scale as f64,
            };
            let want = matmul_ref(
                &rounded::<F>(&x),
                &deq,
                m,
                n,
                k,
                Some(&rounded::<F>(&bias)),
                Some(&lref),
            );
            let what = format!("matmul+LoRA {format} M={m} N={n} K={k} r={rank}");
            assert_close(&what, &got, &want, tol, seed);
        }
    }
}

pub fn matmul_transposed<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    for format in QuantFormat::ALL {
        for (n, k) in shapes(format) {
            let w = random_weight(&mut rng, format, n, k);
            let dw = DeviceWeight::upload(&c, &w).unwrap();
            let deq = w.dequantize();
            for m in MS {
                let what = format!("dX {format} M={m} N={n} K={k}");
                check_dx::<R, F>(&c, &mut rng, &dw, &deq, (m, n, k), &what, tol, seed);
            }
        }
    }
}

/// The tensor-core path (CUDA f16/bf16; skipped where the runtime has no `cmma`): shapes that
/// select each of its tile configurations (32x128, 64x128, 128x128 per cube), with M, N and K
/// not multiples of the tiles, through the forward product (bias, LoRA with its down-projection)
/// and dX.
/// The strategies a product above the decode kernel can take here, each checked alone.
fn strategies<R: Runtime, F: Float>(c: &ComputeClient<R>) -> Vec<gemm::Strategy> {
    let mut all = vec![
        gemm::Strategy::Auto,
        gemm::Strategy::TensorCores,
        gemm::Strategy::Tuned,
    ];
    all.extend(gemm::TileConfig::ALL.map(gemm::Strategy::TensorCoresTiles));
    if gemm::cublas_usable::<R, F>(c) {
        all.push(gemm::Strategy::Cublas);
    } else {
        eprintln!(
            "note: no cuBLAS strategy for {} here",
            std::any::type_name::<F>()
        );
    }
    all
}

/// Sets a process-wide kernel setting and restores the one in force before when a test ends,
/// even by a panic.
struct Restore<T: Copy> {
    before: T,
    set: fn(T),
}

impl<T: Copy> Restore<T> {
    fn set(value: T, before: T, set: fn(T)) -> Restore<T> {
        set(value);
        Restore { before, set }
    }
}

impl<T: Copy> Drop for Restore<T> {
    fn drop(&mut self) {
        (self.set)(self.before);
    }
}

/// The GEMM strategy `s` while alive.
fn strategy_guard(s: gemm::Strategy) -> Restore<gemm::Strategy> {
    Restore::set(s, gemm::strategy().expect("QERL_GEMM"), gemm::set_strategy)
}

/// Products the tensor cores serve (M > 8), through every strategy: each tile configuration
/// alone, the tuner's choice, and dequantize + cuBLAS where it exists (CUDA bf16/f16), with bias,
/// with LoRA (bias and LoRA are extra columns on the cuBLAS path), and dX.
pub fn matmul_tensor_cores<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    // The tensor-core path needs F x F -> f32 cmma; f32 (and wgpu) keep the tiled kernel, which
    // the other tests cover.
    if !has_cmma::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    // (format, M, N, K): forward over 32x128 tiles (M <= 32), 64x128 (M <= 64, or >= 132
    // cubes), 128x128 (M > 64, >= 264 cubes).
    let cases = [
        (QuantFormat::Nvfp4, 9, 176, 96),
        (QuantFormat::Nf4, 16, 96, 160),
        (QuantFormat::Nvfp4, 12, 192, 512),
        (QuantFormat::Nvfp4, 64, 320, 384),
        (QuantFormat::Mxfp4, 150, 5600, 256),
        (QuantFormat::Nvfp4, 17, 176, 96),
        (QuantFormat::Mxfp4, 40, 208, 160),
        (QuantFormat::Nf4, 33, 96, 224),
        (QuantFormat::Nvfp4, 130, 5600, 96),
        (QuantFormat::Nvfp4, 300, 11200, 64),
        // dX over 64x128 and 128x128 tiles (its columns are K).
        (QuantFormat::Nvfp4, 130, 96, 5600),
        (QuantFormat::Nvfp4, 300, 64, 11232),
    ];
    for (format, m, n, k) in cases {
        let w = random_weight(&mut rng, format, n, k);
        let dw = DeviceWeight::upload(&c, &w).unwrap();
        let deq = w.dequantize();
        let x = normal(&mut rng, m * k, 1.0);
        let bias = normal(&mut rng, n, 0.5);
        let rank = 16;
        let a = normal(&mut rng, rank * k, 0.1);
        let b = normal(&mut rng, n * rank, 0.1);
        let scale = 2.0f32;
        let (xh, bh, ah, lbh) = (
            upload::<R, F>(&c, &x),
            upload::<R, F>(&c, &bias),
            upload::<R, F>(&c, &a),
            upload::<R, F>(&c, &b),
        );
        let rx = rounded::<F>(&x);
        let rbias = rounded::<F>(&bias);
        let (ra, rb) = (rounded::<F>(&a), rounded::<F>(&b));
        let lref = LoraRef {
            a: &ra,
            b: &rb,
            rank,
            scale: scale as f64,
        };
        let want_bias = matmul_ref(&rx, &deq, m, n, k, Some(&rbias), None);
        let want_lora = matmul_ref(&rx, &deq, m, n, k, Some(&rbias), Some(&lref));
        for strategy in strategies::<R, F>(&c) {
            let _s = strategy_guard(strategy);
            let what = format!("{strategy:?} {format} M={m} N={n} K={k}");

            let y = poisoned::<R, F>(&c, m * n);
            gemm::matmul::<R, F>(&c, &xh, m, &dw, Some(&bh), None, &y).unwrap();
            let got = read::<R, F>(&c, &y);
            assert_close(&format!("matmul+bias {what}"), &got, &want_bias, tol, seed);

            let got = lora_forward::<R, F>(&c, &dw, &xh, m, (&ah, &lbh, rank, scale), &bh);
            assert_close(
                &format!("matmul+bias+LoRA {what}"),
                &got,
                &want_lora,
                tol,
                seed,
            );

            let what = format!("dX {what}");
            check_dx::<R, F>(&c, &mut rng, &dw, &deq, (m, n, k), &what, tol, seed);
        }
    }
}

/// Dense products ([`gemm::dense_matmul`]: a BF16 model's frozen weights, the lm_head) of 256
/// rows and more, on the tensor-core kernel and on cuBLAS (`set_dense_cublas`, where libcublas
/// loads), into `F` with bias and LoRA and into f32 without, against the f64 host product.
/// Needs `cmma` for `F` (CUDA); skipped elsewhere.
pub fn dense_products<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) || !has_cmma::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    for (m, n, k) in [(260, 96, 192), (300, 64, 320), (256, 200, 128)] {
        let rank = 6;
        let (d, x) = (normal(&mut rng, n * k, 0.1), normal(&mut rng, m * k, 1.0));
        let bias = normal(&mut rng, n, 0.5);
        let (t, b) = (
            normal(&mut rng, m * rank, 1.0),
            normal(&mut rng, n * rank, 0.1),
        );
        let scale = 2.0f32;
        let (rd, rx, rbias, rb) = (
            rounded::<F>(&d),
            rounded::<F>(&x),
            rounded::<F>(&bias),
            rounded::<F>(&b),
        );
        let dot = |u: &[f64], v: &[f64]| u.iter().zip(v).map(|(a, b)| a * b).sum::<f64>();
        let mut plain = vec![0.0; m * n];
        let mut full = vec![0.0; m * n];
        for r in 0..m {
            for col in 0..n {
                let y = dot(&rx[r * k..(r + 1) * k], &rd[col * k..(col + 1) * k]);
                let tr: Vec<f64> = t[r * rank..(r + 1) * rank]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                let l = scale as f64 * dot(&tr, &rb[col * rank..(col + 1) * rank]);
                plain[r * n + col] = y;
                full[r * n + col] = y + rbias[col] + l;
            }
        }
        let (dh, xh, biash, bh) = (
            upload::<R, F>(&c, &d),
            upload::<R, F>(&c, &x),
            upload::<R, F>(&c, &bias),
            upload::<R, F>(&c, &b),
        );
        let th = c.create_from_slice(f32::as_bytes(&t));
        for cublas in [false, true] {
            if cublas && !gemm::cublas_usable::<R, F>(&c) {
                eprintln!("note: no cuBLAS here, dense products checked on the tensor cores only");
                continue;
            }
            let _on = Restore::set(cublas, gemm::dense_cublas(), gemm::set_dense_cublas);
            let what = format!("dense M={m} N={n} K={k} cuBLAS={cublas}");
            let lora = gemm::LoraEpilogue {
                t: &th,
                b: &bh,
                rank,
                scale,
            };
            let y = poisoned::<R, F>(&c, m * n);
            let ran =
                gemm::dense_matmul::<R, F, F>(&c, &xh, m, &dh, n, k, Some(&biash), Some(lora), &y);
            assert!(ran.unwrap(), "{what}: not run");
            assert_close(
                &format!("{what} +bias+LoRA"),
                &read::<R, F>(&c, &y),
                &full,
                tol,
                seed,
            );
            let y32 = poisoned::<R, f32>(&c, m * n);
            let ran = gemm::dense_matmul::<R, F, f32>(&c, &xh, m, &dh, n, k, None, None, &y32);
            assert!(ran.unwrap(), "{what}: not run");
            assert_close(
                &format!("{what} into f32"),
                &read::<R, f32>(&c, &y32),
                &plain,
                tol,
                seed,
            );
        }
    }
}

/// [`qerl_kernels::blas::products`] (the training's LoRA and lm_head products on cuBLAS): every
/// transpose combination with a scale, and a second product reading the first one's output in
/// the same call, against the f64 host product; outputs poisoned. Where cuBLAS cannot run `F`
/// here (wgpu, f32) the call must say so and launch nothing.
pub fn blas_products<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    use qerl_kernels::blas::{self, DenseProduct};
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    let (m, n, k, j) = (70, 24, 48, 36);
    for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
        let (a, b, d) = (
            normal(&mut rng, m * k, 1.0),
            normal(&mut rng, k * n, 1.0),
            normal(&mut rng, n * j, 1.0),
        );
        let (ra, rb, rd) = (rounded::<F>(&a), rounded::<F>(&b), rounded::<F>(&d));
        let alpha = 0.75f32;
        let op_a = |i: usize, l: usize| if a_t { ra[l * m + i] } else { ra[i * k + l] };
        let op_b = |l: usize, q: usize| if b_t { rb[q * k + l] } else { rb[l * n + q] };
        let mut c1 = vec![0.0; m * n];
        for i in 0..m {
            for q in 0..n {
                c1[i * n + q] = alpha as f64 * (0..k).map(|l| op_a(i, l) * op_b(l, q)).sum::<f64>();
            }
        }
        // The second product reads C1 as the device stores it: rounded to F.
        let c1r = rounded::<F>(&c1.iter().map(|&v| v as f32).collect::<Vec<_>>());
        let mut c2 = vec![0.0; m * j];
        for i in 0..m {
            for q in 0..j {
                c2[i * j + q] = (0..n).map(|l| c1r[i * n + l] * rd[l * j + q]).sum();
            }
        }
        let (ah, bh, dh) = (
            upload::<R, F>(&c, &a),
            upload::<R, F>(&c, &b),
            upload::<R, F>(&c, &d),
        );
        let (y1, y2) = (poisoned::<R, F>(&c, m * n), poisoned::<R, F>(&c, m * j));
        let products = [
            DenseProduct {
                a: &ah,
                a_t,
                b: &bh,
                b_t,
                c: &y1,
                m,
                n,
                k,
                alpha,
            },
            DenseProduct {
                a: &y1,
                a_t: false,
                b: &dh,
                b_t: false,
                c: &y2,
                m,
                n: j,
                k: n,
                alpha: 1.0,
            },
        ];
        let ran = blas::products::<R, F>(&c, &products).expect("product shapes");
        assert_eq!(ran, blas::available::<R, F>(&c), "ran where available only");
        if !ran {
            eprintln!("note: no cuBLAS for this type here, dense products not run");
            return;
        }
        let what = format!("blas a_t={a_t} b_t={b_t}");
        assert_close(&what, &read::<R, F>(&c, &y1), &c1, tol, seed);
        assert_close(
            &format!("{what}, chained"),
            &read::<R, F>(&c, &y2),
            &c2,
            tol,
            seed,
        );
    }
    // The device scripts set this where CUPTI is on the library path: the products above must
    // then have run on cubecl's own stream, not silently on the host-ordered path.
    if std::env::var("QERL_EXPECT_CUBECL_STREAM").is_ok_and(|v| v == "1") {
        assert!(
            blas::cubecl_streams_found() > 0,
            "cuBLAS did not find cubecl's stream (CUPTI missing or taken?)"
        );
    }
}

/// cuBLAS ordered against cubecl's stream: per round, slow cubecl copies keep the stream busy, a
/// cubecl copy writes the round's `A` into a buffer every round reuses, cuBLAS computes
/// `C = A·B` into another reused buffer, and a cubecl copy takes `C` into the round's own
/// output. Nothing is read back until every round is queued. A GEMM that starts before its
/// producers finish reads the previous round's `A`; a consumer that runs before the GEMM ends
/// copies the previous round's `C`; either fails the round against the host.
pub fn blas_ordering<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    use qerl_kernels::blas::{self, DenseProduct};
    use qerl_kernels::dense::{widen, ExtraColumn};
    let c = R::client(device);
    if !supported::<R, F>(&c) || !blas::available::<R, F>(&c) {
        eprintln!("note: no cuBLAS for this type here, ordering not checked");
        return;
    }
    let (mut rng, seed) = fresh_rng();
    let (m, n, k, rounds) = (96, 80, 256, 12);
    let copy = |from: &Handle, to: &Handle, rows: usize, cols: usize| {
        widen::<R, F, F>(
            &c,
            Some(from),
            None,
            ExtraColumn::None,
            to,
            rows,
            cols,
            cols,
        )
        .expect("copy shapes")
    };
    // 4 x 32 MB of copies ahead of each round's producer (~100 us on an H100).
    let big = 1 << 24;
    let (slow_in, slow_out) = (
        upload::<R, F>(&c, &normal(&mut rng, big, 1.0)),
        c.empty(big * 4),
    );
    let b = normal(&mut rng, k * n, 1.0);
    let (rb, bh) = (rounded::<F>(&b), upload::<R, F>(&c, &b));
    {
        let (a_live, c_live) = (poisoned::<R, F>(&c, m * k), poisoned::<R, F>(&c, m * n));
        let mut cases = Vec::new();
        for _ in 0..rounds {
            let a = normal(&mut rng, m * k, 1.0);
            let ah = upload::<R, F>(&c, &a);
            for _ in 0..4 {
                copy(&slow_in, &slow_out, big / 256, 256);
            }
            copy(&ah, &a_live, m, k);
            let product = DenseProduct {
                a: &a_live,
                a_t: false,
                b: &bh,
                b_t: false,
                c: &c_live,
                m,
                n,
                k,
                alpha: 1.0,
            };
            assert!(blas::products::<R, F>(&c, &[product]).expect("product shapes"));
            let out = poisoned::<R, F>(&c, m * n);
            copy(&c_live, &out, m, n);
            cases.push((rounded::<F>(&a), out));
        }
        for (round, (ra, out)) in cases.iter().enumerate() {
            let want: Vec<f64> = (0..m * n)
                .map(|e| {
                    (0..k)
                        .map(|l| ra[(e / n) * k + l] * rb[l * n + e % n])
                        .sum()
                })
                .collect();
            let what = format!("blas ordering, round {round}");
            assert_close(&what, &read::<R, F>(&c, out), &want, tol, seed);
        }
    }
}

/// The dense operands of the cuBLAS strategy, on any runtime: `deq(W)` at a row stride wider
/// than K (columns past K untouched), and the widened activation / weight rows (X copied, then
/// `s·T` or `B`, then the bias column, then zeros), all exact against the host.
pub fn dense_operands<R: Runtime, F: Float + CubeElement>(device: &R::Device) {
    use qerl_kernels::dense::{self, ExtraColumn};
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    for format in [QuantFormat::Nvfp4, QuantFormat::Mxfp4, QuantFormat::Nf4] {
        let (n, k, m, rank) = (48, 96, 5, 3);
        let w = random_weight(&mut rng, format, n, k);
        let dw = DeviceWeight::upload(&c, &w).unwrap();
        let deq = rounded::<F>(&w.dequantize());
        let ld = dense::widened_ld(k, rank, true);
        assert!(ld > k + rank && ld.is_multiple_of(dense::LD_ALIGN));
        let x = normal(&mut rng, m * k, 1.0);
        let t = normal(&mut rng, m * rank, 1.0);
        let b = normal(&mut rng, n * rank, 1.0);
        let bias = normal(&mut rng, n, 1.0);
        let scale = 0.75f32;

        // weight side: deq(W) | B | bias | 0
        let ww = poisoned::<R, F>(&c, n * ld);
        dense::dequantize_rows::<R, F>(&c, &dw, &ww, ld).unwrap();
        let (bh, biash) = (upload::<R, F>(&c, &b), upload::<R, F>(&c, &bias));
        let extra = ExtraColumn::PerRow(&biash);
        dense::widen::<R, F, F>(&c, None, Some((&bh, rank, 1.0)), extra, &ww, n, k, ld).unwrap();
        let (rb, rbias) = (rounded::<F>(&b), rounded::<F>(&bias));
        let mut want = vec![0.0; n * ld];
        for r in 0..n {
            want[r * ld..r * ld + k].copy_from_slice(&deq[r * k..(r + 1) * k]);
            want[r * ld + k..r * ld + k + rank].copy_from_slice(&rb[r * rank..(r + 1) * rank]);
            want[r * ld + k + rank] = rbias[r];
        }
        assert_eq!(
            read::<R, F>(&c, &ww),
            want,
            "{format} weight side, seed {seed}"
        );

        // activation side: X | s·T | 1 | 0, T in f32
        let xw = poisoned::<R, F>(&c, m * ld);
        let (xh, th) = (
            upload::<R, F>(&c, &x),
            c.create_from_slice(f32::as_bytes(&t)),
        );
        let tail = Some((&th, rank, scale));
        dense::widen::<R, F, f32>(&c, Some(&xh), tail, ExtraColumn::Ones, &xw, m, k, ld).unwrap();
        let st: Vec<f32> = t.iter().map(|v| v * scale).collect();
        let (rx, rst) = (rounded::<F>(&x), rounded::<F>(&st));
        let mut want = vec![0.0; m * ld];
        for r in 0..m {
            want[r * ld..r * ld + k].copy_from_slice(&rx[r * k..(r + 1) * k]);
            want[r * ld + k..r * ld + k + rank].copy_from_slice(&rst[r * rank..(r + 1) * rank]);
            want[r * ld + k + rank] = 1.0;
        }
        assert_eq!(
            read::<R, F>(&c, &xw),
            want,
            "{format} activation side, seed {seed}"
        );

        // a row stride that is too narrow is an error, not a launch
        let err = dense::widen::<R, F, f32>(&c, Some(&xh), tail, ExtraColumn::Ones, &xw, m, k, k)
            .unwrap_err();
        assert!(err.to_string().contains("row stride"), "{err}");
    }
}

/// Resets the forced split count when a test ends, even by a panic.
struct SplitGuard;

impl SplitGuard {
    fn force(splits: Option<usize>) -> SplitGuard {
        gemm::force_splits(splits);
        SplitGuard
    }
}

impl Drop for SplitGuard {
    fn drop(&mut self) {
        gemm::force_splits(None);
    }
}

/// Whether the tensor-core path serves `F` here (CUDA f16/bf16); prints a skip otherwise.
fn has_cmma<R: Runtime, F: Float>(c: &ComputeClient<R>) -> bool {
    let ty = F::as_type_native_unchecked().storage_type();
    let ok = c
        .properties()
        .features
        .matmul
        .cmma
        .iter()
        .any(|m| m.a_type == ty);
    if !ok {
        eprintln!(
            "skipped: no cmma for {} on this device",
            std::any::type_name::<F>()
        );
    }
    ok
}

/// The decode-batch `mma` kernel's options `o` while alive.
fn mma_guard(o: gemm::MmaOptions) -> Restore<gemm::MmaOptions> {
    Restore::set(o, gemm::mma_options(), gemm::set_mma_options)
}

/// The decode-batch `mma` kernel (CUDA, 1 to 150 rows of an NVFP4/MXFP4 weight with K a multiple
/// of 64): rows and tokens that do not fill a tile, every warp tile, every E2M1 decoding (bit
/// placement on bf16 only), bias, LoRA of rank 16 and of rank 6 (a partial 16-deep step),
/// unsplit and with K-slices forced and chosen. Checks that the kernel ran.
pub fn matmul_mma<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) || !has_cmma::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    let bf16 = F::as_type_native_unchecked() == half::bf16::as_type_native_unchecked();
    // (format, M, N, K)
    let cases = [
        (QuantFormat::Nvfp4, 1, 48, 64),
        (QuantFormat::Mxfp4, 5, 176, 192),
        (QuantFormat::Nvfp4, 9, 48, 64),
        (QuantFormat::Nvfp4, 16, 176, 192),
        (QuantFormat::Mxfp4, 17, 112, 128),
        (QuantFormat::Nvfp4, 33, 80, 320),
        (QuantFormat::Mxfp4, 64, 208, 256),
        (QuantFormat::Nvfp4, 64, 512, 3584),
        (QuantFormat::Nvfp4, 40, 1040, 1152),
        // past 64 rows: token groups along the grid's fastest dimension
        (QuantFormat::Nvfp4, 150, 96, 192),
    ];
    // QERL_MMA_TEST_TILES=default checks the tiles each M picks alone (a quarter of the
    // kernels to compile, for a device call that changed no tiling).
    let all_tiles = [None, Some((1, 1)), Some((2, 4)), Some((4, 8))];
    let only_default = std::env::var("QERL_MMA_TEST_TILES").is_ok_and(|v| v == "default");
    let tiles = &all_tiles[..if only_default { 1 } else { all_tiles.len() }];
    let before = gemm::mma_launches();
    let wg_before = gemm::mma_warpgroup_launches();
    for (ci, (format, m, n, k)) in cases.into_iter().enumerate() {
        let w = random_weight(&mut rng, format, n, k);
        let dw = DeviceWeight::upload(&c, &w).unwrap();
        let deq = w.dequantize();
        let x = normal(&mut rng, m * k, 1.0);
        let bias = normal(&mut rng, n, 0.5);
        let rank = if ci % 2 == 0 { 16 } else { 6 };
        let a = normal(&mut rng, rank * k, 0.1);
        let b = normal(&mut rng, n * rank, 0.1);
        let scale = 2.0f32;
        let (xh, bh, ah, lbh) = (
            upload::<R, F>(&c, &x),
            upload::<R, F>(&c, &bias),
            upload::<R, F>(&c, &a),
            upload::<R, F>(&c, &b),
        );
        let rx = rounded::<F>(&x);
        let rbias = rounded::<F>(&bias);
        let (ra, rb) = (rounded::<F>(&a), rounded::<F>(&b));
        let lref = LoraRef {
            a: &ra,
            b: &rb,
            rank,
            scale: scale as f64,
        };
        let want = matmul_ref(&rx, &deq, m, n, k, None, None);
        let want_lora = matmul_ref(&rx, &deq, m, n, k, Some(&rbias), Some(&lref));
        // QERL_MMA_TEST_DECODE=spread (any decoding's name) checks that one alone: a device
        // call that only changed one decoding then compiles a quarter of the kernels.
        // QERL_MMA_TEST_KERNEL=staged likewise checks one kernel (the staged one runs the
        // spread decoding only).
        let only = std::env::var("QERL_MMA_TEST_DECODE").ok();
        let only_kernel = std::env::var("QERL_MMA_TEST_KERNEL").ok();
        let runs = gemm::MmaDecode::ALL.into_iter().flat_map(|d| {
            gemm::MmaKernel::ALL
                .into_iter()
                .filter(move |k| d == gemm::MmaDecode::Spread || *k == gemm::MmaKernel::Direct)
                .map(move |k| (d, k))
        });
        for (decode, kernel) in runs {
            let bf16_only = matches!(decode, gemm::MmaDecode::Bits | gemm::MmaDecode::Spread);
            let named = |o: &Option<String>, v: String| {
                o.as_deref().is_some_and(|o| !v.eq_ignore_ascii_case(o))
            };
            if (bf16_only && !bf16)
                || named(&only, format!("{decode:?}"))
                || named(&only_kernel, format!("{kernel:?}"))
            {
                continue;
            }
            for &t in tiles {
                for splits in [None, Some(1), Some(3)] {
                    let _m = mma_guard(gemm::MmaOptions {
                        enabled: true,
                        tiles: t,
                        decode,
                        kernel,
                        // the staged kernel's ring of codes, shallow and deep
                        prefetch: if t == Some((1, 1)) { 4 } else { 1 + ci % 3 },
                        x_ahead: 1 + ci % 2,
                        warps_per_sm: gemm::MMA_DEFAULT_WARPS_PER_SM,
                        min_m: 1,
                        // 2x4 tiles also under 32 warps a cube (64 registers a thread),
                        // the default tiles under each kernel's default warps
                        warps_per_cube: match t {
                            Some((2, 4)) => 32,
                            None => 0,
                            _ => 4,
                        },
                        max_m: 256,
                    });
                    let _s = SplitGuard::force(splits);
                    let what = format!(
                        "mma {format} M={m} N={n} K={k} tiles={t:?} {decode:?} {kernel:?} \
                         splits={splits:?}"
                    );
                    let y = poisoned::<R, F>(&c, m * n);
                    gemm::matmul::<R, F>(&c, &xh, m, &dw, None, None, &y).unwrap();
                    assert_close(&what, &read::<R, F>(&c, &y), &want, tol, seed);
                    let got = lora_forward::<R, F>(&c, &dw, &xh, m, (&ah, &lbh, rank, scale), &bh);
                    let what = format!("{what} +bias+LoRA(r={rank})");
                    assert_close(&what, &got, &want_lora, tol, seed);
                }
            }
        }
    }
    assert!(
        gemm::mma_launches() > before,
        "the mma kernel never ran (seed {seed})"
    );
    warpgroup_ran(wg_before);
}

/// With `QERL_MMA_TEST_KERNEL=warpgroup` (asked for on an sm_90 GPU), that the warpgroup
/// kernel ran rather than the staged kernel it falls back to elsewhere.
fn warpgroup_ran(before: usize) {
    let ran = gemm::mma_warpgroup_launches() - before;
    eprintln!("warpgroup kernel launches: {ran}");
    if std::env::var("QERL_MMA_TEST_KERNEL").as_deref() == Ok("warpgroup") {
        assert!(
            ran > 0,
            "QERL_MMA_TEST_KERNEL=warpgroup: the warpgroup kernel never ran"
        );
    }
}

/// [`gemm::matmul_segments_or_parts`] on the same products (no bias): where it keeps the
/// K-slices, each column's slices summed in slice order and rounded to `F` equal `ys` (written by
/// [`gemm::matmul_segments`], whose reduction sums them so) bit for bit; where it writes, its
/// outputs equal `ys`. Returns 1 where it kept the slices.
#[allow(clippy::too_many_arguments)]
fn kept_parts_equal_outputs<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    what: &str,
    xh: &Handle,
    m: usize,
    segs: &[SegCase],
    ys: &[Handle],
    lora: bool,
    rank: usize,
    seed: u64,
) -> usize {
    let ys2: Vec<Handle> = segs.iter().map(|s| poisoned::<R, F>(c, m * s.n)).collect();
    let p = seg_products(segs, &ys2, false, lora, rank);
    let n_total: usize = segs.iter().map(|s| s.n).sum();
    let outcome = gemm::matmul_segments_or_parts::<R, F>(c, xh, m, &p, true).unwrap();
    let (got, kept): (Vec<Vec<f64>>, usize) = match outcome {
        gemm::SegmentsOutcome::Parts(sp) => {
            let parts = f32::from_bytes(&c.read_one(sp.parts.clone()).unwrap()).to_vec();
            let mut col0 = 0;
            let per_seg = segs
                .iter()
                .map(|s| {
                    let sums: Vec<f32> = (0..m * s.n)
                        .map(|i| {
                            let at = (i / s.n) * n_total + col0 + i % s.n;
                            (0..sp.splits).fold(0.0f32, |a, z| a + parts[z * m * n_total + at])
                        })
                        .collect();
                    col0 += s.n;
                    rounded::<F>(&sums)
                })
                .collect();
            (per_seg, 1)
        }
        gemm::SegmentsOutcome::Written => (ys2.iter().map(|y| read::<R, F>(c, y)).collect(), 0),
        gemm::SegmentsOutcome::NotTaken => panic!("{what}: or_parts not taken (seed {seed})"),
    };
    for (i, (g, y)) in got.iter().zip(ys).enumerate() {
        let want = read::<R, F>(c, y);
        let bad = g
            .iter()
            .zip(&want)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(
            bad.is_none(),
            "{what}: segment {i} kept={kept}: element {bad:?} differs from matmul_segments's \
             (seed {seed})"
        );
    }
    kept
}

/// One segment of [`matmul_mma_segments`]: its weight, bias, LoRA `A`/`B` and `T = X·Aᵀ`
/// on the device, and the host values for the reference.
struct SegCase {
    n: usize,
    dw: DeviceWeight,
    deq: Vec<f32>,
    bias: Handle,
    rbias: Vec<f64>,
    ra: Vec<f64>,
    rb: Vec<f64>,
    a: Handle,
    t: Handle,
    b: Handle,
    scale: f32,
}

/// The products of `segs` into `ys`, with their bias and LoRA (rank `rank`) where asked.
fn seg_products<'a>(
    segs: &'a [SegCase],
    ys: &'a [Handle],
    bias: bool,
    lora: bool,
    rank: usize,
) -> Vec<gemm::SegmentProduct<'a>> {
    segs.iter()
        .zip(ys)
        .map(|(s, y)| gemm::SegmentProduct {
            weight: &s.dw,
            bias: bias.then_some(&s.bias),
            lora: lora.then_some(gemm::LoraEpilogue {
                t: &s.t,
                b: &s.b,
                rank,
                scale: s.scale,
            }),
            y,
        })
        .collect()
}

/// [`gemm::matmul_folding_lora_down`] of `segs` (no bias, LoRA of rank `rank` on each),
/// written and then kept as K-slices, each into poisoned `T`s and outputs, with the same two
/// counters: where it runs, each `T` within a relative L2 error of 1e-5 of the f64 product of
/// the rounded `rx` and its `A`, each output (the slices summed in slice order and rounded,
/// where kept) within `tol` of the f64 reference, the kept slices equal to the written outputs
/// bit for bit, and the counters back at 0. Returns the launches it made (0 where the fold
/// does not apply: nothing may have run).
#[allow(clippy::too_many_arguments)]
fn folded_equals_reference<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    what: &str,
    xh: &Handle,
    rx: &[f64],
    (m, k, rank): (usize, usize, usize),
    segs: &[SegCase],
    tol: f64,
    seed: u64,
) -> usize {
    let counters = c.create_from_slice(u32::as_bytes(&[0u32; 2]));
    let n_total: usize = segs.iter().map(|s| s.n).sum();
    let a: Vec<&Handle> = segs.iter().map(|s| &s.a).collect();
    let mut first_outputs: Option<Vec<Vec<f64>>> = None;
    let mut launches = 0;
    for keep in [false, true] {
        let ts: Vec<Handle> = segs
            .iter()
            .map(|_| c.create_from_slice(f32::as_bytes(&vec![f32::NAN; m * rank])))
            .collect();
        let ys: Vec<Handle> = segs.iter().map(|s| poisoned::<R, F>(c, m * s.n)).collect();
        let products: Vec<gemm::SegmentProduct<'_>> = segs
            .iter()
            .zip(&ts)
            .zip(&ys)
            .map(|((s, t), y)| gemm::SegmentProduct {
                weight: &s.dw,
                bias: None,
                lora: Some(gemm::LoraEpilogue {
                    t,
                    b: &s.b,
                    rank,
                    scale: s.scale,
                }),
                y,
            })
            .collect();
        let fold = gemm::LoraFold {
            a: &a,
            counters: &counters,
        };
        let outcome =
            gemm::matmul_folding_lora_down::<R, F>(c, xh, m, &products, &fold, keep).unwrap();
        let got: Vec<Vec<f64>> = match outcome {
            gemm::SegmentsOutcome::NotTaken => {
                assert_eq!(launches, 0, "{what}: taken once, then not (seed {seed})");
                return 0;
            }
            gemm::SegmentsOutcome::Written => ys.iter().map(|y| read::<R, F>(c, y)).collect(),
            gemm::SegmentsOutcome::Parts(sp) => {
                let parts = f32::from_bytes(&c.read_one(sp.parts.clone()).unwrap()).to_vec();
                let mut col0 = 0;
                segs.iter()
                    .map(|s| {
                        let sums: Vec<f32> = (0..m * s.n)
                            .map(|i| {
                                let at = (i / s.n) * n_total + col0 + i % s.n;
                                (0..sp.splits)
                                    .fold(0.0f32, |acc, z| acc + parts[z * m * n_total + at])
                            })
                            .collect();
                        col0 += s.n;
                        rounded::<F>(&sums)
                    })
                    .collect()
            }
        };
        launches += 1;
        let what = format!("{what} (keep_parts={keep})");
        for (i, (seg, t)) in segs.iter().zip(&ts).enumerate() {
            let want_t: Vec<f64> = (0..m * rank)
                .map(|e| {
                    let (row, j) = (e / rank, e % rank);
                    (0..k).map(|q| rx[row * k + q] * seg.ra[j * k + q]).sum()
                })
                .collect();
            let t_got: Vec<f64> = f32::from_bytes(&c.read_one(t.clone()).unwrap())
                .iter()
                .map(|&v| v as f64)
                .collect();
            assert!(
                t_got.iter().all(|v| v.is_finite()),
                "{what}: segment {i}: T not all written (seed {seed})"
            );
            let err: f64 = t_got
                .iter()
                .zip(&want_t)
                .map(|(a, b)| (a - b).powi(2))
                .sum();
            let norm: f64 = want_t.iter().map(|b| b * b).sum();
            assert!(
                err.sqrt() <= 1e-5 * norm.sqrt(),
                "{what}: segment {i}: T relative L2 error {} (seed {seed})",
                err.sqrt() / norm.sqrt()
            );
            let lref = LoraRef {
                a: &seg.ra,
                b: &seg.rb,
                rank,
                scale: seg.scale as f64,
            };
            let want_y = matmul_ref(rx, &seg.deq, m, seg.n, k, None, Some(&lref));
            assert_close(&format!("{what}: segment {i}"), &got[i], &want_y, tol, seed);
        }
        match &first_outputs {
            None => first_outputs = Some(got),
            Some(first) => assert!(
                first
                    .iter()
                    .flatten()
                    .zip(got.iter().flatten())
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: the kept slices summed differ from the written outputs (seed {seed})"
            ),
        }
        let left = u32::from_bytes(&c.read_one(counters.clone()).unwrap()).to_vec();
        assert_eq!(left, [0, 0], "{what}: counters not reset (seed {seed})");
    }
    launches
}

/// One segment of a segmented-product test: a random `n x k` weight of `format`, a bias, and a
/// LoRA adapter of rank `r` whose `T` is computed from `xh [m, k]` on the device.
#[allow(clippy::too_many_arguments)]
fn seg_case<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    rng: &mut StdRng,
    format: QuantFormat,
    m: usize,
    n: usize,
    k: usize,
    xh: &Handle,
    r: usize,
) -> SegCase {
    let w = random_weight(rng, format, n, k);
    let bias = normal(rng, n, 0.5);
    let a = normal(rng, r * k, 0.1);
    let b = normal(rng, n * r, 0.1);
    let ah = upload::<R, F>(c, &a);
    let t = c.create_from_slice(f32::as_bytes(&vec![f32::NAN; m * r]));
    gemm::lora_down::<R, F>(c, xh, &ah, &t, m, k, r).unwrap();
    SegCase {
        n,
        dw: DeviceWeight::upload(c, &w).unwrap(),
        deq: w.dequantize(),
        bias: upload::<R, F>(c, &bias),
        rbias: rounded::<F>(&bias),
        ra: rounded::<F>(&a),
        rb: rounded::<F>(&b),
        a: ah,
        t,
        b: upload::<R, F>(c, &b),
        scale: 0.5 + n as f32 / 1024.0,
    }
}

/// Each segment's output `ys[i]` against the f64 reference of its product of `rx [m, k]`.
#[allow(clippy::too_many_arguments)]
fn check_segment_outputs<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    what: &str,
    segs: &[SegCase],
    ys: &[Handle],
    rx: &[f64],
    (m, k, rank): (usize, usize, usize),
    (bias, lora): (bool, bool),
    tol: f64,
    seed: u64,
) {
    for (i, (s, y)) in segs.iter().zip(ys).enumerate() {
        let lref = LoraRef {
            a: &s.ra,
            b: &s.rb,
            rank,
            scale: s.scale as f64,
        };
        let want = matmul_ref(
            rx,
            &s.deq,
            m,
            s.n,
            k,
            bias.then_some(&s.rbias[..]),
            lora.then_some(&lref),
        );
        let what = format!("{what}: segment {i}");
        assert_close(&what, &read::<R, F>(c, y), &want, tol, seed);
    }
}

/// One segmented product of a decode test: the segments, the input on the device and rounded
/// on the host, its rows, depth and LoRA rank.
struct SegRun {
    segs: Vec<SegCase>,
    xh: Handle,
    rx: Vec<f64>,
    m: usize,
    k: usize,
    rank: usize,
}

impl SegRun {
    /// A random input of `m` rows by `k` and one random segment ([`seg_case`]) per width.
    #[allow(clippy::too_many_arguments)]
    fn new<R: Runtime, F: Float + CubeElement>(
        c: &ComputeClient<R>,
        rng: &mut StdRng,
        format: QuantFormat,
        widths: &[usize],
        m: usize,
        k: usize,
        rank: usize,
    ) -> Self {
        let x = normal(rng, m * k, 1.0);
        let xh = upload::<R, F>(c, &x);
        let rx = rounded::<F>(&x);
        let segs = widths
            .iter()
            .map(|&n| seg_case::<R, F>(c, rng, format, m, n, k, &xh, rank))
            .collect();
        SegRun {
            segs,
            xh,
            rx,
            m,
            k,
            rank,
        }
    }

    /// Runs the segments as one launch into poisoned outputs, with their bias and LoRA where
    /// asked, and checks each against the reference; `false` where the launch was not taken.
    fn check<R: Runtime, F: Float + CubeElement>(
        &self,
        c: &ComputeClient<R>,
        what: &str,
        (bias, lora): (bool, bool),
        tol: f64,
        seed: u64,
    ) -> bool {
        let (m, k, rank) = (self.m, self.k, self.rank);
        let ys: Vec<Handle> = self
            .segs
            .iter()
            .map(|s| poisoned::<R, F>(c, m * s.n))
            .collect();
        let p = seg_products(&self.segs, &ys, bias, lora, rank);
        if !gemm::matmul_segments::<R, F>(c, &self.xh, m, &p).unwrap() {
            return false;
        }
        check_segment_outputs::<R, F>(
            c,
            what,
            &self.segs,
            &ys,
            &self.rx,
            (m, k, rank),
            (bias, lora),
            tol,
            seed,
        );
        true
    }
}

/// Products sharing an input as one launch of the staged mma kernel (CUDA bf16): q/k/v-like
/// (3 segments) and gate/up-like (2) at 9 to 256 rows, with and without bias, with LoRA of
/// rank 16 on each and none, split-K forced to 3 and 1 slices and chosen; every segment's
/// output (poisoned first) against the f64 reference. Layouts the launch does not take
/// (a segment's N not a multiple of the cube width, unequal ranks or bias presence, the path
/// switched off) return `Ok(false)` and launch nothing. Checks that the segmented path ran.
pub fn matmul_mma_segments<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) || !has_cmma::<R, F>(&c) {
        return;
    }
    if F::as_type_native_unchecked() != half::bf16::as_type_native_unchecked() {
        eprintln!("skipped: the staged mma kernel runs bf16 only");
        return;
    }
    let (mut rng, seed) = fresh_rng();
    // QERL_MMA_TEST_KERNEL=warpgroup runs the segments on the warpgroup kernel (sm_90).
    let kernel = match std::env::var("QERL_MMA_TEST_KERNEL").as_deref() {
        Ok("warpgroup") => gemm::MmaKernel::Warpgroup,
        _ => gemm::MmaKernel::Auto,
    };
    let _m = mma_guard(gemm::MmaOptions {
        enabled: true,
        tiles: None,
        decode: gemm::MmaDecode::Auto,
        kernel,
        prefetch: gemm::MMA_DEFAULT_PREFETCH,
        x_ahead: gemm::MMA_DEFAULT_X_AHEAD,
        warps_per_sm: gemm::MMA_DEFAULT_WARPS_PER_SM,
        min_m: 2,
        warps_per_cube: 0,
        max_m: 256,
    });
    let _on = Restore::set(true, gemm::mma_segments(), gemm::set_mma_segments);
    let rank = 16;
    let make = |rng: &mut StdRng, format, m: usize, n: usize, k: usize, xh: &Handle, r: usize| {
        seg_case::<R, F>(&c, rng, format, m, n, k, xh, r)
    };
    // (format, M, segment widths, K): q/k/v and gate/up shapes; 9 rows take 2x2 tiles (a
    // 256-wide cube), 64 and more 1x8 (128-wide).
    let cases: [(QuantFormat, usize, &[usize], usize); 8] = [
        (QuantFormat::Nvfp4, 9, &[512, 256, 256], 256),
        (QuantFormat::Nvfp4, 64, &[384, 128, 128], 256),
        (QuantFormat::Nvfp4, 64, &[3584, 512, 512], 3584),
        (QuantFormat::Mxfp4, 150, &[384, 128, 128], 256),
        (QuantFormat::Nvfp4, 256, &[384, 128, 128], 256),
        (QuantFormat::Nvfp4, 64, &[1024, 1024], 512),
        (QuantFormat::Nvfp4, 150, &[512, 512], 256),
        (QuantFormat::Mxfp4, 9, &[256, 512], 192),
    ];
    let before = gemm::mma_segment_launches();
    let wg_before = gemm::mma_warpgroup_launches();
    let mut ran = 0;
    let mut kept = 0;
    let mut folded = 0;
    for (format, m, widths, k) in cases {
        let x = normal(&mut rng, m * k, 1.0);
        let xh = upload::<R, F>(&c, &x);
        let rx = rounded::<F>(&x);
        let segs: Vec<SegCase> = widths
            .iter()
            .map(|&n| make(&mut rng, format, m, n, k, &xh, rank))
            .collect();
        for splits in [Some(3), None, Some(1)] {
            let _s = SplitGuard::force(splits);
            for (bias, lora) in [(false, false), (true, true), (true, false), (false, true)] {
                let what = format!(
                    "mma segments {format} M={m} N={widths:?} K={k} splits={splits:?} \
                     bias={bias} lora={lora}"
                );
                let ys: Vec<Handle> = segs.iter().map(|s| poisoned::<R, F>(&c, m * s.n)).collect();
                let p = seg_products(&segs, &ys, bias, lora, rank);
                let took = gemm::matmul_segments::<R, F>(&c, &xh, m, &p).unwrap();
                assert!(took, "{what}: not taken, seed {seed}");
                ran += 1;
                check_segment_outputs::<R, F>(
                    &c,
                    &what,
                    &segs,
                    &ys,
                    &rx,
                    (m, k, rank),
                    (bias, lora),
                    tol,
                    seed,
                );
                if !bias {
                    kept += kept_parts_equal_outputs::<R, F>(
                        &c, &what, &xh, m, &segs, &ys, lora, rank, seed,
                    );
                    // The first product alone (the engine's o and down products), against
                    // its own written form (its split plan is its own, not the three's).
                    let what = format!("{what}, the first segment alone");
                    let y1 = [poisoned::<R, F>(&c, m * segs[0].n)];
                    let p1 = seg_products(&segs[..1], &y1, false, lora, rank);
                    assert!(
                        gemm::matmul_segments::<R, F>(&c, &xh, m, &p1).unwrap(),
                        "{what}"
                    );
                    kept += kept_parts_equal_outputs::<R, F>(
                        &c,
                        &what,
                        &xh,
                        m,
                        &segs[..1],
                        &y1,
                        lora,
                        rank,
                        seed,
                    );
                    ran += 3;
                    // Their LoRA down-projections computed in the launch: the first product
                    // alone (o, down), then all of them (q/k/v, gate/up).
                    for n_segs in [1, segs.len()].into_iter().filter(|_| lora) {
                        let what = format!("{what}, {n_segs} folded");
                        let f = folded_equals_reference::<R, F>(
                            &c,
                            &what,
                            &xh,
                            &rx,
                            (m, k, rank),
                            &segs[..n_segs],
                            tol,
                            seed,
                        );
                        ran += f;
                        folded += f;
                    }
                }
            }
        }
    }
    assert!(
        kept > 0,
        "matmul_segments_or_parts never kept the K-slices (seed {seed})"
    );
    eprintln!("folded LoRA down-projections: {folded} launches");
    if std::env::var("QERL_MMA_TEST_KERNEL").as_deref() == Ok("warpgroup") {
        assert!(
            folded > 0,
            "the folded LoRA down-projection never ran (seed {seed})"
        );
    }
    assert_eq!(
        gemm::mma_segment_launches() - before,
        ran,
        "the segmented mma path did not run for every case (seed {seed})"
    );
    warpgroup_ran(wg_before);

    // Layouts it does not take: nothing launched, `Ok(false)` for the caller's fallback.
    let (m, k) = (64, 256);
    let xh = upload::<R, F>(&c, &normal(&mut rng, m * k, 1.0));
    let mut unaligned: Vec<SegCase> = [384, 64, 128]
        .iter()
        .map(|&n| make(&mut rng, QuantFormat::Nvfp4, m, n, k, &xh, rank))
        .collect();
    let ys: Vec<Handle> = unaligned
        .iter()
        .map(|s| poisoned::<R, F>(&c, m * s.n))
        .collect();
    let before = gemm::mma_segment_launches();
    let p = seg_products(&unaligned, &ys, true, true, rank);
    assert!(
        !gemm::matmul_segments::<R, F>(&c, &xh, m, &p).unwrap(),
        "N = 64 segment"
    );
    // unequal bias presence
    let mut p = seg_products(&unaligned[..1], &ys[..1], true, false, rank);
    p.extend(seg_products(&unaligned[2..], &ys[2..], false, false, rank));
    assert!(
        !gemm::matmul_segments::<R, F>(&c, &xh, m, &p).unwrap(),
        "bias on one"
    );
    // unequal ranks
    unaligned[1] = make(&mut rng, QuantFormat::Nvfp4, m, 128, k, &xh, 8);
    let mut p = seg_products(&unaligned[..1], &ys[..1], false, true, rank);
    p.push(gemm::SegmentProduct {
        weight: &unaligned[1].dw,
        bias: None,
        lora: Some(gemm::LoraEpilogue {
            t: &unaligned[1].t,
            b: &unaligned[1].b,
            rank: 8,
            scale: 1.0,
        }),
        y: &ys[1],
    });
    assert!(
        !gemm::matmul_segments::<R, F>(&c, &xh, m, &p).unwrap(),
        "ranks 16 and 8"
    );
    // switched off (QERL_MMA_SEGMENTS=0)
    let aligned = [&unaligned[0], &unaligned[2]];
    let p: Vec<_> = aligned
        .iter()
        .zip([&ys[0], &ys[2]])
        .map(|(s, y)| gemm::SegmentProduct {
            weight: &s.dw,
            bias: None,
            lora: None,
            y,
        })
        .collect();
    {
        let _off = Restore::set(false, gemm::mma_segments(), gemm::set_mma_segments);
        assert!(
            !gemm::matmul_segments::<R, F>(&c, &xh, m, &p).unwrap(),
            "switched off"
        );
    }
    assert_eq!(
        gemm::mma_segment_launches(),
        before,
        "a refused layout launched"
    );
    // and the same products, switched back on, are taken
    assert!(
        gemm::matmul_segments::<R, F>(&c, &xh, m, &p).unwrap(),
        "N = 384, 128"
    );
}

/// Sends M <= 16 to the decode kernel while alive.
struct DecodeGuard;

impl DecodeGuard {
    fn all() -> DecodeGuard {
        gemm::set_decode_max_m(16);
        DecodeGuard
    }
}

impl Drop for DecodeGuard {
    fn drop(&mut self) {
        gemm::set_decode_max_m(gemm::DEFAULT_DECODE_MAX_M);
    }
}

/// Fixes the decode kernel's planes per row group (0: its own choice) while alive.
struct KPlanesGuard;

impl KPlanesGuard {
    fn set(k_planes: usize) -> KPlanesGuard {
        gemm::set_decode_k_planes(k_planes);
        KPlanesGuard
    }
}

impl Drop for KPlanesGuard {
    fn drop(&mut self) {
        gemm::set_decode_k_planes(0);
    }
}

/// Products sharing an input as one decode launch (one row: q/k/v-like and gate/up-like
/// segments), with each planes-per-row-group choice, with and without bias and LoRA, against
/// the f64 reference of each segment.
pub fn matmul_decode_segments<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    let (m, rank) = (1, 16);
    let cases: [(QuantFormat, &[usize], usize); 3] = [
        (QuantFormat::Nvfp4, &[512, 128, 128], 2080),
        (QuantFormat::Mxfp4, &[384, 256], 1024),
        (QuantFormat::Nvfp4, &[300, 36, 36], 4096),
    ];
    for (format, widths, k) in cases {
        let case = SegRun::new::<R, F>(&c, &mut rng, format, widths, m, k, rank);
        for kp in [0, 1, 2, 4] {
            let _kp = KPlanesGuard::set(kp);
            for (bias, lora) in [(true, true), (false, false)] {
                let what = format!(
                    "decode segments {format} N={widths:?} K={k} k_planes={kp} \
                     bias={bias} lora={lora}"
                );
                if !case.check::<R, F>(&c, &what, (bias, lora), tol, seed) {
                    eprintln!("{what}: not taken here (no decode kernel on this runtime)");
                    return;
                }
            }
        }
    }
}

/// `parts` (a product's unreduced K-slices, or `None` with the product in `y`) added in slice
/// order from 0.0 and rounded to `F` once equal `reduced` bit for bit.
#[allow(clippy::too_many_arguments)]
fn assert_parts_add_up<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    what: &str,
    parts: &Option<gemm::SplitParts>,
    y: &Handle,
    len: usize,
    reduced: &[f64],
    seed: u64,
) {
    let summed: Vec<f64> = match parts {
        Some(p) => {
            let v = f32::from_bytes(&c.read_one(p.parts.clone()).unwrap()).to_vec();
            (0..len)
                .map(|i| {
                    let sum = (0..p.splits).fold(0.0f32, |a, s| a + v[s * len + i]);
                    F::from(sum).unwrap().to_f64().unwrap()
                })
                .collect()
        }
        None => read::<R, F>(c, y),
    };
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&summed),
        bits(reduced),
        "{what}: unreduced slices ({:?}) against the reduction, seed {seed}",
        parts.as_ref().map(|p| p.splits)
    );
}

/// The decode kernel (M <= 16 where the runtime has 32-wide warps; elsewhere the tiled kernel):
/// M from 1 to 16 with bias and LoRA, unsplit and with forced K-slices that do not divide the
/// reduction (K/32 = 65 chunks into 3 and 7 slices), rows not a multiple of the plane's 4, and
/// an automatic split (narrow N, deep K).
pub fn matmul_decode<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let _decode = DecodeGuard::all();
    let started = std::time::Instant::now();
    let (mut rng, seed) = fresh_rng();
    let cases = [
        (QuantFormat::Nvfp4, 50, 2080),
        (QuantFormat::Mxfp4, 36, 2080),
        (QuantFormat::Nf4, 50, 2080),
        // 7 planes' worth of rows over K/32 = 256 chunks: split automatically.
        (QuantFormat::Nvfp4, 26, 8192),
    ];
    for (format, n, k) in cases {
        let w = random_weight(&mut rng, format, n, k);
        let dw = DeviceWeight::upload(&c, &w).unwrap();
        let deq = w.dequantize();
        for m in [1, 5, 9, 16] {
            eprintln!(
                "decode {format} N={n} K={k} M={m}: {:.1?}",
                started.elapsed()
            );
            // Forced K-slices, then (few rows only) forced planes per row group.
            let planes: &[(Option<usize>, usize)] = if m <= 5 {
                &[
                    (None, 0),
                    (Some(3), 0),
                    (Some(7), 0),
                    (None, 1),
                    (None, 2),
                    (Some(3), 4),
                ]
            } else {
                &[(None, 0), (Some(3), 0), (Some(7), 0)]
            };
            for &(forced, kp) in planes {
                let _guard = SplitGuard::force(forced);
                let _kp = KPlanesGuard::set(kp);
                let rank = 8;
                let x = normal(&mut rng, m * k, 1.0);
                let bias = normal(&mut rng, n, 0.5);
                let a = normal(&mut rng, rank * k, 0.05);
                let b = normal(&mut rng, n * rank, 0.1);
                let (xh, bh, ah, lbh) = (
                    upload::<R, F>(&c, &x),
                    upload::<R, F>(&c, &bias),
                    upload::<R, F>(&c, &a),
                    upload::<R, F>(&c, &b),
                );
                let t = c.create_from_slice(f32::as_bytes(&vec![f32::NAN; m * rank]));
                gemm::lora_down::<R, F>(&c, &xh, &ah, &t, m, k, rank).unwrap();
                let y = poisoned::<R, F>(&c, m * n);
                let lora = gemm::LoraEpilogue {
                    t: &t,
                    b: &lbh,
                    rank,
                    scale: 1.5,
                };
                gemm::matmul::<R, F>(&c, &xh, m, &dw, Some(&bh), Some(lora), &y).unwrap();
                let (ra, rb) = (rounded::<F>(&a), rounded::<F>(&b));
                let lref = LoraRef {
                    a: &ra,
                    b: &rb,
                    rank,
                    scale: 1.5,
                };
                let want = matmul_ref(
                    &rounded::<F>(&x),
                    &deq,
                    m,
                    n,
                    k,
                    Some(&rounded::<F>(&bias)),
                    Some(&lref),
                );
                let what =
                    format!("decode {format} M={m} N={n} K={k} splits={forced:?} k_planes={kp}");
                assert_close(&what, &read::<R, F>(&c, &y), &want, tol, seed);

                // The K-slices left unreduced (where the product splits) add up, in slice
                // order from 0.0 and rounded once, to the reduced output bit for bit.
                let reduced = read::<R, F>(&c, &y);
                let y2 = poisoned::<R, F>(&c, m * n);
                let lora = gemm::LoraEpilogue {
                    t: &t,
                    b: &lbh,
                    rank,
                    scale: 1.5,
                };
                let parts =
                    gemm::matmul_or_parts::<R, F>(&c, &xh, m, &dw, Some(&bh), Some(lora), &y2)
                        .unwrap();
                assert_parts_add_up::<R, F>(&c, &what, &parts, &y2, m * n, &reduced, seed);
                // And without the epilogue, the plain product.
                let y = poisoned::<R, F>(&c, m * n);
                gemm::matmul::<R, F>(&c, &xh, m, &dw, None, None, &y).unwrap();
                let want = matmul_ref(&rounded::<F>(&x), &deq, m, n, k, None, None);
                assert_close(
                    &format!("{what} plain"),
                    &read::<R, F>(&c, &y),
                    &want,
                    tol,
                    seed,
                );
            }
        }
    }
}

/// The decode product on tensor cores (`gemv_mma`: CUDA bf16, M <= 8, K a multiple of 128; the
/// decode kernel elsewhere): M 1, 3 and 8 (the batch `mma` kernel held off below 9 rows), NVFP4
/// and MXFP4, N not a multiple of 16, with bias and LoRA of rank 16 or 6 or neither, unsplit,
/// with forced 3 and 7 K-slices and a chosen split (deep K), the unreduced slices adding up to
/// the reduced output bit for bit; then q/k/v- and gate/up-like segments. M = 1 takes the
/// shared ring of chunks in flight (`QERL_GEMV_MMA_STAGES`, three by default) wherever it fits.
/// Outputs poisoned, against the f64 reference. With `QERL_GEMV_MMA_EXPECT=1`, checks that the
/// kernel ran.
pub fn matmul_decode_mma<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let _mma = mma_guard(gemm::MmaOptions {
        min_m: 9,
        ..gemm::mma_options()
    });
    // The shared ring wherever it fits at M = 1 (the engine's plans keep it to walks of six
    // chunks or more, which these shapes do not reach); M = 3 and 8 take the register ring.
    let before_ring = gemm::set_gemv_mma_ring_min_chunks(0);
    let _ring = Restore::set(0, before_ring, |n| {
        gemm::set_gemv_mma_ring_min_chunks(n);
    });
    let before = gemm::gemv_mma_launches();
    let (mut rng, seed) = fresh_rng();
    let cases = [
        (QuantFormat::Nvfp4, 40, 1024),
        (QuantFormat::Mxfp4, 72, 2048),
        (QuantFormat::Nvfp4, 300, 8192),
    ];
    for (format, n, k) in cases {
        let w = random_weight(&mut rng, format, n, k);
        let dw = DeviceWeight::upload(&c, &w).unwrap();
        let deq = w.dequantize();
        for m in [1, 3, 8] {
            for (forced, rank) in [(None, 16), (Some(3), 6), (Some(7), 16), (None, 0)] {
                let _guard = SplitGuard::force(forced);
                let what =
                    format!("decode mma {format} M={m} N={n} K={k} splits={forced:?} r={rank}");
                let x = normal(&mut rng, m * k, 1.0);
                let bias = normal(&mut rng, n, 0.5);
                let a = normal(&mut rng, rank.max(1) * k, 0.05);
                let b = normal(&mut rng, n * rank.max(1), 0.1);
                let (xh, bh, ah, lbh) = (
                    upload::<R, F>(&c, &x),
                    upload::<R, F>(&c, &bias),
                    upload::<R, F>(&c, &a),
                    upload::<R, F>(&c, &b),
                );
                let t = c.create_from_slice(f32::as_bytes(&vec![f32::NAN; m * rank.max(1)]));
                if rank > 0 {
                    gemm::lora_down::<R, F>(&c, &xh, &ah, &t, m, k, rank).unwrap();
                }
                let lora = || {
                    (rank > 0).then_some(gemm::LoraEpilogue {
                        t: &t,
                        b: &lbh,
                        rank,
                        scale: 1.5,
                    })
                };
                let bias_h = (rank > 0).then_some(&bh);
                let y = poisoned::<R, F>(&c, m * n);
                gemm::matmul::<R, F>(&c, &xh, m, &dw, bias_h, lora(), &y).unwrap();
                let (ra, rb) = (rounded::<F>(&a), rounded::<F>(&b));
                let lref = LoraRef {
                    a: &ra,
                    b: &rb,
                    rank,
                    scale: 1.5,
                };
                let rbias = rounded::<F>(&bias);
                let want = matmul_ref(
                    &rounded::<F>(&x),
                    &deq,
                    m,
                    n,
                    k,
                    (rank > 0).then_some(&rbias[..]),
                    (rank > 0).then_some(&lref),
                );
                let reduced = read::<R, F>(&c, &y);
                assert_close(&what, &reduced, &want, tol, seed);

                let y2 = poisoned::<R, F>(&c, m * n);
                let parts =
                    gemm::matmul_or_parts::<R, F>(&c, &xh, m, &dw, bias_h, lora(), &y2).unwrap();
                assert_parts_add_up::<R, F>(&c, &what, &parts, &y2, m * n, &reduced, seed);
            }
        }
    }
    let rank = 16;
    let seg_cases: [(QuantFormat, &[usize], usize); 2] = [
        (QuantFormat::Nvfp4, &[256, 64, 64], 1024),
        (QuantFormat::Mxfp4, &[384, 128], 2048),
    ];
    for (format, widths, k) in seg_cases {
        for m in [1, 5] {
            let case = SegRun::new::<R, F>(&c, &mut rng, format, widths, m, k, rank);
            for (bias, lora) in [(true, true), (false, false)] {
                let what = format!(
                    "decode mma segments {format} N={widths:?} K={k} M={m} bias={bias} lora={lora}"
                );
                if !case.check::<R, F>(&c, &what, (bias, lora), tol, seed) {
                    eprintln!("{what}: not taken here");
                }
            }
        }
    }
    let ran = gemm::gemv_mma_launches() - before;
    eprintln!("decode mma kernel launches: {ran}");
    if std::env::var("QERL_GEMV_MMA_EXPECT").as_deref() == Ok("1") {
        assert!(
            ran > 0,
            "QERL_GEMV_MMA_EXPECT=1: the decode mma kernel never ran"
        );
    }
}

/// Split-K on the tensor-core path (CUDA f16/bf16): the forward product with bias, with LoRA
/// (whose `lora_down` splits too), and dX, with K-slices that do not divide the reduction
/// (forced 3 and 7 slices of 4128/32 = 129 stages), and automatic splits on narrow-N, deep-K
/// shapes (a handful of output tiles).
pub fn matmul_split_k<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) || !has_cmma::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    // (format, M, N, K, forced splits)
    let cases = [
        (QuantFormat::Nvfp4, 40, 160, 4128, Some(3)),
        (QuantFormat::Mxfp4, 17, 96, 4128, Some(7)),
        // Few rows (M <= 16), forced and by the plan.
        (QuantFormat::Nvfp4, 5, 96, 4128, Some(3)),
        (QuantFormat::Nvfp4, 12, 224, 4128, None),
        (QuantFormat::Nf4, 70, 224, 4160, Some(7)),
        (QuantFormat::Nvfp4, 33, 288, 6144, None),
        (QuantFormat::Nvfp4, 150, 96, 4128, None),
        // dX splits itself: 2048 / 32 = 64 stages over 4 output tiles.
        (QuantFormat::Nvfp4, 33, 2048, 256, None),
    ];
    let started = std::time::Instant::now();
    for (format, m, n, k, forced) in cases {
        eprintln!(
            "split-K {format} M={m} N={n} K={k}: {:.1?}",
            started.elapsed()
        );
        let _guard = SplitGuard::force(forced);
        let w = random_weight(&mut rng, format, n, k);
        let dw = DeviceWeight::upload(&c, &w).unwrap();
        let deq = w.dequantize();
        let x = normal(&mut rng, m * k, 1.0);
        let bias = normal(&mut rng, n, 0.5);
        let rank = 24;
        let a = normal(&mut rng, rank * k, 0.05);
        let b = normal(&mut rng, n * rank, 0.1);
        let (xh, bh, ah, lbh) = (
            upload::<R, F>(&c, &x),
            upload::<R, F>(&c, &bias),
            upload::<R, F>(&c, &a),
            upload::<R, F>(&c, &b),
        );
        let rx = rounded::<F>(&x);
        let what = format!("split-K {format} M={m} N={n} K={k} splits={forced:?}");

        let y = poisoned::<R, F>(&c, m * n);
        gemm::matmul::<R, F>(&c, &xh, m, &dw, Some(&bh), None, &y).unwrap();
        let want = matmul_ref(&rx, &deq, m, n, k, Some(&rounded::<F>(&bias)), None);
        assert_close(&what, &read::<R, F>(&c, &y), &want, tol, seed);

        // lora_down alone: T = X·Aᵀ in f32.
        let t = c.create_from_slice(f32::as_bytes(&vec![f32::NAN; m * rank]));
        gemm::lora_down::<R, F>(&c, &xh, &ah, &t, m, k, rank).unwrap();
        let ra = rounded::<F>(&a);
        let mut t_want = vec![0.0; m * rank];
        for i in 0..m {
            for j in 0..rank {
                t_want[i * rank + j] = (0..k).map(|kk| rx[i * k + kk] * ra[j * k + kk]).sum();
            }
        }
        let t_got: Vec<f64> = f32::from_bytes(&c.read_one(t.clone()).unwrap())
            .iter()
            .map(|&v| v as f64)
            .collect();
        assert_close(&format!("{what} lora_down"), &t_got, &t_want, tol, seed);

        let y = poisoned::<R, F>(&c, m * n);
        let lora = gemm::LoraEpilogue {
            t: &t,
            b: &lbh,
            rank,
            scale: 2.0,
        };
        gemm::matmul::<R, F>(&c, &xh, m, &dw, Some(&bh), Some(lora), &y).unwrap();
        let rb = rounded::<F>(&b);
        let lref = LoraRef {
            a: &ra,
            b: &rb,
            rank,
            scale: 2.0,
        };
        let want = matmul_ref(&rx, &deq, m, n, k, Some(&rounded::<F>(&bias)), Some(&lref));
        assert_close(
            &format!("{what} +LoRA"),
            &read::<R, F>(&c, &y),
            &want,
            tol,
            seed,
        );

        // dX: its reduction is N (a multiple of 32 here), its columns K.
        let what = format!("{what} dX");
        check_dx::<R, F>(&c, &mut rng, &dw, &deq, (m, n, k), &what, tol, seed);
    }
}

/// f64 reference of the noisy RMSNorm: forward `y`, and the backward `dx`, `dw` written from the
/// Jacobian (`∂r/∂x_i = −r³ x_i / D`), not from the kernel's factored formula.
pub fn rms_norm_ref(
    x: &[f64],
    gain: &[f64],
    dy: &[f64],
    rows: usize,
    dim: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut y, mut dx, mut dw) = (vec![0.0; rows * dim], vec![0.0; rows * dim], vec![0.0; dim]);
    for i in 0..rows {
        let row = &x[i * dim..(i + 1) * dim];
        let ms: f64 = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let r = 1.0 / (ms + eps).sqrt();
        let g: Vec<f64> = (0..dim).map(|c| dy[i * dim + c] * gain[c]).collect();
        let gx: f64 = (0..dim).map(|c| g[c] * row[c]).sum();
        for c in 0..dim {
            y[i * dim + c] = row[c] * r * gain[c];
            dx[i * dim + c] = r * g[c] - r * r * r * row[c] * gx / dim as f64;
            dw[c] += dy[i * dim + c] * row[c] * r;
        }
    }
    (y, dx, dw)
}

pub fn rms_norm_fwd_bwd<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    let eps = 1e-6f32;
    // dims of every vector width (8, 4, 2), and rows over several 64-row slices of dw
    for (rows, dim) in [
        (1, 48),
        (3, 80),
        (17, 208),
        (64, 896),
        (5, 1040),
        (150, 96),
        (7, 36),
        (2, 18),
    ] {
        for with_noise in [false, true] {
            let x = normal(&mut rng, rows * dim, 1.0);
            let w: Vec<f32> = normal(&mut rng, dim, 0.2).iter().map(|v| 1.0 + v).collect();
            let z = normal(&mut rng, dim, 0.01);
            let dy = normal(&mut rng, rows * dim, 1.0);
            let (xh, wh, zh, dyh) = (
                upload::<R, F>(&c, &x),
                upload::<R, F>(&c, &w),
                upload::<R, F>(&c, &z),
                upload::<R, F>(&c, &dy),
            );
            let noise = with_noise.then_some(&zh);
            let y = poisoned::<R, F>(&c, rows * dim);
            let rstd = c.create_from_slice(f32::as_bytes(&vec![f32::NAN; rows]));
            rms_norm::forward::<R, F>(&c, &xh, &wh, noise, rows, dim, eps, &y, &rstd).unwrap();
            let dx = poisoned::<R, F>(&c, rows * dim);
            let dw = poisoned::<R, F>(&c, dim);
            rms_norm::backward::<R, F>(&c, &dyh, &xh, &wh, noise, &rstd, rows, dim, &dx, &dw)
                .unwrap();

            let (rw, rz) = (rounded::<F>(&w), rounded::<F>(&z));
            let gain: Vec<f64> = (0..dim)
                .map(|i| rw[i] + if with_noise { rz[i] } else { 0.0 })
                .collect();
            let (ry, rdx, rdw) = rms_norm_ref(
                &rounded::<F>(&x),
                &gain,
                &rounded::<F>(&dy),
                rows,
                dim,
                eps as f64,
            );
            let what = format!("rms_norm rows={rows} dim={dim} noise={with_noise}");
            assert_close(&format!("{what} y"), &read::<R, F>(&c, &y), &ry, tol, seed);
            assert_close(
                &format!("{what} dx"),
                &read::<R, F>(&c, &dx),
                &rdx,
                tol,
                seed,
            );
            assert_close(
                &format!("{what} dw"),
                &read::<R, F>(&c, &dw),
                &rdw,
                tol,
                seed,
            );
        }
    }
}

/// The noise must change the output: y(z) differs from y(0) by exactly x̂ ⊙ z.
pub fn rms_norm_noise_reaches_output<R: Runtime, F: Float + CubeElement>(device: &R::Device) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    let (rows, dim) = (4, 64);
    let x = normal(&mut rng, rows * dim, 1.0);
    let w = vec![1.0f32; dim];
    let z = normal(&mut rng, dim, 0.3);
    let (xh, wh, zh) = (
        upload::<R, F>(&c, &x),
        upload::<R, F>(&c, &w),
        upload::<R, F>(&c, &z),
    );
    let run = |noise: Option<&Handle>| {
        let y = poisoned::<R, F>(&c, rows * dim);
        let rstd = c.create_from_slice(f32::as_bytes(&vec![0.0f32; rows]));
        rms_norm::forward::<R, F>(&c, &xh, &wh, noise, rows, dim, 1e-6, &y, &rstd).unwrap();
        read::<R, F>(&c, &y)
    };
    let (clean, noisy) = (run(None), run(Some(&zh)));
    // With w = 1 the noisy output exceeds the clean one by x̂ ⊙ z.
    let (rx, rz) = (rounded::<F>(&x), rounded::<F>(&z));
    let mut want = vec![0.0; rows * dim];
    for i in 0..rows {
        let row = &rx[i * dim..(i + 1) * dim];
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / dim as f64 + 1e-6).sqrt();
        for c in 0..dim {
            want[i * dim + c] = row[c] * r * rz[c];
        }
    }
    let diff: Vec<f64> = noisy.iter().zip(&clean).map(|(a, b)| a - b).collect();
    // The difference of two rounded outputs of size ~1 carries their rounding (bf16: about 1e-3
    // absolute against a signal of about 0.25, i.e. ~1% relative): 5% holds for f16 and bf16 and
    // still fails if the noise is dropped (error 100%).
    assert_close("noisy − clean = x̂ ⊙ z", &diff, &want, 0.05, seed);
}

/// f64 reference of the SwiGLU gate: `h = silu(g)·u` and, from `dh`, `dg`, `du` written from
/// the derivative of `g / (1 + e^-g)` as a quotient (not the kernels' factored form).
pub fn silu_mul_ref(g: &[f64], u: &[f64], dh: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..g.len() {
        let (x, e) = (g[i], (-g[i]).exp());
        let silu = x / (1.0 + e);
        let dsilu = ((1.0 + e) + x * e) / ((1.0 + e) * (1.0 + e));
        out.0.push(silu * u[i]);
        out.1.push(dh[i] * u[i] * dsilu);
        out.2.push(dh[i] * silu);
    }
    out
}

pub fn silu_mul_fwd_bwd<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    // lengths of every vector width (8, 4, 2, 1) and several cubes
    for len in [8, 36, 18, 7, 4096 + 8, 3 * 18944] {
        // wide gate values: the tails of σ (e^±12) as well as its middle
        let g = normal(&mut rng, len, 4.0);
        let u = normal(&mut rng, len, 1.0);
        let dh = normal(&mut rng, len, 1.0);
        let (gh, uh, dhh) = (
            upload::<R, F>(&c, &g),
            upload::<R, F>(&c, &u),
            upload::<R, F>(&c, &dh),
        );
        let h = poisoned::<R, F>(&c, len);
        silu_mul::forward::<R, F>(&c, &gh, &uh, len, &h).unwrap();
        let (dg, du) = (poisoned::<R, F>(&c, len), poisoned::<R, F>(&c, len));
        silu_mul::backward::<R, F>(&c, &gh, &uh, &dhh, len, &dg, &du).unwrap();
        let (rh, rdg, rdu) = silu_mul_ref(&rounded::<F>(&g), &rounded::<F>(&u), &rounded::<F>(&dh));
        let what = format!("silu_mul len={len}");
        assert_close(&format!("{what} h"), &read::<R, F>(&c, &h), &rh, tol, seed);
        assert_close(
            &format!("{what} dg"),
            &read::<R, F>(&c, &dg),
            &rdg,
            tol,
            seed,
        );
        assert_close(
            &format!("{what} du"),
            &read::<R, F>(&c, &du),
            &rdu,
            tol,
            seed,
        );
    }
    // a buffer too small is refused, naming it
    let small = poisoned::<R, F>(&c, 4);
    let err = silu_mul::forward::<R, F>(&c, &small, &small, 1 << 20, &small).unwrap_err();
    assert!(err.to_string().contains("g holds"), "{err}");
}

/// f64 reference of the fused RoPE: `x [tokens, heads·d]` -> `y [batch, heads, seq, d]`, and the
/// backward `dy` -> `dx` as the transpose of the same linear map (element by element).
pub fn rope_ref(
    x: &[f64],
    cos: &[f64],
    sin: &[f64],
    dy: &[f64],
    shape: RopeShape,
) -> (Vec<f64>, Vec<f64>) {
    let RopeShape {
        batch,
        seq,
        heads,
        head_dim: d,
    } = shape;
    let h = d / 2;
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    for b in 0..batch {
        for t in 0..seq {
            let token = b * seq + t;
            for hd in 0..heads {
                let src = (token * heads + hd) * d;
                let dst = ((b * heads + hd) * seq + t) * d;
                for i in 0..d {
                    // y[i] = x[i]·c[i] + rot(x)[i]·s[i], rot(x) = (−x[h..], x[..h])
                    let (j, sign) = if i < h { (i + h, -1.0) } else { (i - h, 1.0) };
                    let (c, s) = (cos[token * d + i], sin[token * d + i]);
                    y[dst + i] = x[src + i] * c + sign * x[src + j] * s;
                    // ∂y[i]/∂x[i] = c, ∂y[i]/∂x[j] = sign·s
                    dx[src + i] += dy[dst + i] * c;
                    dx[src + j] += dy[dst + i] * sign * s;
                }
            }
        }
    }
    (y, dx)
}

pub fn rope_fwd_bwd<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64) {
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let (mut rng, seed) = fresh_rng();
    // head sizes of every vector width (half 64, 4, 2, 3), several cubes
    for (batch, seq, heads, head_dim) in [
        (2, 5, 3, 128),
        (1, 7, 2, 8),
        (3, 4, 5, 4),
        (2, 3, 1, 6),
        (4, 33, 4, 64),
    ] {
        let shape = RopeShape {
            batch,
            seq,
            heads,
            head_dim,
        };
        let (tokens, n) = (batch * seq, batch * seq * heads * head_dim);
        let x = normal(&mut rng, n, 1.0);
        let dy = normal(&mut rng, n, 1.0);
        // any tables will do for the algebra: not only cos² + sin² = 1
        let cos = normal(&mut rng, tokens * head_dim, 1.0);
        let sin = normal(&mut rng, tokens * head_dim, 1.0);
        let (xh, dyh, ch, sh) = (
            upload::<R, F>(&c, &x),
            upload::<R, F>(&c, &dy),
            upload::<R, F>(&c, &cos),
            upload::<R, F>(&c, &sin),
        );
        let (y, dx) = (poisoned::<R, F>(&c, n), poisoned::<R, F>(&c, n));
        rope::forward::<R, F>(&c, &xh, &ch, &sh, shape, &y).unwrap();
        rope::backward::<R, F>(&c, &dyh, &ch, &sh, shape, &dx).unwrap();
        let (ry, rdx) = rope_ref(
            &rounded::<F>(&x),
            &rounded::<F>(&cos),
            &rounded::<F>(&sin),
            &rounded::<F>(&dy),
            shape,
        );
        let what = format!("rope {shape:?}");
        assert_close(&format!("{what} y"), &read::<R, F>(&c, &y), &ry, tol, seed);
        assert_close(
            &format!("{what} dx"),
            &read::<R, F>(&c, &dx),
            &rdx,
            tol,
            seed,
        );
    }
    let shape = RopeShape {
        batch: 1,
        seq: 1,
        heads: 1,
        head_dim: 5,
    };
    let h = poisoned::<R, F>(&c, 8);
    let err = rope::forward::<R, F>(&c, &h, &h, &h, shape, &h).unwrap_err();
    assert!(err.to_string().contains("odd head size"), "{err}");
}

macro_rules! suite {
    ($name:ident, $runtime:ty, $device:expr, $float:ty, $tol:expr $(, #[$attr:meta])?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            type R = $runtime;
            type F = $float;
            const TOL: f64 = $tol;

            $(#[$attr])? #[test]
            fn dequantize_all_formats() { super::dequantize::<R, F>(&$device) }
            $(#[$attr])? #[test]
            fn matmul_all_formats() { super::matmul::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn matmul_lora_epilogue() { super::matmul_lora::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn matmul_tensor_cores() { super::matmul_tensor_cores::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn matmul_mma_decode_batches() { super::matmul_mma::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn matmul_mma_segments() { super::matmul_mma_segments::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn matmul_decode_split_k() { super::matmul_decode::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn matmul_decode_segments() { super::matmul_decode_segments::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn matmul_decode_mma() { super::matmul_decode_mma::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn matmul_tensor_cores_split_k() { super::matmul_split_k::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn dense_operands() { super::dense_operands::<R, F>(&$device) }
            $(#[$attr])? #[test]
            fn dense_products() { super::dense_products::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn blas_products() { super::blas_products::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn blas_ordering() { super::blas_ordering::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn matmul_transposed_all_formats() { super::matmul_transposed::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn rms_norm_forward_backward() { super::rms_norm_fwd_bwd::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn rope_forward_backward() { super::rope_fwd_bwd::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn silu_mul_forward_backward() { super::silu_mul_fwd_bwd::<R, F>(&$device, TOL) }
            $(#[$attr])? #[test]
            fn rms_norm_noise_reaches_output() {
                super::rms_norm_noise_reaches_output::<R, F>(&$device)
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
    1e-5
);
#[cfg(feature = "wgpu")]
suite!(
    wgpu_f16,
    cubecl::wgpu::WgpuRuntime,
    qerl_kernels::runtime::wgpu_device_or_exit(),
    half::f16,
    2e-3
);

#[cfg(feature = "cuda")]
suite!(cuda_bf16, cubecl::cuda::CudaRuntime, cubecl::cuda::CudaDevice::new(0), half::bf16, 1e-2,
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored cuda"]);
#[cfg(feature = "cuda")]
suite!(cuda_f16, cubecl::cuda::CudaRuntime, cubecl::cuda::CudaDevice::new(0), half::f16, 2e-3,
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored cuda"]);
#[cfg(feature = "cuda")]
suite!(cuda_f32, cubecl::cuda::CudaRuntime, cubecl::cuda::CudaDevice::new(0), f32, 1e-5,
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored cuda"]);

/// The host reference of the RoPE backward is the transpose of its forward:
/// `⟨y(x), dy⟩ = ⟨x, dx(dy)⟩` for random `x`, `dy` and tables.
#[test]
fn rope_reference_backward_is_the_transpose() {
    let (mut rng, seed) = fresh_rng();
    let shape = RopeShape {
        batch: 2,
        seq: 3,
        heads: 2,
        head_dim: 8,
    };
    let n = 2 * 3 * 2 * 8;
    let to64 = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
    let (x, dy) = (
        to64(normal(&mut rng, n, 1.0)),
        to64(normal(&mut rng, n, 1.0)),
    );
    let (cos, sin) = (
        to64(normal(&mut rng, 6 * 8, 1.0)),
        to64(normal(&mut rng, 6 * 8, 1.0)),
    );
    let (y, dx) = rope_ref(&x, &cos, &sin, &dy, shape);
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f64>();
    let (lhs, rhs) = (dot(&y, &dy), dot(&x, &dx));
    assert!(
        (lhs - rhs).abs() < 1e-9 * lhs.abs().max(1.0),
        "{lhs} vs {rhs}, seed {seed}"
    );
}

/// The host reference of the SwiGLU gate's backward agrees with central finite differences of
/// its forward.
#[test]
fn silu_mul_reference_matches_finite_differences() {
    let (mut rng, seed) = fresh_rng();
    let to64 = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
    let (g, u, dh) = (
        to64(normal(&mut rng, 64, 4.0)),
        to64(normal(&mut rng, 64, 1.0)),
        to64(normal(&mut rng, 64, 1.0)),
    );
    let (_, dg, du) = silu_mul_ref(&g, &u, &dh);
    let h = 1e-6;
    for i in 0..g.len() {
        let f = |gi: f64, ui: f64| silu_mul_ref(&[gi], &[ui], &[0.0]).0[0] * dh[i];
        let fd_g = (f(g[i] + h, u[i]) - f(g[i] - h, u[i])) / (2.0 * h);
        let fd_u = (f(g[i], u[i] + h) - f(g[i], u[i] - h)) / (2.0 * h);
        assert!(
            (fd_g - dg[i]).abs() < 1e-6,
            "dg[{i}]: fd {fd_g} vs {}, seed {seed}",
            dg[i]
        );
        assert!(
            (fd_u - du[i]).abs() < 1e-6,
            "du[{i}]: fd {fd_u} vs {}, seed {seed}",
            du[i]
        );
    }
}

/// The host reference of the RMSNorm backward agrees with central finite differences of its own
/// forward, so the GPU checks above compare against a trustworthy gradient.
#[test]
fn rms_norm_reference_matches_finite_differences() {
    let (mut rng, seed) = fresh_rng();
    let (rows, dim, eps) = (2, 24, 1e-6);
    let x: Vec<f64> = normal(&mut rng, rows * dim, 1.0)
        .iter()
        .map(|&v| v as f64)
        .collect();
    let gain: Vec<f64> = normal(&mut rng, dim, 0.2)
        .iter()
        .map(|&v| 1.0 + v as f64)
        .collect();
    let dy: Vec<f64> = normal(&mut rng, rows * dim, 1.0)
        .iter()
        .map(|&v| v as f64)
        .collect();
    let (_, dx, dgain) = rms_norm_ref(&x, &gain, &dy, rows, dim, eps);
    let loss = |x: &[f64], gain: &[f64]| -> f64 {
        let (y, _, _) = rms_norm_ref(x, gain, &dy, rows, dim, eps);
        y.iter().zip(&dy).map(|(a, b)| a * b).sum()
    };
    let h = 1e-6;
    for i in 0..rows * dim {
        let (mut xp, mut xm) = (x.clone(), x.clone());
        xp[i] += h;
        xm[i] -= h;
        let fd = (loss(&xp, &gain) - loss(&xm, &gain)) / (2.0 * h);
        assert!(
            (fd - dx[i]).abs() < 1e-6,
            "dx[{i}]: fd {fd} vs {}, seed {seed}",
            dx[i]
        );
    }
    for c in 0..dim {
        let (mut gp, mut gm) = (gain.clone(), gain.clone());
        gp[c] += h;
        gm[c] -= h;
        let fd = (loss(&x, &gp) - loss(&x, &gm)) / (2.0 * h);
        assert!(
            (fd - dgain[c]).abs() < 1e-6,
            "dw[{c}]: fd {fd} vs {}, seed {seed}",
            dgain[c]
        );
    }
}

/// A weight whose input dimension the tiled kernels cannot step through is refused on upload.
#[cfg(feature = "wgpu")]
#[test]
fn upload_refuses_input_dims_not_a_multiple_of_16() {
    let w = QuantizedWeight::quantize(
        QuantFormat::Nf4,
        "w",
        &normal(&mut fresh_rng().0, 64 * 8, 1.0),
        &[64, 8],
        SourceDtype::F32,
    )
    .unwrap();
    let c = cubecl::wgpu::WgpuRuntime::client(&qerl_kernels::runtime::wgpu_device_or_exit());
    let e = DeviceWeight::upload(&c, &w).unwrap_err().to_string();
    assert!(e.contains("[64, 8]") && e.contains("multiple of 16"), "{e}");
}
