//! The decode-batch product with `X` staged through shared memory once per cube ("staged";
//! bf16, spread decoding only): what the direct kernel ([`super::gemm_mma_kernel`]) spends most
//! of its instructions on, it does once per cube instead of once per warp and step.
//!
//! Why: the direct kernel's warps each load their tokens' `X` from global memory (L1) and build
//! every `B` fragment of the spread order with a byte permute per register, and with 2x4 tiles
//! they decode each weight once per 32 tokens; on an H100 its SASS was ~23 instructions for each
//! `mma` (2026-11-27), so it is bound by issue. Here, for each 64-deep chunk:
//! * the cube's threads copy the chunk of its `8·m_tiles` tokens into shared memory in
//!   *fragment order*, token tiles in pairs: each lane's two `B` registers of step `s` for
//!   tiles `2·pr` and `2·pr + 1` are one 16-byte entry at `(pr·4 + s)·32 + lane` (a warp reads
//!   512 contiguous bytes: no bank conflict, one read for two `mma`), the spread permutation
//!   (`x_i, x_{i+4}` pairs) applied once while copying;
//! * each warp decodes its `16·r_tiles` weight rows exactly as the spread decoding does and
//!   feeds each decoded `A` fragment to `m_tiles` token tiles (up to 8: 64 tokens), so at 64
//!   rows every weight is decoded once.
//!
//! Two shared buffers alternate: the copy of chunk `c + 1` is loaded into registers before
//! chunk `c` is multiplied and stored after, with one barrier a chunk. The codes are loaded
//! `depth` chunks ahead (comptime, 1 to 4) and `X` `x_ahead` chunks (1 or 2), to keep more
//! weight in flight.
//!
//! What bounds it (ncu, H100, 7B decode at batch 64): in 2026-11-27's build, issue (11.2
//! instructions a `mma` on the gate/up product, 0.57 issued per scheduler cycle; its K loop 265
//! SASS instructions for 32 `mma`, 112 of them loads, predicates, zeroing, address arithmetic
//! and the copy's index math). Since 2026-11-28 the loop issues no predicated load, the copy's
//! offsets are computed once and one 16-byte read feeds two `mma`: 8.8 a `mma` (-22%), but the
//! product only 4-9% faster, at 0.47 issued per cycle: with 126 registers a unit (two cubes, 16
//! warps a multiprocessor) it now waits on latency (fixed-latency dependencies, global loads,
//! the barrier) more than on issue. More warps a multiprocessor is the next lever.
//!
//! The `mma` columns, the reduction order and so every rounding are those of the direct kernel
//! with the spread decoding: only where `B` comes from changed.

use super::{finish, spread_bits, CHUNK, TWO_POW_63};
use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;

/// `Y[M, N] = X[M, K] · deq(W)ᵀ (+ bias) (+ s·T·Bᵀ)` (see the module documentation); `P` is 2
/// (pairs, code words of a row's chunk), `Q` is 4 (16-byte loads of `X`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_mma_staged_kernel<F: Float, O: Float, P: Size, Q: Size>(
    x: &Array<Vector<u32, Q>>,
    codes: &Array<Vector<u32, P>>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
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
    #[comptime] depth: usize,
    #[comptime] x_ahead: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] split: bool,
    #[comptime] m_major: bool,
) {
    // Not segmented: the three segment arguments are never read (comptime), so the generated
    // code is the body's alone.
    staged_body::<F, O, P, Q>(
        x,
        codes,
        scale_bytes,
        scale_table,
        bias,
        lora_t,
        lora_b,
        y,
        m_rows,
        n_cols,
        k_dim,
        split_chunks,
        rank,
        lora_scale,
        0usize,
        0usize,
        0usize,
        warps,
        r_tiles,
        m_tiles,
        block,
        depth,
        x_ahead,
        has_bias,
        has_lora,
        split,
        m_major,
        false,
    );
}

