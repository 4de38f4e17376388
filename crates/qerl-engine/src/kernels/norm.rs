//! Row kernels at the edges of a decoder layer: the embedding gather, and the residual add
//! fused with RMSNorm.
//!
//! One cube per row, reducing in shared memory (no plane ops, so the same kernel runs on
//! lavapipe). Activations are `F` (bf16 on CUDA); the norm's gain is f32 (the RMSNorm weight
//! plus the AQN vector, summed once per optimizer step on the host side of the engine).

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{grid_rows, row_of_cube, ROW_CUBE};

/// Tree sum of `partial[0..ROW_CUBE]` into `partial[0]`; every unit of the cube calls it.
#[cube]
pub(crate) fn cube_sum(partial: &mut SharedMemory<f32>) {
    let t = UNIT_POS_X as usize;
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if t < stride {
            partial[t] += partial[t + stride];
        }
        sync_cube();
        stride /= 2;
    }
}

/// `h[r, :] = table[tokens[r], :]`.
#[cube(launch_unchecked)]
fn embed_kernel<F: Float>(
    table: &Array<F>,
    tokens: &Array<u32>,
    h: &mut Array<F>,
    rows: u32,
    hidden: u32,
) {
    let r = row_of_cube();
    if r < rows as usize {
        let hidden = hidden as usize;
        let src = tokens[r] as usize * hidden;
        let mut c = UNIT_POS_X as usize;
        while c < hidden {
            h[r * hidden + c] = table[src + c];
            c += CUBE_DIM_X as usize;
        }
    }
}

/// What a norm adds to the residual stream before normalising it.
#[derive(Clone, Copy, Debug)]
pub enum Residual<'a> {
    /// Nothing (the first layer's norm).
    None,
    /// The product's output `d [rows, dim]` in `F`.
    Dense(&'a Handle),
    /// A split-K product's f32 partial sums `[slices, rows, dim]` (its epilogue in slice 0),
    /// not yet added: the norm adds them in slice order and rounds to `F`, as the product's
    /// reduction would have, which saves that reduction's launch
    /// ([`qerl_kernels::gemm::matmul_or_parts`]).
    Parts(&'a Handle, usize),
}

impl Residual<'_> {
    /// `(add, slices)`: the kernels' comptime form (`slices` 0 for a dense `d`).
    pub(crate) fn mode(&self) -> (bool, usize) {
        match self {
            Residual::None => (false, 0),
            Residual::Dense(_) => (true, 0),
            Residual::Parts(_, slices) => (true, *slices),
        }
    }

    /// The `F` buffer the kernels bind as `d` and the f32 one they bind as the partial sums
    /// (`fallback` where there is none: bound, never read).
    pub(crate) fn buffers<'b>(&'b self, fallback: &'b Handle) -> (&'b Handle, &'b Handle) {
        match self {
            Residual::None => (fallback, fallback),
            Residual::Dense(d) => (d, fallback),
            Residual::Parts(p, _) => (fallback, p),
        }
    }
}

/// The f32 vector width the norms read a split product's K-slices in ([`residual_sum`]): four
/// (16-byte loads) where it divides the row's vectors of `vs`, else `vs`. Scalar loads, each
/// warp-wide load touching 32 sectors, made the 64-row norm over 9 slices as slow as the
/// reduction launch it replaced (H200, 2026-11-28).
pub(crate) fn parts_width(vs: usize) -> usize {
    if vs.is_multiple_of(4) {
        4
    } else {
        vs
    }
}

