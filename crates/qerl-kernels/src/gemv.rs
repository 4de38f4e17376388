//! Decode-time product for few rows (M <= 8 by default, up to 16): memory-bound, one plane (warp) per group of
//! `ROWS` output columns and one slice of the reduction.
//!
//! Every unit of a plane reads 16-byte chunks (4 u32 words, 32 codes) of each of the plane's
//! weight rows, `UNROLL` chunks per row at a time, so that `ROWS x UNROLL` 16-byte loads (and
//! their scale words) are in flight before the first use. The codes are decoded in registers
//! through a 16-entry table in shared memory (the 256 block-scale values of NVFP4/MXFP4 sit
//! there too), and each activation vector (8 values of one of the M rows) is read once per word
//! and reused for all the plane's rows. A plane sum reduces the partial dot products.
//!
//! When the planes alone would not fill the device (narrow N, deep K: o_proj, down_proj), the
//! reduction is split into slices (the grid's y dimension): each slice writes f32 partial sums
//! and [`crate::splitk::reduce`] adds them and applies the epilogue. Needs plane (warp)
//! operations, 32-wide planes and `K % 32 == 0`; [`crate::gemm::matmul`] falls back otherwise.

use crate::device::DeviceWeight;
use crate::gemm::{store_output, with_epilogue};
use crate::splitk;
use cubecl::prelude::*;
use cubecl::server::Handle;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Weight rows (output columns) per plane.
const ROWS: usize = 4;
/// Chunks (16 bytes of codes) per row a unit loads before computing. On an H100 (2026-11-27,
/// 7B decode at batch 1) 1 gave 5.34 ms a step, 2 gave 5.54-5.56 and 4 gave 6.38: the
/// fewer registers a unit holds, the more warps run.
const UNROLL: usize = 1;

/// Chunks per row in flight: [`UNROLL`], or `QERL_GEMV_UNROLL` (1 to 8) for experiments.
fn unroll() -> usize {
    static UNROLL_ENV: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *UNROLL_ENV.get_or_init(|| {
        std::env::var("QERL_GEMV_UNROLL")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|u| (1..=8).contains(u))
            .unwrap_or(UNROLL)
    })
}
/// Planes per cube.
const PLANES: u32 = 4;
/// Most planes of a cube that share one group of `ROWS` rows, each taking a part of the
/// reduction (the cube adds the parts in shared memory). On the narrow products at batch 1
/// (q/k/v, o: a few hundred cubes) one plane a group left 8 warps a multiprocessor, each
/// walking 3-4 chunks a unit one after the other (ncu, H100, 2026-11-27: 0.46-0.50 TB/s).
const MAX_K_PLANES: usize = 4;
/// Planes sharing a row group: 0 lets [`k_planes`] choose (`QERL_GEMV_K_PLANES`, 1, 2 or 4,
/// fixes it for a process; [`set_k_planes`] for tests).
static K_PLANES: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Fixes the planes that share a row group (1, 2 or 4; 0 restores the automatic choice), for
/// tests and benchmarks.
pub fn set_k_planes(k_planes: usize) {
    K_PLANES.store(k_planes, Ordering::Relaxed);
}

/// Fewest planes sharing a row group: two, even where the row groups alone fill the device
/// (the gate/up product's 9,472 groups of a 7B model at batch 1). On an H100 (2026-11-27, 7B
/// decode at batch 1, ncu) gate/up took 47.3 µs with two planes a group against 52.6 with one,
/// and the step 4.31 ms against 4.59.
const MIN_K_PLANES: usize = 2;

