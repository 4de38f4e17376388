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
//! Needs `cmma` for `F x F -> f32` at 16x16x16, 32-wide planes and `K % 32 == 0`
//! ([`applies`]); CUDA with f16/bf16. Everything else keeps the portable tiled kernel.

use crate::device::DeviceWeight;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::{cmma, features::MmaConfig};

/// Reduction depth of one shared-memory stage.
const BK: usize = 32;
/// 8-wide vectors per tile row.
const KV: usize = BK / 8;
/// Padded row stride of a tile in vectors (40 elements, 80 bytes: no bank conflicts for the
/// 16-byte row reads of the fragment loads).
const SROW: usize = KV + 1;
const SROW_ELEMS: u32 = (SROW * 8) as u32;

/// A tile configuration: planes along M and N, 16x16 fragments per plane along M and N.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tiles {
    pub warps_m: usize,
    pub warps_n: usize,
    pub frags_m: usize,
    pub frags_n: usize,
}

impl Tiles {
    pub fn bm(&self) -> usize {
        self.warps_m * self.frags_m * 16
    }
    pub fn bn(&self) -> usize {
        self.warps_n * self.frags_n * 16
    }
    pub fn threads(&self) -> usize {
        32 * self.warps_m * self.warps_n
    }
}

/// 128x128 output per cube, 8 planes of 64x32.
const BIG: Tiles = Tiles {
    warps_m: 2,
    warps_n: 4,
    frags_m: 4,
    frags_n: 2,
};
/// 64x128, 8 planes of 32x32.
const MID: Tiles = Tiles {
    warps_m: 2,
    warps_n: 4,
    frags_m: 2,
    frags_n: 2,
};
/// 32x128, 4 planes of 32x32 (few rows).
const SMALL: Tiles = Tiles {
    warps_m: 1,
    warps_n: 4,
    frags_m: 2,
    frags_n: 2,
};

/// The largest configuration that still gives every multiprocessor about two cubes.
pub(crate) fn pick_tiles(m: usize, n: usize) -> Tiles {
    let cubes = |t: Tiles| m.div_ceil(t.bm()) * n.div_ceil(t.bn());
    if cubes(BIG) >= 264 {
        BIG
    } else if m > 32 && cubes(MID) >= 132 {
        MID
    } else {
        SMALL
    }
}

/// Whether the tensor-core path can run a product with reduction depth `k` in `F` here.
pub(crate) fn applies<R: Runtime, F: Float>(client: &ComputeClient<R>, k: usize) -> bool {
    let props = client.properties();
    let ty = F::as_type_native_unchecked().storage_type();
    let cfg = MmaConfig {
        a_type: ty,
        b_type: ty,
        cd_type: f32::as_type_native_unchecked().storage_type(),
        m: 16,
        n: 16,
        k: 16,
    };
    k.is_multiple_of(BK)
        && props.features.matmul.cmma.contains(&cfg)
        && props.hardware.plane_size_min == 32
        && props.hardware.plane_size_max == 32
}

/// Loads one stage's global data into registers: `BM x BK` activations and, for the weight, the
/// packed words and raw scales (or dense `F` rows).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_a<F: Float, V: Size>(
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
fn store_a<F: Float, V: Size>(
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
fn compute_stage<F: Float, V: Size>(
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
    let k_tiles = red_vecs / KV;

    for kt in 0..k_tiles + 1 {
        // Iteration kt computes stage kt - 1 and fetches stage kt: its global loads are issued
        // before the cmmas, decoded into the other buffer after them.
        let cur = (kt + 1) % 2;
        let fetch = kt < k_tiles;
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
        if kt > 0 {
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
            let nxt = kt % 2;
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
        // s·T[M, r] against B[N, r]: extra zero-padded stages through buffer 0.
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

    // Epilogue: each plane stores one fragment at a time into its 16x16 f32 patch of `stage`,
    // then each lane writes 8 consecutive outputs of one row.
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
                        y[m * n_cols + n] = O::cast_from(v);
                    }
                }
            }
            sync_plane();
        }
    }
}

