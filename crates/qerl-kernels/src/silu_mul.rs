//! The SwiGLU gate of the training MLP, `h = silu(g) ⊙ u` with `silu(g) = g·σ(g)`, forward and
//! backward, each one element-wise kernel computing in f32 whatever the storage type.
//!
//! Backward from `dh`, with `s = σ(g)`:
//! `dg = dh ⊙ u ⊙ s ⊙ (1 + g·(1 − s))`, `du = dh ⊙ g ⊙ s`.
//!
//! Why a kernel of its own: burn's `silu` is `g · sigmoid(g)`, and its `sigmoid` runs seven
//! element-wise kernels through f32 copies of the whole `[tokens, intermediate]` tensor (cast,
//! neg, exp, add, log, neg, exp, cast), whose autodiff keeps several of them for the backward.
//! At a 7B micro-batch of 20k tokens that tensor is 1.5 GB in f32. Here the forward reads `g`
//! and `u` once and writes `h` once; the backward reads `g`, `u`, `dh` and writes `dg`, `du`.

use crate::device::{check_buffer, grid_1d, linear_cube, shape_err, vector_width, KernelError};
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Units per cube.
const CUBE: u32 = 256;

/// `σ(x) = 1 / (1 + e^-x)` in f32 (0 and 1 at the far ends, never NaN).
#[cube]
fn sigmoid(x: f32) -> f32 {
    1.0f32 / (1.0f32 + f32::exp(-x))
}

/// Vector `i` of the flat tensors (one unit per vector of `V` elements).
#[cube(launch_unchecked)]
fn forward_kernel<F: Float, V: Size>(
    g: &Array<Vector<F, V>>,
    u: &Array<Vector<F, V>>,
    h: &mut Array<Vector<F, V>>,
    vectors: u32,
) {
    let i = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if i < vectors as usize {
        let (gv, uv) = (g[i], u[i]);
        let mut o = Vector::<F, V>::empty();
        #[unroll]
        for e in 0..g.vector_size() {
            let x = f32::cast_from(gv[e]);
            o[e] = F::cast_from(x * sigmoid(x) * f32::cast_from(uv[e]));
        }
        h[i] = o;
    }
}

#[cube(launch_unchecked)]
fn backward_kernel<F: Float, V: Size>(
    g: &Array<Vector<F, V>>,
    u: &Array<Vector<F, V>>,
    dh: &Array<Vector<F, V>>,
    dg: &mut Array<Vector<F, V>>,
    du: &mut Array<Vector<F, V>>,
    vectors: u32,
) {
    let i = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if i < vectors as usize {
        let (gv, uv, dv) = (g[i], u[i], dh[i]);
        let mut og = Vector::<F, V>::empty();
        let mut ou = Vector::<F, V>::empty();
        #[unroll]
        for e in 0..g.vector_size() {
            let x = f32::cast_from(gv[e]);
            let d = f32::cast_from(dv[e]);
            let s = sigmoid(x);
            og[e] = F::cast_from(d * f32::cast_from(uv[e]) * s * (1.0f32 + x * (1.0f32 - s)));
            ou[e] = F::cast_from(d * x * s);
        }
        dg[i] = og;
        du[i] = ou;
    }
}

/// Checks `len` elements of `F` in every buffer, and picks the vector width and the grid.
fn plan<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    buffers: &[(&str, &Handle)],
    len: usize,
) -> Result<(usize, CubeCount), KernelError> {
    if len == 0 {
        return Err(shape_err("silu_mul", "empty input".into()));
    }
    for (what, h) in buffers {
        check_buffer("silu_mul", what, h, len * std::mem::size_of::<F>())?;
    }
    let vs = vector_width::<R, F>(client, len);
    let cubes = (len / vs).div_ceil(CUBE as usize);
    Ok((vs, grid_1d(cubes)))
}

/// Forward: `h = silu(g) ⊙ u` over `len` elements of `F` (any shape, flat).
pub fn forward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    g: &Handle,
    u: &Handle,
    len: usize,
    h: &Handle,
) -> Result<(), KernelError> {
    let (vs, grid) = plan::<R, F>(client, &[("g", g), ("u", u), ("h", h)], len)?;
    let vectors = len / vs;
    // SAFETY: every buffer holds `len` elements (checked); the kernel bounds the vectors.
    unsafe {
        forward_kernel::launch_unchecked::<F, R>(
            client,
            grid,
            CubeDim::new_1d(CUBE),
            vs,
            ArrayArg::from_raw_parts(g.clone(), vectors),
            ArrayArg::from_raw_parts(u.clone(), vectors),
            ArrayArg::from_raw_parts(h.clone(), vectors),
            vectors as u32,
        );
    }
    Ok(())
}

/// Backward: from the forward's inputs `g`, `u` and the upstream `dh`, writes `dg` and `du`
/// (`len` elements of `F` each).
#[allow(clippy::too_many_arguments)]
pub fn backward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    g: &Handle,
    u: &Handle,
    dh: &Handle,
    len: usize,
    dg: &Handle,
    du: &Handle,
) -> Result<(), KernelError> {
    let buffers = [("g", g), ("u", u), ("dh", dh), ("dg", dg), ("du", du)];
    let (vs, grid) = plan::<R, F>(client, &buffers, len)?;
    let vectors = len / vs;
    // SAFETY: every buffer holds `len` elements (checked); the kernel bounds the vectors.
    unsafe {
        backward_kernel::launch_unchecked::<F, R>(
            client,
            grid,
            CubeDim::new_1d(CUBE),
            vs,
            ArrayArg::from_raw_parts(g.clone(), vectors),
            ArrayArg::from_raw_parts(u.clone(), vectors),
            ArrayArg::from_raw_parts(dh.clone(), vectors),
            ArrayArg::from_raw_parts(dg.clone(), vectors),
            ArrayArg::from_raw_parts(du.clone(), vectors),
            vectors as u32,
        );
    }
    Ok(())
}
