//! Dense products of row-major matrices on cuBLAS: the training's small products (the LoRA
//! backward, the lm_head's chunks), which would otherwise go to burn's autotuned matmul.
//!
//! Why: burn's matmul tunes every new shape bucket by compiling and timing about a dozen
//! candidate kernels. On an H100 (2026-11-27, `tools/device_compile_census.sh`, a 7B-shaped
//! NVFP4 GRPO step on empty caches) that was 156 of the 346 kernels the first step compiled and
//! 284 of its 345 seconds. cuBLAS compiles nothing. Where cubecl's stream cannot be found
//! (see the `cublas` module) it costs a host round trip per call, so a caller with several
//! products to run should pass them in one call.
//!
//! [`products`] returns `Ok(false)`, launching nothing, where cuBLAS cannot run them (not CUDA,
//! f32, libcublas missing). The caller then falls back to its own path.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::device::{check_buffer, shape_err, KernelError};

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

/// How many cubecl streams cuBLAS runs on directly (found through CUPTI); 0 where every product
/// is ordered through the host (not CUDA, CUPTI missing or taken, `QERL_CUBLAS_STREAM=host`).
pub fn cubecl_streams_found() -> usize {
    #[cfg(feature = "cuda")]
    return crate::cubecl_stream::found();
    #[cfg(not(feature = "cuda"))]
    0
}

/// Whether [`products`] runs products of `F` on this client.
pub fn available<R: Runtime, F: Float>(client: &ComputeClient<R>) -> bool {
    crate::tune::cublas_usable::<R, F>(client)
}

/// Runs `products` in order (a later one may read an earlier one's `C`), after everything
/// queued on `client` so far and before anything queued later (on cubecl's stream where it can
/// be found, else through the host, returning when they are done). `Ok(false)` where cuBLAS cannot run
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
            shape: blas_shape(p.m, p.n, p.k, p.a_t, p.b_t),
            // Column-major, C stored row-major [m, n] is Cᵀ [n, m]: Cᵀ = op(B)ᵀ · op(A)ᵀ.
            a: p.b,
            b: p.a,
            c: p.c,
            ab_type: ty,
            c_type: ty,
            alpha: p.alpha,
            beta: 0.0,
            batched: None,
        })
        .collect();
    crate::cublas::run(client, &gemms)
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::extra_unused_type_parameters)] // the CUDA form's signature
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
pub(crate) fn blas_shape(
    m: usize,
    n: usize,
    k: usize,
    a_t: bool,
    b_t: bool,
) -> crate::dense::BlasShape {
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
