//! Tensor-core W4A16 product for larger M: `Y[M,N] = X[M,K] · deq(W)ᵀ (+ bias) (+ s·T·Bᵀ)`.
//!
//! A cube owns a `BM x BN` output tile, split over `warps_m x warps_n` planes of
//! `frags_m x frags_n` 16x16 `cmma` accumulators (f32). The reduction runs in stages of
//! `BK = 32`: the activation tile is copied as 16-byte vectors, the weight tile is read as 8- or
//! 16-byte vectors of packed codes and decoded in registers (a 16-entry code table and the 256
//! block-scale values in shared memory) into an `F` tile; both tiles live in a shared-memory
//! double buffer. The next stage's global loads are issued before the current stage's `cmma`s, and
//! decoded into the other buffer after them, so one barrier per stage suffices.
//!
//! The LoRA term is a short tail of the same loop: `s·T` (from [`lora_down`], rounded to `F`) and
//! `B[N, r]` are staged as extra zero-padded reduction stages, so the adapter costs `r / K` of the
//! product. [`lora_down`] itself runs on the same kernel with a dense `F` operand in place of the
//! packed weight (`dense_b`).
//!
//! Split-K: when the output tiles alone would give fewer than about two cubes per
//! multiprocessor, the grid's third dimension splits the reduction into slices of whole stages;
//! each slice writes f32 partial sums (the LoRA stages run in slice 0) and
//! [`crate::splitk::reduce`] adds them and applies the bias. Whether a launch is split is a
//! comptime flag, so unsplit launches carry no slice bookkeeping.
//!
//! Needs `cmma` for `F x F -> f32` at 16x16x16, 32-wide planes and `K % 32 == 0`
//! ([`applies`]); CUDA with f16/bf16. Everything else keeps the portable tiled kernel.
//! Tile configurations and the launch (with the split-K choice) are in [`launch`].

mod launch;
mod stage;

pub(crate) use launch::{applies, launch, TcEpilogue, TcProduct, Tiles, BIG, MID, SMALL};

use cubecl::cmma;
use cubecl::prelude::*;
use stage::{compute_stage, decode_w, load_a, load_w, stage_lora, store_a};