/// The staged product for one weight, shared by [`gemm_mma_staged_kernel`] and the segments
/// kernel (`segments.rs`). `segmented`: the weight is one of several whose row groups share
/// the grid: its cubes along `N` start at `seg_cube0`, and when `split` its partial sums go
/// to a workspace `[splits, M, y_cols]` at column `y_col0` (both unused otherwise).
///
/// The K loop issues no predicated load: a row past `N` reads the weight's last row, a token
/// past `M` the last token, a chunk past the slice the row's last chunk. Those values only
/// reach outputs that [`finish`] never stores (an `mma` output depends on its own row and
/// token alone) or chunks that are never multiplied, and they are finite, so no NaN can
/// appear; what it saves is a compare, a predicate and a zeroing per load.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn staged_body<F: Float, O: Float, P: Size, Q: Size>(
    x: &Array<Vector<u32, Q>>,
    codes: &Array<Vector<u32, P>>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
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
    seg_cube0: usize,
    y_cols: usize,
    y_col0: usize,
    #[comptime] warps: usize,
    #[comptime] r_tiles: usize,
    #[comptime] m_tiles: usize,
    #[comptime] block: usize,
    #[comptime] depth: usize,
    #[comptime] x_ahead: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] split: bool,
    #[comptime] m_major: bool,
    #[comptime] segmented: bool,
) {
    let tid = UNIT_POS as usize;
    let lane = tid % 32;
    let g = lane / 4;
    let t = lane % 4;
    let m_rows = m_rows as usize;
    let n_cols = n_cols as usize;
    let k_dim = k_dim as usize;

    let mut stab = SharedMemory::<f32>::new(256usize);
    let mut i = tid;
    while i < 256 {
        stab[i] = scale_table[i];
        i += comptime!(32 * warps);
    }
    // Two buffers of the chunk's `X` in fragment order, token tiles in pairs: entry
    // `(pair · 4 + s) · 32 + lane` holds the lane's two `B` registers of step `s` for tile
    // `2·pair` and then for tile `2·pair + 1` (one 16-byte read feeds two `mma`).
    let pairs = comptime!(m_tiles.div_ceil(2));
    let frag_words = comptime!(pairs * 4 * 32);
    let mut xs = SharedMemory::<Vector<u32, Q>>::new(comptime!(2 * pairs * 4 * 32));

    let mut cube_n = CUBE_POS_X as usize;
    let mut cube_m = CUBE_POS_Y as usize;
    if m_major {
        cube_n = CUBE_POS_Y as usize;
        cube_m = CUBE_POS_X as usize;
    }
    if segmented {
        cube_n -= seg_cube0;
    }
    let n0 = (cube_n * warps + tid / 32) * comptime!(16 * r_tiles);
    let m0 = cube_m * comptime!(8 * m_tiles);
    // A warp past the last row still copies `X` and meets every barrier; it skips the rest.
    let warp_live = n0 < n_cols;
    let chunks = k_dim / CHUNK;
    let last_chunk = chunks - 1;
    let mut c0 = 0usize;
    let mut c1 = chunks;
    let mut out0 = 0usize;
    if split {
        let z = CUBE_POS_Z as usize;
        c0 = min(z * split_chunks as usize, chunks);
        c1 = min(c0 + split_chunks as usize, chunks);
        if segmented {
            out0 = z * m_rows * y_cols + y_col0;
        } else {
            out0 = z * m_rows * n_cols;
        }
    }

    // The copy: pair item `p` is the 8-column group `p % 8` of tokens `16·(p / 64) + (p % 64) / 8`
    // and 8 further (16 bytes each); its place in the buffer and in `x` do not change from chunk
    // to chunk, so both offsets are computed once here.
    let items = comptime!(pairs * 64);
    let per_thread = comptime!((pairs * 64).div_ceil(32 * warps));
    let x_vecs_per_row = k_dim / 8;
    let mut x_off = Array::<usize>::new(comptime!(2 * per_thread));
    let mut st_off = Array::<usize>::new(per_thread);
    let mut st_ok = Array::<bool>::new(per_thread);
    #[unroll]
    for u in 0..per_thread {
        let p = tid + u * comptime!(32 * warps);
        st_ok[u] = p < items;
        let pc = min(p, comptime!(items - 1));
        let pair = pc / 64;
        let gi = (pc % 64) / 8;
        let j = pc % 8;
        let ma = min(m0 + pair * 16 + gi, m_rows - 1);
        let mb = min(m0 + pair * 16 + 8 + gi, m_rows - 1);
        x_off[2 * u] = ma * x_vecs_per_row + j;
        x_off[2 * u + 1] = mb * x_vecs_per_row + j;
        st_off[u] = (pair * 4 + 2 * (j % 2)) * 32 + gi * 4 + j / 2;
    }
    // `X` of `x_ahead + 1` chunks in registers, two vectors a pair item: slot 0 is chunk c + 1
    // (stored after chunk c is multiplied), slot d chunk c + 1 + d.
    let slot = comptime!(2 * per_thread);
    let mut xq = Array::<Vector<u32, Q>>::new(comptime!((x_ahead + 1) * 2 * per_thread));
    let partial = comptime!(items % (32 * warps) != 0);
    load_x::<Q>(
        x,
        &mut xq,
        &x_off,
        &st_ok,
        min(c0, last_chunk),
        per_thread,
        partial,
        0usize,
    );
    store_x::<Q>(&xq, &mut xs, &st_off, &st_ok, 0usize, per_thread, 0usize);
    #[unroll]
    for d in 0..x_ahead {
        load_x::<Q>(
            x,
            &mut xq,
            &x_off,
            &st_ok,
            min(c0 + 1 + d, last_chunk),
            per_thread,
            partial,
            comptime!(d * 2 * per_thread),
        );
    }

    // Rows g and g + 8 of each 16-row tile: where their codes, scales and tokens are (a row
    // past `N` reads row `N - 1`, see above).
    let pairs_per_row = k_dim / 16;
    let mut row_ok = Array::<bool>::new(comptime!(2 * r_tiles));
    let mut row_pair0 = Array::<usize>::new(comptime!(2 * r_tiles));
    let mut row_elem0 = Array::<usize>::new(comptime!(2 * r_tiles));
    #[unroll]
    for j in 0..comptime!(2 * r_tiles) {
        let n = n0 + (j / 2) * 16 + (j % 2) * 8 + g;
        row_ok[j] = n < n_cols;
        let nc = min(n, n_cols - 1);
        row_pair0[j] = nc * pairs_per_row + t;
        row_elem0[j] = nc * k_dim + 16 * t;
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

    // Codes and scale words of `depth + 1` chunks: slot 0 is the chunk being multiplied, slot
    // d the one d chunks ahead (in flight).
    let rows = comptime!(2 * r_tiles);
    let mut wq = Array::<Vector<u32, P>>::new(comptime!((depth + 1) * 2 * r_tiles));
    let mut sq = Array::<u32>::new(comptime!((depth + 1) * 2 * r_tiles));
    #[unroll]
    for d in 0..depth {
        load_codes::<P>(
            codes,
            scale_bytes,
            &row_pair0,
            &row_elem0,
            min(c0 + d, last_chunk),
            &mut wq,
            &mut sq,
            r_tiles,
            block,
            comptime!((d + 1) * 2 * r_tiles),
        );
    }
    let mut a_frag = Array::<Vector<F, P>>::new(comptime!(4 * r_tiles));
    let mut b_frag = Array::<Vector<F, P>>::new(2usize);
    let mut scales_f = Array::<Vector<F, P>>::new(comptime!(2 * r_tiles));
    sync_cube();

    let mut buf = 0usize;
    for c in c0..c1 {
        #[unroll]
        for j in 0..comptime!(depth * 2 * r_tiles) {
            wq[j] = wq[j + rows];
            sq[j] = sq[j + rows];
        }
        load_codes::<P>(
            codes,
            scale_bytes,
            &row_pair0,
            &row_elem0,
            min(c + depth, last_chunk),
            &mut wq,
            &mut sq,
            r_tiles,
            block,
            comptime!(depth * 2 * r_tiles),
        );
        load_x::<Q>(
            x,
            &mut xq,
            &x_off,
            &st_ok,
            min(c + 1 + x_ahead, last_chunk),
            per_thread,
            partial,
            comptime!(x_ahead * 2 * per_thread),
        );
        if warp_live {
            // One block scale per row for the lane's 16 codes, with 2^63 of the placement's
            // 2^126 (the products stay normal bf16 numbers).
            #[unroll]
            for j in 0..comptime!(2 * r_tiles) {
                let b = (row_elem0[j] + c * CHUNK) / block;
                let byte = (sq[j] >> (((b % 4) * 8) as u32)) & 0xffu32;
                scales_f[j] = Vector::<F, P>::new(F::cast_from(stab[byte as usize] * TWO_POW_63));
            }
            let base = buf * frag_words;
            #[unroll]
            for s in 0..4usize {
                // Step s: code pairs (i0, i0 + 4) and (i0 + 1, i0 + 5) of word s / 2.
                let i0 = 2 * (s % 2);
                #[unroll]
                for r in 0..r_tiles {
                    #[unroll]
                    for h in 0..2usize {
                        let j = 2 * r + h;
                        let word = wq[j][s / 2];
                        a_frag[4 * r + h] =
                            Vector::<F, P>::reinterpret(spread_bits(word, i0 as u32)) * scales_f[j];
                        a_frag[4 * r + 2 + h] =
                            Vector::<F, P>::reinterpret(spread_bits(word, (i0 + 1) as u32))
                                * scales_f[j];
                    }
                }
                #[unroll]
                for pr in 0..pairs {
                    let bw = xs[base + (pr * 4 + s) * 32 + lane];
                    #[unroll]
                    for half in 0..2usize {
                        let mt = 2 * pr + half;
                        if comptime!(mt < m_tiles) {
                            b_frag[0] = Vector::<F, P>::reinterpret(bw[2 * half]);
                            b_frag[1] = Vector::<F, P>::reinterpret(bw[2 * half + 1]);
                            #[unroll]
                            for r in 0..r_tiles {
                                let mut a = Array::<Vector<F, P>>::new(4usize);
                                #[unroll]
                                for q in 0..4usize {
                                    a[q] = a_frag[4 * r + q];
                                }
                                def.execute_inplace(&a, &b_frag, acc.index_mut(r * m_tiles + mt));
                            }
                        }
                    }
                }
            }
        }
        buf = 1 - buf;
        store_x::<Q>(
            &xq,
            &mut xs,
            &st_off,
            &st_ok,
            buf * frag_words,
            per_thread,
            0usize,
        );
        #[unroll]
        for j in 0..comptime!(x_ahead * 2 * per_thread) {
            xq[j] = xq[j + slot];
        }
        sync_cube();
    }

    if !warp_live {
        terminate!();
    }
    // Split segments write rows of the shared workspace (`y_cols` wide); otherwise `y` is
    // this weight's own `[M, N]`.
    let mut y_stride = n_cols;
    if segmented && split {
        y_stride = y_cols;
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
        y_stride,
        rank as usize,
        lora_scale,
        r_tiles,
        m_tiles,
        true,
        has_bias,
        has_lora,
        split,
    );
}

/// This thread's pair items of chunk `c` (two 16-byte vectors each, at the offsets
/// [`staged_body`] computed) into `out[at ..]`; where the cube has more threads than items
/// (`partial`), those without one load nothing.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_x<Q: Size>(
    x: &Array<Vector<u32, Q>>,
    out: &mut Array<Vector<u32, Q>>,
    x_off: &Array<usize>,
    st_ok: &Array<bool>,
    c: usize,
    #[comptime] per_thread: usize,
    #[comptime] partial: bool,
    #[comptime] at: usize,
) {
    #[unroll]
    for u in 0..per_thread {
        if !partial || st_ok[u] {
            out[at + 2 * u] = x[x_off[2 * u] + c * 8];
            out[at + 2 * u + 1] = x[x_off[2 * u + 1] + c * 8];
        }
    }
}