/// Planes sharing a row group for `planes` groups of `ROWS` rows: the fewest (from
/// [`MIN_K_PLANES`], doubling) that give the grid `target` planes, else [`MAX_K_PLANES`].
fn k_planes(planes: usize, target: usize) -> usize {
    let mut fixed = K_PLANES.load(Ordering::Relaxed);
    if fixed == usize::MAX {
        fixed = std::env::var("QERL_GEMV_K_PLANES")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|v: &usize| [0, 1, 2, 4].contains(v))
            .unwrap_or(0);
        K_PLANES.store(fixed, Ordering::Relaxed);
    }
    if fixed > 0 {
        return fixed;
    }
    let mut kp = MIN_K_PLANES;
    while kp < MAX_K_PLANES && planes * kp < target {
        kp *= 2;
    }
    kp
}
/// u32 words per unit load (16 bytes, 32 codes).
const WORDS: usize = 4;
/// Fewest chunks per K-slice (two per unit).
const MIN_SPLIT_CHUNKS: usize = 64;

/// [`MIN_SPLIT_CHUNKS`], or `QERL_GEMV_MIN_SPLIT_CHUNKS` (read once) for experiments: a large
/// value keeps every product unsplit.
fn min_split_chunks() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        std::env::var("QERL_GEMV_MIN_SPLIT_CHUNKS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v: &usize| v > 0)
            .unwrap_or(MIN_SPLIT_CHUNKS)
    })
}
/// Planes per multiprocessor the split aims for (about 4 KiB of loads in flight each).
const PLANES_PER_SM: usize = 32;

/// Planes per multiprocessor the launches aim for: [`PLANES_PER_SM`], or
/// `QERL_GEMV_PLANES_PER_SM` (read once) for experiments.
fn planes_per_sm() -> usize {
    static PER_SM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PER_SM.get_or_init(|| {
        std::env::var("QERL_GEMV_PLANES_PER_SM")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v: &usize| v > 0)
            .unwrap_or(PLANES_PER_SM)
    })
}

/// Largest M the decode kernel takes.
pub(crate) const MAX_M: usize = 16;
/// Largest M sent to it by default: on an H100 (2026-11-22) the tensor-core path with split-K
/// beat it at M = 16 on every Qwen2.5 shape (at M > 8 the CUDA-core FMAs bound it), while at
/// M <= 8 it is the faster one.
pub const DEFAULT_DECODE_MAX_M: usize = 8;
static DECODE_MAX_M: AtomicUsize = AtomicUsize::new(DEFAULT_DECODE_MAX_M);
static DECODE_MAX_M_ENV: std::sync::Once = std::sync::Once::new();

/// `QERL_DECODE_MAX_M` (0 to 16), read once, before any explicit setting.
fn read_env_once() {
    DECODE_MAX_M_ENV.call_once(|| {
        if let Some(v) = std::env::var("QERL_DECODE_MAX_M")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
        {
            DECODE_MAX_M.store(v.min(MAX_M), Ordering::Relaxed);
        }
    });
}

/// The largest M sent to the decode kernel where the tensor-core paths apply.
fn decode_max_m() -> usize {
    read_env_once();
    DECODE_MAX_M.load(Ordering::Relaxed)
}

/// Sets the largest M that goes to the decode kernel (at most 16; 0 turns it off), for tests
/// and benchmarks (`QERL_DECODE_MAX_M` sets it for a process). Default
/// [`DEFAULT_DECODE_MAX_M`]; where the tensor-core path does not apply, M <= 16 always takes the
/// decode kernel when it can.
pub fn set_decode_max_m(max: usize) {
    read_env_once();
    DECODE_MAX_M.store(max.min(MAX_M), Ordering::Relaxed);
}

