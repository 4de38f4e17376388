//! The backward kernels, recomputing the attention weights from the saved log-sum-exps:
//! with `S = scale·Q·Kᵀ`, `P = exp(S − lse)` (0 where masked), `D = rowsum(dO ⊙ O)`,
//! `dP = dO·Vᵀ` and `dS = P ⊙ (dP − D)`:
//!
//! ```text
//! dQ = scale · dS · K        dK = scale · dSᵀ · Q        dV = Pᵀ · dO
//! ```
//!
//! Three launches, no atomics (lavapipe has no float atomics): [`row_dot_kernel`] for `D`,
//! [`dq_kernel`] (one cube per query tile, looping over key tiles, as the forward) and
//! [`dkdv_kernel`] (one cube per key tile of one kv head, looping over the query tiles of every
//! query head of its group, so that dK and dV sum the group without a second pass).

use cubecl::prelude::*;

use super::forward::load_tile;
use super::{visible, UNITS};

/// `dvec[row] = Σ_d dO[row, d] · O[row, d]` in f32 for `rows` rows of `head_dim`.
#[cube(launch_unchecked)]
pub(crate) fn row_dot_kernel<F: Float>(
    d_out: &Array<F>,
    out: &Array<F>,
    dvec: &mut Array<f32>,
    rows: u32,
    #[comptime] head_dim: usize,
) {
    let row = crate::device::linear_cube() * UNITS as usize + UNIT_POS_X as usize;
    if row < rows as usize {
        let mut s = 0.0f32;
        for d in 0..head_dim {
            let e = row * head_dim + d;
            s += f32::cast_from(d_out[e]) * f32::cast_from(out[e]);
        }
        dvec[row] = s;
    }
}

/// `dq [batch, heads, seq, head_dim]`: one cube per (tile of `bq` queries, batch row × head);
/// unit `(r, c)` owns channels `c, c + tc, ..` of query `r`. V and then K go through one
/// shared buffer: `dP` first, then `S`, `P` and `dS` in place of `dP`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dq_kernel<F: Float>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    d_out: &Array<F>,
    lse: &Array<f32>,
    dvec: &Array<f32>,
    bounds: &Array<u32>,
    dq: &mut Array<F>,
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
    let mut dos = SharedMemory::<f32>::new(comptime!(bq * (head_dim + 1)));
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
    load_tile(d_out, &mut dos, q0, i0, seq, 1.0f32, head_dim, bq, t);
    let mut row_lse = 0.0f32;
    let mut row_d = 0.0f32;
    if i < seq {
        row_lse = lse[bh * seq + i];
        row_d = dvec[bh * seq + i];
    }
    let mut acc = Array::<f32>::new(per_d);
    #[unroll]
    for u in 0..per_d {
        acc[u] = 0.0f32;
    }
    let kend = min(end, i0 + bq);
    let mut j0 = start;
    while j0 < kend {
        load_tile(v, &mut kvs, kv0, j0, kend, 1.0f32, head_dim, bk, t);
        sync_cube();
        #[unroll]
        for u in 0..per_k {
            let cc = c + u * tc;
            if cc < bk {
                let mut s = 0.0f32;
                for d in 0..head_dim {
                    s += dos[r * dp + d] * kvs[cc * dp + d];
                }
                ss[r * sp + cc] = s;
            }
        }
        sync_cube();
        load_tile(k, &mut kvs, kv0, j0, kend, 1.0f32, head_dim, bk, t);
        sync_cube();
        #[unroll]
        for u in 0..per_k {
            let cc = c + u * tc;
            if cc < bk {
                let mut ds = 0.0f32;
                if visible(i, j0 + cc, seq, start, end) {
                    let mut s = 0.0f32;
                    for d in 0..head_dim {
                        s += qs[r * dp + d] * kvs[cc * dp + d];
                    }
                    let p = f32::exp(s - row_lse);
                    ds = p * (ss[r * sp + cc] - row_d);
                }
                ss[r * sp + cc] = ds;
            }
        }
        sync_cube();
        #[unroll]
        for u in 0..per_d {
            let d = c + u * tc;
            if d < head_dim {
                let mut a = acc[u];
                for cc in 0..bk {
                    a += ss[r * sp + cc] * kvs[cc * dp + d];
                }
                acc[u] = a;
            }
        }
        sync_cube();
        j0 += bk;
    }
    if i < seq {
        #[unroll]
        for u in 0..per_d {
            let d = c + u * tc;
            if d < head_dim {
                dq[q0 + i * head_dim + d] = F::cast_from(acc[u] * scale);
            }
        }
    }
}