/// Writes this thread's pair items into the buffer at `base` in fragment order: the 8 columns
/// `x0 .. x7` of group `j` of a token become the pairs `(x0, x4), (x1, x5)` of step
/// `2·(j % 2)` and `(x2, x6), (x3, x7)` of step `2·(j % 2) + 1`, for lane `(token % 8)·4 + j / 2`;
/// the item's two tokens (tiles `2·pair` and `2·pair + 1`) fill the two halves of each entry.
#[cube]
fn store_x<Q: Size>(
    vals: &Array<Vector<u32, Q>>,
    xs: &mut SharedMemory<Vector<u32, Q>>,
    st_off: &Array<usize>,
    st_ok: &Array<bool>,
    base: usize,
    #[comptime] per_thread: usize,
    #[comptime] at: usize,
) {
    #[unroll]
    for u in 0..per_thread {
        if st_ok[u] {
            let a = vals[at + 2 * u];
            let b = vals[at + 2 * u + 1];
            let mut lo = Vector::<u32, Q>::empty();
            lo[0] = (a[0] & 0xffffu32) | (a[2] << 16u32);
            lo[1] = (a[0] >> 16u32) | (a[2] & 0xffff_0000u32);
            lo[2] = (b[0] & 0xffffu32) | (b[2] << 16u32);
            lo[3] = (b[0] >> 16u32) | (b[2] & 0xffff_0000u32);
            let mut hi = Vector::<u32, Q>::empty();
            hi[0] = (a[1] & 0xffffu32) | (a[3] << 16u32);
            hi[1] = (a[1] >> 16u32) | (a[3] & 0xffff_0000u32);
            hi[2] = (b[1] & 0xffffu32) | (b[3] << 16u32);
            hi[3] = (b[1] >> 16u32) | (b[3] & 0xffff_0000u32);
            let at = base + st_off[u];
            xs[at] = lo;
            xs[at + 32] = hi;
        }
    }
}

/// Issues the loads of chunk `c` into `w[at + j]`, `s[at + j]`: each row's 8 bytes of codes
/// and the scale word holding its block's scale byte (unpredicated: see [`staged_body`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_codes<P: Size>(
    codes: &Array<Vector<u32, P>>,
    scale_bytes: &Array<u32>,
    row_pair0: &Array<usize>,
    row_elem0: &Array<usize>,
    c: usize,
    w: &mut Array<Vector<u32, P>>,
    s: &mut Array<u32>,
    #[comptime] r_tiles: usize,
    #[comptime] block: usize,
    #[comptime] at: usize,
) {
    #[unroll]
    for j in 0..comptime!(2 * r_tiles) {
        w[at + j] = codes[row_pair0[j] + c * 4];
        s[at + j] = scale_bytes[(row_elem0[j] + c * CHUNK) / block / 4];
    }
}
