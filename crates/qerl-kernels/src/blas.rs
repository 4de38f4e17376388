//! Dense products of row-major matrices on cuBLAS: the training's small products (the LoRA
//! backward, the lm_head's chunks), which would otherwise go to burn's autotuned matmul.
//!
//! Why: burn's matmul tunes every new shape bucket by compiling and timing about a dozen
//! candidate kernels. On an H100 (2026-11-27, `tools/device_compile_census.sh`, a 7B-shaped
//! NVFP4 GRPO step on empty caches) that was 156 of the 346 kernels the first step compiled and
//! 284 of its 345 seconds. cuBLAS compiles nothing.
//!
//! cubecl does not expose its stream, so cuBLAS runs on a stream of its own, ordered against
//! cubecl's ([`device_ordering`]): by default on the device, through two flags in device memory
//! and a one-unit wait kernel on cubecl's side, with no host round trip; with
//! `QERL_CUBLAS_ORDER=host` (the first way, kept to measure against) through the host, which
//! waits for cubecl's stream, then for the GEMMs, on every call. Either way a caller with
//! several products should pass them in one call.
//!
//! [`products`] returns `Ok(false)`, launching nothing, where cuBLAS cannot run them (not CUDA,
//! f32, libcublas missing). The caller then falls back to its own path.

use std::sync::atomic::{AtomicU8, Ordering};

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::device::{check_buffer, shape_err, KernelError};

/// The environment variable that picks how cuBLAS is ordered against cubecl: `device` (the
/// default) or `host`.
pub const ORDER_ENV: &str = "QERL_CUBLAS_ORDER";

static ORDER: AtomicU8 = AtomicU8::new(u8::MAX);

/// Whether cuBLAS products are ordered against cubecl's stream on the device (flags in device
/// memory, no host round trip) rather than through the host: the last
/// [`set_device_ordering`], else [`ORDER_ENV`] (empty: `device`, unless a kernel profiler is
/// injected); any other value is an error that names the variable.
pub fn device_ordering() -> Result<bool, KernelError> {
    Ok(match ORDER.load(Ordering::Relaxed) {
        0 => false,
        1 => true,
        _ => {
            let on = match std::env::var(ORDER_ENV).unwrap_or_default().as_str() {
                "" => !kernel_profiler_attached(),
                "device" => true,
                "host" => false,
                other => {
                    return Err(KernelError::Vendor {
                        what: format!("{ORDER_ENV}={other:?}: expected `device` or `host`"),
                    })
                }
            };
            set_device_ordering(on);
            on
        }
    })
}

/// Whether a CUDA tool that replays kernels one at a time (Nsight Compute) is injected into
/// this process. Under it the wait kernel on cubecl's side would never see the GEMM it waits
/// for, so [`device_ordering`] defaults to the host there (Nsight Systems, which does not
/// serialise kernels, keeps the device ordering).
fn kernel_profiler_attached() -> bool {
    let attached = std::env::var("CUDA_INJECTION64_PATH")
        .is_ok_and(|p| !p.is_empty() && !p.to_ascii_lowercase().contains("nsight-systems"));
    if attached {
        eprintln!(
            "qerl: a CUDA profiler is injected (CUDA_INJECTION64_PATH): cuBLAS is ordered \
             through the host ({ORDER_ENV}=device overrides)"
        );
    }
    attached
}

/// Sets [`device_ordering`] for every later product of this process (benchmarks time both).
pub fn set_device_ordering(on: bool) {
    ORDER.store(u8::from(on), Ordering::Relaxed);
}

/// `C[m, n] = alpha · op(A) · op(B)` for row-major matrices of one float type: `op(A)` is
/// `[m, k]` (`A` is stored `[k, m]` when `a_t`), `op(B)` is `[k, n]` (`B` stored `[n, k]` when
/// `b_t`). `C` is overwritten.
#[derive(Clone, Copy, Debug)]
pub struct DenseProduct<'a> {
    pub a: &'a Handle,
    pub a_t: bool,
    pub b: &'a Handle,
    pub b_t: bool,
    pub c: &'a Handle,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
}

/// Whether [`products`] runs products of `F` on this client.
pub fn available<R: Runtime, F: Float>(client: &ComputeClient<R>) -> bool {
    crate::tune::cublas_usable::<R, F>(client)
}

