//! Fused noisy RMSNorm, forward and backward, over rows of length `D`.
//!
//! Forward: `y = x · r ⊙ (w + z)` with `r = 1 / sqrt(mean(x²) + eps)` per row, `z` the optional
//! per-channel AQN noise vector. `r` is saved per row for the backward pass.
//! Backward, with `g = dy ⊙ (w + z)` and `x̂ = x · r`:
//! `dx = r · (g − x̂ · mean(g ⊙ x̂))`, `dw = Σ_rows dy ⊙ x̂` (equal to the gradient of `z`).
//!
//! One cube per row reduces in shared memory (no plane ops: lavapipe has none), reading and
//! writing whole vectors (8 bf16 = 16 bytes on CUDA, 4 on wgpu, narrower when `D` needs it).
//! The weight gradient sums over rows in slices of 64 rows, then over the slices, in order.

use crate::device::{check_buffer, grid_1d, linear_cube, shape_err, vector_width, KernelError};
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Units per row; a power of two for the tree reduction.
const CUBE: u32 = 128;

/// Sum of `partial[0..CUBE_DIM_X]` into `partial[0]`; every unit must call it.
#[cube]
fn reduce_sum(partial: &mut SharedMemory<f32>) {
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

/// `w[c] + z[c]` (or `w[c]` without noise), element `i` of vector `c`, in f32.
#[cube]
fn gain<F: Float, V: Size>(
    w: &Array<Vector<F, V>>,
    z: &Array<Vector<F, V>>,
    c: usize,
    i: usize,
    #[comptime] has_noise: bool,
) -> f32 {
    let mut g = f32::cast_from(w[c][i]);
    if has_noise {
        g += f32::cast_from(z[c][i]);
    }
    g
}

/// One cube per row, `V`-wide vectors (16-byte loads and stores of bf16 on CUDA).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float, V: Size>(
    x: &Array<Vector<F, V>>,
    w: &Array<Vector<F, V>>,
    z: &Array<Vector<F, V>>,
    y: &mut Array<Vector<F, V>>,
    rstd: &mut Array<f32>,
    rows: u32,
    dim: u32,
    eps: f32,
    #[comptime] has_noise: bool,
) {
    let vs = x.vector_size();
    let mut partial = SharedMemory::<f32>::new(CUBE as usize);
    let row = linear_cube();
    // The whole cube takes the same branch, so the barriers inside are uniform.
    if row < rows as usize {
        let dim = dim as usize;
        let vecs = dim / vs;
        let base = row * vecs;
        let t = UNIT_POS_X as usize;
        let step = CUBE_DIM_X as usize;
        let mut s = 0.0f32;
        let mut c = t;
        while c < vecs {
            let v = x[base + c];
            #[unroll]
            for i in 0..vs {
                let e = f32::cast_from(v[i]);
                s += e * e;
            }
            c += step;
        }
        partial[t] = s;
        sync_cube();
        reduce_sum(&mut partial);
        let r = 1.0f32 / f32::sqrt(partial[0] / dim as f32 + eps);
        let mut c = t;
        while c < vecs {
            let v = x[base + c];
            let mut o = Vector::<F, V>::empty();
            #[unroll]
            for i in 0..vs {
                o[i] = F::cast_from(f32::cast_from(v[i]) * r * gain(w, z, c, i, has_noise));
            }
            y[base + c] = o;
            c += step;
        }
        if t == 0 {
            rstd[row] = r;
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn backward_dx_kernel<F: Float, V: Size>(
    dy: &Array<Vector<F, V>>,
    x: &Array<Vector<F, V>>,
    w: &Array<Vector<F, V>>,
    z: &Array<Vector<F, V>>,
    rstd: &Array<f32>,
    dx: &mut Array<Vector<F, V>>,
    rows: u32,
    dim: u32,
    #[comptime] has_noise: bool,
) {
    let vs = x.vector_size();
    let mut partial = SharedMemory::<f32>::new(CUBE as usize);
    let row = linear_cube();
    if row < rows as usize {
        let dim = dim as usize;
        let vecs = dim / vs;
        let base = row * vecs;
        let t = UNIT_POS_X as usize;
        let step = CUBE_DIM_X as usize;
        let r = rstd[row];
        let mut s = 0.0f32;
        let mut c = t;
        while c < vecs {
            let g = dy[base + c];
            let v = x[base + c];
            #[unroll]
            for i in 0..vs {
                let gi = f32::cast_from(g[i]) * gain(w, z, c, i, has_noise);
                s += gi * f32::cast_from(v[i]) * r;
            }
            c += step;
        }
        partial[t] = s;
        sync_cube();
        reduce_sum(&mut partial);
        let mean_gx = partial[0] / dim as f32;
        let mut c = t;
        while c < vecs {
            let g = dy[base + c];
            let v = x[base + c];
            let mut o = Vector::<F, V>::empty();
            #[unroll]
            for i in 0..vs {
                let gi = f32::cast_from(g[i]) * gain(w, z, c, i, has_noise);
                let xhat = f32::cast_from(v[i]) * r;
                o[i] = F::cast_from(r * (gi - xhat * mean_gx));
            }
            dx[base + c] = o;
            c += step;
        }
    }
}

/// Rows per slice of the weight-gradient reduction.
const DW_ROWS: usize = 64;

/// `part[slice, c] = Σ over the slice's rows of dy ⊙ x̂`: a cube column per 256 channels, a
/// cube row per slice of [`DW_ROWS`] rows, so a long batch spreads over the device.
#[cube(launch_unchecked)]
fn backward_dw_part_kernel<F: Float>(
    dy: &Array<F>,
    x: &Array<F>,
    rstd: &Array<f32>,
    part: &mut Array<f32>,
    rows: u32,
    dim: u32,
) {
    let c = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let dim = dim as usize;
    if c < dim {
        let slice = CUBE_POS_Y as usize;
        let first = slice * DW_ROWS;
        let mut end = first + DW_ROWS;
        if end > rows as usize {
            end = rows as usize;
        }
        let mut s = 0.0f32;
        for row in first..end {
            s += f32::cast_from(dy[row * dim + c]) * f32::cast_from(x[row * dim + c]) * rstd[row];
        }
        part[slice * dim + c] = s;
    }
}

/// `dw[c] = Σ_slices part[slice, c]`, in slice order (deterministic).
#[cube(launch_unchecked)]
fn backward_dw_sum_kernel<F: Float>(part: &Array<f32>, dw: &mut Array<F>, slices: u32, dim: u32) {
    let c = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let dim = dim as usize;
    if c < dim {
        let mut s = 0.0f32;
        for j in 0..slices as usize {
            s += part[j * dim + c];
        }
        dw[c] = F::cast_from(s);
    }
}

/// Forward: `x`, `y` `[rows, dim]`, `w` and the optional noise `z` `[dim]` of `F`; `rstd`
/// `[rows]` f32 receives `1 / sqrt(mean(x²) + eps)` for [`backward`].
#[allow(clippy::too_many_arguments)]
pub fn forward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    w: &Handle,
    noise: Option<&Handle>,
    rows: usize,
    dim: usize,
    eps: f32,
    y: &Handle,
    rstd: &Handle,
) -> Result<(), KernelError> {
    let e = std::mem::size_of::<F>();
    check_buffer("rms_norm", "x", x, rows * dim * e)?;
    check_buffer("rms_norm", "w", w, dim * e)?;
    check_buffer("rms_norm", "y", y, rows * dim * e)?;
    check_buffer("rms_norm", "rstd", rstd, rows * 4)?;
    if let Some(z) = noise {
        check_buffer("rms_norm", "noise", z, dim * e)?;
    }
    if rows == 0 || dim == 0 {
        return Err(shape_err(
            "rms_norm",
            format!("empty input [{rows}, {dim}]"),
        ));
    }
    let vs = vector_width::<R, F>(client, dim);
    // SAFETY: sizes checked above; the kernel bounds rows and columns (dim % vs == 0).
    unsafe {
        forward_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(rows),
            CubeDim::new_1d(CUBE),
            vs,
            ArrayArg::from_raw_parts(x.clone(), rows * dim / vs),
            ArrayArg::from_raw_parts(w.clone(), dim / vs),
            ArrayArg::from_raw_parts(noise.unwrap_or(w).clone(), dim / vs),
            ArrayArg::from_raw_parts(y.clone(), rows * dim / vs),
            ArrayArg::from_raw_parts(rstd.clone(), rows),
            rows as u32,
            dim as u32,
            eps,
            noise.is_some(),
        );
    }
    Ok(())
}

/// Backward: from `dy [rows, dim]` and the forward's inputs and `rstd`, writes `dx [rows, dim]`
/// and `dw [dim]` (the gradient of the weight, and of the noise).
#[allow(clippy::too_many_arguments)]
pub fn backward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    dy: &Handle,
    x: &Handle,
    w: &Handle,
    noise: Option<&Handle>,
    rstd: &Handle,
    rows: usize,
    dim: usize,
    dx: &Handle,
    dw: &Handle,
) -> Result<(), KernelError> {
    let e = std::mem::size_of::<F>();
    check_buffer("rms_norm", "dy", dy, rows * dim * e)?;
    check_buffer("rms_norm", "x", x, rows * dim * e)?;
    check_buffer("rms_norm", "w", w, dim * e)?;
    check_buffer("rms_norm", "rstd", rstd, rows * 4)?;
    check_buffer("rms_norm", "dx", dx, rows * dim * e)?;
    check_buffer("rms_norm", "dw", dw, dim * e)?;
    if let Some(z) = noise {
        check_buffer("rms_norm", "noise", z, dim * e)?;
    }
    if rows == 0 || dim == 0 {
        return Err(shape_err(
            "rms_norm",
            format!("empty input [{rows}, {dim}]"),
        ));
    }
    let vs = vector_width::<R, F>(client, dim);
    let slices = rows.div_ceil(DW_ROWS);
    let part = client.empty(slices * dim * 4);
    // SAFETY: sizes checked above (the slice sums are ours); the kernels bound rows, columns
    // and slices, and dim % vs == 0.
    unsafe {
        backward_dx_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(rows),
            CubeDim::new_1d(CUBE),
            vs,
            ArrayArg::from_raw_parts(dy.clone(), rows * dim / vs),
            ArrayArg::from_raw_parts(x.clone(), rows * dim / vs),
            ArrayArg::from_raw_parts(w.clone(), dim / vs),
            ArrayArg::from_raw_parts(noise.unwrap_or(w).clone(), dim / vs),
            ArrayArg::from_raw_parts(rstd.clone(), rows),
            ArrayArg::from_raw_parts(dx.clone(), rows * dim / vs),
            rows as u32,
            dim as u32,
            noise.is_some(),
        );
        backward_dw_part_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(dim.div_ceil(256) as u32, slices as u32, 1),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(dy.clone(), rows * dim),
            ArrayArg::from_raw_parts(x.clone(), rows * dim),
            ArrayArg::from_raw_parts(rstd.clone(), rows),
            ArrayArg::from_raw_parts(part.clone(), slices * dim),
            rows as u32,
            dim as u32,
        );
        backward_dw_sum_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(dim.div_ceil(256)),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(part, slices * dim),
            ArrayArg::from_raw_parts(dw.clone(), dim),
            slices as u32,
            dim as u32,
        );
    }
    Ok(())
}
