//! Dense operands for a vendor GEMM: the 4-bit weight decoded into a reused `F` buffer with a
//! row stride of our choosing, and the extra columns that fold bias and LoRA into one product.
//!
//! With `K' = K + r (+ 1)` rounded up to [`LD_ALIGN`]:
//!
//! ```text
//! Xw[M, K'] = [ X | s·T | 1 | 0.. ]       Ww[N, K'] = [ deq(W) | B | bias | 0.. ]
//! Xw · Wwᵀ  =  X·deq(W)ᵀ + s·T·Bᵀ + bias
//! ```
//!
//! so the whole forward of a LoRA linear is one GEMM over `K + r + 1` instead of a GEMM and an
//! epilogue pass over `Y` (which would read and write `M·N` elements again: ~13% of a 7B
//! gate_up product at M = 4096). Where `K > N` the copy of `X` costs more than that pass, so
//! the cuBLAS forward widens only the two small operands (`K = 0`: `[s·T | 1 | 0..]` and
//! `[B | bias | 0..]`) and adds their product to `Y` in a second GEMM. The padding columns are written as zeros on both sides, so
//! nothing left in a reused buffer can reach the product. `s·T` is rounded to `F` here (the
//! fused kernels keep `T` in f32), a relative 2⁻⁹ on a term that is itself small next to `Y`.
//!
//! Both kernels write whole vectors of `V` elements (8 on CUDA: 16-byte stores; 4 on wgpu).

use crate::device::{
    block_scale, check_buffer, grid_1d, linear_cube, shape_err, DeviceWeight, KernelError,
};
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Row strides of the widened operands are multiples of this many elements (32 bytes in bf16),
/// which keeps every row aligned for 16-byte vector loads in the vendor GEMM.
pub const LD_ALIGN: usize = 16;

const CUBE: u32 = 256;

/// A product in BLAS's column-major terms, `C[m, n] = op(A)[m, k] · op(B)[k, n]` (leading
/// dimensions in elements), for the row-major buffers of the cuBLAS strategy. Built here, not
/// next to the cuBLAS call, so its mapping is tested on every build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlasShape {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

impl BlasShape {
    /// `Y[rows, n] = Xw[rows, ld] · Ww[n, ld]ᵀ` (row-major), with `A = Ww`, `B = Xw`, `C = Y`:
    /// row-major `Y` is column-major `Yᵀ[n, rows] = Ww-as-stored(transposed) · Xw-as-stored`.
    pub fn forward(rows: usize, n: usize, ld: usize) -> Self {
        BlasShape {
            trans_a: true,
            trans_b: false,
            m: n,
            n: rows,
            k: ld,
            lda: ld,
            ldb: ld,
            ldc: n,
        }
    }

    /// `dX[rows, k] = dY[rows, n] · W[n, k]` (row-major), with `A = W`, `B = dY`, `C = dX`:
    /// column-major `dXᵀ[k, rows] = W-as-stored[k, n] · dY-as-stored[n, rows]`.
    pub fn transposed(rows: usize, n: usize, k: usize) -> Self {
        BlasShape {
            trans_a: false,
            trans_b: false,
            m: k,
            n: rows,
            k: n,
            lda: k,
            ldb: n,
            ldc: k,
        }
    }

