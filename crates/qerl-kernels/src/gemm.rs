//! W4A16 matrix products against a frozen 4-bit weight `W[N, K]`.
//!
//! * [`matmul`]: `Y[M,N] = X[M,K] · deq(W)ᵀ (+ bias[N]) (+ s · T[M,r] · B[N,r]ᵀ)` with
//!   `T = X·Aᵀ` from [`lora_down`]: the LoRA term is added in the epilogue, so `Y` is written once.
//! * [`matmul_transposed`]: `dX[M,K] = dY[M,N] · deq(W)`, the backward product for dX.
//!
//! M <= 8 (16 where there are no tensor cores) goes to the decode kernel ([`crate::gemv`])
//! where the runtime has warp operations, except that 2-256 rows of an E2M1 weight go to the
//! decode-batch `mma` kernel ([`crate::gemm_mma`]) on CUDA; larger M, by [`Strategy`] (default
//! [`Strategy::Auto`]), to dequantize + cuBLAS from [`cublas_min_m`] rows where it runs, else to
//! the tensor-core kernel ([`crate::gemm_tc`], with split-K when the output tiles do not fill
//! the device) where it has `cmma`. The portable kernels below serve the rest.
//! Both tile the output over a 16x16 cube, each unit owning a 2x2 patch, with the activation tile
//! loaded as 4-wide vectors and the weight tile decoded from u32 words (8 codes each) into shared
//! memory. Correct and simple; the fast sm_90 kernels are a separate piece of work.

use crate::device::{
    check_buffer, decode_word_to, grid_1d, linear_cube, shape_err, DeviceWeight, KernelError,
};
use crate::gemm_tc::{TcEpilogue, TcProduct};
use crate::tune::Product;
use cubecl::prelude::*;
use cubecl::server::Handle;

pub use crate::gemm_mma::{
    launches as mma_launches, options as mma_options, segment_launches as mma_segment_launches,
    segments_enabled as mma_segments, set_options as set_mma_options,
    set_segments as set_mma_segments, warpgroup_launches as mma_warpgroup_launches, MmaDecode,
    MmaKernel, MmaOptions, DEFAULT_MAX_M as MMA_DEFAULT_MAX_M,
    DEFAULT_PREFETCH as MMA_DEFAULT_PREFETCH, DEFAULT_WARPS_PER_SM as MMA_DEFAULT_WARPS_PER_SM,
    DEFAULT_X_AHEAD as MMA_DEFAULT_X_AHEAD, MAX_M_LIMIT as MMA_MAX_M_LIMIT,
    WARPGROUP_MIN_M as MMA_WARPGROUP_MIN_M,
};
pub use crate::gemv::{
    set_decode_max_m, set_k_planes as set_decode_k_planes, DEFAULT_DECODE_MAX_M,
};
pub use crate::splitk::force_splits;
pub use crate::workspace_arena::WorkspaceArena;

