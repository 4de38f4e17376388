//! The SwiGLU activation between the gate/up products and the down product.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{grid_rows, vector_width, ROW_CUBE};

/// `out[i] = silu(gate[i]) · up[i]`, computed in f32, rounded once; one unit per vector of
/// `vs` elements (16-byte loads where the length allows).
#[cube(launch_unchecked)]
fn silu_mul_kernel<F: Float, V: Size>(
    gate: &Array<Vector<F, V>>,
    up: &Array<Vector<F, V>>,
    out: &mut Array<Vector<F, V>>,
    vectors: u32,
) {
    let vs = gate.vector_size();
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    if i < vectors as usize {
        let g = gate[i];
        let u = up[i];
        let mut o = Vector::<F, V>::empty();
        #[unroll]
        for e in 0..vs {
            let x = f32::cast_from(g[e]);
            let silu = x / (1.0f32 + f32::exp(-x));
            o[e] = F::cast_from(silu * f32::cast_from(u[e]));
        }
        out[i] = o;
    }
}

/// `out = silu(gate) ⊙ up` over `len` elements.
pub fn silu_mul<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    gate: &Handle,
    up: &Handle,
    out: &Handle,
    len: usize,
) {
    let vs = vector_width::<F>(len);
    let vectors = len / vs;
    // SAFETY: the three buffers hold `len` elements (sized by the engine), whole engine
    // buffers (so aligned for any vector).
    unsafe {
        silu_mul_kernel::launch_unchecked::<F, R>(
            client,
            grid_rows(vectors.div_ceil(ROW_CUBE as usize)),
            CubeDim::new_1d(ROW_CUBE),
            vs,
            ArrayArg::from_raw_parts(gate.clone(), vectors),
            ArrayArg::from_raw_parts(up.clone(), vectors),
            ArrayArg::from_raw_parts(out.clone(), vectors),
            vectors as u32,
        );
    }
}

/// [`silu_mul`] from the gate/up product's unreduced K-slices: `parts [splits, rows, 2·width]`
/// f32 (gate in columns `0..width`, up in `width..2·width`); each sum is taken in slice order
/// from 0 and rounded to `F` as the product's reduction rounds it, then the activation as in
/// [`silu_mul_kernel`], so the output equals the unfused path's bit for bit. One unit per
/// vector of `vs` outputs.
#[cube(launch_unchecked)]
fn silu_mul_parts_kernel<F: Float, V: Size>(
    parts: &Array<Vector<f32, V>>,
    out: &mut Array<Vector<F, V>>,
    rows: u32,
    width_vecs: u32,
    #[comptime] splits: usize,
) {
    let vs = parts.vector_size();
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    let wv = width_vecs as usize;
    let total = rows as usize * wv;
    if i < total {
        let row = i / wv;
        let at = row * 2 * wv + i % wv;
        let slice = rows as usize * 2 * wv;
        let mut g = Vector::<f32, V>::new(0.0f32);
        let mut u = Vector::<f32, V>::new(0.0f32);
        #[unroll]
        for s in 0..splits {
            g += parts[s * slice + at];
            u += parts[s * slice + at + wv];
        }
        let mut o = Vector::<F, V>::empty();
        #[unroll]
        for e in 0..vs {
            let x = f32::cast_from(F::cast_from(g[e]));
            let silu = x / (1.0f32 + f32::exp(-x));
            o[e] = F::cast_from(silu * f32::cast_from(F::cast_from(u[e])));
        }
        out[i] = o;
    }
}

/// `out [rows, width] = silu(gate) ⊙ up` with gate and up summed from `parts`, the
/// `[splits, rows, 2·width]` f32 K-slices of their product
/// ([`qerl_kernels::gemm::SegmentsOutcome::Parts`]): the reduction and the activation in one
/// launch. `width` must be a multiple of 4.
pub fn silu_mul_parts<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    parts: &Handle,
    splits: usize,
    rows: usize,
    width: usize,
    out: &Handle,
) {
    assert!(
        width.is_multiple_of(4)
            && parts.size_in_used() >= (splits * rows * 2 * width * 4) as u64
            && out.size_in_used() >= (rows * width * std::mem::size_of::<F>()) as u64,
        "silu_mul_parts: width {width} not a multiple of 4 or buffers smaller than \
         [{splits}, {rows}, 2·{width}] f32 and [{rows}, {width}]"
    );
    // Four outputs a unit: 16-byte loads of the f32 slices.
    let vs = 4;
    let vectors = rows * width / vs;
    // SAFETY: sizes asserted above; the kernel reads vectors below `splits · rows · 2·width / 4`
    // and stores below `rows · width / 4`.
    unsafe {
        silu_mul_parts_kernel::launch_unchecked::<F, R>(
            client,
            grid_rows(vectors.div_ceil(ROW_CUBE as usize)),
            CubeDim::new_1d(ROW_CUBE),
            vs,
            ArrayArg::from_raw_parts(parts.clone(), splits * rows * 2 * width / vs),
            ArrayArg::from_raw_parts(out.clone(), vectors),
            rows as u32,
            (width / vs) as u32,
            splits,
        );
    }
}