/// The product of one weight by the cube at `cube_x` of its own grid; the code table is
/// already in `lut`, and the block-scale table is loaded into `stab` here.
#[cube]
#[allow(clippy::too_many_arguments)]
fn gemv_body<F: Float, V: Size, W: Size>(
    x: &Array<Vector<F, V>>,
    codes: &Array<Vector<u32, W>>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<F>,
    y: &mut Array<F>,
    part_out: &mut Array<f32>,
    lut: &SharedMemory<f32>,
    stab: &mut SharedMemory<f32>,
    red: &mut SharedMemory<f32>,
    cube_x: usize,
    n_cols: u32,
    k_dim: u32,
    split_chunks: u32,
    rank: u32,
    lora_scale: f32,
    #[comptime] m_rows: usize,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] split: bool,
    #[comptime] plane: usize,
    #[comptime] unroll: usize,
    #[comptime] kp: usize,
) {
    let lane = UNIT_POS_X as usize;
    let tid = UNIT_POS_Y as usize * plane + lane;
    let n_cols = n_cols as usize;
    let k_dim = k_dim as usize;
    // `kp` planes share a group of ROWS rows, plane `part` of them taking every kp-th run of
    // `plane` chunks.
    let py = UNIT_POS_Y as usize;
    let part = py % kp;
    let n0 = (cube_x * comptime!(PLANES as usize / kp) + py / kp) * ROWS;
    let chunks = k_dim / (8 * WORDS);
    let c_begin = CUBE_POS_Y as usize * split_chunks as usize;
    let c_end = min(c_begin + split_chunks as usize, chunks);
    // Activation vectors (8 wide) per row of x.
    let x_row = k_dim / 8;
    // Flat block index of a chunk's first element is (n*K + 32c) / block: blocks per row and
    // per chunk (a chunk never straddles a u32 of scale bytes: K % 32 == 0, so for 16-element
    // blocks the chunk's first block is even).
    let row_elems = k_dim;

    let mut acc = Array::<f32>::new(comptime!(ROWS * m_rows));
    #[unroll]
    for i in 0..ROWS * m_rows {
        acc[i] = 0.0f32;
    }
    let mut w_reg = Array::<Vector<u32, W>>::new(comptime!(ROWS * unroll));
    let mut s_reg = Array::<u32>::new(comptime!(ROWS * unroll));
    let mut s_val = Array::<f32>::new(comptime!(ROWS * unroll));

    let step = comptime!(plane * kp * unroll);
    let mut c = c_begin + part * plane + lane;
    // The first step's loads go out before the block-scale table is filled and synchronised,
    // so that the cube's start does not wait on two global round trips.
    if c < c_end {
        load_step::<W>(
            codes,
            scale_bytes,
            scale_table,
            &mut w_reg,
            &mut s_reg,
            &mut s_val,
            c,
            c_end,
            n0,
            n_cols,
            chunks,
            row_elems,
            block,
            byte_scales,
            plane,
            unroll,
            kp,
        );
    }
    if byte_scales {
        let mut i = tid;
        while i < 256 {
            stab[i] = scale_table[i];
            i += comptime!(plane * PLANES as usize);
        }
    }
    sync_cube();
    while c < c_end {
        #[unroll]
        for u in 0..unroll {
            let cu = c + u * comptime!(plane * kp);
            if cu < c_end {
                #[unroll]
                for wi in 0..WORDS {
                    // Decode word wi of each row: 8 values, times the block scale later.
                    let mut wv = Array::<f32>::new(comptime!(ROWS * 8));
                    let mut sv = Array::<f32>::new(ROWS);
                    #[unroll]
                    for r in 0..ROWS {
                        let word = w_reg[u * ROWS + r][wi];
                        #[unroll]
                        for i in 0..8usize {
                            wv[r * 8 + i] = lut[((word >> (4 * i) as u32) & 0xfu32) as usize];
                        }
                        if byte_scales {
                            // Second scale byte for the second half of a 16-element-block chunk.
                            let shift = ((wi * 8 / block) * 8) as u32;
                            sv[r] = stab[((s_reg[u * ROWS + r] >> shift) & 0xffu32) as usize];
                        } else {
                            sv[r] = s_val[u * ROWS + r];
                        }
                    }
                    #[unroll]
                    for m in 0..m_rows {
                        let xv = x[m * x_row + cu * WORDS + wi];
                        let mut xf = Array::<f32>::new(8usize);
                        #[unroll]
                        for i in 0..8usize {
                            xf[i] = f32::cast_from(xv[i]);
                        }
                        #[unroll]
                        for r in 0..ROWS {
                            let mut dot = wv[r * 8] * xf[0];
                            #[unroll]
                            for i in 1..8usize {
                                dot += wv[r * 8 + i] * xf[i];
                            }
                            acc[r * m_rows + m] += dot * sv[r];
                        }
                    }
                }
            }
        }
        if c + step < c_end {
            load_step::<W>(
                codes,
                scale_bytes,
                scale_table,
                &mut w_reg,
                &mut s_reg,
                &mut s_val,
                c + step,
                c_end,
                n0,
                n_cols,
                chunks,
                row_elems,
                block,
                byte_scales,
                plane,
                unroll,
                kp,
            );
        }
        c += step;
    }

    let rank = rank as usize;
    let out0 = CUBE_POS_Y as usize * m_rows * n_cols;
    let outs = comptime!(ROWS * m_rows);
    #[unroll]
    for r in 0..ROWS {
        #[unroll]
        for m in 0..m_rows {
            let total = plane_sum(acc[r * m_rows + m]);
            if lane == (r * m_rows + m) % plane {
                if kp > 1 {
                    red[py * outs + r * m_rows + m] = total;
                } else {
                    gemv_store::<F>(
                        total,
                        m,
                        n0 + r,
                        out0,
                        bias,
                        lora_t,
                        lora_b,
                        y,
                        part_out,
                        m_rows,
                        n_cols,
                        rank,
                        lora_scale,
                        has_bias,
                        has_lora,
                        split,
                    );
                }
            }
        }
    }
    if kp > 1 {
        // The first plane of each group adds the group's parts, in plane order.
        sync_cube();
        if part == 0 {
            let mut i = lane;
            while i < outs {
                let mut total = red[py * outs + i];
                #[unroll]
                for j in 1..kp {
                    total += red[(py + j) * outs + i];
                }
                gemv_store::<F>(
                    total,
                    i % m_rows,
                    n0 + i / m_rows,
                    out0,
                    bias,
                    lora_t,
                    lora_b,
                    y,
                    part_out,
                    m_rows,
                    n_cols,
                    rank,
                    lora_scale,
                    has_bias,
                    has_lora,
                    split,
                );
                i += plane;
            }
        }
    }
}