/// Products the decode kernel on tensor cores (`gemv_mma`, CUDA bf16 at up to 8 rows) has run
/// in this process (tests check that it ran); always 0 without the `cuda` feature.
pub fn gemv_mma_launches() -> usize {
    #[cfg(feature = "cuda")]
    {
        crate::gemv_mma::launches()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Sets the fewest chunks a warp of the decode kernel on tensor cores must walk at one token for
/// it to take the shared ring of chunks in flight (default 6; 0: wherever it fits), returning
/// the previous value: tests reach the ring on small shapes with it. No effect without the
/// `cuda` feature.
pub fn set_gemv_mma_ring_min_chunks(chunks: usize) -> usize {
    #[cfg(feature = "cuda")]
    {
        crate::gemv_mma::set_ring_min_chunks(chunks)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = chunks;
        0
    }
}
pub use crate::tune::{
    cublas_min_m, cublas_usable, set_strategy, strategy, Strategy, TileConfig,
    DEFAULT_CUBLAS_MIN_M, STRATEGY_ENV,
};

/// Output rows (M) per cube.
const TILE_M: usize = 32;
/// Output columns per cube.
const TILE_N: usize = 32;
/// Reduction depth per shared-memory stage (one NVFP4 block).
const TILE_K: usize = 16;
/// Above this many rows, products go to the tensor-core kernel where the runtime has one
/// ([`crate::gemm_tc`]); `matmul` sends up to [`DEFAULT_DECODE_MAX_M`] rows to the decode
/// kernel first.
pub const TC_MIN_M: usize = 8;

static TENSOR_CORES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns the tensor-core path off (or back on) for every later launch in this process, so that
/// benchmarks can time the portable tiled kernel on the same device. On by default.
pub fn use_tensor_cores(on: bool) {
    TENSOR_CORES.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn tensor_cores<R: Runtime, F: Float>(client: &ComputeClient<R>, m: usize, k: usize) -> bool {
    m > TC_MIN_M
        && TENSOR_CORES.load(std::sync::atomic::Ordering::Relaxed)
        && crate::gemm_tc::applies::<R, F>(client, k)
}
/// Activation vector width: `K` is a multiple of 16, so of 4.
const VEC: usize = 4;

/// `acc += sum over kk of a[row][kk] * b[col][kk]`, from two row-major tiles of stride `stride`.
#[cube]
fn dot_tile(
    a: &SharedMemory<f32>,
    b: &SharedMemory<f32>,
    a_row: usize,
    b_row: usize,
    #[comptime] depth: usize,
    #[comptime] stride: usize,
) -> f32 {
    let mut acc = 0.0f32;
    #[unroll]
    for kk in 0..depth {
        acc += a[a_row * stride + kk] * b[b_row * stride + kk];
    }
    acc
}

/// `acc` plus the bias and LoRA terms of output `(m, n)` (each where present), in f32.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn with_epilogue<F: Float>(
    acc: f32,
    m: usize,
    n: usize,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<F>,
    rank: usize,
    lora_scale: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
) -> f32 {
    let mut v = acc;
    if has_bias {
        v += f32::cast_from(bias[n]);
    }
    if has_lora {
        let mut l = 0.0f32;
        for j in 0..rank {
            l += lora_t[m * rank + j] * f32::cast_from(lora_b[n * rank + j]);
        }
        v += lora_scale * l;
    }
    v
}

/// Bias and LoRA epilogue for one output element, then the store.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_output<F: Float>(
    acc: f32,
    m: usize,
    n: usize,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<F>,
    y: &mut Array<F>,
    m_rows: usize,
    n_cols: usize,
    rank: usize,
    lora_scale: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
) {
    if m < m_rows && n < n_cols {
        let v = with_epilogue::<F>(
            acc, m, n, bias, lora_t, lora_b, rank, lora_scale, has_bias, has_lora,
        );
        y[m * n_cols + n] = F::cast_from(v);
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn matmul_kernel<F: Float, V: Size>(
    x: &Array<Vector<F, V>>,
    codes: &Array<u32>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    code_table: &Array<f32>,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<F>,
    y: &mut Array<F>,
    m_rows: u32,
    n_cols: u32,
    k_dim: u32,
    rank: u32,
    lora_scale: f32,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
) {
    let stride = TILE_K + 1;
    let mut xs = SharedMemory::<f32>::new(TILE_M * (TILE_K + 1));
    let mut ws = SharedMemory::<f32>::new(TILE_N * (TILE_K + 1));
    let m_rows = m_rows as usize;
    let n_cols = n_cols as usize;
    let k_dim = k_dim as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let tid = ty * 16 + tx;
    let m0 = CUBE_POS_Y as usize * TILE_M;
    let n0 = CUBE_POS_X as usize * TILE_N;
    let vecs_per_row = k_dim / VEC;
    let vecs_per_tile = TILE_K / VEC;
    let words_per_row = k_dim / 8;

    // The unit's 2x2 patch: rows ty, ty + 16; columns tx, tx + 16.
    let mut acc = Array::<f32>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        acc[i] = 0.0f32;
    }

    for kt in 0..k_dim / TILE_K {
        if tid < TILE_M * vecs_per_tile {
            // Activations: one 4-wide vector per unit.
            let r = tid / vecs_per_tile;
            let v = tid % vecs_per_tile;
            let m = m0 + r;
            let mut vec = Vector::<F, V>::new(F::new(0.0));
            if m < m_rows {
                vec = x[m * vecs_per_row + kt * vecs_per_tile + v];
            }
            #[unroll]
            for i in 0..VEC {
                xs[r * stride + v * VEC + i] = f32::cast_from(vec[i]);
            }
        } else if tid < TILE_M * vecs_per_tile + TILE_N * (TILE_K / 8) {
            // Weights: one u32 word (8 codes) per unit.
            let j = tid - TILE_M * vecs_per_tile;
            let r = j / (TILE_K / 8);
            let half = j % (TILE_K / 8);
            let n = n0 + r;
            if n < n_cols {
                let w = n * words_per_row + kt * (TILE_K / 8) + half;
                decode_word_to(
                    codes,
                    scale_bytes,
                    scale_table,
                    code_table,
                    w,
                    &mut ws,
                    r * stride + half * 8,
                    block,
                    byte_scales,
                );
            } else {
                #[unroll]
                for i in 0..8usize {
                    ws[r * stride + half * 8 + i] = 0.0f32;
                }
            }
        }
        sync_cube();
        #[unroll]
        for i in 0..2usize {
            #[unroll]
            for j in 0..2usize {
                acc[2 * i + j] += dot_tile(&xs, &ws, ty + 16 * i, tx + 16 * j, TILE_K, TILE_K + 1);
            }
        }
        sync_cube();
    }

    let rank = rank as usize;
    #[unroll]
    for i in 0..2usize {
        #[unroll]
        for j in 0..2usize {
            store_output::<F>(
                acc[2 * i + j],
                m0 + ty + 16 * i,
                n0 + tx + 16 * j,
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

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn matmul_transposed_kernel<F: Float>(
    dy: &Array<F>,
    codes: &Array<u32>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    code_table: &Array<f32>,
    dx: &mut Array<F>,
    m_rows: u32,
    n_cols: u32,
    k_dim: u32,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
) {
    // Output tile: 32 rows of dX by 32 columns (K); reduction over N in steps of 16.
    let mut gs = SharedMemory::<f32>::new(TILE_M * (16 + 1));
    let mut ws = SharedMemory::<f32>::new(16 * (TILE_N + 1));
    let m_rows = m_rows as usize;
    let n_cols = n_cols as usize;
    let k_dim = k_dim as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let tid = ty * 16 + tx;
    let m0 = CUBE_POS_Y as usize * TILE_M;
    let k0 = CUBE_POS_X as usize * TILE_N;
    let words_per_row = k_dim / 8;
    let g_stride = 16 + 1;
    let w_stride = TILE_N + 1;

    let mut acc = Array::<f32>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        acc[i] = 0.0f32;
    }

    for nt in 0..n_cols.div_ceil(16) {
        let n0 = nt * 16;
        // dY tile [32 x 16]: two scalars per unit.
        #[unroll]
        for q in 0..2usize {
            let idx = tid + q * 256;
            let r = idx / 16;
            let c = idx % 16;
            let m = m0 + r;
            let n = n0 + c;
            let mut v = 0.0f32;
            if m < m_rows && n < n_cols {
                v = f32::cast_from(dy[m * n_cols + n]);
            }
            gs[r * g_stride + c] = v;
        }
        // W tile [16 x 32]: 4 words per row, one word per unit.
        if tid < 64 {
            let r = tid / 4;
            let q = tid % 4;
            let n = n0 + r;
            let k = k0 + q * 8;
            if n < n_cols && k < k_dim {
                decode_word_to(
                    codes,
                    scale_bytes,
                    scale_table,
                    code_table,
                    n * words_per_row + k / 8,
                    &mut ws,
                    r * w_stride + q * 8,
                    block,
                    byte_scales,
                );
            } else {
                #[unroll]
                for i in 0..8usize {
                    ws[r * w_stride + q * 8 + i] = 0.0f32;
                }
            }
        }
        sync_cube();
        #[unroll]
        for nn in 0..16usize {
            #[unroll]
            for i in 0..2usize {
                #[unroll]
                for j in 0..2usize {
                    acc[2 * i + j] +=
                        gs[(ty + 16 * i) * g_stride + nn] * ws[nn * w_stride + tx + 16 * j];
                }
            }
        }
        sync_cube();
    }

    #[unroll]
    for i in 0..2usize {
        #[unroll]
        for j in 0..2usize {
            let m = m0 + ty + 16 * i;
            let k = k0 + tx + 16 * j;
            if m < m_rows && k < k_dim {
                dx[m * k_dim + k] = F::cast_from(acc[2 * i + j]);
            }
        }
    }
}

#[cube(launch_unchecked)]
fn lora_down_kernel<F: Float>(
    x: &Array<F>,
    a: &Array<F>,
    t: &mut Array<f32>,
    m_rows: u32,
    k_dim: u32,
    rank: u32,
) {
    let idx = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let rank = rank as usize;
    let k_dim = k_dim as usize;
    if idx < m_rows as usize * rank {
        let m = idx / rank;
        let j = idx % rank;
        let mut acc = 0.0f32;
        for k in 0..k_dim {
            acc += f32::cast_from(x[m * k_dim + k]) * f32::cast_from(a[j * k_dim + k]);
        }
        t[idx] = acc;
    }
}

/// The LoRA adapter of a linear: `A[r, K]`, `B[N, r]` (PEFT's `lora_A`, `lora_B`), scale `s`
/// (`alpha / r`), and `T[M, r] = X·Aᵀ` in f32 from [`lora_down`].
#[derive(Clone, Debug)]
pub struct LoraEpilogue<'a> {
    pub t: &'a Handle,
    pub b: &'a Handle,
    pub rank: usize,
    pub scale: f32,
}

fn bytes_of<F>(len: usize) -> usize {
    len * std::mem::size_of::<F>()
}

/// `T[M, r] = X[M, K] · A[r, K]ᵀ` in f32: the small first half of the LoRA branch.
pub fn lora_down<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    a: &Handle,
    t: &Handle,
    m: usize,
    k: usize,
    rank: usize,
) -> Result<(), KernelError> {
    check_buffer("lora_down", "x", x, bytes_of::<F>(m * k))?;
    check_buffer("lora_down", "A", a, bytes_of::<F>(rank * k))?;
    check_buffer("lora_down", "T", t, bytes_of::<f32>(m * rank))?;
    if tensor_cores::<R, F>(client, m, k) {
        let product = TcProduct::Dense { d: a, n: rank, k };
        let none = TcEpilogue {
            bias: None,
            lora: None,
        };
        crate::gemm_tc::launch::<R, F, f32>(client, x, m, product, none, t, None);
        return Ok(());
    }
    let units = m * rank;
    // SAFETY: the kernel reads x[m*k], a[rank*k] and writes t[m*rank], all checked above.
    unsafe {
        lora_down_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(units.div_ceil(256)),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(x.clone(), m * k),
            ArrayArg::from_raw_parts(a.clone(), rank * k),
            ArrayArg::from_raw_parts(t.clone(), m * rank),
            m as u32,
            k as u32,
            rank as u32,
        );
    }
    Ok(())
}

/// Whether the decode-batch mma kernel takes `m` rows of `weight`: only under the default
/// strategy and the tensor-core one (the others choose their own products).
fn mma_applies<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    weight: &DeviceWeight,
    lora_rank: Option<usize>,
) -> bool {
    matches!(strategy(), Ok(Strategy::Auto | Strategy::TensorCores))
        && crate::gemm_mma::applies::<R, F>(client, m, weight, lora_rank)
}

/// A split-K product's f32 partial sums `[splits, M, N]`, not yet added: slice 0 holds the
/// bias and LoRA terms, so `Y = F(Σ_s parts[s])` summed in slice order (from 0.0), which is
/// what the product's own reduction would have stored.
#[derive(Debug)]
pub struct SplitParts {
    pub parts: Handle,
    pub splits: usize,
}

/// The sizes of a product's buffers: `x [m, K]`, `y [m, N]`, bias `[N]`, LoRA `T [m, r]` (f32)
/// and `B [N, r]`.
fn check_product_buffers<F: Float>(
    x: &Handle,
    m: usize,
    weight: &DeviceWeight,
    bias: Option<&Handle>,
    lora: Option<&LoraEpilogue<'_>>,
    y: &Handle,
) -> Result<(), KernelError> {
    let (n, k) = (weight.n, weight.k);
    check_buffer("matmul", "x", x, bytes_of::<F>(m * k))?;
    check_buffer("matmul", "y", y, bytes_of::<F>(m * n))?;
    if let Some(b) = bias {
        check_buffer("matmul", "bias", b, bytes_of::<F>(n))?;
    }
    if let Some(l) = lora {
        check_buffer("matmul", "LoRA T", l.t, bytes_of::<f32>(m * l.rank))?;
        check_buffer("matmul", "LoRA B", l.b, bytes_of::<F>(n * l.rank))?;
    }
    Ok(())
}

/// Where [`matmul`] sends `m > 0` rows of `weight`: `(decode, mma)`, whether the decode kernel
/// takes them, and whether the decode-batch mma kernel could. Up to `max_m` (256) rows of an
/// E2M1 weight on CUDA go to the mma kernel from `min_m` rows; fewer to the decode kernel.
fn decode_route<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    weight: &DeviceWeight,
    lora_rank: Option<usize>,
) -> (bool, bool) {
    let k = weight.k;
    let mma = mma_applies::<R, F>(client, m, weight, lora_rank);
    let decode = crate::gemv::applies(client, m, k, tensor_cores::<R, F>(client, m, k));
    (
        decode && !(mma && m >= crate::gemm_mma::options().min_m),
        mma,
    )
}

