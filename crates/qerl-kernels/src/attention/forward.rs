//! The forward kernel: one cube per (tile of `bq` queries, batch row × query head), looping over
//! tiles of `bk` keys with an online softmax (running max `m` and sum `l` per query).
//!
//! Units are laid out as `bq` rows × `tc = UNITS / bq` columns. Unit `(r, c)` scores keys
//! `c, c + tc, ..` of the tile against query `r` and owns the output channels `c, c + tc, ..` of
//! that query, kept in a per-unit array. Every operand is widened to f32 in shared memory (rows
//! padded to `head_dim + 1` floats so that units reading different rows hit different banks);
//! K and V tiles share one buffer, V loaded once the scores are taken.

use cubecl::prelude::*;

use super::{visible, MASKED, UNITS};

/// `out [batch, heads, seq, head_dim]` and `lse [batch, heads, seq]` (f32, natural log; `MASKED`
/// for a query that sees no key) from `q [batch, heads, seq, head_dim]` and `k`, `v`
/// `[batch, kv_heads, seq, head_dim]`; `bounds [batch, 2]` holds each row's visible keys
/// `[start, end)`. Queries of head `h` read kv head `h / (heads / kv_heads)`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_kernel<F: Float>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    bounds: &Array<u32>,
    out: &mut Array<F>,
    lse: &mut Array<f32>,
    seq: u32,
    heads: u32,
    kv_heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] bq: usize,
    #[comptime] bk: usize,
) {
    let tc = comptime!(UNITS as usize / bq);
    let per_d = comptime!(head_dim.div_ceil(UNITS as usize / bq));
    let per_k = comptime!(bk.div_ceil(UNITS as usize / bq));
    let dp = comptime!(head_dim + 1);
    let sp = comptime!(bk + 1);
    let mut qs = SharedMemory::<f32>::new(comptime!(bq * (head_dim + 1)));
    let mut kvs = SharedMemory::<f32>::new(comptime!(bk * (head_dim + 1)));
    let mut ss = SharedMemory::<f32>::new(comptime!(bq * (bk + 1)));

    let t = UNIT_POS_X as usize;
    let r = t / tc;
    let c = t % tc;
    let seq = seq as usize;
    let heads = heads as usize;
    let bh = CUBE_POS_Y as usize;
    let b = bh / heads;
    let kvh = (bh % heads) / (heads / kv_heads as usize);
    let start = bounds[2 * b] as usize;
    let end = bounds[2 * b + 1] as usize;
    let i0 = CUBE_POS_X as usize * bq;
    let i = i0 + r;
    let q0 = bh * seq * head_dim;
    let kv0 = (b * kv_heads as usize + kvh) * seq * head_dim;

    load_tile(q, &mut qs, q0, i0, seq, scale, head_dim, bq, t);
    let mut acc = Array::<f32>::new(per_d);
    #[unroll]
    for u in 0..per_d {
        acc[u] = 0.0f32;
    }
    let mut m = f32::new(MASKED);
    let mut l = 0.0f32;
    // Causal: no query of this tile sees a key past its last query.
    let kend = min(end, i0 + bq);
    let mut j0 = start;
    while j0 < kend {
        load_tile(k, &mut kvs, kv0, j0, kend, 1.0f32, head_dim, bk, t);
        sync_cube();
        #[unroll]
        for u in 0..per_k {
            let cc = c + u * tc;
            if cc < bk {
                let mut s = 0.0f32;
                for d in 0..head_dim {
                    s += qs[r * dp + d] * kvs[cc * dp + d];
                }
                let mut val = f32::new(MASKED);
                if visible(i, j0 + cc, seq, start, end) {
                    val = s;
                }
                ss[r * sp + cc] = val;
            }
        }
        sync_cube();
        let mut tile_max = f32::new(MASKED);
        for cc in 0..bk {
            tile_max = max(tile_max, ss[r * sp + cc]);
        }
        let m_new = max(m, tile_max);
        // Every unit of the row has read the raw scores before any is replaced by its weight.
        sync_cube();
        #[unroll]
        for u in 0..per_k {
            let cc = c + u * tc;
            if cc < bk {
                let sv = ss[r * sp + cc];
                let mut p = 0.0f32;
                if sv > f32::new(MASKED) {
                    p = f32::exp(sv - m_new);
                }
                ss[r * sp + cc] = p;
            }
        }
        load_tile(v, &mut kvs, kv0, j0, kend, 1.0f32, head_dim, bk, t);
        sync_cube();
        let alpha = f32::exp(m - m_new);
        let mut psum = 0.0f32;
        for cc in 0..bk {
            psum += ss[r * sp + cc];
        }
        l = l * alpha + psum;
        m = m_new;
        #[unroll]
        for u in 0..per_d {
            let d = c + u * tc;
            if d < head_dim {
                let mut o = acc[u] * alpha;
                for cc in 0..bk {
                    o += ss[r * sp + cc] * kvs[cc * dp + d];
                }
                acc[u] = o;
            }
        }
        sync_cube();
        j0 += bk;
    }
    if i < seq {
        let mut inv = 0.0f32;
        let mut row_lse = f32::new(MASKED);
        if l > 0.0f32 {
            inv = 1.0f32 / l;
            row_lse = m + f32::ln(l);
        }
        #[unroll]
        for u in 0..per_d {
            let d = c + u * tc;
            if d < head_dim {
                out[q0 + i * head_dim + d] = F::cast_from(acc[u] * inv);
            }
        }
        if c == 0 {
            lse[bh * seq + i] = row_lse;
        }
    }
}

/// Rows `j0 .. j0 + rows` of one head (`base` = its first element) into `dst` as f32 times
/// `scale`, rows at or past `stop` as zeros; rows padded to `head_dim + 1`. Every unit of the
/// cube calls it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_tile<F: Float>(
    src: &Array<F>,
    dst: &mut SharedMemory<f32>,
    base: usize,
    j0: usize,
    stop: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] rows: usize,
    t: usize,
) {
    let dp = comptime!(head_dim + 1);
    let mut x = t;
    while x < rows * head_dim {
        let row = x / head_dim;
        let mut val = 0.0f32;
        if j0 + row < stop {
            val = f32::cast_from(src[base + j0 * head_dim + x]) * scale;
        }
        dst[row * dp + x % head_dim] = val;
        x += UNITS as usize;
    }
}