/// Issues the loads of one step of [`gemv_body`]: `unroll` chunks of each of the `ROWS` rows
/// from chunk `c` (every `plane * kp`-th), and their scales.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_step<W: Size>(
    codes: &Array<Vector<u32, W>>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    w_reg: &mut Array<Vector<u32, W>>,
    s_reg: &mut Array<u32>,
    s_val: &mut Array<f32>,
    c: usize,
    c_end: usize,
    n0: usize,
    n_cols: usize,
    chunks: usize,
    row_elems: usize,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
    #[comptime] plane: usize,
    #[comptime] unroll: usize,
    #[comptime] kp: usize,
) {
    #[unroll]
    for u in 0..unroll {
        let cl = min(c + u * comptime!(plane * kp), c_end - 1);
        #[unroll]
        for r in 0..ROWS {
            // Rows past N read the last row (in bounds) and are never stored.
            let n = min(n0 + r, n_cols - 1);
            w_reg[u * ROWS + r] = codes[n * chunks + cl];
            let b = (n * row_elems + cl * 32) / block;
            if byte_scales {
                s_reg[u * ROWS + r] = scale_bytes[b / 4] >> (((b % 4) * 8) as u32);
            } else {
                s_val[u * ROWS + r] = scale_table[b];
            }
        }
    }
}