/// [`matmul`], except where it would end in a split-K reduction launch of its own (the decode
/// kernel at a few rows, whose K-slices fill the device): then the partial sums come back
/// unreduced, for a consumer that reads them anyway to add them itself (the engine's norm after
/// the down product), and `y` is not written. `Ok(None)`: `y` holds the product.
pub fn matmul_or_parts<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    weight: &DeviceWeight,
    bias: Option<&Handle>,
    lora: Option<LoraEpilogue<'_>>,
    y: &Handle,
) -> Result<Option<SplitParts>, KernelError> {
    let lora_rank = lora.as_ref().map(|l| l.rank);
    if m == 0 || !decode_route::<R, F>(client, m, weight, lora_rank).0 {
        return matmul::<R, F>(client, x, m, weight, bias, lora, y).map(|()| None);
    }
    check_product_buffers::<F>(x, m, weight, bias, lora.as_ref(), y)?;
    let l = lora.map(|l| (l.t.clone(), l.b.clone(), l.rank, l.scale));
    let parts = crate::gemv::launch::<R, F>(client, x, m, weight, bias.cloned(), l, y, true);
    Ok(parts.map(|(parts, splits)| SplitParts { parts, splits }))
}

/// `Y[M, N] = X[M, K] · deq(W)ᵀ (+ bias) (+ LoRA)`. `x` holds `M*K` elements of `F`, `y` `M*N`.
pub fn matmul<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    weight: &DeviceWeight,
    bias: Option<&Handle>,
    lora: Option<LoraEpilogue<'_>>,
    y: &Handle,
) -> Result<(), KernelError> {
    let (n, k) = (weight.n, weight.k);
    if m == 0 {
        return Err(shape_err("matmul", "M = 0".into()));
    }
    check_product_buffers::<F>(x, m, weight, bias, lora.as_ref(), y)?;
    // Unused optional inputs are bound to a buffer that is never read.
    let bias_h = bias.unwrap_or(&weight.code_table).clone();
    let (t_h, b_h, rank, scale) = match &lora {
        Some(l) => (l.t.clone(), l.b.clone(), l.rank, l.scale),
        None => (weight.code_table.clone(), weight.code_table.clone(), 0, 0.0),
    };
    let lora_rank = lora.as_ref().map(|l| l.rank);
    let (decode, mma) = decode_route::<R, F>(client, m, weight, lora_rank);
    if decode {
        let l = lora
            .as_ref()
            .map(|l| (l.t.clone(), l.b.clone(), l.rank, l.scale));
        crate::gemv::launch::<R, F>(client, x, m, weight, bias.cloned(), l, y, false);
        return Ok(());
    }
    if mma {
        let l = lora.map(|l| (l.t.clone(), l.b.clone(), l.rank, l.scale));
        crate::gemm_mma::launch::<R, F>(client, x, m, weight, bias.cloned(), l, y);
        return Ok(());
    }
    if tensor_cores::<R, F>(client, m, k) {
        return crate::tune::run::<R, F>(Product {
            client: client.clone(),
            x: x.clone(),
            m,
            weight: weight.clone(),
            bias: bias.cloned(),
            lora: lora.map(|l| (l.t.clone(), l.b.clone(), l.rank, l.scale)),
            y: y.clone(),
            transposed: false,
        });
    }
    let count = CubeCount::Static(n.div_ceil(TILE_N) as u32, m.div_ceil(TILE_M) as u32, 1);
    // SAFETY: buffer sizes are checked above; the kernel bounds every row/column by m and n and
    // K is a multiple of the block size (a DeviceWeight invariant).
    unsafe {
        matmul_kernel::launch_unchecked::<F, R>(
            client,
            count,
            CubeDim::new_2d(16, 16),
            VEC,
            ArrayArg::from_raw_parts(x.clone(), m * k / VEC),
            ArrayArg::from_raw_parts(weight.codes.clone(), weight.words()),
            ArrayArg::from_raw_parts(weight.scale_bytes.clone(), weight.scale_words()),
            ArrayArg::from_raw_parts(weight.scale_table.clone(), weight.scale_table_len()),
            ArrayArg::from_raw_parts(weight.code_table.clone(), 16),
            ArrayArg::from_raw_parts(bias_h, n),
            ArrayArg::from_raw_parts(t_h, m * rank.max(1)),
            ArrayArg::from_raw_parts(b_h, n * rank.max(1)),
            ArrayArg::from_raw_parts(y.clone(), m * n),
            m as u32,
            n as u32,
            k as u32,
            rank as u32,
            scale,
            weight.block(),
            weight.byte_scales(),
            bias.is_some(),
            lora.is_some(),
        );
    }
    Ok(())
}

