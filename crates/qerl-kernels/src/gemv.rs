//! Decode-time product for few rows (M <= 8): memory-bound, one plane (warp) per group of
//! output columns.
//!
//! Every unit of a plane streams 16-byte chunks (4 u32 words, 32 codes) of the weight rows its
//! plane owns, decodes them in registers through a 16-entry code table held in shared memory,
//! and multiplies them with the matching 32 activations of each of the M rows; a plane sum then
//! reduces the partial dot products. The activations are read once per chunk and reused for all
//! the plane's weight rows. Needs plane (warp) operations and `K % 32 == 0`;
//! [`crate::gemm::matmul`] falls back to the tiled kernel otherwise.

use crate::device::{block_scale, DeviceWeight};
use crate::gemm::store_output;
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Weight rows (output columns) per plane.
pub(crate) const ROWS: usize = 4;
/// Planes per cube.
const PLANES: u32 = 4;
/// u32 words per unit load (16 bytes).
const WORDS: usize = 4;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gemv_kernel<F: Float, V: Size, W: Size>(
    x: &Array<Vector<F, V>>,
    codes: &Array<Vector<u32, W>>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    code_table: &Array<f32>,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<F>,
    y: &mut Array<F>,
    n_cols: u32,
    k_dim: u32,
    rank: u32,
    lora_scale: f32,
    #[comptime] m_rows: usize,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
) {
    let mut lut = SharedMemory::<f32>::new(16usize);
    let lane = UNIT_POS_X as usize;
    if UNIT_POS_Y == 0 && lane < 16 {
        lut[lane] = code_table[lane];
    }
    sync_cube();

    let n_cols = n_cols as usize;
    let k_dim = k_dim as usize;
    let n0 = (CUBE_POS_X as usize * PLANES as usize + UNIT_POS_Y as usize) * ROWS;
    let chunks = k_dim / (8 * WORDS);
    // Activation vectors (8 wide) per row of x, and per chunk of 32 codes.
    let x_row = k_dim / 8;

    let mut acc = Array::<f32>::new(ROWS * m_rows);
    #[unroll]
    for i in 0..ROWS * m_rows {
        acc[i] = 0.0f32;
    }

    let mut c = lane;
    while c < chunks {
        #[unroll]
        for r in 0..ROWS {
            let n = n0 + r;
            if n < n_cols {
                let words = codes[n * chunks + c];
                #[unroll]
                for wi in 0..WORDS {
                    // Flat word index, for the scale block.
                    let w = (n * chunks + c) * WORDS + wi;
                    let s = block_scale(scale_bytes, scale_table, w / (block / 8), byte_scales);
                    let word = words[wi];
                    #[unroll]
                    for m in 0..m_rows {
                        let xv = x[m * x_row + c * WORDS + wi];
                        let mut dot = 0.0f32;
                        #[unroll]
                        for i in 0..8usize {
                            let code = (word >> (4 * i) as u32) & 0xfu32;
                            dot += lut[code as usize] * f32::cast_from(xv[i]);
                        }
                        acc[r * m_rows + m] += dot * s;
                    }
                }
            }
        }
        c += 32;
    }

    let rank = rank as usize;
    #[unroll]
    for r in 0..ROWS {
        #[unroll]
        for m in 0..m_rows {
            let total = plane_sum(acc[r * m_rows + m]);
            if lane == 0 {
                store_output::<F>(
                    total,
                    m,
                    n0 + r,
                    bias,
                    lora_t,
                    lora_b,
                    y,
                    m_rows,
                    n_cols,
                    rank,
                    lora_scale,
                    has_bias,
                    has_lora,
                );
            }
        }
    }
}

/// Whether [`launch`] can run this product on this client.
pub(crate) fn applies<R: Runtime>(client: &ComputeClient<R>, m: usize, k: usize) -> bool {
    m <= 8
        && k.is_multiple_of(8 * WORDS)
        && client
            .properties()
            .features
            .plane
            .contains(cubecl::features::Plane::Ops)
        && client.properties().hardware.plane_size_min == 32
        && client.properties().hardware.plane_size_max == 32
}

/// Launches the decode product; the caller has checked buffers and [`applies`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    weight: &DeviceWeight,
    bias: Handle,
    t: Handle,
    b: Handle,
    rank: usize,
    scale: f32,
    has_bias: bool,
    has_lora: bool,
    y: &Handle,
) {
    let (n, k) = (weight.n, weight.k);
    let cubes = n.div_ceil(ROWS * PLANES as usize) as u32;
    // SAFETY: buffer sizes were checked by the caller; the kernel bounds columns by n, rows by
    // the comptime m, and K is a multiple of 32 (checked by `applies`).
    unsafe {
        gemv_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_2d(32, PLANES),
            8,
            WORDS,
            ArrayArg::from_raw_parts(x.clone(), m * k / 8),
            ArrayArg::from_raw_parts(weight.codes.clone(), weight.words() / WORDS),
            ArrayArg::from_raw_parts(weight.scale_bytes.clone(), weight.scale_words()),
            ArrayArg::from_raw_parts(weight.scale_table.clone(), weight.scale_table_len()),
            ArrayArg::from_raw_parts(weight.code_table.clone(), 16),
            ArrayArg::from_raw_parts(bias, n),
            ArrayArg::from_raw_parts(t, m * rank.max(1)),
            ArrayArg::from_raw_parts(b, n * rank.max(1)),
            ArrayArg::from_raw_parts(y.clone(), m * n),
            n as u32,
            k as u32,
            rank as u32,
            scale,
            m,
            weight.block(),
            weight.byte_scales(),
            has_bias,
            has_lora,
        );
    }
}