    /// Elements of A, B and C the product touches (the last column's offset plus its rows).
    pub fn extents(&self) -> (usize, usize, usize) {
        let (a_rows, a_cols) = if self.trans_a {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (b_rows, b_cols) = if self.trans_b {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        (
            self.lda * (a_cols - 1) + a_rows,
            self.ldb * (b_cols - 1) + b_rows,
            self.ldc * (self.n - 1) + self.m,
        )
    }
}

/// The row stride of the widened operands for a product with `k` inputs, LoRA rank `rank` (0
/// without an adapter) and an optional bias.
pub fn widened_ld(k: usize, rank: usize, bias: bool) -> usize {
    (k + rank + usize::from(bias)).next_multiple_of(LD_ALIGN)
}

/// Unit `u` decodes `8 · words` consecutive elements of one row (`words` code words under one
/// scale: the host keeps `8 · words` a divisor of the block) and stores them as vectors of `V`
/// at row stride `ld`. Why two words a unit:
/// half the index arithmetic and scale reads per byte written, and twice the bytes in flight a
/// thread, for a kernel whose only job is to write the dense weight at the copy bandwidth.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dequant_rows_kernel<F: Float, V: Size>(
    codes: &Array<u32>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    code_table: &Array<f32>,
    out: &mut Array<Vector<F, V>>,
    n: u32,
    k: u32,
    ld: u32,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
    #[comptime] words: usize,
) {
    let vs = out.vector_size();
    let u = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let span = comptime!(8 * words);
    let vectors = comptime!(8 / vs);
    let k_spans = k as usize / span;
    if u < n as usize * k_spans {
        let row = u / k_spans;
        let col = (u % k_spans) * span;
        let e0 = row * k as usize + col;
        let s = block_scale(scale_bytes, scale_table, e0 / block, byte_scales);
        let base = (row * ld as usize + col) / vs;
        #[unroll]
        for wi in 0..words {
            let word = codes[e0 / 8 + wi];
            #[unroll]
            for j in 0..vectors {
                let mut v = Vector::<F, V>::empty();
                #[unroll]
                for i in 0..vs {
                    let code = (word >> (4 * (j * vs + i)) as u32) & 0xfu32;
                    v[i] = F::cast_from(code_table[code as usize] * s);
                }
                out[base + (8 * wi) / vs + j] = v;
            }
        }
    }
}

/// Writes columns `first..ld` of every row of `out` (row stride `ld`): columns `< k` copied from
/// `main` (`[rows, k]`), `k + j` for `j < rank` = `scale · tail[row, j]`, `k + rank` = 1
/// (`extra == 1`) or `extra_col[row]` (`extra == 2`), the rest 0.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn widen_kernel<F: Float, E: Float, V: Size>(
    main: &Array<Vector<F, V>>,
    tail: &Array<E>,
    extra_col: &Array<F>,
    out: &mut Array<Vector<F, V>>,
    rows: u32,
    k: u32,
    ld: u32,
    rank: u32,
    scale: f32,
    #[comptime] copy_main: bool,
    #[comptime] extra: u32,
) {
    let vs = out.vector_size();
    let k = k as usize;
    let ld = ld as usize;
    let rank = rank as usize;
    let mut first = 0usize;
    if !copy_main {
        first = k / vs;
    }
    let per_row = ld / vs - first;
    let u = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if u < rows as usize * per_row {
        let row = u / per_row;
        let cv = first + u % per_row;
        if cv < k / vs {
            out[row * (ld / vs) + cv] = main[row * (k / vs) + cv];
        } else {
            let mut v = Vector::<F, V>::empty();
            #[unroll]
            for i in 0..vs {
                let j = cv * vs + i - k;
                let mut e = 0.0f32;
                if j < rank {
                    e = f32::cast_from(tail[row * rank + j]) * scale;
                } else if j == rank {
                    if extra == 1 {
                        e = 1.0f32;
                    } else if extra == 2 {
                        e = f32::cast_from(extra_col[row]);
                    }
                }
                v[i] = F::cast_from(e);
            }
            out[row * (ld / vs) + cv] = v;
        }
    }
}

/// The vector width for `F` on this client: 16-byte stores where the runtime allows them.
fn width<R: Runtime, F: Float>(client: &ComputeClient<R>) -> usize {
    let bytes = std::mem::size_of::<F>();
    let max = client.properties().hardware.max_vector_size.max(1);
    (16 / bytes).min(max).clamp(1, 8)
}