/// One product of [`matmul_segments`]: `y = x · deq(W)ᵀ (+ bias) (+ LoRA)`.
pub struct SegmentProduct<'a> {
    pub weight: &'a DeviceWeight,
    pub bias: Option<&'a Handle>,
    pub lora: Option<LoraEpilogue<'a>>,
    pub y: &'a Handle,
}

/// Two or three [`matmul`]s of one input `x [M, K]` (q/k/v, gate/up) as one launch:
/// * where the decode-batch mma kernel takes the rows (CUDA, `min_m..=max_m` rows of an E2M1
///   weight), as one staged launch over the products' concatenated columns with one split-K
///   reduction ([`crate::gemm_mma`], `segments.rs`) when it is the staged kernel (bf16) and the
///   products share `K`, format, epilogue terms and LoRA rank and each `N` is a multiple of
///   the cube's column width ([`mma_segments`], `QERL_MMA_SEGMENTS=0` turns this off);
/// * otherwise as one decode launch when the decode kernel takes them all (few rows, same
///   format, `K` and epilogue terms, none split).
///
/// Returns `Ok(false)` without launching anything where neither applies, for the caller to run
/// them one by one. One launch instead of three fills the device where each alone would not.
pub fn matmul_segments<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    products: &[SegmentProduct<'_>],
) -> Result<bool, KernelError> {
    matmul_segments_or_parts::<R, F>(client, x, m, products, false)
        .map(|o| !matches!(o, SegmentsOutcome::NotTaken))
}

