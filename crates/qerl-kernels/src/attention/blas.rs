//! Attention on cuBLAS: the scores of a few sequences at a time materialised in f32, the four
//! products of the forward and backward on the tensor cores, a row kernel for the softmax and
//! its gradient. CUDA with bf16/f16 only; [`super::forward`] and [`super::backward`] use it
//! where it runs and fall back to the fused kernels otherwise.
//!
//! Why: the fused kernels run on CUDA cores (no `mma` in them), about 9 TFLOP/s; on an H100
//! (2026-11-28, `tools/device_update_profile.sh`, one 16 x 1,280-token micro-batch of a 7B GRPO
//! update) they were 2.7 of the 4.6 s of GPU time. Here the products run at cuBLAS's rate and
//! the extra cost is the traffic of the score tiles (12 bytes a score in the backward).
//!
//! Layout. The `g = heads / kv_heads` query heads that share kv head `h` are consecutive in
//! `q [batch, heads, seq, d]`, so item `i = b·kv_heads + h` is one `[g·seq, d]` matrix of queries
//! at `i·g·seq·d`, its keys and values one `[seq, d]` matrix at `i·seq·d`, and its scores one
//! `[g·seq, seq]` matrix: every product is a strided batch over items. Row `r` of an item is
//! query `r mod seq` of head `h·g + r / seq`; its log-sum-exp sits at `i·g·seq + r` of
//! `lse [batch, heads, seq]`. Items go in chunks whose score buffers fit [`WORKSPACE`].
//!
//! Products (row-major, per item, `s` the softmax scale):
//! forward `S = s·Q·Kᵀ` (f32), `P = softmax(S)` (`F`, masked entries 0), `O = P·V`;
//! backward `S` again, `dP = dO·Vᵀ` (f32), `dS = P ⊙ (dP − D)` with `D = rowsum(dO ⊙ O)`,
//! `dV = Pᵀ·dO`, `dQ = s·dS·K`, `dK = s·dSᵀ·Q`. `P` and `dS` are rounded to `F` before their
//! products, as flash attention does.

use std::sync::atomic::{AtomicUsize, Ordering};

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{visible, AttentionShape, MASKED};
use crate::blas::blas_shape;
use crate::cublas::{self, Batched, Gemm};
use crate::device::{grid_1d, linear_cube, KernelError};

/// Bytes the score buffers of one chunk may take (the chunk holds at least one item; an item
/// past twice this runs on the fused kernels instead).
pub const WORKSPACE: usize = 768 << 20;

/// Rows a cube of the row kernels takes: one plane (32 units) each.
const ROWS: u32 = 8;

static ITEMS_PER_CHUNK: AtomicUsize = AtomicUsize::new(0);

/// Fixes the items a chunk takes (`None`: as many as fit [`WORKSPACE`]); the tests use it to
/// run many chunks at small shapes.
pub fn set_items_per_chunk(items: Option<usize>) {
    ITEMS_PER_CHUNK.store(items.map_or(0, |n| n.max(1)), Ordering::Relaxed);
}

/// Items a chunk takes when each needs `item_bytes`, or `None` when one alone is too big.
fn chunk_items(item_bytes: usize) -> Option<usize> {
    let fits = (WORKSPACE / item_bytes).max(1);
    (item_bytes <= 2 * WORKSPACE).then(|| match ITEMS_PER_CHUNK.load(Ordering::Relaxed) {
        0 => fits,
        n => n,
    })
}

