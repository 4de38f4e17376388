//! RoPE on the new queries and keys, fused with the write of keys and values into the KV
//! cache: one launch per layer for every row of the step.
//!
//! Rotate-half convention (Hugging Face): for `i < D/2`, with `c, s` the cosine and sine of
//! `pos · inv_freq[i]` (host tables `[max_positions, D/2]`, built once, the same f32 values the
//! burn model uses), `x'[i] = x[i]·c − x[i+D/2]·s` and `x'[i+D/2] = x[i+D/2]·c + x[i]·s`.
//! Cache layout per layer: `[slots, kv_heads, capacity, D]`.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::arrival::{allow_dependents, wait_for_primaries};
use super::{grid_rows, grid_rows_by, row_of_cube, ROW_CUBE};

/// Channels `i` and `i + half` of one head at position `p`, `(x1, x2)` in f32, rotated by the
/// position's angle and stored at `out[at]` and `out[at + half]`: the one rotation both kernels
/// use, so their results are the same bits.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_rotated<F: Float>(
    out: &mut Array<F>,
    at: usize,
    x1: f32,
    x2: f32,
    cos: &Array<f32>,
    sin: &Array<f32>,
    p: usize,
    i: usize,
    half: usize,
) {
    let c = cos[p * half + i];
    let s = sin[p * half + i];
    store_rotated_by::<F>(out, at, x1, x2, c, s, half);
}

/// [`store_rotated`] with the angle's cosine and sine already loaded.
#[cube]
fn store_rotated_by<F: Float>(
    out: &mut Array<F>,
    at: usize,
    x1: f32,
    x2: f32,
    c: f32,
    s: f32,
    half: usize,
) {
    out[at] = F::cast_from(x1 * c - x2 * s);
    out[at + half] = F::cast_from(x2 * c + x1 * s);
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kv_kernel<F: Float>(
    q: &mut Array<F>,
    k: &mut Array<F>,
    v: &mut Array<F>,
    slot: &mut Array<u32>,
    pos: &mut Array<u32>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    k_cache: &mut Array<F>,
    v_cache: &mut Array<F>,
    rows: u32,
    q_heads: u32,
    kv_heads: u32,
    capacity: u32,
    #[comptime] head_dim: usize,
    #[comptime] pdl: bool,
) {
    allow_dependents(pdl);
    // One pair of channels a unit: the row's query pairs, then its key/value pairs, spread
    // over the grid's z dimension (a row's loop of dependent loads in one cube took 6 µs at
    // batch 1 on an H100).
    let r = row_of_cube();
    let j = CUBE_POS_Z as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let half = head_dim / 2;
    // The row's position and the pair's angle before the wait: no kernel of a decode step
    // writes them before this one (the sampling at the step's end advances the position).
    let p = pos[min(r, rows as usize - 1)] as usize;
    let i = j % half;
    let c = cos[p * half + i];
    let s = sin[p * half + i];
    wait_for_primaries(pdl);
    if r < rows as usize {
        let q_heads = q_heads as usize;
        let kv_heads = kv_heads as usize;
        let capacity = capacity as usize;
        if j < q_heads * half {
            // Queries, rotated in place.
            let hd = j / half;
            let base = (r * q_heads + hd) * head_dim;
            let x1 = f32::cast_from(q[base + i]);
            let x2 = f32::cast_from(q[base + i + half]);
            store_rotated_by::<F>(q, base + i, x1, x2, c, s, half);
        } else if j < (q_heads + kv_heads) * half {
            // Keys, rotated into the cache; values copied.
            let jk = j - q_heads * half;
            // `jk % half` is `i`: the queries' pairs are whole heads.
            let hd = jk / half;
            let sl = slot[r] as usize;
            let src = (r * kv_heads + hd) * head_dim;
            let dst = ((sl * kv_heads + hd) * capacity + p) * head_dim;
            let x1 = f32::cast_from(k[src + i]);
            let x2 = f32::cast_from(k[src + i + half]);
            store_rotated_by::<F>(k_cache, dst + i, x1, x2, c, s, half);
            v_cache[dst + i] = v[src + i];
            v_cache[dst + i + half] = v[src + i + half];
        }
    }
}

/// Shapes of one [`rope_kv`] launch.
#[derive(Clone, Copy, Debug)]
pub struct RopeShape {
    pub rows: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Positions per slot in the cache.
    pub capacity: usize,
    pub slots: usize,
    /// Rows of the cos/sin tables.
    pub max_positions: usize,
}

/// Rotates `q [rows, q_heads·D]` in place and writes the rotated `k` and the `v`
/// (`[rows, kv_heads·D]`) of every row into the cache at `(slot[r], pos[r])`.
#[allow(clippy::too_many_arguments)]
pub fn rope_kv<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: RopeShape,
    q: &Handle,
    k: &Handle,
    v: &Handle,
    slot: &Handle,
    pos: &Handle,
    cos: &Handle,
    sin: &Handle,
    k_cache: &Handle,
    v_cache: &Handle,
) {
    let d = s.head_dim;
    let cache = s.slots * s.kv_heads * s.capacity * d;
    let pairs = (s.q_heads + s.kv_heads) * d / 2;
    let grid = grid_rows_by(s.rows, pairs.div_ceil(ROW_CUBE as usize));
    // SAFETY: buffers sized by the engine from these shapes; the engine keeps every position
    // below both `capacity` and `max_positions`, and every slot below `slots`.
    // Units past a row's pairs do nothing.
    unsafe {
        rope_kv_kernel::launch_unchecked::<F, R>(
            client,
            grid,
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(q.clone(), s.rows * s.q_heads * d),
            ArrayArg::from_raw_parts(k.clone(), s.rows * s.kv_heads * d),
            ArrayArg::from_raw_parts(v.clone(), s.rows * s.kv_heads * d),
            ArrayArg::from_raw_parts(slot.clone(), s.rows),
            ArrayArg::from_raw_parts(pos.clone(), s.rows),
            ArrayArg::from_raw_parts(cos.clone(), s.max_positions * d / 2),
            ArrayArg::from_raw_parts(sin.clone(), s.max_positions * d / 2),
            ArrayArg::from_raw_parts(k_cache.clone(), cache),
            ArrayArg::from_raw_parts(v_cache.clone(), cache),
            s.rows as u32,
            s.q_heads as u32,
            s.kv_heads as u32,
            s.capacity as u32,
            d,
            R::name(client) == "cuda",
        );
    }
}