/// Stores one output of [`gemv_body`]: its f32 partial sum when split (slice 0's with the
/// epilogue terms), else the output with its epilogue. Rows past `n_cols` are not stored.
#[cube]
#[allow(clippy::too_many_arguments)]
fn gemv_store<F: Float>(
    total: f32,
    m: usize,
    n: usize,
    out0: usize,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<F>,
    y: &mut Array<F>,
    part_out: &mut Array<f32>,
    #[comptime] m_rows: usize,
    n_cols: usize,
    rank: usize,
    lora_scale: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] split: bool,
) {
    if split {
        if n < n_cols {
            // Slice 0 carries the epilogue, so the slices' sum is the output.
            let mut v = total;
            if CUBE_POS_Y == 0 {
                v = with_epilogue::<F>(
                    total, m, n, bias, lora_t, lora_b, rank, lora_scale, has_bias, has_lora,
                );
            }
            part_out[out0 + m * n_cols + n] = v;
        }
    } else {
        store_output::<F>(
            total, m, n, bias, lora_t, lora_b, y, m_rows, n_cols, rank, lora_scale, has_bias,
            has_lora,
        );
    }
}

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
    part: &mut Array<f32>,
    n_cols: u32,
    k_dim: u32,
    split_chunks: u32,
    rank: u32,
    lora_scale: f32,
    #[comptime] m_rows: usize,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] split: bool,
    #[comptime] plane: usize,
    #[comptime] unroll: usize,
    #[comptime] kp: usize,
) {
    let mut lut = SharedMemory::<f32>::new(16usize);
    let mut stab = SharedMemory::<f32>::new(256usize);
    let mut red = SharedMemory::<f32>::new(comptime!(PLANES as usize * ROWS * m_rows));
    let tid = UNIT_POS_Y as usize * plane + UNIT_POS_X as usize;
    if tid < 16 {
        lut[tid] = code_table[tid];
    }
    gemv_body::<F, V, W>(
        x,
        codes,
        scale_bytes,
        scale_table,
        bias,
        lora_t,
        lora_b,
        y,
        part,
        &lut,
        &mut stab,
        &mut red,
        CUBE_POS_X as usize,
        n_cols,
        k_dim,
        split_chunks,
        rank,
        lora_scale,
        m_rows,
        block,
        byte_scales,
        has_bias,
        has_lora,
        split,
        plane,
        unroll,
        kp,
    );
}

/// Up to three products of one input (q/k/v, gate/up) in one launch: the grid's cubes are the
/// first weight's, then the second's, then the third's (a cube's segment is uniform, so the
/// barriers and plane sums inside stay uniform). Unsplit only; same format and `K` for all.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gemv_segments_kernel<F: Float, V: Size, W: Size>(
    x: &Array<Vector<F, V>>,
    code_table: &Array<f32>,
    codes0: &Array<Vector<u32, W>>,
    scale_bytes0: &Array<u32>,
    scale_table0: &Array<f32>,
    bias0: &Array<F>,
    lora_t0: &Array<f32>,
    lora_b0: &Array<F>,
    y0: &mut Array<F>,
    codes1: &Array<Vector<u32, W>>,
    scale_bytes1: &Array<u32>,
    scale_table1: &Array<f32>,
    bias1: &Array<F>,
    lora_t1: &Array<f32>,
    lora_b1: &Array<F>,
    y1: &mut Array<F>,
    codes2: &Array<Vector<u32, W>>,
    scale_bytes2: &Array<u32>,
    scale_table2: &Array<f32>,
    bias2: &Array<F>,
    lora_t2: &Array<f32>,
    lora_b2: &Array<F>,
    y2: &mut Array<F>,
    part: &mut Array<f32>,
    n0: u32,
    n1: u32,
    n2: u32,
    cubes0: u32,
    cubes1: u32,
    k_dim: u32,
    rank: u32,
    scale0: f32,
    scale1: f32,
    scale2: f32,
    #[comptime] m_rows: usize,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] segments: usize,
    #[comptime] plane: usize,
    #[comptime] unroll: usize,
    #[comptime] kp: usize,
) {
    let mut lut = SharedMemory::<f32>::new(16usize);
    let mut stab = SharedMemory::<f32>::new(256usize);
    let mut red = SharedMemory::<f32>::new(comptime!(PLANES as usize * ROWS * m_rows));
    let tid = UNIT_POS_Y as usize * plane + UNIT_POS_X as usize;
    if tid < 16 {
        lut[tid] = code_table[tid];
    }
    let cx = CUBE_POS_X as usize;
    let c0 = cubes0 as usize;
    let c1 = c0 + cubes1 as usize;
    if cx < c0 {
        gemv_body::<F, V, W>(
            x,
            codes0,
            scale_bytes0,
            scale_table0,
            bias0,
            lora_t0,
            lora_b0,
            y0,
            part,
            &lut,
            &mut stab,
            &mut red,
            cx,
            n0,
            k_dim,
            1u32 << 30,
            rank,
            scale0,
            m_rows,
            block,
            byte_scales,
            has_bias,
            has_lora,
            false,
            plane,
            unroll,
            kp,
        );
    } else if segments > 1 && cx < c1 {
        gemv_body::<F, V, W>(
            x,
            codes1,
            scale_bytes1,
            scale_table1,
            bias1,
            lora_t1,
            lora_b1,
            y1,
            part,
            &lut,
            &mut stab,
            &mut red,
            cx - c0,
            n1,
            k_dim,
            1u32 << 30,
            rank,
            scale1,
            m_rows,
            block,
            byte_scales,
            has_bias,
            has_lora,
            false,
            plane,
            unroll,
            kp,
        );
    } else if segments > 2 {
        gemv_body::<F, V, W>(
            x,
            codes2,
            scale_bytes2,
            scale_table2,
            bias2,
            lora_t2,
            lora_b2,
            y2,
            part,
            &lut,
            &mut stab,
            &mut red,
            cx - c1,
            n2,
            k_dim,
            1u32 << 30,
            rank,
            scale2,
            m_rows,
            block,
            byte_scales,
            has_bias,
            has_lora,
            false,
            plane,
            unroll,
            kp,
        );
    }
}