/// What [`matmul_segments_or_parts`] did.
pub enum SegmentsOutcome {
    /// The layout is not one the segment launches take: nothing ran (the caller's fallback).
    NotTaken,
    /// Every `y` is written.
    Written,
    /// The split product's unreduced K-slices `[splits, M, ΣN]` (segment `i`'s columns start at
    /// `Σ_{j<i} N_j`; the LoRA terms are in slice 0; the biases are NOT added), no `y` written:
    /// for a consumer that adds the slices and biases itself (the engine's SiLU·mul of gate/up,
    /// its RoPE of q/k/v), one reduction launch fewer.
    Parts(SplitParts),
}

/// [`matmul_segments`], saying what it did; with `keep_parts`, where it would end in a split-K
/// reduction (the decode-batch `mma` kernels) it returns the partial sums instead, without the
/// biases ([`SegmentsOutcome::Parts`]). Through the `mma` kernels it also takes a single
/// product (the engine's o and down products, whose K-slices the next norm adds).
pub fn matmul_segments_or_parts<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    products: &[SegmentProduct<'_>],
    keep_parts: bool,
) -> Result<SegmentsOutcome, KernelError> {
    segments_or_parts::<R, F>(client, x, m, products, keep_parts, None)
}

/// LoRA down-projections not computed yet: each product's adapter `A [r, K]` (in `F`), and
/// two u32 counters, zero before the first use, which the launch leaves at zero.
pub struct LoraFold<'a> {
    pub a: &'a [&'a Handle],
    pub counters: &'a Handle,
}