/// Row `r` of a chunk's scores: the softmax of its visible entries into `p` (masked entries 0)
/// and its log-sum-exp (`MASKED` for a query that sees nothing). `s` holds `s·q·kᵀ`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn softmax_kernel<F: Float>(
    s: &Array<f32>,
    p: &mut Array<F>,
    lse: &mut Array<f32>,
    bounds: &Array<u32>,
    rows: u32,
    seq: u32,
    item_rows: u32,
    kv_heads: u32,
    item0: u32,
) {
    let r = linear_cube() * ROWS as usize + UNIT_POS_Y as usize;
    if r < rows as usize {
        let seq = seq as usize;
        let lane = UNIT_POS_X as usize;
        let item = item0 as usize + r / item_rows as usize;
        let i = (r % item_rows as usize) % seq;
        let b = item / kv_heads as usize;
        let (start, end) = (bounds[2 * b] as usize, bounds[2 * b + 1] as usize);
        let base = r * seq;
        let mut m = f32::new(MASKED);
        let mut j = lane;
        while j < seq {
            if visible(i, j, seq, start, end) {
                m = max(m, s[base + j]);
            }
            j += 32;
        }
        m = plane_max(m);
        let mut sum = 0.0f32;
        let mut j = lane;
        while j < seq {
            if visible(i, j, seq, start, end) {
                sum += f32::exp(s[base + j] - m);
            }
            j += 32;
        }
        sum = plane_sum(sum);
        let mut inv = 0.0f32;
        let mut row_lse = f32::new(MASKED);
        if sum > 0.0f32 {
            inv = 1.0f32 / sum;
            row_lse = m + f32::ln(sum);
        }
        let mut j = lane;
        while j < seq {
            let mut e = 0.0f32;
            if visible(i, j, seq, start, end) {
                e = f32::exp(s[base + j] - m) * inv;
            }
            p[base + j] = F::cast_from(e);
            j += 32;
        }
        if lane == 0 {
            lse[item0 as usize * item_rows as usize + r] = row_lse;
        }
    }
}

/// Row `r` of a chunk: `P = exp(S − lse)` on the visible entries (0 elsewhere and on a blind
/// query's row) into `p`, and `dS = P ⊙ (dP − D)` into `ds`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn softmax_grad_kernel<F: Float>(
    s: &Array<f32>,
    dp: &Array<f32>,
    lse: &Array<f32>,
    dvec: &Array<f32>,
    bounds: &Array<u32>,
    p: &mut Array<F>,
    ds: &mut Array<F>,
    rows: u32,
    seq: u32,
    item_rows: u32,
    kv_heads: u32,
    item0: u32,
) {
    let r = linear_cube() * ROWS as usize + UNIT_POS_Y as usize;
    if r < rows as usize {
        let seq = seq as usize;
        let lane = UNIT_POS_X as usize;
        let item = item0 as usize + r / item_rows as usize;
        let i = (r % item_rows as usize) % seq;
        let b = item / kv_heads as usize;
        let (start, end) = (bounds[2 * b] as usize, bounds[2 * b + 1] as usize);
        let row = item0 as usize * item_rows as usize + r;
        let row_lse = lse[row];
        let d = dvec[row];
        let base = r * seq;
        let mut j = lane;
        while j < seq {
            let mut pv = 0.0f32;
            if row_lse > f32::new(MASKED) && visible(i, j, seq, start, end) {
                pv = f32::exp(s[base + j] - row_lse);
            }
            p[base + j] = F::cast_from(pv);
            ds[base + j] = F::cast_from(pv * (dp[base + j] - d));
            j += 32;
        }
    }
}

/// Where cuBLAS attention runs: CUDA, bf16/f16, libcublas loadable, `QERL_ATTENTION` not
/// `fused`.
pub fn usable<R: Runtime, F: Float>(client: &ComputeClient<R>) -> bool {
    std::env::var("QERL_ATTENTION").as_deref() != Ok("fused")
        && crate::tune::cublas_usable::<R, F>(client)
}

/// The items of `s` and what one item's products look like.
struct Items {
    /// Items (`batch·kv_heads`) and query rows of one (`g·seq`).
    count: usize,
    rows: usize,
    seq: usize,
    d: usize,
}

impl Items {
    fn of(s: &AttentionShape) -> Items {
        Items {
            count: s.batch * s.kv_heads,
            rows: s.heads / s.kv_heads * s.seq,
            seq: s.seq,
            d: s.head_dim,
        }
    }