/// Writes `deq(W)` into columns `0..K` of the `[N, ld]` row-major buffer `out` (`ld >= K`, a
/// multiple of 8). Columns past `K` are left alone: [`widen`] fills them.
pub fn dequantize_rows<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    weight: &DeviceWeight,
    out: &Handle,
    ld: usize,
) -> Result<(), KernelError> {
    let (n, k) = (weight.n, weight.k);
    if ld < k || !ld.is_multiple_of(8) {
        return Err(shape_err(
            "dequantize_rows",
            format!("row stride {ld} for K = {k}: needs >= K and a multiple of 8"),
        ));
    }
    check_buffer(
        "dequantize_rows",
        "out",
        out,
        n * ld * std::mem::size_of::<F>(),
    )?;
    let vs = width::<R, F>(client);
    let words = dequant_words(weight.block(), k);
    let units = n * k / (8 * words);
    // SAFETY: the kernel reads codes[n*k/8] and the scale buffers DeviceWeight::upload made,
    // and writes out[n*ld] (checked above); K and ld are multiples of 8, so of vs, and
    // `8 · words` divides K and the block.
    unsafe {
        dequant_rows_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(units.div_ceil(CUBE as usize)),
            CubeDim::new_1d(CUBE),
            vs,
            ArrayArg::from_raw_parts(weight.codes.clone(), weight.words()),
            ArrayArg::from_raw_parts(weight.scale_bytes.clone(), weight.scale_words()),
            ArrayArg::from_raw_parts(weight.scale_table.clone(), weight.scale_table_len()),
            ArrayArg::from_raw_parts(weight.code_table.clone(), 16),
            ArrayArg::from_raw_parts(out.clone(), n * ld / vs),
            n as u32,
            k as u32,
            ld as u32,
            weight.block(),
            weight.byte_scales(),
            words,
        );
    }
    Ok(())
}

/// Code words a unit of the decode takes: 2 (16 elements under one scale) where the block and
/// `K` allow it, else 1. `QERL_DEQUANT_WORDS=1` forces one word (the earlier kernel's shape, for
/// A/B runs).
fn dequant_words(block: usize, k: usize) -> usize {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| {
        std::env::var("QERL_DEQUANT_WORDS")
            .ok()
            .and_then(|v| v.parse().ok())
    });
    let want = forced.unwrap_or(2);
    if want >= 2 && block.is_multiple_of(16) && k.is_multiple_of(16) {
        2
    } else {
        1
    }
}

/// The extra column after the rank columns of a widened operand.
#[derive(Clone, Copy, Debug)]
pub enum ExtraColumn<'a> {
    None,
    /// All ones (the activation side of a bias).
    Ones,
    /// One value per row (the weight side: the bias itself), `rows` elements of `F`.
    PerRow(&'a Handle),
}

