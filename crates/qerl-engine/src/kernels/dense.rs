//! Dense products for few rows: `Y[M, N] = X[M, K] · Wᵀ`, `W [N, K]` row-major in `F`.
//!
//! Serves the lm_head (f32 logits), the LoRA down-projections where [`super::lora_down`] does
//! not run (no plane operations: f32 `T = X·Aᵀ`, up to three adapters that share an input in
//! one launch: q/k/v, gate/up) and the frozen weights of a BF16 model when few rows are decoded. Memory-bound: a group of units per output column (32, or a
//! whole cube of 256 when there are few columns, as in a LoRA down-projection) reads the weight
//! row once in 16-byte vectors, four loads in flight per unit, and applies it to `MR` rows of
//! `X`; partial sums meet in shared memory (no plane operations, so it runs on lavapipe too).
//! Bias and a LoRA term
//! (`+ s · T·Bᵀ`) are applied in the epilogue of single-segment products.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::vector_width;

/// Units per cube.
const UNITS: u32 = 256;
/// Vectors a unit loads before it uses them (loads in flight per unit).
const UNROLL: usize = 4;
/// Most rows one cube applies a weight row to.
pub const MAX_ROWS: usize = 8;
/// Below this many output columns (LoRA down-projections: a few times the rank), each column
/// gets a whole cube so that the reduction is spread over enough units to fill the device.
/// Each such cube reads its rows of `X` again (48 times for q/k/v at rank 16): at 64 rows
/// that traffic, not the weights, sets the time. `QERL_DENSE_FEW_COLUMNS` (read once) moves
/// the threshold, 0 giving every product 8 columns a cube.
const FEW_COLUMNS: usize = 512;