/// Element `col` of row `r` of the split q/k/v product: its K-slices (`[splits, rows, total]`
/// f32, slice stride `slice`) summed in order from 0, plus its segment's bias when `has_bias`
/// (`bias[at]`), rounded to `F`: what the product's reduction would have stored.
#[cube]
#[allow(clippy::too_many_arguments)]
fn reduced<F: Float>(
    parts: &Array<f32>,
    bias: &Array<F>,
    r: usize,
    col: usize,
    at: usize,
    total: usize,
    slice: usize,
    #[comptime] splits: usize,
    #[comptime] has_bias: bool,
) -> F {
    // Unrolled (the count is comptime), so a unit's loads of all slices are in flight at once.
    let mut x = 0.0f32;
    #[unroll]
    for z in 0..splits {
        x += parts[z * slice + r * total + col];
    }
    if has_bias {
        x += f32::cast_from(bias[at]);
    }
    F::cast_from(x)
}

/// [`rope_kv_kernel`] on the q/k/v product's unreduced K-slices: each element first reduced as
/// the product's reduction would ([`reduced`]), then rotated and stored exactly as there; the
/// rotated queries go to `q` (`[rows, q_heads·D]`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kv_parts_kernel<F: Float>(
    parts: &Array<f32>,
    q_bias: &Array<F>,
    k_bias: &Array<F>,
    v_bias: &Array<F>,
    q: &mut Array<F>,
    slot: &Array<u32>,
    pos: &Array<u32>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    k_cache: &mut Array<F>,
    v_cache: &mut Array<F>,
    rows: u32,
    q_heads: u32,
    kv_heads: u32,
    capacity: u32,
    #[comptime] splits: usize,
    #[comptime] head_dim: usize,
    #[comptime] has_bias: bool,
) {
    let r = row_of_cube();
    let j = CUBE_POS_Z as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if r < rows as usize {
        let half = head_dim / 2;
        let q_heads = q_heads as usize;
        let kv_heads = kv_heads as usize;
        let capacity = capacity as usize;
        let q_dim = q_heads * head_dim;
        let kv_dim = kv_heads * head_dim;
        let total = q_dim + 2 * kv_dim;
        let slice = rows as usize * total;
        let p = pos[r] as usize;
        if j < q_heads * half {
            let hd = j / half;
            let i = j % half;
            let at = hd * head_dim + i;
            let x1 = f32::cast_from(reduced::<F>(
                parts, q_bias, r, at, at, total, slice, splits, has_bias,
            ));
            let x2 = f32::cast_from(reduced::<F>(
                parts,
                q_bias,
                r,
                at + half,
                at + half,
                total,
                slice,
                splits,
                has_bias,
            ));
            store_rotated::<F>(q, r * q_dim + at, x1, x2, cos, sin, p, i, half);
        } else if j < (q_heads + kv_heads) * half {
            let jk = j - q_heads * half;
            let hd = jk / half;
            let i = jk % half;
            let at = hd * head_dim + i;
            let sl = slot[r] as usize;
            let dst = ((sl * kv_heads + hd) * capacity + p) * head_dim + i;
            let (kc, vc) = (q_dim + at, q_dim + kv_dim + at);
            let x1 = f32::cast_from(reduced::<F>(
                parts, k_bias, r, kc, at, total, slice, splits, has_bias,
            ));
            let x2 = f32::cast_from(reduced::<F>(
                parts,
                k_bias,
                r,
                kc + half,
                at + half,
                total,
                slice,
                splits,
                has_bias,
            ));
            store_rotated::<F>(k_cache, dst, x1, x2, cos, sin, p, i, half);
            v_cache[dst] = reduced::<F>(parts, v_bias, r, vc, at, total, slice, splits, has_bias);
            v_cache[dst + half] = reduced::<F>(
                parts,
                v_bias,
                r,
                vc + half,
                at + half,
                total,
                slice,
                splits,
                has_bias,
            );
        }
    }
}

