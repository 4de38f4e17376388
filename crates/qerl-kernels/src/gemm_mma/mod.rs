//! W4A16 product for decode batches on CUDA tensor cores: `Y[M,N] = X[M,K] · deq(W)ᵀ (+ bias)
//! (+ s·T·Bᵀ)` for M up to [`MmaOptions::max_m`] rows, reading the 4-bit weight once, straight from global
//! memory into registers, with no shared-memory tile and no barrier in the loop.
//!
//! Why a separate kernel: at 16-64 rows the tiled tensor-core kernel ([`crate::gemm_tc`]) decodes
//! each weight tile into shared memory and waits on memory every 32-deep stage (an H100 profile:
//! 18% occupancy, 2.7-4.5 us a stage), so a 64-row decode step of a 7B model ran at 0.2 TB/s of
//! weights against 3 TB/s. Here each warp owns `16·r_tiles` weight rows and `8·m_tiles` tokens
//! and works alone: the weight is the `A` operand of `mma.m16n8k16` (rows of `W` are the
//! product's M side), the activations the `B` operand, and the next 64-deep chunk of codes is in
//! flight while the current one is decoded and multiplied.
//!
//! The layout trick: inside a 64-deep chunk the reduction order is permuted so that the codes a
//! lane needs are the 16 consecutive codes (8 bytes) it loads, one block scale for all of them.
//! Lane `(g, t)` (`g = lane / 4`, `t = lane % 4`) holds physical columns `16t .. 16t + 16` of its
//! rows; at step `s` of the chunk it feeds the `mma` columns `16t + 4s .. 16t + 4s + 4` in the
//! places the instruction calls `2t, 2t+1, 2t+8, 2t+9`, and reads the same four columns of `X`.
//! A sum does not depend on the order of its terms, so the product is unchanged, and the on-disk
//! (compressed-tensors) layout the training kernels read serves this one too.
//!
//! Decoding an E2M1 byte (two codes) to a pair of `F`, three ways (comptime `decode`):
//! * table: a 16-entry f32 table in shared memory (conflict-free), f32 products rounded once
//!   like the host's dequantization;
//! * bits (bf16 only): each code's 3 magnitude bits placed into the bf16 exponent and mantissa
//!   (the value times 2^-126, exact, subnormal for the 0.5 code) with its sign bit, then two bf16
//!   multiplies (by 2^126 and by the block scale);
//! * pairs: a 256-entry table of both codes of a byte as an exact `F` pair, one shared-memory
//!   read and one pair multiply by the block scale (fewest instructions; reads of different
//!   entries may share a bank);
//! * spread (bf16 only): the bits again, but for codes `i` and `i + 4` of a word, so one pair
//!   takes two shifts and two masks for both codes (the two codes of a byte need four), with
//!   2^63 of the 2^126 folded into the block scale and the rest onto the f32 sums after the
//!   loop (powers of two: exact). The reduction order changes once more (a step's `mma`
//!   columns are those pairs) and `X` follows it. On an H100 the bit placement of bytes took
//!   ~10 instructions a pair and 677 a 64-deep chunk for 32 `mma` (SASS, 2x4 tiles, 2026-11-27).
//!
//! Split-K over whole chunks writes f32 partial sums that [`crate::splitk::reduce`] adds (with the
//! bias); the LoRA term is one more reduction of depth `r` in slice 0, in the natural order.
//!
//! `staged.rs` holds the default kernel for bf16 above 8 rows ([`MmaKernel::Staged`]): the same
//! fragments and spread decoding, with `X` copied into shared memory once per cube in fragment
//! order and up to 64 tokens per decoded fragment; both kernels end in [`finish`].
//! `segments.rs` runs its body over two or three weights that share `X` (q/k/v, gate/up) in
//! one grid, with one split-K reduction for all. `warpgroup.rs` (CUDA sm_90, the default there
//! from [`WARPGROUP_MIN_M`] rows) is the staged product, one weight or segments, on Hopper's
//! warpgroup MMA: hand-written CUDA (`warpgroup.cu`) that cubecl compiles and launches as its
//! own, with `B` read by the tensor cores from shared memory.