    /// Row-major `C [m, n] = op(A)·op(B)` over `n` items from `first`, each operand at its
    /// per-item stride (`A`, `B`, `C` in elements), `(a_t, b_t)` as in [`blas_shape`].
    #[allow(clippy::too_many_arguments)]
    fn gemm<'a>(
        &self,
        (m, n, k): (usize, usize, usize),
        (a, a_t, a_stride, a_first): (&'a Handle, bool, usize, usize),
        (b, b_t, b_stride, b_first): (&'a Handle, bool, usize, usize),
        (c, c_stride, c_first): (&'a Handle, usize, usize),
        count: usize,
        alpha: f32,
        (ab_type, c_type): (
            cudarc::cublas::sys::cudaDataType,
            cudarc::cublas::sys::cudaDataType,
        ),
    ) -> Gemm<'a> {
        // Column-major, row-major C [m, n] is Cᵀ: Cᵀ = op(B)ᵀ·op(A)ᵀ (see `blas_shape`).
        Gemm {
            shape: blas_shape(m, n, k, a_t, b_t),
            a: b,
            b: a,
            c,
            ab_type,
            c_type,
            alpha,
            beta: 0.0,
            batched: Some(Batched {
                count,
                offsets: [b_first * b_stride, a_first * a_stride, c_first * c_stride],
                strides: [b_stride, a_stride, c_stride],
            }),
        }
    }
}

fn vendor(what: &str) -> KernelError {
    KernelError::Vendor { what: what.into() }
}

/// [`super::forward`] on cuBLAS; `Ok(false)` (nothing launched) where an item's scores are too
/// big for [`WORKSPACE`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    shape: &AttentionShape,
    q: &Handle,
    k: &Handle,
    v: &Handle,
    bounds: &Handle,
    out: &Handle,
    lse: &Handle,
) -> Result<bool, KernelError> {
    let it = Items::of(shape);
    let f = std::mem::size_of::<F>();
    let scores = it.rows * it.seq;
    let Some(chunk) = chunk_items(scores * (4 + f)) else {
        return Ok(false);
    };
    let ty = cublas::data_type::<F>().ok_or_else(|| vendor("cuBLAS attention: bf16/f16 only"))?;
    let f32t = cublas::output_type::<f32>().ok_or_else(|| vendor("cuBLAS f32 output"))?;
    let n = chunk.min(it.count);
    let (s_buf, p_buf) = (client.empty(n * scores * 4), client.empty(n * scores * f));
    let (qs, kvs) = (it.rows * it.d, it.seq * it.d);
    let mut first = 0;
    while first < it.count {
        let n = chunk.min(it.count - first);
        let s_gemm = it.gemm(
            (it.rows, it.seq, it.d),
            (q, false, qs, first),
            (k, true, kvs, first),
            (&s_buf, scores, 0),
            n,
            shape.scale,
            (ty, f32t),
        );
        cublas::run(client, &[s_gemm])?;
        let rows = n * it.rows;
        // SAFETY: `s_buf`/`p_buf` hold `n` items' scores; `lse` and `bounds` were checked by
        // the caller for the whole shape, and rows stay within items `first .. first + n`.
        unsafe {
            softmax_kernel::launch_unchecked::<F, R>(
                client,
                grid_1d(rows.div_ceil(ROWS as usize)),
                CubeDim::new_2d(32, ROWS),
                ArrayArg::from_raw_parts(s_buf.clone(), n * scores),
                ArrayArg::from_raw_parts(p_buf.clone(), n * scores),
                ArrayArg::from_raw_parts(lse.clone(), it.count * it.rows),
                ArrayArg::from_raw_parts(bounds.clone(), 2 * shape.batch),
                rows as u32,
                it.seq as u32,
                it.rows as u32,
                shape.kv_heads as u32,
                first as u32,
            );
        }
        let o_gemm = it.gemm(
            (it.rows, it.d, it.seq),
            (&p_buf, false, scores, 0),
            (v, false, kvs, first),
            (out, qs, first),
            n,
            1.0,
            (ty, ty),
        );
        cublas::run(client, &[o_gemm])?;
        first += n;
    }
    Ok(true)
}