fn few_columns() -> usize {
    static FEW: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *FEW.get_or_init(|| {
        std::env::var("QERL_DENSE_FEW_COLUMNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(FEW_COLUMNS)
    })
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dense_kernel<F: Float, O: Float, V: Size>(
    x: &Array<Vector<F, V>>,
    w0: &Array<Vector<F, V>>,
    w1: &Array<Vector<F, V>>,
    w2: &Array<Vector<F, V>>,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<F>,
    y0: &mut Array<O>,
    y1: &mut Array<O>,
    y2: &mut Array<O>,
    m_rows: u32,
    seg: u32,
    k_dim: u32,
    rank: u32,
    lora_scale: f32,
    #[comptime] mr: usize,
    #[comptime] cols: usize,
    #[comptime] segments: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
) {
    let vs = x.vector_size();
    let lanes = comptime!(UNITS as usize / cols);
    let mut partial = SharedMemory::<f32>::new(comptime!(mr * UNITS as usize));
    let tid = UNIT_POS_X as usize;
    let lane = tid % lanes;
    let group = tid / lanes;
    let seg = seg as usize;
    let m_rows = m_rows as usize;
    let vecs = k_dim as usize / vs;
    let col = CUBE_POS_X as usize * cols + group;
    let m0 = CUBE_POS_Y as usize * mr;
    // Columns past the end compute on the last one and never store.
    let c = min(col, segments * seg - 1);
    let s = c / seg;
    let n = c % seg;

    let mut acc = Array::<f32>::new(mr);
    #[unroll]
    for m in 0..mr {
        acc[m] = 0.0f32;
    }
    let mut v = lane;
    while v < vecs {
        // UNROLL vectors of the weight row, clamped in bounds; past the end they count zero.
        let mut wv = Array::<Vector<F, V>>::new(UNROLL);
        let mut keep = Array::<f32>::new(UNROLL);
        #[unroll]
        for u in 0..UNROLL {
            let vu = min(v + u * lanes, vecs - 1);
            keep[u] = select(v + u * lanes < vecs, 1.0f32, 0.0f32);
            let mut w = w0[n * vecs + vu];
            if segments > 1 {
                if s == 1 {
                    w = w1[n * vecs + vu];
                } else if s == 2 {
                    w = w2[n * vecs + vu];
                }
            }
            wv[u] = w;
        }
        #[unroll]
        for m in 0..mr {
            let row = min(m0 + m, m_rows - 1);
            #[unroll]
            for u in 0..UNROLL {
                let vu = min(v + u * lanes, vecs - 1);
                let xv = x[row * vecs + vu];
                let mut dot = 0.0f32;
                #[unroll]
                for i in 0..vs {
                    dot += f32::cast_from(xv[i]) * f32::cast_from(wv[u][i]);
                }
                acc[m] += dot * keep[u];
            }
        }
        v += comptime!(UNROLL) * lanes;
    }
    #[unroll]
    for m in 0..mr {
        partial[m * UNITS as usize + tid] = acc[m];
    }
    sync_cube();
    // Tree sum over the lanes of each column.
    let mut stride = CUBE_DIM_X as usize / cols / 2;
    while stride > 0 {
        if lane < stride {
            #[unroll]
            for m in 0..mr {
                partial[m * UNITS as usize + tid] += partial[m * UNITS as usize + tid + stride];
            }
        }
        sync_cube();
        stride /= 2;
    }
    if lane < mr {
        let m = m0 + lane;
        if m < m_rows && col < segments * seg {
            let mut total = partial[lane * UNITS as usize + group * lanes];
            if has_bias {
                total += f32::cast_from(bias[n]);
            }
            if has_lora {
                let rank = rank as usize;
                let mut l = 0.0f32;
                for j in 0..rank {
                    l += lora_t[m * rank + j] * f32::cast_from(lora_b[n * rank + j]);
                }
                total += lora_scale * l;
            }
            let out = O::cast_from(total);
            if s == 0 {
                y0[m * seg + n] = out;
            } else if s == 1 {
                y1[m * seg + n] = out;
            } else {
                y2[m * seg + n] = out;
            }
        }
    }
}

/// Epilogue of a single-weight [`dense`] product: bias `[N]` and LoRA (`T [M, r]` f32,
/// `B [N, r]`, scale).
#[derive(Clone, Copy, Debug, Default)]
pub struct DenseEpilogue<'a> {
    pub bias: Option<&'a Handle>,
    pub lora: Option<(&'a Handle, &'a Handle, usize, f32)>,
}

/// `y_s [M, N] = x [M, K] · w_sᵀ` for each weight `w_s [N, K]` (one to three, all `N x K`,
/// e.g. the LoRA A matrices of q, k and v), with the epilogue applied when there is one weight.
#[allow(clippy::too_many_arguments)]
pub fn dense<R: Runtime, F: Float, O: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    weights: &[&Handle],
    n: usize,
    k: usize,
    epilogue: DenseEpilogue<'_>,
    outputs: &[&Handle],
) {
    let segments = weights.len();
    assert!(
        (1..=3).contains(&segments) && outputs.len() == segments,
        "dense: one to three weights, one output each"
    );
    assert!(
        segments == 1 || (epilogue.bias.is_none() && epilogue.lora.is_none()),
        "dense: the epilogue applies to single-weight products"
    );
    let vs = vector_width::<F>(k);
    let mr = m.min(MAX_ROWS);
    let w = |i: usize| weights[i.min(segments - 1)].clone();
    let y = |i: usize| outputs[i.min(segments - 1)].clone();
    let unused = weights[0].clone();
    let (t, b, rank, scale) = match epilogue.lora {
        Some((t, b, r, s)) => (t.clone(), b.clone(), r, s),
        None => (unused.clone(), unused.clone(), 0, 0.0),
    };
    let cols = if segments * n < few_columns() { 1 } else { 8 };
    let count = CubeCount::Static(
        (segments * n).div_ceil(cols) as u32,
        m.div_ceil(mr) as u32,
        1,
    );
    // SAFETY: `x` holds `m * k`, each weight `n * k`, each output `m * n` elements; the kernel
    // clamps rows to `m` and columns to `segments * n`, and stores only in bounds.
    unsafe {
        dense_kernel::launch_unchecked::<F, O, R>(
            client,
            count,
            CubeDim::new_1d(UNITS),
            vs,
            ArrayArg::from_raw_parts(x.clone(), m * k / vs),
            ArrayArg::from_raw_parts(w(0), n * k / vs),
            ArrayArg::from_raw_parts(w(1), n * k / vs),
            ArrayArg::from_raw_parts(w(2), n * k / vs),
            ArrayArg::from_raw_parts(epilogue.bias.unwrap_or(&unused).clone(), n),
            ArrayArg::from_raw_parts(t, m * rank.max(1)),
            ArrayArg::from_raw_parts(b, n * rank.max(1)),
            ArrayArg::from_raw_parts(y(0), m * n),
            ArrayArg::from_raw_parts(y(1), m * n),
            ArrayArg::from_raw_parts(y(2), m * n),
            m as u32,
            n as u32,
            k as u32,
            rank as u32,
            scale,
            mr,
            cols,
            segments,
            epilogue.bias.is_some(),
            epilogue.lora.is_some(),
        );
    }
}