/// Loads `words` packed words from word `w0` (if `valid`) and the raw scale of each word.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_w<W: Size>(
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
fn decode_w<F: Float, V: Size, W: Size>(
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
fn stage_lora<F: Float, V: Size, E: Float>(
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

/// What [`launch`] computes.
pub(crate) enum TcProduct<'a> {
    /// `Y[M, N] = X[M, K] · deq(W)ᵀ`, bias and LoRA optional.
    Forward(&'a DeviceWeight),
    /// `dX[M, K] = dY[M, N] · deq(W)`.
    Transposed(&'a DeviceWeight),
    /// `Y[M, n] = X[M, K] · D[n, K]ᵀ` with a dense row-major `D` (the LoRA down-projection).
    Dense { d: &'a Handle, n: usize, k: usize },
}

/// Optional epilogue inputs of [`launch`]; unused ones are bound to a buffer never read.
pub(crate) struct TcEpilogue {
    pub bias: Option<Handle>,
    pub lora: Option<(Handle, Handle, usize, f32)>,
}

/// Launches the tensor-core product; the caller has checked buffers and [`applies`] (and, for
/// `Transposed`, `N % 32 == 0`). `x` holds `M x reduction` elements of `F`, `y` receives
/// `M x columns` elements of `O`.
pub(crate) fn launch<R: Runtime, F: Float, O: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    product: TcProduct<'_>,
    epilogue: TcEpilogue,
    y: &Handle,
) {
    // (output columns, reduction length, weight K)
    let (cols, red, wk) = match &product {
        TcProduct::Forward(w) => (w.n, w.k, w.k),
        TcProduct::Transposed(w) => (w.k, w.n, w.k),
        TcProduct::Dense { n, k, .. } => (*n, *k, *k),
    };
    let tiles = pick_tiles(m, cols);
    let words = KV * tiles.bn() / tiles.threads();
    let count = CubeCount::Static(
        cols.div_ceil(tiles.bn()) as u32,
        m.div_ceil(tiles.bm()) as u32,
        1,
    );
    let unused = x.clone();
    let (w, dense, dense_b, transposed) = match &product {
        TcProduct::Forward(w) => (Some(*w), unused.clone(), false, false),
        TcProduct::Transposed(w) => (Some(*w), unused.clone(), false, true),
        TcProduct::Dense { d, .. } => (None, (*d).clone(), true, false),
    };
    let dense_len = if dense_b { cols * red / 8 } else { m * red / 8 };
    let (codes, codes_len, sb, sbl, st, stl, ct, block, byte_scales) = match w {
        Some(w) => (
            w.codes.clone(),
            w.words() / words,
            w.scale_bytes.clone(),
            w.scale_words(),
            w.scale_table.clone(),
            w.scale_table_len(),
            w.code_table.clone(),
            w.block(),
            w.byte_scales(),
        ),
        None => (
            unused.clone(),
            1,
            unused.clone(),
            1,
            unused.clone(),
            1,
            unused.clone(),
            16,
            true,
        ),
    };
    let has_bias = epilogue.bias.is_some();
    let bias = epilogue.bias.unwrap_or_else(|| unused.clone());
    let has_lora = epilogue.lora.is_some();
    let (t, lb, rank, scale) = epilogue
        .lora
        .unwrap_or_else(|| (unused.clone(), unused.clone(), 0, 0.0));
    // SAFETY: buffer sizes were checked by the caller; every global read is bounded by the m
    // rows, the weight's rows and columns and the reduction length (a multiple of BK, checked by
    // `applies`), every write by m and the output columns.
    unsafe {
        gemm_tc_kernel::launch_unchecked::<F, O, R>(
            client,
            count,
            CubeDim::new_1d(tiles.threads() as u32),
            8,
            words,
            ArrayArg::from_raw_parts(x.clone(), m * red / 8),
            ArrayArg::from_raw_parts(codes, codes_len),
            ArrayArg::from_raw_parts(dense, dense_len),
            ArrayArg::from_raw_parts(sb, sbl),
            ArrayArg::from_raw_parts(st, stl),
            ArrayArg::from_raw_parts(ct, 16),
            ArrayArg::from_raw_parts(bias, cols),
            ArrayArg::from_raw_parts(t, m * rank.max(1)),
            ArrayArg::from_raw_parts(lb, cols * rank.max(1)),
            ArrayArg::from_raw_parts(y.clone(), m * cols),
            m as u32,
            cols as u32,
            red as u32,
            wk as u32,
            rank as u32,
            scale,
            tiles.warps_m,
            tiles.warps_n,
            tiles.frags_m,
            tiles.frags_n,
            words,
            block,
            byte_scales,
            dense_b,
            transposed,
            has_bias,
            has_lora,
        );
    }
}