/// Reduction depth of one shared-memory stage.
const BK: usize = 32;
/// 8-wide vectors per tile row.
const KV: usize = BK / 8;
/// Padded row stride of a tile in vectors (40 elements, 80 bytes: no bank conflicts for the
/// 16-byte row reads of the fragment loads).
const SROW: usize = KV + 1;
const SROW_ELEMS: u32 = (SROW * 8) as u32;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gemm_tc_kernel<F: Float, O: Float, V: Size, W: Size>(
    x: &Array<Vector<F, V>>,
    codes: &Array<Vector<u32, W>>,
    dense_w: &Array<Vector<F, V>>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    code_table: &Array<f32>,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<F>,
    y: &mut Array<O>,
    m_rows: u32,
    n_cols: u32,
    red_dim: u32,
    w_k: u32,
    split_tiles: u32,
    rank: u32,
    lora_scale: f32,
    #[comptime] warps_m: usize,
    #[comptime] warps_n: usize,
    #[comptime] frags_m: usize,
    #[comptime] frags_n: usize,
    #[comptime] words: usize,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
    #[comptime] dense_b: bool,
    #[comptime] transposed: bool,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] split: bool,
) {
    let bm = comptime!(warps_m * frags_m * 16);
    let bn = comptime!(warps_n * frags_n * 16);
    let threads = comptime!(32 * warps_m * warps_n);
    let a_iters = comptime!(bm * KV / threads);
    let b_iters = comptime!(bn * KV / threads);
    // Transposed (dX): the weight tile is [BK rows of N, bn columns of K], row stride `trow`.
    let trow = comptime!(bn / 8 + 1);
    let b_stage = comptime!(if transposed { BK * trow } else { bn * SROW });
    let parts = comptime!(if transposed {
        bn / 8 / words
    } else {
        KV / words
    });
    let b_frag_step = comptime!(if transposed { 2usize } else { 16 * SROW });
    let b_k_step = comptime!(if transposed { 16 * trow } else { 2usize });
    let b_stride = comptime!(if transposed { trow * 8 } else { SROW * 8 }) as u32;

    let tid = UNIT_POS as usize;
    let warp = tid / 32;
    let lane = tid % 32;
    let wm = warp / warps_n;
    let wn = warp % warps_n;
    let m_rows = m_rows as usize;
    let n_cols = n_cols as usize;
    let red_vecs = red_dim as usize / 8;
    let k_vecs = w_k as usize / 8;
    let m0 = CUBE_POS_Y as usize * bm;
    let n0 = CUBE_POS_X as usize * bn;

    let mut lut = SharedMemory::<f32>::new(16usize);
    let mut stab = SharedMemory::<f32>::new(256usize);
    if !dense_b {
        if tid < 16 {
            lut[tid] = code_table[tid];
        }
        if byte_scales {
            let mut i = tid;
            while i < 256 {
                stab[i] = scale_table[i];
                i += threads;
            }
        }
    }
    sync_cube();
    let mut a_s = SharedMemory::<Vector<F, V>>::new_aligned(comptime!(2 * bm * SROW), 128usize);
    let mut b_s = SharedMemory::<Vector<F, V>>::new_aligned(comptime!(2 * b_stage), 128usize);
    let mut stage = SharedMemory::<f32>::new_aligned(comptime!(threads / 32 * 256), 128usize);

    let mut a_frag = Sequence::<cmma::Matrix<F>>::new();
    let mut b_frag = Sequence::<cmma::Matrix<F>>::new();
    let mut acc = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _ in 0..frags_m {
        a_frag.push(unsafe {
            cmma::Matrix::<F>::uninitialized(
                cmma::MatrixIdent::A,
                16usize,
                16usize,
                16usize,
                cmma::MatrixLayout::RowMajor,
            )
        });
    }
    #[unroll]
    for _ in 0..frags_n {
        if transposed {
            b_frag.push(unsafe {
                cmma::Matrix::<F>::uninitialized(
                    cmma::MatrixIdent::B,
                    16usize,
                    16usize,
                    16usize,
                    cmma::MatrixLayout::RowMajor,
                )
            });
        } else {
            b_frag.push(unsafe {
                cmma::Matrix::<F>::uninitialized(
                    cmma::MatrixIdent::B,
                    16usize,
                    16usize,
                    16usize,
                    cmma::MatrixLayout::ColMajor,
                )
            });
        }
    }
    #[unroll]
    for _ in 0..frags_m * frags_n {
        acc.push(cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::Undefined,
            0.0f32,
        ));
    }

    // Register copies of the next stage.
    let mut a_reg = Array::<Vector<F, V>>::new(a_iters);
    let mut d_reg = Array::<Vector<F, V>>::new(b_iters);
    let mut w_reg = Vector::<u32, W>::new(0u32);
    let mut s_raw = Array::<u32>::new(words);
    let mut s_val = Array::<f32>::new(words);
    // This unit's weight row and word group in the tile, and its offset in a stage buffer.
    let w_row = tid / parts;
    let w_part = tid % parts;
    let mut w_dst = w_row * SROW + w_part * words;
    if transposed {
        w_dst = w_row * trow + w_part * words;
    }

    let a_base_w = wm * frags_m * 16 * SROW;
    let mut b_base_w = wn * frags_n * 16 * SROW;
    if transposed {
        b_base_w = wn * frags_n * 2;
    }
    // This cube's slice of the reduction: stages kt0 .. kt0 + tiles (the whole of it unsplit;
    // `split` is comptime so that unsplit launches carry no slice bookkeeping in registers).
    let k_tiles = red_vecs / KV;
    let mut kt0 = 0usize;
    let mut tiles = k_tiles;
    let mut out0 = 0usize;
    if split {
        let z = CUBE_POS_Z as usize;
        kt0 = z * split_tiles as usize;
        let kt_end = min(kt0 + split_tiles as usize, k_tiles);
        tiles = kt_end - min(kt0, kt_end);
        out0 = z * m_rows * n_cols;
    }

    for it in 0..tiles + 1 {
        // Iteration it computes stage it - 1 and fetches stage it: its global loads are issued
        // before the cmmas, decoded into the other buffer after them.
        let kt = kt0 + it;
        let cur = (it + 1) % 2;
        let fetch = it < tiles;
        if fetch {
            load_a::<F, V>(
                x, &mut a_reg, m0, m_rows, red_vecs, kt, tid, a_iters, threads,
            );
            if dense_b {
                load_a::<F, V>(
                    dense_w, &mut d_reg, n0, n_cols, k_vecs, kt, tid, b_iters, threads,
                );
            } else {
                // Word w0 of the packed weight, and whether it lies inside the weight.
                let mut w0 = (n0 + w_row) * k_vecs + kt * KV + w_part * words;
                let mut valid = n0 + w_row < n_cols;
                if transposed {
                    w0 = (kt * BK + w_row) * k_vecs + n0 / 8 + w_part * words;
                    valid = n0 + w_part * words * 8 < n_cols;
                }
                w_reg = load_w::<W>(
                    codes,
                    scale_bytes,
                    scale_table,
                    &mut s_raw,
                    &mut s_val,
                    w0,
                    valid,
                    words,
                    block,
                    byte_scales,
                );
            }
        }
        if it > 0 {
            compute_stage::<F, V>(
                &a_s,
                &b_s,
                cur * bm * SROW + a_base_w,
                cur * b_stage + b_base_w,
                &a_frag,
                &b_frag,
                &acc,
                frags_m,
                frags_n,
                b_frag_step,
                b_k_step,
                b_stride,
            );
        }
        if fetch {
            let nxt = it % 2;
            store_a::<F, V>(&a_reg, &mut a_s, nxt * bm * SROW, tid, a_iters, threads);
            if dense_b {
                store_a::<F, V>(&d_reg, &mut b_s, nxt * b_stage, tid, b_iters, threads);
            } else {
                decode_w::<F, V, W>(
                    &w_reg,
                    &s_raw,
                    &s_val,
                    &lut,
                    &stab,
                    &mut b_s,
                    nxt * b_stage + w_dst,
                    words,
                    byte_scales,
                );
            }
        }
        sync_cube();
    }

    if has_lora {
        // s·T[M, r] against B[N, r]: extra zero-padded stages through buffer 0 (in slice 0
        // when split).
        let mut here = true;
        if split {
            here = CUBE_POS_Z == 0;
        }
        if here {
            let rank = rank as usize;
            for rt in 0..rank.div_ceil(BK) {
                stage_lora::<F, V, f32>(
                    lora_t, &mut a_s, m0, m_rows, rank, rt, lora_scale, tid, bm, threads,
                );
                stage_lora::<F, V, F>(
                    lora_b, &mut b_s, n0, n_cols, rank, rt, 1.0f32, tid, bn, threads,
                );
                sync_cube();
                compute_stage::<F, V>(
                    &a_s,
                    &b_s,
                    a_base_w,
                    b_base_w,
                    &a_frag,
                    &b_frag,
                    &acc,
                    frags_m,
                    frags_n,
                    b_frag_step,
                    b_k_step,
                    b_stride,
                );
                sync_cube();
            }
        }
    }

    // Epilogue: each plane stores one fragment at a time into its 16x16 f32 patch of `stage`,
    // then each lane writes 8 consecutive outputs of one row (of this slice's `[M, N]` block
    // when split).
    let patch = warp * 256;
    let row = lane / 2;
    let col = (lane % 2) * 8;
    #[unroll]
    for fm in 0..frags_m {
        #[unroll]
        for fn_ in 0..frags_n {
            let mut sl = stage.slice_mut(patch, patch + 256);
            cmma::store(
                &mut sl,
                acc.index(fm * frags_n + fn_),
                16u32,
                cmma::MatrixLayout::RowMajor,
            );
            sync_plane();
            let m = m0 + wm * frags_m * 16 + fm * 16 + row;
            let nb = n0 + wn * frags_n * 16 + fn_ * 16 + col;
            if m < m_rows {
                #[unroll]
                for i in 0..8usize {
                    let n = nb + i;
                    if n < n_cols {
                        let mut v = stage[patch + row * 16 + col + i];
                        if has_bias {
                            v += f32::cast_from(bias[n]);
                        }
                        y[out0 + m * n_cols + n] = O::cast_from(v);
                    }
                }
            }
            sync_plane();
        }
    }
}