mod launch;
mod segments;
mod staged;
#[cfg(feature = "cuda")]
mod warpgroup;

pub(crate) use launch::{applies, launch};
pub use launch::{
    launches, options, set_options, MmaDecode, MmaKernel, MmaOptions, DEFAULT_MAX_M,
    DEFAULT_PREFETCH, DEFAULT_WARPS_PER_SM, DEFAULT_X_AHEAD, MAX_M_LIMIT, WARPGROUP_MIN_M,
};
pub use segments::{
    enabled as segments_enabled, launches as segment_launches, set_enabled as set_segments,
};
pub(crate) use segments::{launch as launch_segments, plan as plan_segments, SegmentPlan};

use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

static WARPGROUP_LAUNCHES: AtomicUsize = AtomicUsize::new(0);

/// Whether this device runs the warpgroup kernel (CUDA sm_90; never without the `cuda`
/// feature).
fn warpgroup_available<R: Runtime>(client: &ComputeClient<R>) -> bool {
    #[cfg(feature = "cuda")]
    {
        warpgroup::available(client)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = client;
        false
    }
}

/// Products the warpgroup kernel ([`MmaKernel::Warpgroup`]) has run in this process (tests
/// check that it ran rather than the staged kernel it falls back to).
pub fn warpgroup_launches() -> usize {
    WARPGROUP_LAUNCHES.load(Ordering::Relaxed)
}

/// Reduction depth of one chunk: 64 codes, 32 bytes of a weight row.
pub(crate) const CHUNK: usize = 64;

/// `2^126`: the factor between a bit-decoded E2M1 code and its value.
const TWO_POW_126: f32 = 8.507_059e37;
/// `2^63`: the spread decoding's split of that factor, half into the block scale (so the
/// products stay normal bf16 numbers) and half onto the f32 sums after the loop.
const TWO_POW_63: f32 = 9.223_372e18;

/// E2M1 decodings ([`MmaDecode`](launch::MmaDecode)) as the kernel's comptime code.
pub(crate) const DECODE_TABLE: u32 = 0;
pub(crate) const DECODE_BITS: u32 = 1;
pub(crate) const DECODE_PAIRS: u32 = 2;
pub(crate) const DECODE_SPREAD: u32 = 3;

/// Codes `i` and `i + 4` of an E2M1 word as a bf16 pair times `2^-126`, by two shifts and two
/// masks for both (spread decoding, bf16 only): the three magnitude bits of each land on the
/// exponent's two low bits and the mantissa's top bit, the sign bit on the sign.
/// `i` is a constant wherever the kernel calls this (its loops are unrolled).
#[cube]
fn spread_bits(word: u32, i: u32) -> u32 {
    let v = word >> (4u32 * i);
    ((v << 6u32) & 0x01C0_01C0u32) | ((v << 12u32) & 0x8000_8000u32)
}