/// [`super::backward`] on cuBLAS, given `D = rowsum(dO ⊙ O)` in `dvec`; `Ok(false)` (nothing
/// launched) where an item's scores are too big for [`WORKSPACE`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    shape: &AttentionShape,
    (q, k, v): (&Handle, &Handle, &Handle),
    bounds: &Handle,
    lse: &Handle,
    dvec: &Handle,
    d_out: &Handle,
    (dq, dk, dv): (&Handle, &Handle, &Handle),
) -> Result<bool, KernelError> {
    let it = Items::of(shape);
    let f = std::mem::size_of::<F>();
    let scores = it.rows * it.seq;
    let Some(chunk) = chunk_items(scores * (8 + 2 * f)) else {
        return Ok(false);
    };
    let ty = cublas::data_type::<F>().ok_or_else(|| vendor("cuBLAS attention: bf16/f16 only"))?;
    let f32t = cublas::output_type::<f32>().ok_or_else(|| vendor("cuBLAS f32 output"))?;
    let n = chunk.min(it.count);
    let (s_buf, dp_buf) = (client.empty(n * scores * 4), client.empty(n * scores * 4));
    let (p_buf, ds_buf) = (client.empty(n * scores * f), client.empty(n * scores * f));
    let (qs, kvs) = (it.rows * it.d, it.seq * it.d);
    let (r, sq, d) = (it.rows, it.seq, it.d);
    let mut first = 0;
    while first < it.count {
        let n = chunk.min(it.count - first);
        let s_gemm = it.gemm(
            (r, sq, d),
            (q, false, qs, first),
            (k, true, kvs, first),
            (&s_buf, scores, 0),
            n,
            shape.scale,
            (ty, f32t),
        );
        let dp_gemm = it.gemm(
            (r, sq, d),
            (d_out, false, qs, first),
            (v, true, kvs, first),
            (&dp_buf, scores, 0),
            n,
            1.0,
            (ty, f32t),
        );
        cublas::run(client, &[s_gemm, dp_gemm])?;
        let rows = n * r;
        // SAFETY: as in `forward`; `dvec` holds one f32 a row of the whole shape.
        unsafe {
            softmax_grad_kernel::launch_unchecked::<F, R>(
                client,
                grid_1d(rows.div_ceil(ROWS as usize)),
                CubeDim::new_2d(32, ROWS),
                ArrayArg::from_raw_parts(s_buf.clone(), n * scores),
                ArrayArg::from_raw_parts(dp_buf.clone(), n * scores),
                ArrayArg::from_raw_parts(lse.clone(), it.count * r),
                ArrayArg::from_raw_parts(dvec.clone(), it.count * r),
                ArrayArg::from_raw_parts(bounds.clone(), 2 * shape.batch),
                ArrayArg::from_raw_parts(p_buf.clone(), n * scores),
                ArrayArg::from_raw_parts(ds_buf.clone(), n * scores),
                rows as u32,
                sq as u32,
                r as u32,
                shape.kv_heads as u32,
                first as u32,
            );
        }
        let dv_gemm = it.gemm(
            (sq, d, r),
            (&p_buf, true, scores, 0),
            (d_out, false, qs, first),
            (dv, kvs, first),
            n,
            1.0,
            (ty, ty),
        );
        let dq_gemm = it.gemm(
            (r, d, sq),
            (&ds_buf, false, scores, 0),
            (k, false, kvs, first),
            (dq, qs, first),
            n,
            shape.scale,
            (ty, ty),
        );
        let dk_gemm = it.gemm(
            (sq, d, r),
            (&ds_buf, true, scores, 0),
            (q, false, qs, first),
            (dk, kvs, first),
            n,
            shape.scale,
            (ty, ty),
        );
        cublas::run(client, &[dv_gemm, dq_gemm, dk_gemm])?;
        first += n;
    }
    Ok(true)
}