/// Whether [`launch`] can run this product on this client.
pub(crate) fn applies<R: Runtime>(
    client: &ComputeClient<R>,
    m: usize,
    k: usize,
    tensor_cores: bool,
) -> bool {
    let max = if tensor_cores { decode_max_m() } else { MAX_M };
    m <= max
        && k.is_multiple_of(8 * WORDS)
        && client
            .properties()
            .features
            .plane
            .contains(cubecl::features::Plane::Ops)
        && client.properties().hardware.plane_size_min == 32
        && client.properties().hardware.plane_size_max == 32
}

/// Launches the decode product; the caller has checked buffers and [`applies`]. Split along
/// K, it ends in [`splitk::reduce`], unless `keep_parts`: then it returns the partial sums and
/// their slice count, `y` unwritten (see [`crate::gemm::matmul_or_parts`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    weight: &DeviceWeight,
    bias: Option<Handle>,
    lora: Option<(Handle, Handle, usize, f32)>,
    y: &Handle,
    keep_parts: bool,
) -> Option<(Handle, usize)> {
    #[cfg(feature = "cuda")]
    if crate::gemv_mma::applies::<R, F>(client, m, weight, lora.as_ref().map(|l| l.2)) {
        return crate::gemv_mma::launch::<R, F>(client, x, m, weight, bias, lora, y, keep_parts);
    }
    let (n, k) = (weight.n, weight.k);
    // 32 wherever `applies` holds; tests may run other widths.
    let plane = client.properties().hardware.plane_size_max as usize;
    let planes = n.div_ceil(ROWS);
    let target = planes_per_sm() * splitk::multiprocessors(client);
    let kp = k_planes(planes, target);
    let cubes = n.div_ceil(ROWS * PLANES as usize / kp);
    let (splits, per) = splitk::plan(
        planes * kp,
        k / (8 * WORDS),
        target,
        min_split_chunks() * kp,
    );
    let split = splits > 1;
    let unused = weight.code_table.clone();
    // Unsplit, `part` is never written: bound to the code table.
    let part = if split {
        splitk::workspace(client, splits, m, n)
    } else {
        unused.clone()
    };
    // Split, slice 0 adds the epilogue terms to its partial sums.
    let has_bias = bias.is_some();
    let has_lora = lora.is_some();
    let bias_h = bias.unwrap_or_else(|| unused.clone());
    let (t, b, rank, scale) = lora.unwrap_or_else(|| (unused.clone(), unused.clone(), 0, 0.0));
    // SAFETY: buffer sizes were checked by the caller and the workspace holds splits*m*n f32;
    // the kernel clamps weight rows to n and chunks to the reduction, bounds stores by n and the
    // comptime m, and K is a multiple of 32 (checked by `applies`).
    unsafe {
        gemv_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(cubes as u32, splits as u32, 1),
            CubeDim::new_2d(plane as u32, PLANES),
            8,
            WORDS,
            ArrayArg::from_raw_parts(x.clone(), m * k / 8),
            ArrayArg::from_raw_parts(weight.codes.clone(), weight.words() / WORDS),
            ArrayArg::from_raw_parts(weight.scale_bytes.clone(), weight.scale_words()),
            ArrayArg::from_raw_parts(weight.scale_table.clone(), weight.scale_table_len()),
            ArrayArg::from_raw_parts(weight.code_table.clone(), 16),
            ArrayArg::from_raw_parts(bias_h, n),
            ArrayArg::from_raw_parts(t, m * rank.max(1)),
            ArrayArg::from_raw_parts(b, n * rank.max(1)),
            ArrayArg::from_raw_parts(y.clone(), m * n),
            ArrayArg::from_raw_parts(part.clone(), if split { splits * m * n } else { 16 }),
            n as u32,
            k as u32,
            per as u32,
            rank as u32,
            scale,
            m,
            weight.block(),
            weight.byte_scales(),
            has_bias,
            has_lora,
            split,
            plane,
            unroll(),
            kp,
        );
    }
    if !split {
        return None;
    }
    splitk::reduce_unless_kept::<R, F>(client, part, splits, m, n, y, keep_parts)
}

