//! LoRA down-projections fused into the kernel that makes their input, for decode batches:
//! add + RMSNorm with `T_s = xn · A_sᵀ` for the adapters that read the norm (q/k/v, gate/up),
//! and SiLU·mul with `T = act · Aᵀ` for the down product's adapter.
//!
//! Why: at batch 1 on an H100 each LoRA down-projection was a launch of its own at ~4 µs
//! (4 a layer, 0.46 ms of a 4.5-ms 7B step), reading one row that the launch before it had
//! just written. Here each cube makes the whole row itself (a few KiB to ~100 KiB, read from
//! L2 by every cube), the cubes of grid column 0 store it, and every cube dots it with `nc`
//! rows of the adapters for `mr` rows of the batch: a grid of (adapters · rank / nc) x
//! ceil(m / mr) cubes, no sums across cubes.
//!
//! Arithmetic: the row is the unfused kernels' bit for bit (the same loads, the same
//! shared-memory tree for the norm's sum of squares, the same roundings to `F`), so `xn` and
//! `act` equal [`super::norm::add_rms_norm`]'s and [`super::act::silu_mul`]'s. Each `T` is
//! summed per unit over its vectors (in order), then over the units by the same tree:
//! deterministic and batch-invariant (a row's sums do not depend on `m` or the tile).
//!
//! The residual: cubes other than column 0 read `h` and `d` while column 0 stores their sum,
//! so the sum goes to another buffer (`h_out`; the engine alternates two).
//! Shared memory and barriers only: the same code runs on wgpu (lavapipe) for the tests.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::lora_down::load_a;
use super::{vector_width, ROW_CUBE};

/// Units per cube (the trees below assume it).
const UNITS: usize = ROW_CUBE as usize;
/// Most rows [`norm_lora`] takes (decode batches; above, the norm and the LoRA kernel run
/// apart).
pub const NORM_MAX_ROWS: usize = 64;
/// Most rows [`silu_lora`] takes: each cube reads its rows' whole gate and up (~75 KiB a row
/// for Qwen2.5-7B), which pays only for a few rows.
pub const SILU_MAX_ROWS: usize = 8;

/// Tree sums of `outs` runs of [`UNITS`] values (`partial[o·UNITS ..]`) into their first
/// element, each in the order of [`super::norm::cube_sum`]; every unit calls it.
#[cube]
fn trees(partial: &mut SharedMemory<f32>, #[comptime] outs: usize) {
    let t = UNIT_POS_X as usize;
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if t < stride {
            #[unroll]
            for o in 0..outs {
                let at = o * UNITS + t;
                partial[at] += partial[at + stride];
            }
        }
        sync_cube();
        stride /= 2;
    }
}

/// Stores the tree sums of `mr x nc` outputs: row `row0 + o / nc`, column `j0 + o % nc` of
/// adapter `s`'s `T [rows, rank]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_t(
    partial: &SharedMemory<f32>,
    t0: &mut Array<f32>,
    t1: &mut Array<f32>,
    t2: &mut Array<f32>,
    s: usize,
    row0: usize,
    j0: usize,
    rows: usize,
    rank: usize,
    #[comptime] nc: usize,
    #[comptime] outs: usize,
) {
    let t = UNIT_POS_X as usize;
    if t < outs {
        let row = row0 + t / nc;
        if row < rows {
            let total = partial[t * UNITS];
            let at = row * rank + j0 + t % nc;
            if s == 0 {
                t0[at] = total;
            } else if s == 1 {
                t1[at] = total;
            } else {
                t2[at] = total;
            }
        }
    }
}