/// Runs `products` in order (a later one may read an earlier one's `C`), after everything
/// queued on `client` so far; every cubecl kernel queued after it sees their results. `Ok(false)` where cuBLAS cannot run
/// products of `F` here (nothing launched).
pub fn products<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    products: &[DenseProduct<'_>],
) -> Result<bool, KernelError> {
    let size = std::mem::size_of::<F>();
    for p in products {
        if p.m == 0 || p.n == 0 || p.k == 0 {
            return Err(shape_err(
                "dense product",
                format!("empty product {}x{}x{}", p.m, p.n, p.k),
            ));
        }
        check_buffer("dense product", "A", p.a, p.m * p.k * size)?;
        check_buffer("dense product", "B", p.b, p.k * p.n * size)?;
        check_buffer("dense product", "C", p.c, p.m * p.n * size)?;
    }
    if products.is_empty() || !available::<R, F>(client) {
        return Ok(false);
    }
    run::<R, F>(client, products)?;
    Ok(true)
}

#[cfg(feature = "cuda")]
fn run<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    products: &[DenseProduct<'_>],
) -> Result<(), KernelError> {
    use crate::cublas::{data_type, Gemm};
    let ty = data_type::<F>().ok_or_else(|| KernelError::Vendor {
        what: "cuBLAS runs bf16 and f16 products only".into(),
    })?;
    let gemms: Vec<Gemm<'_>> = products
        .iter()
        .map(|p| Gemm {
            alpha: p.alpha,
            // Column-major, C stored row-major [m, n] is Cᵀ [n, m]: Cᵀ = op(B)ᵀ · op(A)ᵀ.
            ..Gemm::new(blas_shape(p.m, p.n, p.k, p.a_t, p.b_t), (p.b, p.a, p.c)).types(ty, ty)
        })
        .collect();
    crate::cublas::run(client, &gemms)
}

#[cfg(not(feature = "cuda"))]
fn run<R: Runtime, F: Float>(
    _client: &ComputeClient<R>,
    _products: &[DenseProduct<'_>],
) -> Result<(), KernelError> {
    unreachable!("`available` is false without the cuda feature")
}

/// The column-major GEMM that computes row-major `C = op(A)·op(B)` as `Cᵀ = op(B)ᵀ·op(A)ᵀ`.
/// A row-major `[r, c]` matrix read column-major is its transpose `[c, r]` with leading
/// dimension `c`: `B` stored `[k, n]` is already `op(B)ᵀ` (no transpose, ld `n`); stored
/// `[n, k]` it needs one (ld `k`). Likewise `A` with `m`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn blas_shape(m: usize, n: usize, k: usize, a_t: bool, b_t: bool) -> crate::dense::BlasShape {
    crate::dense::BlasShape {
        trans_a: b_t,
        trans_b: a_t,
        m: n,
        n: m,
        k,
        lda: if b_t { k } else { n },
        ldb: if a_t { m } else { k },
        ldc: n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape, read back through BLAS's column-major definition, is the row-major product.
    #[test]
    fn column_major_shape_is_the_row_major_product() {
        let (m, n, k) = (3usize, 5usize, 4usize);
        for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
            // Row-major A (stored [k, m] when transposed) and B (stored [n, k] when transposed).
            let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
            let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.71).cos()).collect();
            let op_a = |i: usize, l: usize| if a_t { a[l * m + i] } else { a[i * k + l] };
            let op_b = |l: usize, j: usize| if b_t { b[j * k + l] } else { b[l * n + j] };
            let s = blas_shape(m, n, k, a_t, b_t);
            // The column-major GEMM's A is the row-major B, and its B the row-major A.
            let c = crate::dense::tests::blas(&s, &b, &a);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|l| op_a(i, l) * op_b(l, j)).sum();
                    // Row-major C[i, j] is column-major C_cm[j, i], at j + i·ldc.
                    let got = c[j + i * s.ldc];
                    assert!(
                        (want - got).abs() < 1e-12,
                        "a_t {a_t} b_t {b_t} at ({i}, {j})"
                    );
                }
            }
            assert_eq!(s.ldc, n);
        }
    }
}