/// [`rope_kv`] from the split q/k/v product's K-slices `parts [splits, rows, (q_heads +
/// 2·kv_heads)·D]` (q, then k, then v columns; [`qerl_kernels::gemm::SegmentsOutcome::Parts`])
/// and their biases (added here, as the reduction would): the reduction and RoPE in one launch,
/// the rotated queries into `q`, keys and values into the cache.
#[allow(clippy::too_many_arguments)]
pub fn rope_kv_parts<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: RopeShape,
    (parts, splits): (&Handle, usize),
    biases: Option<[&Handle; 3]>,
    q: &Handle,
    slot: &Handle,
    pos: &Handle,
    cos: &Handle,
    sin: &Handle,
    k_cache: &Handle,
    v_cache: &Handle,
) {
    let d = s.head_dim;
    let (q_dim, kv_dim) = (s.q_heads * d, s.kv_heads * d);
    let cache = s.slots * s.kv_heads * s.capacity * d;
    let pairs = (s.q_heads + s.kv_heads) * d / 2;
    let grid = grid_rows_by(s.rows, pairs.div_ceil(ROW_CUBE as usize));
    let total = q_dim + 2 * kv_dim;
    assert!(
        parts.size_in_used() >= (splits * s.rows * total * 4) as u64,
        "rope_kv_parts: the K-slices hold fewer than [{splits}, {}, {total}] f32",
        s.rows
    );
    // Without biases the bias arguments are bound to `cos`, never read.
    let [qb, kb, vb] = biases.unwrap_or([cos, cos, cos]);
    let bias_len = |n: usize| if biases.is_some() { n } else { 1 };
    // SAFETY: as `rope_kv`'s; `parts` holds `splits·rows·total` f32 (asserted) and each bias
    // its segment's width (the engine's weights) when present.
    unsafe {
        rope_kv_parts_kernel::launch_unchecked::<F, R>(
            client,
            grid,
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(parts.clone(), splits * s.rows * total),
            ArrayArg::from_raw_parts(qb.clone(), bias_len(q_dim)),
            ArrayArg::from_raw_parts(kb.clone(), bias_len(kv_dim)),
            ArrayArg::from_raw_parts(vb.clone(), bias_len(kv_dim)),
            ArrayArg::from_raw_parts(q.clone(), s.rows * q_dim),
            ArrayArg::from_raw_parts(slot.clone(), s.rows),
            ArrayArg::from_raw_parts(pos.clone(), s.rows),
            ArrayArg::from_raw_parts(cos.clone(), s.max_positions * d / 2),
            ArrayArg::from_raw_parts(sin.clone(), s.max_positions * d / 2),
            ArrayArg::from_raw_parts(k_cache.clone(), cache),
            ArrayArg::from_raw_parts(v_cache.clone(), cache),
            s.rows as u32,
            s.q_heads as u32,
            s.kv_heads as u32,
            s.capacity as u32,
            splits,
            d,
            biases.is_some(),
        );
    }
}