/// For rows `row0 .. row0 + mr` (cube y) and adapter columns `col0 .. col0 + nc` (cube x, in
/// the concatenation of the adapters): `x = h + d` (when `add`; stored to `h_out` by column
/// 0), `y = x / sqrt(mean(x²) + eps) ⊙ gain` (stored by column 0), `T_s[row, j] = y · A_s[j]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn norm_lora_kernel<F: Float, V: Size>(
    h: &Array<Vector<F, V>>,
    d: &Array<Vector<F, V>>,
    gain: &Array<f32>,
    a0: &Array<Vector<F, V>>,
    a1: &Array<Vector<F, V>>,
    a2: &Array<Vector<F, V>>,
    h_out: &mut Array<Vector<F, V>>,
    y: &mut Array<Vector<F, V>>,
    t0: &mut Array<f32>,
    t1: &mut Array<f32>,
    t2: &mut Array<f32>,
    rows: u32,
    dim: u32,
    rank: u32,
    eps: f32,
    #[comptime] add: bool,
    #[comptime] mr: usize,
    #[comptime] nc: usize,
    #[comptime] per_unit: usize,
) {
    let vs = h.vector_size();
    let mut partial = SharedMemory::<f32>::new(comptime!(mr * nc * UNITS));
    let t = UNIT_POS_X as usize;
    let rows = rows as usize;
    let rank = rank as usize;
    let vecs = dim as usize / vs;
    let col0 = CUBE_POS_X as usize * nc;
    let s = col0 / rank;
    let j0 = col0 % rank;
    let row0 = CUBE_POS_Y as usize * mr;
    let writer = CUBE_POS_X == 0;

    // Every load first: the adapters' vectors, then the rows' (clamped in bounds; vectors
    // past the row's end and rows past `rows` are computed on and never stored).
    let mut av = Array::<Vector<F, V>>::new(comptime!(nc * per_unit));
    #[unroll]
    for c in 0..nc {
        #[unroll]
        for u in 0..per_unit {
            let v = min(t + u * UNITS, vecs - 1);
            av[c * per_unit + u] = load_a::<F, V>(a0, a1, a2, s, (j0 + c) * vecs + v);
        }
    }
    let mut e = Array::<Vector<F, V>>::new(comptime!(mr * per_unit));
    #[unroll]
    for r in 0..mr {
        let row = min(row0 + r, rows - 1);
        #[unroll]
        for u in 0..per_unit {
            let v = min(t + u * UNITS, vecs - 1);
            let x = h[row * vecs + v];
            if add {
                let dv = d[row * vecs + v];
                let mut sum = Vector::<F, V>::empty();
                #[unroll]
                for k in 0..vs {
                    sum[k] = F::cast_from(f32::cast_from(x[k]) + f32::cast_from(dv[k]));
                }
                e[r * per_unit + u] = sum;
            } else {
                e[r * per_unit + u] = x;
            }
        }
    }
    // The norms: each row's sum of squares in the unfused kernel's order.
    #[unroll]
    for r in 0..mr {
        let mut sq = 0.0f32;
        #[unroll]
        for u in 0..per_unit {
            if t + u * UNITS < vecs {
                #[unroll]
                for k in 0..vs {
                    let f = f32::cast_from(e[r * per_unit + u][k]);
                    sq += f * f;
                }
            }
        }
        partial[r * UNITS + t] = sq;
    }
    sync_cube();
    trees(&mut partial, mr);
    let mut acc = Array::<f32>::new(comptime!(mr * nc));
    #[unroll]
    for o in 0..comptime!(mr * nc) {
        acc[o] = 0.0f32;
    }
    #[unroll]
    for r in 0..mr {
        let inv = 1.0f32 / f32::sqrt(partial[r * UNITS] / dim as f32 + eps);
        let row = row0 + r;
        #[unroll]
        for u in 0..per_unit {
            let v = t + u * UNITS;
            if v < vecs {
                let x = e[r * per_unit + u];
                let mut out = Vector::<F, V>::empty();
                #[unroll]
                for k in 0..vs {
                    out[k] = F::cast_from(f32::cast_from(x[k]) * inv * gain[v * vs + k]);
                }
                if writer && row < rows {
                    if add {
                        h_out[row * vecs + v] = x;
                    }
                    y[row * vecs + v] = out;
                }
                #[unroll]
                for k in 0..vs {
                    let xf = f32::cast_from(out[k]);
                    #[unroll]
                    for c in 0..nc {
                        acc[r * nc + c] =
                            fma(xf, f32::cast_from(av[c * per_unit + u][k]), acc[r * nc + c]);
                    }
                }
            }
        }
    }
    // Every unit has read its rows' norms: the shared sums may be overwritten.
    sync_cube();
    #[unroll]
    for o in 0..comptime!(mr * nc) {
        partial[o * UNITS + t] = acc[o];
    }
    sync_cube();
    trees(&mut partial, comptime!(mr * nc));
    store_t(
        &partial,
        t0,
        t1,
        t2,
        s,
        row0,
        j0,
        rows,
        rank,
        nc,
        comptime!(mr * nc),
    );
}