/// `dk`, `dv [batch, kv_heads, seq, head_dim]`: one cube per (tile of `bk` keys, batch row × kv
/// head). Scores: unit `(r, c)` takes entries `(r, c), (r, c + tq), ..` of each `bq × bk`
/// block (`tq = UNITS / bq`); sums: unit `(row, c)` owns channels `c, c + tk, ..` of key `row`
/// (`tk = UNITS / bk`) in dK and dV. Keys at or past their row's end get zeros.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dkdv_kernel<F: Float>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    d_out: &Array<F>,
    lse: &Array<f32>,
    dvec: &Array<f32>,
    bounds: &Array<u32>,
    dk: &mut Array<F>,
    dv: &mut Array<F>,
    seq: u32,
    heads: u32,
    kv_heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] bq: usize,
    #[comptime] bk: usize,
) {
    let tq = comptime!(UNITS as usize / bq);
    let tk = comptime!(UNITS as usize / bk);
    let per_s = comptime!(bk.div_ceil(UNITS as usize / bq));
    let per_d = comptime!(head_dim.div_ceil(UNITS as usize / bk));
    let dp = comptime!(head_dim + 1);
    let sp = comptime!(bk + 1);
    let mut ks = SharedMemory::<f32>::new(comptime!(bk * (head_dim + 1)));
    let mut vs = SharedMemory::<f32>::new(comptime!(bk * (head_dim + 1)));
    let mut qs = SharedMemory::<f32>::new(comptime!(bq * (head_dim + 1)));
    let mut dos = SharedMemory::<f32>::new(comptime!(bq * (head_dim + 1)));
    let mut ps = SharedMemory::<f32>::new(comptime!(bq * (bk + 1)));
    let mut dss = SharedMemory::<f32>::new(comptime!(bq * (bk + 1)));
    let mut lse_s = SharedMemory::<f32>::new(bq);
    let mut d_s = SharedMemory::<f32>::new(bq);

    let t = UNIT_POS_X as usize;
    let seq = seq as usize;
    let heads = heads as usize;
    let kv_heads = kv_heads as usize;
    let group = heads / kv_heads;
    let bkv = CUBE_POS_Y as usize;
    let b = bkv / kv_heads;
    let kvh = bkv % kv_heads;
    let start = bounds[2 * b] as usize;
    let end = bounds[2 * b + 1] as usize;
    let j0 = CUBE_POS_X as usize * bk;
    let kv0 = bkv * seq * head_dim;
    // Score-phase coordinates, then sum-phase ones.
    let sr = t / tq;
    let sc = t % tq;
    let kr = t / tk;
    let kc = t % tk;

    load_tile(k, &mut ks, kv0, j0, end, 1.0f32, head_dim, bk, t);
    load_tile(v, &mut vs, kv0, j0, end, 1.0f32, head_dim, bk, t);
    let mut acc_k = Array::<f32>::new(per_d);
    let mut acc_v = Array::<f32>::new(per_d);
    #[unroll]
    for u in 0..per_d {
        acc_k[u] = 0.0f32;
        acc_v[u] = 0.0f32;
    }
    // Only queries at or after the tile's first key see it; a tile of padding keys sees none.
    let mut first = seq;
    if j0 < end {
        first = j0 - j0 % bq;
    }
    for g in 0..group {
        let bh = b * heads + kvh * group + g;
        let q0 = bh * seq * head_dim;
        let mut i0 = first;
        while i0 < seq {
            load_tile(q, &mut qs, q0, i0, seq, scale, head_dim, bq, t);
            load_tile(d_out, &mut dos, q0, i0, seq, 1.0f32, head_dim, bq, t);
            if t < bq {
                let mut row_lse = 0.0f32;
                let mut row_d = 0.0f32;
                if i0 + t < seq {
                    row_lse = lse[bh * seq + i0 + t];
                    row_d = dvec[bh * seq + i0 + t];
                }
                lse_s[t] = row_lse;
                d_s[t] = row_d;
            }
            sync_cube();
            #[unroll]
            for u in 0..per_s {
                let cc = sc + u * tq;
                if cc < bk {
                    let mut p = 0.0f32;
                    let mut ds = 0.0f32;
                    if visible(i0 + sr, j0 + cc, seq, start, end) {
                        let mut s = 0.0f32;
                        let mut dpv = 0.0f32;
                        for d in 0..head_dim {
                            s += qs[sr * dp + d] * ks[cc * dp + d];
                            dpv += dos[sr * dp + d] * vs[cc * dp + d];
                        }
                        p = f32::exp(s - lse_s[sr]);
                        ds = p * (dpv - d_s[sr]);
                    }
                    ps[sr * sp + cc] = p;
                    dss[sr * sp + cc] = ds;
                }
            }
            sync_cube();
            #[unroll]
            for u in 0..per_d {
                let d = kc + u * tk;
                if d < head_dim {
                    let mut ak = acc_k[u];
                    let mut av = acc_v[u];
                    for rr in 0..bq {
                        ak += dss[rr * sp + kr] * qs[rr * dp + d];
                        av += ps[rr * sp + kr] * dos[rr * dp + d];
                    }
                    acc_k[u] = ak;
                    acc_v[u] = av;
                }
            }
            sync_cube();
            i0 += bq;
        }
    }
    let j = j0 + kr;
    if j < seq {
        #[unroll]
        for u in 0..per_d {
            let d = kc + u * tk;
            if d < head_dim {
                dk[kv0 + j * head_dim + d] = F::cast_from(acc_k[u]);
                dv[kv0 + j * head_dim + d] = F::cast_from(acc_v[u]);
            }
        }
    }
}