/// [`matmul_segments_or_parts`] of products with LoRA adapters whose `T = X·Aᵀ` are not
/// computed yet (each `lora.t` is where its `T` goes): where the products' launch can compute them
/// itself (the warpgroup kernel: CUDA sm_90, ranks a multiple of 8 and at most 48 adapter
/// rows in all; `QERL_LORA_FOLD=0` turns it off), they are computed by extra cubes of that
/// launch, beside the product's, which need them only in their epilogue: one launch fewer.
/// Elsewhere returns [`SegmentsOutcome::NotTaken`] without launching anything, for the caller
/// to compute them first.
pub fn matmul_folding_lora_down<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    products: &[SegmentProduct<'_>],
    fold: &LoraFold<'_>,
    keep_parts: bool,
) -> Result<SegmentsOutcome, KernelError> {
    if products.is_empty() || fold.a.len() != products.len() {
        return Ok(SegmentsOutcome::NotTaken);
    }
    for (p, a) in products.iter().zip(fold.a) {
        let Some(lora) = &p.lora else {
            return Ok(SegmentsOutcome::NotTaken);
        };
        let bytes = bytes_of::<F>(lora.rank * p.weight.k);
        check_buffer("matmul_folding_lora_down", "LoRA A", a, bytes)?;
    }
    check_buffer("matmul_folding_lora_down", "counters", fold.counters, 8)?;
    segments_or_parts::<R, F>(client, x, m, products, keep_parts, Some(fold))
}

/// [`matmul_segments_or_parts`]; with `fold`, only where the launch computes the products' `T`.
fn segments_or_parts<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    products: &[SegmentProduct<'_>],
    keep_parts: bool,
    fold: Option<&LoraFold<'_>>,
) -> Result<SegmentsOutcome, KernelError> {
    let Some(first) = products.first() else {
        return Ok(SegmentsOutcome::NotTaken);
    };
    if m == 0 {
        return Err(shape_err("matmul_segments", "M = 0".into()));
    }
    let k = first.weight.k;
    let segs = gemv_segments(products);
    let rank = first.lora.as_ref().map(|l| l.rank);
    // Rows the mma kernel takes (see `matmul`): one staged launch, else one by one.
    if let Some(plan) = mma_segments_plan::<R, F>(client, m, &segs) {
        let Some(plan) = plan else {
            return Ok(SegmentsOutcome::NotTaken);
        };
        if fold.is_some() && !plan.folds(client, rank.unwrap_or(0), products.len()) {
            return Ok(SegmentsOutcome::NotTaken);
        }
        check_segments::<F>(x, m, k, products)?;
        let parts =
            crate::gemm_mma::launch_segments::<R, F>(client, x, m, &segs, &plan, keep_parts, fold);
        return Ok(match parts {
            Some((parts, splits)) => SegmentsOutcome::Parts(SplitParts { parts, splits }),
            None => SegmentsOutcome::Written,
        });
    }
    // The decode kernel's segments: two or three (one product alone is `matmul`'s).
    let tc = tensor_cores::<R, F>(client, m, k);
    if fold.is_some()
        || products.len() < 2
        || !crate::gemv::segments_apply::<R, F>(client, m, &segs, tc)
    {
        return Ok(SegmentsOutcome::NotTaken);
    }
    check_segments::<F>(x, m, k, products)?;
    crate::gemv::launch_segments::<R, F>(client, x, m, &segs);
    Ok(SegmentsOutcome::Written)
}

