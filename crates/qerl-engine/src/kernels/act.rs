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