/// One E2M1 byte (low nibble first) as a pair of `F`, times `scale`.
#[cube]
fn decode_pair<F: Float, P: Size>(
    byte: u32,
    scale: f32,
    scale_f: Vector<F, P>,
    lut: &SharedMemory<f32>,
    pairs: &SharedMemory<Vector<F, P>>,
    #[comptime] decode: u32,
) -> Vector<F, P> {
    if decode == DECODE_BITS {
        let bits = ((byte & 7u32) << 6u32)
            | ((byte & 8u32) << 12u32)
            | ((byte & 0x70u32) << 18u32)
            | ((byte & 0x80u32) << 24u32);
        let raw = Vector::<F, P>::reinterpret(bits);
        raw * Vector::<F, P>::new(F::new(TWO_POW_126)) * scale_f
    } else if decode == DECODE_PAIRS {
        pairs[byte as usize] * scale_f
    } else {
        let mut v = Vector::<F, P>::empty();
        v[0] = F::cast_from(lut[(byte & 0xfu32) as usize] * scale);
        v[1] = F::cast_from(lut[(byte >> 4u32) as usize] * scale);
        v
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gemm_mma_kernel<F: Float, O: Float, P: Size, Q: Size>(
    x: &Array<Vector<F, Q>>,
    codes: &Array<Vector<u32, P>>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    code_table: &Array<f32>,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<Vector<F, P>>,
    y: &mut Array<O>,
    m_rows: u32,
    n_cols: u32,
    k_dim: u32,
    split_chunks: u32,
    rank: u32,
    lora_scale: f32,
    #[comptime] warps: usize,
    #[comptime] r_tiles: usize,
    #[comptime] m_tiles: usize,
    #[comptime] block: usize,
    #[comptime] decode: u32,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] split: bool,
    #[comptime] m_major: bool,
) {
    let tid = UNIT_POS as usize;
    let lane = tid % 32;
    let g = lane / 4;
    let t = lane % 4;
    let m_rows = m_rows as usize;
    let n_cols = n_cols as usize;
    let k_dim = k_dim as usize;

    let mut lut = SharedMemory::<f32>::new(16usize);
    let mut stab = SharedMemory::<f32>::new(256usize);
    if tid < 16 {
        lut[tid] = code_table[tid];
    }
    // Every byte's pair of codes, unscaled (exact in F), for DECODE_PAIRS.
    let mut pairs = SharedMemory::<Vector<F, P>>::new(256usize);
    let mut i = tid;
    while i < 256 {
        stab[i] = scale_table[i];
        if decode == DECODE_PAIRS {
            let mut v = Vector::<F, P>::empty();
            v[0] = F::cast_from(code_table[i & 15]);
            v[1] = F::cast_from(code_table[i >> 4]);
            pairs[i] = v;
        }
        i += comptime!(32 * warps);
    }
    sync_cube();

    let mut cube_n = CUBE_POS_X as usize;
    let mut cube_m = CUBE_POS_Y as usize;
    if m_major {
        cube_n = CUBE_POS_Y as usize;
        cube_m = CUBE_POS_X as usize;
    }
    let n0 = (cube_n * warps + tid / 32) * comptime!(16 * r_tiles);
    let m0 = cube_m * comptime!(8 * m_tiles);
    if n0 >= n_cols {
        terminate!();
    }
    // This slice's chunks.
    let chunks = k_dim / CHUNK;
    let mut c0 = 0usize;
    let mut c1 = chunks;
    let mut out0 = 0usize;
    if split {
        let z = CUBE_POS_Z as usize;
        c0 = min(z * split_chunks as usize, chunks);
        c1 = min(c0 + split_chunks as usize, chunks);
        out0 = z * m_rows * n_cols;
    }

    // Rows g and g + 8 of each 16-row tile: where their codes, scales and tokens are.
    let pairs_per_row = k_dim / 16;
    let x_vecs_per_row = k_dim / 4;
    let mut row_ok = Array::<bool>::new(comptime!(2 * r_tiles));
    let mut row_pair0 = Array::<usize>::new(comptime!(2 * r_tiles));
    let mut row_elem0 = Array::<usize>::new(comptime!(2 * r_tiles));
    #[unroll]
    for j in 0..comptime!(2 * r_tiles) {
        let n = n0 + (j / 2) * 16 + (j % 2) * 8 + g;
        row_ok[j] = n < n_cols;
        row_pair0[j] = n * pairs_per_row + t;
        row_elem0[j] = n * k_dim + 16 * t;
    }

    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let mut acc = Sequence::<Array<Vector<f32, P>>>::new();
    #[unroll]
    for _ in 0..comptime!(r_tiles * m_tiles) {
        let mut a = Array::<Vector<f32, P>>::new(2usize);
        a[0] = Vector::<f32, P>::new(0.0f32);
        a[1] = Vector::<f32, P>::new(0.0f32);
        acc.push(a);
    }

    // Codes (8 bytes a row) and raw scale words of the chunk in flight, and of the current one.
    let mut w_next = Array::<Vector<u32, P>>::new(comptime!(2 * r_tiles));
    let mut s_next = Array::<u32>::new(comptime!(2 * r_tiles));
    let mut w_cur = Array::<Vector<u32, P>>::new(comptime!(2 * r_tiles));
    let mut s_cur = Array::<u32>::new(comptime!(2 * r_tiles));
    load_chunk::<P>(
        codes,
        scale_bytes,
        &row_ok,
        &row_pair0,
        &row_elem0,
        c0,
        c0 < c1,
        &mut w_next,
        &mut s_next,
        r_tiles,
        block,
        0usize,
    );

    let mut xs = Array::<Vector<F, Q>>::new(comptime!(4 * m_tiles));
    let mut a_frag = Array::<Vector<F, P>>::new(4usize);
    let mut b_frag = Array::<Vector<F, P>>::new(2usize);
    let mut scales = Array::<f32>::new(comptime!(2 * r_tiles));
    let mut scales_f = Array::<Vector<F, P>>::new(comptime!(2 * r_tiles));
    // Spread decoding: each token tile's two X pairs of the current step.
    let mut x_pairs = Array::<Vector<F, P>>::new(comptime!(2 * m_tiles));

    for c in c0..c1 {
        #[unroll]
        for j in 0..comptime!(2 * r_tiles) {
            w_cur[j] = w_next[j];
            s_cur[j] = s_next[j];
        }
        load_chunk::<P>(
            codes,
            scale_bytes,
            &row_ok,
            &row_pair0,
            &row_elem0,
            c + 1,
            c + 1 < c1,
            &mut w_next,
            &mut s_next,
            r_tiles,
            block,
            0usize,
        );
        // Tokens 8·mt + g: columns 16t + 4s .. + 4 of this chunk.
        #[unroll]
        for mt in 0..m_tiles {
            let m = m0 + mt * 8 + g;
            #[unroll]
            for s in 0..4usize {
                let mut v = Vector::<F, Q>::new(F::new(0.0));
                if m < m_rows {
                    v = x[m * x_vecs_per_row + c * 16 + 4 * t + s];
                }
                xs[mt * 4 + s] = v;
            }
        }
        // One block scale per row for the lane's 16 codes.
        #[unroll]
        for j in 0..comptime!(2 * r_tiles) {
            let b = (row_elem0[j] + c * CHUNK) / block;
            let byte = (s_cur[j] >> (((b % 4) * 8) as u32)) & 0xffu32;
            let sv = stab[byte as usize];
            scales[j] = sv;
            if decode == DECODE_SPREAD {
                scales_f[j] = Vector::<F, P>::new(F::cast_from(sv * TWO_POW_63));
            } else {
                scales_f[j] = Vector::<F, P>::new(F::cast_from(sv));
            }
        }
        #[unroll]
        for s in 0..4usize {
            // Spread: step s takes code pairs (i, i + 4) and (i + 1, i + 5) of word s / 2,
            // i = 2 (s % 2), so its X pairs are the same columns, built once for every r.
            let i0 = 2 * (s % 2);
            if decode == DECODE_SPREAD {
                #[unroll]
                for mt in 0..m_tiles {
                    let xa = xs[mt * 4 + 2 * (s / 2)];
                    let xb = xs[mt * 4 + 2 * (s / 2) + 1];
                    let mut p0 = Vector::<F, P>::empty();
                    p0[0] = xa[i0];
                    p0[1] = xb[i0];
                    let mut p1 = Vector::<F, P>::empty();
                    p1[0] = xa[i0 + 1];
                    p1[1] = xb[i0 + 1];
                    x_pairs[2 * mt] = p0;
                    x_pairs[2 * mt + 1] = p1;
                }
            }
            #[unroll]
            for r in 0..r_tiles {
                // A: rows g / g + 8 of tile r, columns 16t + 4s .. + 4 (two bytes of a word).
                #[unroll]
                for h in 0..2usize {
                    let j = 2 * r + h;
                    let word = w_cur[j][s / 2];
                    if decode == DECODE_SPREAD {
                        let lo_bits = spread_bits(word, i0 as u32);
                        let hi_bits = spread_bits(word, (i0 + 1) as u32);
                        a_frag[h] = Vector::<F, P>::reinterpret(lo_bits) * scales_f[j];
                        a_frag[2 + h] = Vector::<F, P>::reinterpret(hi_bits) * scales_f[j];
                    } else {
                        let half = (word >> ((16 * (s % 2)) as u32)) & 0xffffu32;
                        a_frag[h] = decode_pair::<F, P>(
                            half & 0xffu32,
                            scales[j],
                            scales_f[j],
                            &lut,
                            &pairs,
                            decode,
                        );
                        a_frag[2 + h] = decode_pair::<F, P>(
                            half >> 8u32,
                            scales[j],
                            scales_f[j],
                            &lut,
                            &pairs,
                            decode,
                        );
                    }
                }
                #[unroll]
                for mt in 0..m_tiles {
                    if decode == DECODE_SPREAD {
                        b_frag[0] = x_pairs[2 * mt];
                        b_frag[1] = x_pairs[2 * mt + 1];
                    } else {
                        let xv = xs[mt * 4 + s];
                        let mut lo = Vector::<F, P>::empty();
                        lo[0] = xv[0];
                        lo[1] = xv[1];
                        let mut hi = Vector::<F, P>::empty();
                        hi[0] = xv[2];
                        hi[1] = xv[3];
                        b_frag[0] = lo;
                        b_frag[1] = hi;
                    }
                    def.execute_inplace(&a_frag, &b_frag, acc.index_mut(r * m_tiles + mt));
                }
            }
        }
    }

    finish::<F, O, P>(
        &mut acc,
        lora_t,
        lora_b,
        bias,
        y,
        &row_ok,
        &def,
        n0,
        g,
        t,
        m0,
        m_rows,
        n_cols,
        out0,
        n_cols,
        rank as usize,
        lora_scale,
        r_tiles,
        m_tiles,
        comptime!(decode == DECODE_SPREAD),
        has_bias,
        has_lora,
        split,
    );
}

/// The end of both kernels: the other 2^63 of the spread decoding (`spread`), the LoRA term
/// (in slice 0 only when split), then each accumulator into `y` at `out0` (rows `y_cols`
/// apart: `n_cols`, or a segmented workspace's width) with the bias:
/// tile (r, mt) holds rows g, g + 8 of the weight tile (output columns) for token columns
/// 2t, 2t + 1.
#[cube]
#[allow(clippy::too_many_arguments)]
fn finish<F: Float, O: Float, P: Size>(
    acc: &mut Sequence<Array<Vector<f32, P>>>,
    lora_t: &Array<f32>,
    lora_b: &Array<Vector<F, P>>,
    bias: &Array<F>,
    y: &mut Array<O>,
    row_ok: &Array<bool>,
    def: &MmaDefinition<F, F, f32>,
    n0: usize,
    g: usize,
    t: usize,
    m0: usize,
    m_rows: usize,
    n_cols: usize,
    out0: usize,
    y_cols: usize,
    rank: usize,
    lora_scale: f32,
    #[comptime] r_tiles: usize,
    #[comptime] m_tiles: usize,
    #[comptime] spread: bool,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] split: bool,
) {
    if spread {
        // The half of 2^126 the block scales did not carry (a power of two: exact).
        #[unroll]
        for i in 0..comptime!(r_tiles * m_tiles) {
            let a = acc.index_mut(i);
            a[0] = a[0] * Vector::<f32, P>::new(TWO_POW_63);
            a[1] = a[1] * Vector::<f32, P>::new(TWO_POW_63);
        }
    }

    if has_lora {
        let mut here = true;
        if split {
            here = CUBE_POS_Z == 0;
        }
        if here {
            lora_stages::<F, P>(
                lora_t, lora_b, row_ok, n0, g, t, m0, m_rows, rank, lora_scale, def, acc, r_tiles,
                m_tiles,
            );
        }
    }

    #[unroll]
    for r in 0..r_tiles {
        #[unroll]
        for mt in 0..m_tiles {
            let a = acc.index(r * m_tiles + mt);
            #[unroll]
            for h in 0..2usize {
                let n = n0 + r * 16 + h * 8 + g;
                let v = a[h];
                #[unroll]
                for e in 0..2usize {
                    let m = m0 + mt * 8 + 2 * t + e;
                    if n < n_cols && m < m_rows {
                        let mut out = v[e];
                        if has_bias {
                            out += f32::cast_from(bias[n]);
                        }
                        y[out0 + m * y_cols + n] = O::cast_from(out);
                    }
                }
            }
        }
    }
}

/// Issues the loads of chunk `c` (when `live`) into `w[at + j]`, `s[at + j]`: each row's 8
/// bytes of codes and the scale word holding its block's scale byte.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_chunk<P: Size>(
    codes: &Array<Vector<u32, P>>,
    scale_bytes: &Array<u32>,
    row_ok: &Array<bool>,
    row_pair0: &Array<usize>,
    row_elem0: &Array<usize>,
    c: usize,
    live: bool,
    w: &mut Array<Vector<u32, P>>,
    s: &mut Array<u32>,
    #[comptime] r_tiles: usize,
    #[comptime] block: usize,
    #[comptime] at: usize,
) {
    #[unroll]
    for j in 0..comptime!(2 * r_tiles) {
        if live && row_ok[j] {
            w[at + j] = codes[row_pair0[j] + c * 4];
            s[at + j] = scale_bytes[(row_elem0[j] + c * CHUNK) / block / 4];
        } else {
            w[at + j] = Vector::<u32, P>::new(0u32);
            s[at + j] = 0u32;
        }
    }
}

/// `acc += (s·T)[M, r] · B[N, r]ᵀ` for this warp's tiles: extra 16-deep steps with `B`'s rows
/// as the `A` operand (natural column order), zero past the rank.
#[cube]
#[allow(clippy::too_many_arguments)]
fn lora_stages<F: Float, P: Size>(
    lora_t: &Array<f32>,
    lora_b: &Array<Vector<F, P>>,
    row_ok: &Array<bool>,
    n0: usize,
    g: usize,
    t: usize,
    m0: usize,
    m_rows: usize,
    rank: usize,
    lora_scale: f32,
    def: &MmaDefinition<F, F, f32>,
    acc: &mut Sequence<Array<Vector<f32, P>>>,
    #[comptime] r_tiles: usize,
    #[comptime] m_tiles: usize,
) {
    let mut a_frag = Array::<Vector<F, P>>::new(4usize);
    let mut b_frag = Array::<Vector<F, P>>::new(2usize);
    for rc in 0..rank.div_ceil(16) {
        #[unroll]
        for r in 0..r_tiles {
            #[unroll]
            for q in 0..4usize {
                // q: (row g | g + 8) x (columns 2t | 2t + 8)
                let h = q % 2;
                let col = rc * 16 + 2 * t + (q / 2) * 8;
                let n = n0 + r * 16 + h * 8 + g;
                let mut v = Vector::<F, P>::new(F::new(0.0));
                if row_ok[2 * r + h] && col < rank {
                    v = lora_b[(n * rank + col) / 2];
                }
                a_frag[q] = v;
            }
            #[unroll]
            for mt in 0..m_tiles {
                let m = m0 + mt * 8 + g;
                #[unroll]
                for q in 0..2usize {
                    let col = rc * 16 + 2 * t + q * 8;
                    let mut v = Vector::<F, P>::new(F::new(0.0));
                    if m < m_rows && col < rank {
                        v[0] = F::cast_from(lora_t[m * rank + col] * lora_scale);
                        v[1] = F::cast_from(lora_t[m * rank + col + 1] * lora_scale);
                    }
                    b_frag[q] = v;
                }
                def.execute_inplace(&a_frag, &b_frag, acc.index_mut(r * m_tiles + mt));
            }
        }
    }
}