/// Fills `out[rows, ld]` past column `K` (and, with `main`, columns `0..K` from `main[rows, K]`):
/// `scale · tail[rows, rank]` (elements of `E`), then the [`ExtraColumn`], then zeros.
#[allow(clippy::too_many_arguments)]
pub fn widen<R: Runtime, F: Float, E: Float>(
    client: &ComputeClient<R>,
    main: Option<&Handle>,
    tail: Option<(&Handle, usize, f32)>,
    extra: ExtraColumn<'_>,
    out: &Handle,
    rows: usize,
    k: usize,
    ld: usize,
) -> Result<(), KernelError> {
    let (rank, tail_h, scale) = match tail {
        Some((h, r, s)) => (r, Some(h), s),
        None => (0, None, 0.0),
    };
    let need = k + rank + usize::from(!matches!(extra, ExtraColumn::None));
    if ld < need || !k.is_multiple_of(8) || !ld.is_multiple_of(8) {
        return Err(shape_err(
            "widen",
            format!("row stride {ld} for K = {k}, rank {rank}: too narrow or not a multiple of 8"),
        ));
    }
    let f = std::mem::size_of::<F>();
    check_buffer("widen", "out", out, rows * ld * f)?;
    if let Some(m) = main {
        check_buffer("widen", "main", m, rows * k * f)?;
    }
    if let Some(t) = tail_h {
        check_buffer("widen", "tail", t, rows * rank * std::mem::size_of::<E>())?;
    }
    if let ExtraColumn::PerRow(c) = extra {
        check_buffer("widen", "extra column", c, rows * f)?;
    }
    let vs = width::<R, F>(client);
    let first = if main.is_some() { 0 } else { k / vs };
    let units = rows * (ld / vs - first);
    // Unused inputs are bound to `out`, never read through them.
    let main_h = main.unwrap_or(out).clone();
    let tail_h = tail_h.unwrap_or(out).clone();
    let (extra_h, mode) = match extra {
        ExtraColumn::None => (out.clone(), 0u32),
        ExtraColumn::Ones => (out.clone(), 1),
        ExtraColumn::PerRow(c) => (c.clone(), 2),
    };
    let main_len = if main.is_some() { rows * k / vs } else { 1 };
    // SAFETY: sizes checked above; every index is bounded by rows, ld, k and rank.
    unsafe {
        widen_kernel::launch_unchecked::<F, E, R>(
            client,
            grid_1d(units.div_ceil(CUBE as usize)),
            CubeDim::new_1d(CUBE),
            vs,
            ArrayArg::from_raw_parts(main_h, main_len),
            ArrayArg::from_raw_parts(tail_h, (rows * rank).max(1)),
            ArrayArg::from_raw_parts(extra_h, rows.max(1)),
            ArrayArg::from_raw_parts(out.clone(), rows * ld / vs),
            rows as u32,
            k as u32,
            ld as u32,
            rank as u32,
            scale,
            main.is_some(),
            mode,
        );
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::BlasShape;

    /// BLAS's definition: column-major, `op(X)[i, j]` = `X[j, i]` when transposed.
    pub(crate) fn blas(s: &BlasShape, a: &[f64], b: &[f64]) -> Vec<f64> {
        let at = |i: usize, l: usize| {
            if s.trans_a {
                a[i * s.lda + l]
            } else {
                a[l * s.lda + i]
            }
        };
        let bt = |l: usize, j: usize| {
            if s.trans_b {
                b[l * s.ldb + j]
            } else {
                b[j * s.ldb + l]
            }
        };
        let mut c = vec![f64::NAN; s.extents().2];
        for j in 0..s.n {
            for i in 0..s.m {
                c[j * s.ldc + i] = (0..s.k).map(|l| at(i, l) * bt(l, j)).sum();
            }
        }
        c
    }

    fn values(len: usize, seed: u64) -> Vec<f64> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    #[test]
    fn forward_shape_computes_x_times_w_transposed() {
        let (rows, n, ld) = (3, 5, 16);
        let (w, x) = (values(n * ld, 1), values(rows * ld, 2));
        let s = BlasShape::forward(rows, n, ld);
        assert_eq!(s.extents(), (n * ld, rows * ld, rows * n));
        let y = blas(&s, &w, &x);
        for r in 0..rows {
            for c in 0..n {
                let want: f64 = (0..ld).map(|l| x[r * ld + l] * w[c * ld + l]).sum();
                assert!((y[r * n + c] - want).abs() < 1e-12, "Y[{r}, {c}]");
            }
        }
    }

    #[test]
    fn transposed_shape_computes_dy_times_w() {
        let (rows, n, k) = (4, 6, 3);
        let (w, dy) = (values(n * k, 3), values(rows * n, 4));
        let s = BlasShape::transposed(rows, n, k);
        assert_eq!(s.extents(), (n * k, rows * n, rows * k));
        let dx = blas(&s, &w, &dy);
        for r in 0..rows {
            for c in 0..k {
                let want: f64 = (0..n).map(|j| dy[r * n + j] * w[j * k + c]).sum();
                assert!((dx[r * k + c] - want).abs() < 1e-12, "dX[{r}, {c}]");
            }
        }
    }
}