/// For row `CUBE_POS_Y` and columns `j0 .. j0 + nc` of the adapter (cube x):
/// `out = silu(gate) ⊙ up` (stored by column 0), `T[row, j] = out · A[j]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn silu_lora_kernel<F: Float, V: Size>(
    gate: &Array<Vector<F, V>>,
    up: &Array<Vector<F, V>>,
    a: &Array<Vector<F, V>>,
    out: &mut Array<Vector<F, V>>,
    t: &mut Array<f32>,
    rows: u32,
    width: u32,
    rank: u32,
    #[comptime] nc: usize,
    #[comptime] per_unit: usize,
) {
    let vs = gate.vector_size();
    let mut partial = SharedMemory::<f32>::new(comptime!(nc * UNITS));
    let unit = UNIT_POS_X as usize;
    let rank = rank as usize;
    let vecs = width as usize / vs;
    let j0 = CUBE_POS_X as usize * nc;
    let row = CUBE_POS_Y as usize;
    let writer = CUBE_POS_X == 0;
    let mut acc = Array::<f32>::new(nc);
    #[unroll]
    for c in 0..nc {
        acc[c] = 0.0f32;
    }
    #[unroll]
    for u in 0..per_unit {
        let v = unit + u * UNITS;
        if v < vecs {
            let g = gate[row * vecs + v];
            let p = up[row * vecs + v];
            let mut o = Vector::<F, V>::empty();
            #[unroll]
            for k in 0..vs {
                let x = f32::cast_from(g[k]);
                let silu = x / (1.0f32 + f32::exp(-x));
                o[k] = F::cast_from(silu * f32::cast_from(p[k]));
            }
            if writer {
                out[row * vecs + v] = o;
            }
            #[unroll]
            for c in 0..nc {
                let w = a[(j0 + c) * vecs + v];
                #[unroll]
                for k in 0..vs {
                    acc[c] = fma(f32::cast_from(o[k]), f32::cast_from(w[k]), acc[c]);
                }
            }
        }
    }
    #[unroll]
    for c in 0..nc {
        partial[c * UNITS + unit] = acc[c];
    }
    sync_cube();
    trees(&mut partial, nc);
    if unit < nc && row < rows as usize {
        t[row * rank + j0 + unit] = partial[unit * UNITS];
    }
}

/// Whether the fused kernels run (read once): `QERL_FUSED_LORA=0` keeps the norm, SiLU·mul
/// and LoRA kernels apart, for A/B timing.
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("QERL_FUSED_LORA").map_or(true, |v| v != "0"))
}

/// The tile `(mr, nc)` of [`norm_lora`] for `m` rows: `QERL_NORM_LORA_TILE=<rows>x<columns>`
/// (read once; each 1, 2 or 4, the columns dividing the rank), else one row and one column a
/// cube up to 2 rows (the most cubes: batch 1 is latency), 2 x 2 up to 8, 4 x 4 above (each
/// adapter row read once for 4 rows).
fn norm_tile(m: usize, rank: usize) -> (usize, usize) {
    static TILE: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    let forced = *TILE.get_or_init(|| {
        let v = std::env::var("QERL_NORM_LORA_TILE").ok()?;
        let (r, c) = v.split_once('x')?;
        let ok = |n: usize| [1, 2, 4].contains(&n);
        let (r, c) = (r.trim().parse().ok()?, c.trim().parse().ok()?);
        (ok(r) && ok(c)).then_some((r, c))
    });
    let (mr, nc) = forced.unwrap_or(match m {
        0..=2 => (1, 1),
        3..=8 => (2, 2),
        _ => (4, 4),
    });
    let nc = if rank.is_multiple_of(nc) { nc } else { 1 };
    (mr, nc)
}