/// Vector `v` of row `row` of the residual stream after the add, rounded to `F`: `h` alone
/// (`!add`), `h + d`, or `h + F(Σ_s parts[s])` (`slices > 0`; slice stride `stride`
/// elements; `parts` in vectors of [`parts_width`]), each sum in f32 and rounded once, as the
/// product's reduction and the unfused add would round them.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn residual_sum<F: Float, V: Size, W: Size>(
    h: &Array<Vector<F, V>>,
    d: &Array<Vector<F, V>>,
    parts: &Array<Vector<f32, W>>,
    row: usize,
    v: usize,
    vecs: usize,
    stride: usize,
    #[comptime] add: bool,
    #[comptime] slices: usize,
) -> Vector<F, V> {
    let vs = h.vector_size();
    let x = h[row * vecs + v];
    let mut sum = Vector::<F, V>::empty();
    if !add {
        sum = x;
    } else {
        if slices == 0 {
            let dv = d[row * vecs + v];
            #[unroll]
            for k in 0..vs {
                sum[k] = F::cast_from(f32::cast_from(x[k]) + f32::cast_from(dv[k]));
            }
        } else {
            let pw = parts.vector_size();
            let at = (row * vecs + v) * comptime!(vs / pw);
            let stride = stride / pw;
            #[unroll]
            for q in 0..comptime!(vs / pw) {
                // Slice 0, then each next one added in order: 0.0 + s0 + s1 + ... but for
                // the sign of a zero.
                let mut p = parts[at + q];
                #[unroll]
                for s in 1..slices {
                    p += parts[s * stride + at + q];
                }
                #[unroll]
                for i in 0..pw {
                    let dk = F::cast_from(p[i]);
                    sum[q * pw + i] =
                        F::cast_from(f32::cast_from(x[q * pw + i]) + f32::cast_from(dk));
                }
            }
        }
    }
    sum
}

/// `1 / sqrt(mean(x²) + eps)` of the row whose vectors `t, t + CUBE_DIM, ...` this unit holds
/// in `e` (`per_unit` of them, those past `vecs` not counted): each unit's squares in order,
/// then [`cube_sum`]. Every unit calls it; the fused kernels share it, so their norms are this
/// one's bit for bit.
#[cube]
pub(crate) fn inv_rms<F: Float, V: Size>(
    e: &Array<Vector<F, V>>,
    partial: &mut SharedMemory<f32>,
    vecs: usize,
    dim: u32,
    eps: f32,
    #[comptime] per_unit: usize,
) -> f32 {
    let vs = e.vector_size();
    let t = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    let mut sq = 0.0f32;
    #[unroll]
    for u in 0..per_unit {
        if t + u * step < vecs {
            #[unroll]
            for k in 0..vs {
                let f = f32::cast_from(e[u][k]);
                sq += f * f;
            }
        }
    }
    partial[t] = sq;
    sync_cube();
    cube_sum(partial);
    1.0f32 / f32::sqrt(partial[0] / dim as f32 + eps)
}

/// For output row `i` and its source row `s = index[i]` (or `i` without `gather`):
/// `x = h[s] + d[s]` when `add` ([`residual_sum`]; written back to `h[s]` as the layer's
/// residual, except when gathering: a source row may be gathered several times, and the final
/// norm's residual is not needed afterwards), then `y[i] = x / sqrt(mean(x²) + eps) ⊙ gain`.
///
/// Each unit loads its `per_unit` vectors of the row at once and keeps them in registers for
/// the second half, so a row costs one round trip to memory before the cube's sum (the
/// previous form loaded 4 scalars at a time and read the row again after the sum: 7 µs a row
/// at batch 1 on an H100, 57 launches a 7B decode step).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn add_rms_norm_kernel<F: Float, V: Size, W: Size>(
    h: &mut Array<Vector<F, V>>,
    d: &Array<Vector<F, V>>,
    parts: &Array<Vector<f32, W>>,
    gain: &Array<f32>,
    index: &Array<u32>,
    y: &mut Array<Vector<F, V>>,
    rows: u32,
    h_rows: u32,
    dim: u32,
    eps: f32,
    #[comptime] add: bool,
    #[comptime] slices: usize,
    #[comptime] gather: bool,
    #[comptime] per_unit: usize,
) {
    let vs = h.vector_size();
    let mut partial = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let i = row_of_cube();
    // The whole cube takes the same branch, so the barriers inside are uniform.
    if i < rows as usize {
        let vecs = dim as usize / vs;
        let stride = h_rows as usize * dim as usize;
        let mut s = i;
        if gather {
            s = index[i] as usize;
        }
        let t = UNIT_POS_X as usize;
        let step = CUBE_DIM_X as usize;
        // Every load first (clamped in bounds; vectors past the end are not used).
        let mut e = Array::<Vector<F, V>>::new(per_unit);
        #[unroll]
        for u in 0..per_unit {
            let v = min(t + u * step, vecs - 1);
            e[u] = residual_sum::<F, V, W>(h, d, parts, s, v, vecs, stride, add, slices);
        }
        if add && !gather {
            #[unroll]
            for u in 0..per_unit {
                let v = t + u * step;
                if v < vecs {
                    h[s * vecs + v] = e[u];
                }
            }
        }
        let r = inv_rms::<F, V>(&e, &mut partial, vecs, dim, eps, per_unit);
        #[unroll]
        for u in 0..per_unit {
            let v = t + u * step;
            if v < vecs {
                let mut out = Vector::<F, V>::empty();
                #[unroll]
                for k in 0..vs {
                    out[k] = F::cast_from(f32::cast_from(e[u][k]) * r * gain[v * vs + k]);
                }
                y[i * vecs + v] = out;
            }
        }
    }
}