/// One product of [`launch_segments`]: a weight, its optional bias and LoRA epilogue
/// (`T [M, r]` f32, `B [N, r]`, scale) and its output `[M, N]`.
pub(crate) struct Segment<'a> {
    pub weight: &'a DeviceWeight,
    pub bias: Option<&'a Handle>,
    pub lora: Option<(&'a Handle, &'a Handle, usize, f32)>,
    pub y: &'a Handle,
}

/// Whether [`launch_segments`] takes these products: two or three of one format and `K`, the
/// same epilogue terms (and LoRA rank) on each, and none that the split planner would split.
#[cfg_attr(not(feature = "cuda"), allow(clippy::extra_unused_type_parameters))]
pub(crate) fn segments_apply<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    segs: &[Segment<'_>],
    tensor_cores: bool,
) -> bool {
    #[cfg(feature = "cuda")]
    if crate::gemv_mma::segments_apply::<R, F>(client, m, segs) {
        return true;
    }
    let Some(first) = segs.first() else {
        return false;
    };
    let (k, format) = (first.weight.k, first.weight.format);
    let rank = first.lora.map(|l| l.2);
    let target = planes_per_sm() * splitk::multiprocessors(client);
    let kp = segments_k_planes(segs, target);
    (2..=3).contains(&segs.len())
        && applies(client, m, k, tensor_cores)
        && segs.iter().all(|s| {
            s.weight.k == k
                && s.weight.format == format
                && s.bias.is_some() == first.bias.is_some()
                && s.lora.map(|l| l.2) == rank
                && splitk::plan(
                    s.weight.n.div_ceil(ROWS) * kp,
                    k / (8 * WORDS),
                    target,
                    min_split_chunks() * kp,
                )
                .0 == 1
        })
}