/// `(cos, sin)`, each `[max_positions, D/2]` f32, for frequencies `inv_freq`: the angle
/// `pos · f` rounded to f32, its cosine and sine taken in f64 and rounded to f32 (as the burn
/// model's tables).
pub fn rope_tables(inv_freq: &[f32], max_positions: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0f32; max_positions * half];
    let mut sin = vec![0f32; max_positions * half];
    for p in 0..max_positions {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = (p as f32 * f) as f64;
            cos[p * half + i] = angle.cos() as f32;
            sin[p * half + i] = angle.sin() as f32;
        }
    }
    (cos, sin)
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn copy_prefix_kernel<F: Float>(
    k_cache: &mut Array<F>,
    v_cache: &mut Array<F>,
    src: &Array<u32>,
    dst: &Array<u32>,
    len: &Array<u32>,
    pairs: u32,
    kv_heads: u32,
    capacity: u32,
    #[comptime] head_dim: usize,
) {
    // One cube per (pair, head); units over the prefix's positions x channels.
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let kv_heads = kv_heads as usize;
    let p = cube / kv_heads;
    let hd = cube % kv_heads;
    if p < pairs as usize {
        let capacity = capacity as usize;
        let from = ((src[p] as usize * kv_heads + hd) * capacity) * head_dim;
        let to = ((dst[p] as usize * kv_heads + hd) * capacity) * head_dim;
        let n = len[p] as usize * head_dim;
        let mut i = UNIT_POS_X as usize;
        while i < n {
            k_cache[to + i] = k_cache[from + i];
            v_cache[to + i] = v_cache[from + i];
            i += CUBE_DIM_X as usize;
        }
    }
}

/// Copies the first `len[p]` cached positions of slot `src[p]` to slot `dst[p]` in one layer's
/// caches, for `pairs` pairs: a prompt prefilled once serves its other samples.
#[allow(clippy::too_many_arguments)]
pub fn copy_prefix<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    k_cache: &Handle,
    v_cache: &Handle,
    slots: usize,
    kv_heads: usize,
    capacity: usize,
    head_dim: usize,
    src: &Handle,
    dst: &Handle,
    len: &Handle,
    pairs: usize,
) {
    let cache = slots * kv_heads * capacity * head_dim;
    // SAFETY: slots below `slots` and lengths at most `capacity` (the engine's), source and
    // destination slots distinct.
    unsafe {
        copy_prefix_kernel::launch_unchecked::<F, R>(
            client,
            grid_rows(pairs * kv_heads),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(k_cache.clone(), cache),
            ArrayArg::from_raw_parts(v_cache.clone(), cache),
            ArrayArg::from_raw_parts(src.clone(), pairs),
            ArrayArg::from_raw_parts(dst.clone(), pairs),
            ArrayArg::from_raw_parts(len.clone(), pairs),
            pairs as u32,
            kv_heads as u32,
            capacity as u32,
            head_dim,
        );
    }
}
