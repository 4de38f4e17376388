//! Dequantization: a [`DeviceWeight`] `[N, K]` to a dense row-major `[N, K]` matrix of `F`.
//!
//! One unit decodes one u32 word (8 elements, all in one scale block).

use crate::device::{block_scale, grid_1d, linear_cube, shape_err, DeviceWeight, KernelError};
use cubecl::prelude::*;
use cubecl::server::Handle;

const CUBE: u32 = 256;

#[cube(launch_unchecked)]
fn dequant_kernel<F: Float>(
    codes: &Array<u32>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    code_table: &Array<f32>,
    out: &mut Array<F>,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
) {
    let w = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if w < codes.len() {
        let s = block_scale(scale_bytes, scale_table, w / (block / 8), byte_scales);
        let word = codes[w];
        #[unroll]
        for i in 0..8usize {
            let code = (word >> (4 * i) as u32) & 0xfu32;
            out[8 * w + i] = F::cast_from(code_table[code as usize] * s);
        }
    }
}

/// Writes `deq(W)` into `out`, a buffer of `n * k` elements of `F`.
pub fn dequantize<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    weight: &DeviceWeight,
    out: &Handle,
) -> Result<(), KernelError> {
    let needed = weight.n * weight.k * std::mem::size_of::<F>();
    if (out.size() as usize) < needed {
        return Err(shape_err(
            "dequantize",
            format!(
                "output holds {} bytes, [{}, {}] needs {needed}",
                out.size(),
                weight.n,
                weight.k
            ),
        ));
    }
    let words = weight.words();
    // SAFETY: every index the kernel reads is bounded by the array lengths given here, which
    // match the buffers DeviceWeight::upload created.
    unsafe {
        dequant_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(words.div_ceil(CUBE as usize)),
            CubeDim::new_1d(CUBE),
            ArrayArg::from_raw_parts(weight.codes.clone(), words),
            ArrayArg::from_raw_parts(weight.scale_bytes.clone(), weight.scale_words()),
            ArrayArg::from_raw_parts(weight.scale_table.clone(), weight.scale_table_len()),
            ArrayArg::from_raw_parts(weight.code_table.clone(), 16),
            ArrayArg::from_raw_parts(out.clone(), weight.n * weight.k),
            weight.block(),
            weight.byte_scales(),
        );
    }
    Ok(())
}