/// `h [rows, hidden] = table[tokens]`: the embedding lookup.
pub fn embed<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    table: &Handle,
    vocab: usize,
    tokens: &Handle,
    rows: usize,
    hidden: usize,
    h: &Handle,
) {
    // SAFETY: the engine sizes every buffer from the model shape and `rows`; token ids are
    // checked against the vocabulary on the host before they are uploaded, and sampled ids
    // are below `vocab` by construction.
    unsafe {
        embed_kernel::launch_unchecked::<F, R>(
            client,
            grid_rows(rows),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(table.clone(), vocab * hidden),
            ArrayArg::from_raw_parts(tokens.clone(), rows),
            ArrayArg::from_raw_parts(h.clone(), rows * hidden),
            rows as u32,
            hidden as u32,
        );
    }
}

/// Residual add ([`Residual`]) and RMSNorm of `rows` rows of `h [h_rows, dim]` into
/// `y [rows, dim]`; with `index`, output row `i` is source row `index[i]` (the last token of each
/// prefilled prompt, before the lm_head).
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    h: &Handle,
    h_rows: usize,
    d: Residual<'_>,
    gain: &Handle,
    index: Option<&Handle>,
    rows: usize,
    dim: usize,
    eps: f32,
    y: &Handle,
) {
    let unused = gain.clone();
    let vs = super::vector_width::<F>(dim);
    let pw = parts_width(vs);
    let per_unit = (dim / vs).div_ceil(ROW_CUBE as usize);
    let (add, slices) = d.mode();
    let (d_h, parts) = d.buffers(h);
    // SAFETY: `h` and `d` hold `h_rows * dim` elements, the partial sums `slices` times that
    // (f32), `y` `rows * dim`, `gain` `dim`, and `index` `rows` ids below `h_rows` (built by
    // the engine); `vs` divides `dim`, and the kernel clamps its loads to the row's
    // `dim / vs` vectors and stores only inside it.
    unsafe {
        add_rms_norm_kernel::launch_unchecked::<F, R>(
            client,
            grid_rows(rows),
            CubeDim::new_1d(ROW_CUBE),
            vs,
            pw,
            ArrayArg::from_raw_parts(h.clone(), h_rows * dim / vs),
            // Without `d` the residual stands in (never read: `add` is false).
            ArrayArg::from_raw_parts(d_h.clone(), h_rows * dim / vs),
            ArrayArg::from_raw_parts(
                parts.clone(),
                if slices > 0 {
                    slices * h_rows * dim / pw
                } else {
                    1
                },
            ),
            ArrayArg::from_raw_parts(gain.clone(), dim),
            ArrayArg::from_raw_parts(index.unwrap_or(&unused).clone(), rows.max(1)),
            ArrayArg::from_raw_parts(y.clone(), rows * dim / vs),
            rows as u32,
            h_rows as u32,
            dim as u32,
            eps,
            add,
            slices,
            index.is_some(),
            per_unit,
        );
    }
}
