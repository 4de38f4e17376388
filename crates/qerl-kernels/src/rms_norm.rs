//! Fused noisy RMSNorm, forward and backward, over rows of length `D`.
//!
//! Forward: `y = x · r ⊙ (w + z)` with `r = 1 / sqrt(mean(x²) + eps)` per row, `z` the optional
//! per-channel AQN noise vector. `r` is saved per row for the backward pass.
//! Backward, with `g = dy ⊙ (w + z)` and `x̂ = x · r`:
//! `dx = r · (g − x̂ · mean(g ⊙ x̂))`, `dw = Σ_rows dy ⊙ x̂` (equal to the gradient of `z`).
//!
//! One cube per row reduces in shared memory (no plane ops: lavapipe has none).

use crate::device::{grid_1d, linear_cube, shape_err, KernelError};
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

/// `w[c] + z[c]` (or `w[c]` without noise), in f32.
#[cube]
fn gain<F: Float>(w: &Array<F>, z: &Array<F>, c: usize, #[comptime] has_noise: bool) -> f32 {
    let mut g = f32::cast_from(w[c]);
    if has_noise {
        g += f32::cast_from(z[c]);
    }
    g
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float>(
    x: &Array<F>,
    w: &Array<F>,
    z: &Array<F>,
    y: &mut Array<F>,
    rstd: &mut Array<f32>,
    rows: u32,
    dim: u32,
    eps: f32,
    #[comptime] has_noise: bool,
) {
    let mut partial = SharedMemory::<f32>::new(CUBE as usize);
    let row = linear_cube();
    // The whole cube takes the same branch, so the barriers inside are uniform.
    if row < rows as usize {
        let dim = dim as usize;
        let base = row * dim;
        let t = UNIT_POS_X as usize;
        let step = CUBE_DIM_X as usize;
        let mut s = 0.0f32;
        let mut c = t;
        while c < dim {
            let v = f32::cast_from(x[base + c]);
            s += v * v;
            c += step;
        }
        partial[t] = s;
        sync_cube();
        reduce_sum(&mut partial);
        let r = 1.0f32 / f32::sqrt(partial[0] / dim as f32 + eps);
        let mut c = t;
        while c < dim {
            let v = f32::cast_from(x[base + c]) * r * gain(w, z, c, has_noise);
            y[base + c] = F::cast_from(v);
            c += step;
        }
        if t == 0 {
            rstd[row] = r;
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn backward_dx_kernel<F: Float>(
    dy: &Array<F>,
    x: &Array<F>,
    w: &Array<F>,
    z: &Array<F>,
    rstd: &Array<f32>,
    dx: &mut Array<F>,
    rows: u32,
    dim: u32,
    #[comptime] has_noise: bool,
) {
    let mut partial = SharedMemory::<f32>::new(CUBE as usize);
    let row = linear_cube();
    if row < rows as usize {
        let dim = dim as usize;
        let base = row * dim;
        let t = UNIT_POS_X as usize;
        let step = CUBE_DIM_X as usize;
        let r = rstd[row];
        let mut s = 0.0f32;
        let mut c = t;
        while c < dim {
            let g = f32::cast_from(dy[base + c]) * gain(w, z, c, has_noise);
            s += g * f32::cast_from(x[base + c]) * r;
            c += step;
        }
        partial[t] = s;
        sync_cube();
        reduce_sum(&mut partial);
        let mean_gx = partial[0] / dim as f32;
        let mut c = t;
        while c < dim {
            let g = f32::cast_from(dy[base + c]) * gain(w, z, c, has_noise);
            let xhat = f32::cast_from(x[base + c]) * r;
            dx[base + c] = F::cast_from(r * (g - xhat * mean_gx));
            c += step;
        }
    }
}

#[cube(launch_unchecked)]
fn backward_dw_kernel<F: Float>(
    dy: &Array<F>,
    x: &Array<F>,
    rstd: &Array<f32>,
    dw: &mut Array<F>,
    rows: u32,
    dim: u32,
) {
    let c = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let dim = dim as usize;
    if c < dim {
        let mut s = 0.0f32;
        for row in 0..rows as usize {
            s += f32::cast_from(dy[row * dim + c]) * f32::cast_from(x[row * dim + c]) * rstd[row];
        }
        dw[c] = F::cast_from(s);
    }
}

fn check(what: &str, h: &Handle, bytes: usize) -> Result<(), KernelError> {
    if (h.size() as usize) < bytes {
        return Err(shape_err(
            "rms_norm",
            format!("{what} holds {} bytes but needs {bytes}", h.size()),
        ));
    }
    Ok(())
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
    check("x", x, rows * dim * e)?;
    check("w", w, dim * e)?;
    check("y", y, rows * dim * e)?;
    check("rstd", rstd, rows * 4)?;
    if let Some(z) = noise {
        check("noise", z, dim * e)?;
    }
    if rows == 0 || dim == 0 {
        return Err(shape_err(
            "rms_norm",
            format!("empty input [{rows}, {dim}]"),
        ));
    }
    // SAFETY: sizes checked above; the kernel bounds rows and columns.
    unsafe {
        forward_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(rows),
            CubeDim::new_1d(CUBE),
            ArrayArg::from_raw_parts(x.clone(), rows * dim),
            ArrayArg::from_raw_parts(w.clone(), dim),
            ArrayArg::from_raw_parts(noise.unwrap_or(w).clone(), dim),
            ArrayArg::from_raw_parts(y.clone(), rows * dim),
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
    check("dy", dy, rows * dim * e)?;
    check("x", x, rows * dim * e)?;
    check("w", w, dim * e)?;
    check("rstd", rstd, rows * 4)?;
    check("dx", dx, rows * dim * e)?;
    check("dw", dw, dim * e)?;
    if let Some(z) = noise {
        check("noise", z, dim * e)?;
    }
    if rows == 0 || dim == 0 {
        return Err(shape_err(
            "rms_norm",
            format!("empty input [{rows}, {dim}]"),
        ));
    }
    // SAFETY: sizes checked above; the kernels bound rows and columns.
    unsafe {
        backward_dx_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(rows),
            CubeDim::new_1d(CUBE),
            ArrayArg::from_raw_parts(dy.clone(), rows * dim),
            ArrayArg::from_raw_parts(x.clone(), rows * dim),
            ArrayArg::from_raw_parts(w.clone(), dim),
            ArrayArg::from_raw_parts(noise.unwrap_or(w).clone(), dim),
            ArrayArg::from_raw_parts(rstd.clone(), rows),
            ArrayArg::from_raw_parts(dx.clone(), rows * dim),
            rows as u32,
            dim as u32,
            noise.is_some(),
        );
        backward_dw_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(dim.div_ceil(256)),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(dy.clone(), rows * dim),
            ArrayArg::from_raw_parts(x.clone(), rows * dim),
            ArrayArg::from_raw_parts(rstd.clone(), rows),
            ArrayArg::from_raw_parts(dw.clone(), dim),
            rows as u32,
            dim as u32,
        );
    }
    Ok(())
}