/// `products` as the segment launches take them.
fn gemv_segments<'a>(products: &'a [SegmentProduct<'_>]) -> Vec<crate::gemv::Segment<'a>> {
    products
        .iter()
        .map(|p| crate::gemv::Segment {
            weight: p.weight,
            bias: p.bias,
            lora: p.lora.as_ref().map(|l| (l.t, l.b, l.rank, l.scale)),
            y: p.y,
        })
        .collect()
}

/// Where the mma kernels take `m > 0` rows of `segs` (see [`matmul`]): `Some` of their one
/// staged launch's plan, or `Some(None)` where they take the rows but not this layout; `None`
/// where they do not take the rows.
fn mma_segments_plan<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    segs: &[crate::gemv::Segment<'_>],
) -> Option<Option<crate::gemm_mma::SegmentPlan>> {
    let first = segs.first()?;
    let rank = first.lora.map(|l| l.2);
    if m < crate::gemm_mma::options().min_m || !mma_applies::<R, F>(client, m, first.weight, rank) {
        return None;
    }
    Some(
        segs.iter()
            .all(|s| mma_applies::<R, F>(client, m, s.weight, rank))
            .then(|| crate::gemm_mma::plan_segments::<R, F>(client, m, segs))
            .flatten(),
    )
}

/// Whether [`matmul_folding_lora_down`] takes `products` at `m` rows (nothing is launched):
/// for a caller that would otherwise compute their `T` in a kernel before (the engine's norm).
pub fn folds_lora_down<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    products: &[SegmentProduct<'_>],
) -> bool {
    let Some(rank) = products
        .first()
        .and_then(|p| p.lora.as_ref())
        .map(|l| l.rank)
    else {
        return false;
    };
    m > 0
        && products.iter().all(|p| p.lora.is_some())
        && mma_segments_plan::<R, F>(client, m, &gemv_segments(products))
            .flatten()
            .is_some_and(|plan| plan.folds(client, rank, products.len()))
}

/// The buffers of [`matmul_segments`]: `x [M, K]`, each `y [M, N]`, bias `[N]`, LoRA `T [M, r]`
/// (f32) and `B [N, r]`.
fn check_segments<F: Float>(
    x: &Handle,
    m: usize,
    k: usize,
    products: &[SegmentProduct<'_>],
) -> Result<(), KernelError> {
    check_buffer("matmul_segments", "x", x, bytes_of::<F>(m * k))?;
    for p in products {
        let n = p.weight.n;
        check_buffer("matmul_segments", "y", p.y, bytes_of::<F>(m * n))?;
        if let Some(b) = p.bias {
            check_buffer("matmul_segments", "bias", b, bytes_of::<F>(n))?;
        }
        if let Some(l) = &p.lora {
            check_buffer(
                "matmul_segments",
                "LoRA T",
                l.t,
                bytes_of::<f32>(m * l.rank),
            )?;
            check_buffer("matmul_segments", "LoRA B", l.b, bytes_of::<F>(n * l.rank))?;
        }
    }
    Ok(())
}

/// `dX[M, K] = dY[M, N] · deq(W)[N, K]`: the input gradient of [`matmul`], with no dense `W`.
pub fn matmul_transposed<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    dy: &Handle,
    m: usize,
    weight: &DeviceWeight,
    dx: &Handle,
) -> Result<(), KernelError> {
    let (n, k) = (weight.n, weight.k);
    if m == 0 {
        return Err(shape_err("matmul_transposed", "M = 0".into()));
    }
    check_buffer("matmul_transposed", "dY", dy, bytes_of::<F>(m * n))?;
    check_buffer("matmul_transposed", "dX", dx, bytes_of::<F>(m * k))?;
    if n.is_multiple_of(32) && tensor_cores::<R, F>(client, m, k) {
        return crate::tune::run::<R, F>(Product {
            client: client.clone(),
            x: dy.clone(),
            m,
            weight: weight.clone(),
            bias: None,
            lora: None,
            y: dx.clone(),
            transposed: true,
        });
    }
    let count = CubeCount::Static(k.div_ceil(TILE_N) as u32, m.div_ceil(TILE_M) as u32, 1);
    // SAFETY: sizes checked above; the kernel bounds rows by m, columns by k, reduction by n.
    unsafe {
        matmul_transposed_kernel::launch_unchecked::<F, R>(
            client,
            count,
            CubeDim::new_2d(16, 16),
            ArrayArg::from_raw_parts(dy.clone(), m * n),
            ArrayArg::from_raw_parts(weight.codes.clone(), weight.words()),
            ArrayArg::from_raw_parts(weight.scale_bytes.clone(), weight.scale_words()),
            ArrayArg::from_raw_parts(weight.scale_table.clone(), weight.scale_table_len()),
            ArrayArg::from_raw_parts(weight.code_table.clone(), 16),
            ArrayArg::from_raw_parts(dx.clone(), m * k),
            m as u32,
            n as u32,
            k as u32,
            weight.block(),
            weight.byte_scales(),
        );
    }
    Ok(())
}

/// 0 off, 1 on, anything else: not set yet (read `QERL_DENSE_CUBLAS`).
static DENSE_CUBLAS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(u8::MAX);

/// Whether [`dense_matmul`] sends products to cuBLAS from [`cublas_min_m`] rows: the last
/// [`set_dense_cublas`], else on unless `QERL_DENSE_CUBLAS=0`. On by default since an H100
/// run (2026-11-27, docs/benchmarks/rollout.md, session 12): a BF16 7B prefill of 256 x 256
/// tokens took 2.93 s there against 7.36 s on the tiled kernel, and batch-256 decode 45.8
/// against 61.1 ms a step.
pub fn dense_cublas() -> bool {
    use std::sync::atomic::Ordering;
    match DENSE_CUBLAS.load(Ordering::Relaxed) {
        0 => false,
        1 => true,
        _ => {
            let on = std::env::var("QERL_DENSE_CUBLAS").as_deref() != Ok("0");
            DENSE_CUBLAS.store(u8::from(on), Ordering::Relaxed);
            on
        }
    }
}

/// Turns the cuBLAS path of [`dense_matmul`] on or off for every later product in this process
/// (tests, benchmarks), overriding `QERL_DENSE_CUBLAS`.
pub fn set_dense_cublas(on: bool) {
    DENSE_CUBLAS.store(u8::from(on), std::sync::atomic::Ordering::Relaxed);
}

/// A dense product at least this wide (a vocabulary-sized lm_head) takes cuBLAS from
/// [`WIDE_DENSE_MIN_M`] rows rather than [`cublas_min_m`]: one host round trip a step is worth
/// it on 1 GB of weight. H100, 2026-11-27 (7B NVFP4 decode at batch 64, 32 new tokens, one
/// machine): 12.28 ms a step against 12.47 with the tiled kernel's 0.69-ms lm_head.
pub const WIDE_DENSE_N: usize = 65536;
/// See [`WIDE_DENSE_N`].
pub const WIDE_DENSE_MIN_M: usize = 64;

/// `Y[M, n] = X[M, K] · D[n, K]ᵀ (+ bias[n]) (+ s · T·Bᵀ)` with a dense row-major `D` in `F`
/// and the output in `O`, on the tensor-core kernel (with split-K where the output is small):
/// the lm_head and the frozen weights of a BF16 model when many rows are decoded. From
/// [`cublas_min_m`] rows under the default strategy ([`WIDE_DENSE_MIN_M`] for a product
/// [`WIDE_DENSE_N`] wide; any rows under `QERL_GEMM=cublas`), cuBLAS where it runs, unless
/// `QERL_DENSE_CUBLAS=0` ([`dense_cublas`]).
/// Returns `Ok(false)`, launching nothing, where that kernel does not apply (no tensor cores
/// for `F`, or `K` not a multiple of its stage); the caller then uses a portable product.
#[allow(clippy::too_many_arguments)]
pub fn dense_matmul<R: Runtime, F: Float, O: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    d: &Handle,
    n: usize,
    k: usize,
    bias: Option<&Handle>,
    lora: Option<LoraEpilogue<'_>>,
    y: &Handle,
) -> Result<bool, KernelError> {
    if m == 0 {
        return Err(shape_err("dense_matmul", "M = 0".into()));
    }
    check_buffer("dense_matmul", "x", x, bytes_of::<F>(m * k))?;
    check_buffer("dense_matmul", "D", d, bytes_of::<F>(n * k))?;
    check_buffer("dense_matmul", "y", y, m * n * std::mem::size_of::<O>())?;
    if let Some(b) = bias {
        check_buffer("dense_matmul", "bias", b, bytes_of::<F>(n))?;
    }
    if let Some(l) = &lora {
        check_buffer("dense_matmul", "LoRA T", l.t, bytes_of::<f32>(m * l.rank))?;
        check_buffer("dense_matmul", "LoRA B", l.b, bytes_of::<F>(n * l.rank))?;
    }
    #[cfg(feature = "cuda")]
    if dense_cublas() && cublas_usable::<R, F>(client) {
        let take = match strategy()? {
            Strategy::Auto => m >= cublas_min_m() || (n >= WIDE_DENSE_N && m >= WIDE_DENSE_MIN_M),
            Strategy::Cublas => true,
            _ => false,
        };
        if take {
            let lora = lora.map(|l| (l.t, l.b, l.rank, l.scale));
            crate::cublas::dense_forward::<R, F, O>(client, x, m, d, n, k, bias, lora, y)?;
            return Ok(true);
        }
    }
    if !(TENSOR_CORES.load(std::sync::atomic::Ordering::Relaxed)
        && crate::gemm_tc::applies::<R, F>(client, k))
    {
        return Ok(false);
    }
    let product = TcProduct::Dense { d, n, k };
    let epilogue = TcEpilogue {
        bias: bias.cloned(),
        lora: lora.map(|l| (l.t.clone(), l.b.clone(), l.rank, l.scale)),
    };
    crate::gemm_tc::launch::<R, F, O>(client, x, m, product, epilogue, y, None);
    Ok(true)
}
