//! The SwiGLU activation between the gate/up products and the down product.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{grid_rows, ROW_CUBE};

/// `out[i] = silu(gate[i]) · up[i]`, computed in f32, rounded once.
#[cube(launch_unchecked)]
fn silu_mul_kernel<F: Float>(gate: &Array<F>, up: &Array<F>, out: &mut Array<F>, len: u32) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    if i < len as usize {
        let g = f32::cast_from(gate[i]);
        let silu = g / (1.0f32 + f32::exp(-g));
        out[i] = F::cast_from(silu * f32::cast_from(up[i]));
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
    // SAFETY: the three buffers hold `len` elements (sized by the engine).
    unsafe {
        silu_mul_kernel::launch_unchecked::<F, R>(
            client,
            grid_rows(len.div_ceil(ROW_CUBE as usize)),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(gate.clone(), len),
            ArrayArg::from_raw_parts(up.clone(), len),
            ArrayArg::from_raw_parts(out.clone(), len),
            len as u32,
        );
    }
}