/// Residual add (when `d` is given: `h_out = h + d`, `h_out` not `h`) and RMSNorm of `rows`
/// rows of `h [rows, dim]` into `y [rows, dim]`, with the LoRA down-projections
/// `t[s] [rows, rank] = y · a[s]ᵀ` (f32) of one to three adapters `a[s] [rank, dim]` in `F`.
/// Returns false, launching nothing, where it does not apply (more than [`NORM_MAX_ROWS`]
/// rows, no adapter or more than three, rank 0, or `QERL_FUSED_LORA=0`): the caller runs
/// [`super::norm::add_rms_norm`] and the LoRA kernel.
#[allow(clippy::too_many_arguments)]
pub fn norm_lora<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    h: &Handle,
    d: Option<&Handle>,
    h_out: &Handle,
    gain: &Handle,
    rows: usize,
    dim: usize,
    eps: f32,
    y: &Handle,
    a: &[&Handle],
    rank: usize,
    t: &[&Handle],
) -> bool {
    let adapters = a.len();
    if !enabled()
        || !(1..=NORM_MAX_ROWS).contains(&rows)
        || !(1..=3).contains(&adapters)
        || t.len() != adapters
        || rank == 0
        || dim == 0
    {
        return false;
    }
    let e = std::mem::size_of::<F>() as u64;
    let big = |h: &Handle, len: usize, e: u64| h.size_in_used() >= len as u64 * e;
    assert!(
        [h, h_out, y].iter().all(|b| big(b, rows * dim, e))
            && d.is_none_or(|d| big(d, rows * dim, e))
            && a.iter().all(|b| big(b, rank * dim, e))
            && t.iter().all(|b| big(b, rows * rank, 4)),
        "norm_lora: buffers smaller than h [{rows}, {dim}], a [{rank}, {dim}], t [{rows}, {rank}]"
    );
    let (mr, nc) = norm_tile(rows, rank);
    let vs = vector_width::<F>(dim);
    let vecs = dim / vs;
    let per_unit = vecs.div_ceil(UNITS);
    let a = |i: usize| a[i.min(adapters - 1)].clone();
    let t = |i: usize| t[i.min(adapters - 1)].clone();
    let count = CubeCount::Static((adapters * rank / nc) as u32, rows.div_ceil(mr) as u32, 1);
    // SAFETY: lengths asserted above (`vs` divides `dim`); the kernel clamps its loads to row
    // `rows - 1` and vector `vecs - 1`, stores rows below `rows` only, and a cube's columns
    // lie in one adapter (`nc` divides the rank). Without `d`, `h` stands in and is not read.
    unsafe {
        norm_lora_kernel::launch_unchecked::<F, R>(
            client,
            count,
            CubeDim::new_1d(ROW_CUBE),
            vs,
            ArrayArg::from_raw_parts(h.clone(), rows * vecs),
            ArrayArg::from_raw_parts(d.unwrap_or(h).clone(), rows * vecs),
            ArrayArg::from_raw_parts(gain.clone(), dim),
            ArrayArg::from_raw_parts(a(0), rank * vecs),
            ArrayArg::from_raw_parts(a(1), rank * vecs),
            ArrayArg::from_raw_parts(a(2), rank * vecs),
            ArrayArg::from_raw_parts(h_out.clone(), rows * vecs),
            ArrayArg::from_raw_parts(y.clone(), rows * vecs),
            ArrayArg::from_raw_parts(t(0), rows * rank),
            ArrayArg::from_raw_parts(t(1), rows * rank),
            ArrayArg::from_raw_parts(t(2), rows * rank),
            rows as u32,
            dim as u32,
            rank as u32,
            eps,
            d.is_some(),
            mr,
            nc,
            per_unit,
        );
    }
    true
}

/// `out [rows, width] = silu(gate) ⊙ up` with the LoRA down-projection `t [rows, rank] = out ·
/// aᵀ` (f32) of the adapter `a [rank, width]` in `F`. Returns false, launching nothing, where
/// it does not apply (more than [`SILU_MAX_ROWS`] rows, rank 0, or `QERL_FUSED_LORA=0`).
#[allow(clippy::too_many_arguments)]
pub fn silu_lora<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    gate: &Handle,
    up: &Handle,
    out: &Handle,
    rows: usize,
    width: usize,
    a: &Handle,
    rank: usize,
    t: &Handle,
) -> bool {
    if !enabled() || !(1..=SILU_MAX_ROWS).contains(&rows) || rank == 0 || width == 0 {
        return false;
    }
    let e = std::mem::size_of::<F>() as u64;
    let big = |h: &Handle, len: usize, e: u64| h.size_in_used() >= len as u64 * e;
    assert!(
        [gate, up, out].iter().all(|b| big(b, rows * width, e))
            && big(a, rank * width, e)
            && big(t, rows * rank, 4),
        "silu_lora: buffers smaller than gate [{rows}, {width}], a [{rank}, {width}], \
         t [{rows}, {rank}]"
    );
    let vs = vector_width::<F>(width);
    let vecs = width / vs;
    let per_unit = vecs.div_ceil(UNITS);
    // One adapter column a cube: the rank's cubes per row are what runs at batch 1.
    let nc = 1;
    // SAFETY: lengths asserted above (`vs` divides `width`); the kernel reads vectors below
    // `vecs` of its row (< rows: the grid has `rows` cubes along y) and columns below the rank.
    unsafe {
        silu_lora_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static((rank / nc) as u32, rows as u32, 1),
            CubeDim::new_1d(ROW_CUBE),
            vs,
            ArrayArg::from_raw_parts(gate.clone(), rows * vecs),
            ArrayArg::from_raw_parts(up.clone(), rows * vecs),
            ArrayArg::from_raw_parts(a.clone(), rank * vecs),
            ArrayArg::from_raw_parts(out.clone(), rows * vecs),
            ArrayArg::from_raw_parts(t.clone(), rows * rank),
            rows as u32,
            width as u32,
            rank as u32,
            nc,
            per_unit,
        );
    }
    true
}