/// Planes sharing a row group in one launch of these segments (chosen from their rows together).
fn segments_k_planes(segs: &[Segment<'_>], target: usize) -> usize {
    k_planes(segs.iter().map(|s| s.weight.n.div_ceil(ROWS)).sum(), target)
}

/// Launches two or three decode products of one input `x [m, K]` as one grid; the caller has
/// checked buffers and [`segments_apply`].
pub(crate) fn launch_segments<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    segs: &[Segment<'_>],
) {
    #[cfg(feature = "cuda")]
    if crate::gemv_mma::segments_apply::<R, F>(client, m, segs) {
        crate::gemv_mma::launch_segments(client, x, m, segs);
        return;
    }
    let plane = client.properties().hardware.plane_size_max as usize;
    let k = segs[0].weight.k;
    let seg = |i: usize| &segs[i.min(segs.len() - 1)];
    let target = planes_per_sm() * splitk::multiprocessors(client);
    let kp = segments_k_planes(segs, target);
    let cubes = |i: usize| seg(i).weight.n.div_ceil(ROWS * PLANES as usize / kp);
    let total: usize = (0..segs.len()).map(cubes).sum();
    let unused = segs[0].weight.code_table.clone();
    let has_bias = segs[0].bias.is_some();
    let has_lora = segs[0].lora.is_some();
    let rank = segs[0].lora.map_or(0, |l| l.2);
    let w = seg(0).weight;
    let bias = |i: usize| seg(i).bias.cloned().unwrap_or_else(|| unused.clone());
    let t = |i: usize| seg(i).lora.map_or_else(|| unused.clone(), |l| l.0.clone());
    let b = |i: usize| seg(i).lora.map_or_else(|| unused.clone(), |l| l.1.clone());
    let scale = |i: usize| seg(i).lora.map_or(0.0, |l| l.3);
    let n = |i: usize| seg(i).weight.n;
    // SAFETY (of each `from_raw_parts`): the lengths are the buffers' own (checked by the
    // caller) and the kernel reads or writes them only in bounds.
    let args = |i: usize| unsafe {
        let s = seg(i);
        (
            ArrayArg::from_raw_parts(s.weight.codes.clone(), s.weight.words() / WORDS),
            ArrayArg::from_raw_parts(s.weight.scale_bytes.clone(), s.weight.scale_words()),
            ArrayArg::from_raw_parts(s.weight.scale_table.clone(), s.weight.scale_table_len()),
            ArrayArg::from_raw_parts(bias(i), n(i)),
            ArrayArg::from_raw_parts(t(i), m * rank.max(1)),
            ArrayArg::from_raw_parts(b(i), n(i) * rank.max(1)),
            ArrayArg::from_raw_parts(s.y.clone(), m * n(i)),
        )
    };
    let (a0, a1, a2) = (args(0), args(1), args(2));
    // SAFETY: as for `launch`, per segment (buffer sizes checked by the caller); segments past
    // `segs.len()` repeat the last one and get no cubes; `part` is never written (unsplit).
    unsafe {
        gemv_segments_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(total as u32, 1, 1),
            CubeDim::new_2d(plane as u32, PLANES),
            8,
            WORDS,
            ArrayArg::from_raw_parts(x.clone(), m * k / 8),
            ArrayArg::from_raw_parts(w.code_table.clone(), 16),
            a0.0,
            a0.1,
            a0.2,
            a0.3,
            a0.4,
            a0.5,
            a0.6,
            a1.0,
            a1.1,
            a1.2,
            a1.3,
            a1.4,
            a1.5,
            a1.6,
            a2.0,
            a2.1,
            a2.2,
            a2.3,
            a2.4,
            a2.5,
            a2.6,
            ArrayArg::from_raw_parts(unused.clone(), 16),
            n(0) as u32,
            n(1) as u32,
            n(2) as u32,
            cubes(0) as u32,
            if segs.len() > 1 { cubes(1) as u32 } else { 0 },
            k as u32,
            rank as u32,
            scale(0),
            scale(1),
            scale(2),
            m,
            w.block(),
            w.byte_scales(),
            has_bias,
            has_lora,
            segs.len(),
            plane,
            unroll(),
            kp,
        );
    }
}
