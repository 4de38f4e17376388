//! Per-stage pieces of the tensor-core kernel: global loads into registers, weight decoding,
//! shared-memory stores, the `cmma`s of one stage and the LoRA stages.

use super::{BK, KV, SROW, SROW_ELEMS};
use cubecl::cmma;
use cubecl::prelude::*;

/// Loads one stage's global data into registers: `BM x BK` activations and, for the weight, the
/// packed words and raw scales (or dense `F` rows).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_a<F: Float, V: Size>(
    src: &Array<Vector<F, V>>,
    regs: &mut Array<Vector<F, V>>,
    row0: usize,
    rows: usize,
    k_vecs: usize,
    kt: usize,
    tid: usize,
    #[comptime] iters: usize,
    #[comptime] threads: usize,
) {
    #[unroll]
    for i in 0..iters {
        let idx = tid + i * threads;
        let r = idx / KV;
        let row = row0 + r;
        let mut v = Vector::<F, V>::new(F::new(0.0));
        if row < rows {
            v = src[row * k_vecs + kt * KV + idx % KV];
        }
        regs[i] = v;
    }
}

/// Stores the register copy of a dense tile into stage buffer `dst` at vector offset `base`.
#[cube]
pub(super) fn store_a<F: Float, V: Size>(
    regs: &Array<Vector<F, V>>,
    dst: &mut SharedMemory<Vector<F, V>>,
    base: usize,
    tid: usize,
    #[comptime] iters: usize,
    #[comptime] threads: usize,
) {
    #[unroll]
    for i in 0..iters {
        let idx = tid + i * threads;
        dst[base + (idx / KV) * SROW + idx % KV] = regs[i];
    }
}

/// One stage of `cmma`s from buffers at vector offsets `a_base`, `b_base`. The B tile is read
/// with fragment step `b_frag_step` and depth step `b_k_step` (vectors) and row stride
/// `b_stride` (elements).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn compute_stage<F: Float, V: Size>(
    a_s: &SharedMemory<Vector<F, V>>,
    b_s: &SharedMemory<Vector<F, V>>,
    a_base: usize,
    b_base: usize,
    a_frag: &Sequence<cmma::Matrix<F>>,
    b_frag: &Sequence<cmma::Matrix<F>>,
    acc: &Sequence<cmma::Matrix<f32>>,
    #[comptime] frags_m: usize,
    #[comptime] frags_n: usize,
    #[comptime] b_frag_step: usize,
    #[comptime] b_k_step: usize,
    #[comptime] b_stride: u32,
) {
    let b_row = comptime!(b_stride as usize / 8);
    #[unroll]
    for kk in 0..BK / 16 {
        #[unroll]
        for fm in 0..frags_m {
            let start = a_base + fm * 16 * SROW + kk * 2;
            let sl = a_s.slice(start, start + 15 * SROW + 2);
            cmma::load(a_frag.index(fm), &sl, SROW_ELEMS);
        }
        #[unroll]
        for fn_ in 0..frags_n {
            let start = b_base + fn_ * b_frag_step + kk * b_k_step;
            // 16 rows of 16 elements (2 vectors), `b_row` vectors apart.
            let sl = b_s.slice(start, start + 15 * b_row + 2);
            cmma::load(b_frag.index(fn_), &sl, b_stride);
        }
        #[unroll]
        for fm in 0..frags_m {
            #[unroll]
            for fn_ in 0..frags_n {
                let c = acc.index(fm * frags_n + fn_);
                cmma::execute::<F, F, f32, f32>(a_frag.index(fm), b_frag.index(fn_), c, c);
            }
        }
    }
}

/// Loads `words` packed words from word `w0` (if `valid`) and the raw scale of each word.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_w<W: Size>(
    codes: &Array<Vector<u32, W>>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    s_raw: &mut Array<u32>,
    s_val: &mut Array<f32>,
    w0: usize,
    valid: bool,
    #[comptime] words: usize,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
) -> Vector<u32, W> {
    let mut v = Vector::<u32, W>::new(0u32);
    if valid {
        v = codes[w0 / words];
        #[unroll]
        for j in 0..words {
            let b = (w0 + j) / (block / 8);
            if byte_scales {
                s_raw[j] = (scale_bytes[b / 4] >> (((b % 4) * 8) as u32)) & 0xffu32;
            } else {
                s_val[j] = scale_table[b];
            }
        }
    } else {
        // Outside the weight: zeros, and in-range table indices.
        #[unroll]
        for j in 0..words {
            s_raw[j] = 0u32;
            s_val[j] = 0.0f32;
        }
    }
    v
}

/// Decodes the registers of [`load_w`] into `words` 8-wide vectors of `F` at `dst[base ..]`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_w<F: Float, V: Size, W: Size>(
    w_reg: &Vector<u32, W>,
    s_raw: &Array<u32>,
    s_val: &Array<f32>,
    lut: &SharedMemory<f32>,
    stab: &SharedMemory<f32>,
    dst: &mut SharedMemory<Vector<F, V>>,
    base: usize,
    #[comptime] words: usize,
    #[comptime] byte_scales: bool,
) {
    #[unroll]
    for j in 0..words {
        let s = if byte_scales {
            stab[s_raw[j] as usize]
        } else {
            s_val[j]
        };
        let word = w_reg[j];
        let mut v = Vector::<F, V>::empty();
        #[unroll]
        for i in 0..8usize {
            let code = (word >> (4 * i) as u32) & 0xfu32;
            v[i] = F::cast_from(lut[code as usize] * s);
        }
        dst[base + j] = v;
    }
}

/// Stages columns `rt*BK ..` of a row-major `[rows, rank]` matrix (times `scale`, zero past the
/// rank and the rows) into buffer 0 of `dst`, rows `row0 ..`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn stage_lora<F: Float, V: Size, E: Float>(
    src: &Array<E>,
    dst: &mut SharedMemory<Vector<F, V>>,
    row0: usize,
    rows: usize,
    rank: usize,
    rt: usize,
    scale: f32,
    tid: usize,
    #[comptime] tile_rows: usize,
    #[comptime] threads: usize,
) {
    #[unroll]
    for it in 0..comptime!(tile_rows * KV / threads) {
        let idx = tid + it * threads;
        let r = idx / KV;
        let c0 = rt * BK + (idx % KV) * 8;
        let row = row0 + r;
        let mut v = Vector::<F, V>::empty();
        #[unroll]
        for i in 0..8usize {
            let c = c0 + i;
            let mut e = 0.0f32;
            if row < rows && c < rank {
                e = f32::cast_from(src[row * rank + c]) * scale;
            }
            v[i] = F::cast_from(e);
        }
        dst[r * SROW + idx % KV] = v;
    }
}
