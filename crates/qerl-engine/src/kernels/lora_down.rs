//! LoRA down-projections of a decode batch with plane (warp) operations:
//! `T_s [m, r] = X [m, K] · A_sᵀ` in f32 for one to three adapters `A_s [r, K]` (row-major, in
//! `F`) that share the input (q/k/v, gate/up; o and down alone), m <= 256, r = 16 typically,
//! K = 3584 and 18944 (Qwen2.5-7B), 5120 and 27648 (32B).
//!
//! The data are small (X: m·K, A: S·r·K values, under 3 MB), so what costs is latency and the
//! re-reading of X and A from L2: [`super::dense`] gives each output column a cube, which
//! reads X once per column (48 times for q/k/v) and reduces with an 8-step shared-memory tree.
//! Here a cube of 8 planes (256 units) computes a tile of `MR` rows by `NC` columns of one
//! adapter over the whole of K: unit u reads the 16-byte vectors u, u + 256, ... of the tile's
//! `NC` rows of A and `MR` rows of X (about 16 loads in flight a unit) and keeps `MR·NC` f32
//! sums (`fma`); each plane adds its units' sums with a transposing butterfly of
//! `plane_shuffle_xor` (about `MR·NC` shuffles instead of 5 per sum), and the planes' sums
//! meet in shared memory, added in plane order. The tile (square: 1, 2, 4 or 8, dividing r)
//! comes from a small cost model over (m, S·r, K): reads per multiprocessor and through L2,
//! FMAs and rounds of loads; the grid is (S·r / NC) x ceil(m / MR) cubes.
//!
//! Deterministic and batch-invariant: every output is summed over K in one fixed order (vector
//! by vector in a unit, the same butterfly tree, planes in order) whatever m and the tile, and
//! a row reads only itself, so its T is bit-identical alone or in any batch (each tile is its
//! own compilation, but the arithmetic of an output is the same `fma` chain and adds in each).
//! Needs plane operations with 32-wide planes (CUDA); [`applies`] is false elsewhere (wgpu,
//! lavapipe) and the caller uses [`super::dense`]. From 128 rows the engine takes the
//! tensor-core kernel `qerl_kernels::lora_down_mma` instead (faster there, not at 64 rows:
//! docs/benchmarks/rollout.md session 28).

use cubecl::features::Plane;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::vector_width;

/// Units per plane (the only width [`applies`] accepts).
const PLANE: usize = 32;
/// Planes per cube: all of them share the cube's outputs, each taking every 8th run of K.
const PLANES: usize = 8;
/// Units per cube.
const UNITS: usize = PLANE * PLANES;
/// Most rows, and most columns, of a cube's tile.
const MAX_TILE: usize = 8;
/// 16-byte loads a unit aims to have in flight (A and X vectors together).
const LOADS: usize = 16;
/// Most rows the kernel takes.
pub const MAX_M: usize = 256;

/// Rough H100 figures for the cost model (per nanosecond): bytes a multiprocessor reads from
/// L2, bytes the whole L2 serves, f32 FMAs of a multiprocessor; and the time of one round of
/// loads (an L2/DRAM latency) and of one shuffle step of a cube's reduction.
const SM_BYTES_NS: f64 = 110.0;
const L2_BYTES_NS: f64 = 5000.0;
const SM_FMA_NS: f64 = 220.0;
const ROUND_NS: f64 = 400.0;
const SHUFFLE_NS: f64 = 5.0;

/// Vectors of each row a unit loads before using them: [`LOADS`] over the tile's rows plus
/// columns, a power of two (1 to 8). The order of the additions does not depend on it.
fn unroll(mr: usize, nc: usize) -> usize {
    let u = (LOADS / (mr + nc)).max(1);
    1 << u.ilog2()
}

/// `QERL_LORA_DOWN_TILE=<rows>x<columns>` (read once; powers of two up to 8) fixes the tile
/// for experiments where the columns divide the rank.
fn forced_tile() -> Option<(usize, usize)> {
    static TILE: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    *TILE.get_or_init(|| {
        let v = std::env::var("QERL_LORA_DOWN_TILE").ok()?;
        let (r, c) = v.split_once('x')?;
        let (r, c) = (
            r.trim().parse::<usize>().ok()?,
            c.trim().parse::<usize>().ok()?,
        );
        let ok = |n: usize| n.is_power_of_two() && n <= MAX_TILE;
        (ok(r) && ok(c)).then_some((r, c))
    })
}

/// Estimated nanoseconds of a launch with square tiles of `t` rows by `t` columns (`n`
/// columns in all, `e` bytes per element, `vs` elements per vector): the slowest of the reads
/// of the busiest multiprocessor, the reads through L2, its FMAs and the rounds of loads of a
/// unit, plus the reduction's shuffles.
fn cost(m: usize, n: usize, k: usize, e: usize, vs: usize, t: usize, sms: usize) -> f64 {
    let cubes = m.div_ceil(t) * (n / t);
    let per_sm = cubes.div_ceil(sms) as f64;
    let bytes = (2 * t * k * e) as f64;
    let reads = per_sm * bytes / SM_BYTES_NS;
    let l2 = cubes as f64 * bytes / L2_BYTES_NS;
    let fmas = per_sm * (t * t * k) as f64 / SM_FMA_NS;
    let rounds = (k / vs).div_ceil(UNITS).div_ceil(unroll(t, t)) as f64 * ROUND_NS;
    let shuffles = (t * t).max(PLANE).ilog2() as f64 + (t * t) as f64;
    reads.max(l2).max(fmas).max(rounds) + per_sm * shuffles * SHUFFLE_NS
}

/// The tile `(rows, columns)` of a cube for `m` rows of `adapters` adapters of rank `rank`:
/// the cheapest square one by [`cost`] (1, 2, 4 or 8 dividing the rank, the smallest of
/// equals: at most four compilations per model and dtype; over m = 1..256 on the Qwen2.5-7B
/// shapes the model puts them ~2% behind the best of all 16 tiles), or the one
/// `QERL_LORA_DOWN_TILE` fixes.
fn choose_tile(
    m: usize,
    adapters: usize,
    rank: usize,
    k: usize,
    e: usize,
    vs: usize,
    sms: usize,
) -> (usize, usize) {
    if let Some((r, c)) = forced_tile().filter(|t| rank.is_multiple_of(t.1)) {
        return (r, c);
    }
    let mut best = (1, f64::MAX);
    let mut t = 1;
    while t <= MAX_TILE && rank.is_multiple_of(t) && t < 2 * m {
        let c = cost(m, adapters * rank, k, e, vs, t, sms);
        if c < best.1 {
            best = (t, c);
        }
        t *= 2;
    }
    (best.0, best.0)
}

/// One vector of adapter `s` (uniform over the cube).
#[cube]
pub(super) fn load_a<F: Float, V: Size>(
    a0: &Array<Vector<F, V>>,
    a1: &Array<Vector<F, V>>,
    a2: &Array<Vector<F, V>>,
    s: usize,
    at: usize,
) -> Vector<F, V> {
    let w = if s == 0 {
        a0[at]
    } else if s == 1 {
        a1[at]
    } else {
        a2[at]
    };
    w
}

/// One step of the plane reduction, across units `offset` apart: with several sums a unit
/// keeps half (the upper half where its `offset` bit is set), sends the other half to its
/// partner and adds the partner's; with one, a butterfly step. Each sum goes through the same
/// tree whatever `count` (pairs 16 apart first, then 8, ... 1; `a + b` is exact-commutative).
#[cube]
fn reduce_step(acc: &mut Array<f32>, lane: u32, #[comptime] count: usize, #[comptime] offset: u32) {
    if comptime!(count > 1) {
        let half = comptime!(count / 2);
        let upper = (lane & offset) != 0u32;
        #[unroll]
        for i in 0..half {
            let send = select(upper, acc[i], acc[i + half]);
            let keep = select(upper, acc[i + half], acc[i]);
            acc[i] = keep + plane_shuffle_xor(send, offset);
        }
    } else {
        acc[0] += plane_shuffle_xor(acc[0], offset);
    }
}

/// Sums each of a unit's `outs` values (a power of two) over its plane of 32 with the
/// transposing butterfly of [`reduce_step`], and stores the plane's sums at
/// `red[plane · outs ..]`: deterministic, the same tree for every output whatever `outs`.
#[cube]
pub(super) fn plane_sums(
    acc: &mut Array<f32>,
    red: &mut SharedMemory<f32>,
    lane: u32,
    plane: usize,
    #[comptime] outs: usize,
) {
    // Counts halve (at least 1) over offsets 16, 8, 4, 2, 1.
    reduce_step(acc, lane, outs, 16u32);
    reduce_step(acc, lane, comptime!((outs / 2).max(1)), 8u32);
    reduce_step(acc, lane, comptime!((outs / 4).max(1)), 4u32);
    reduce_step(acc, lane, comptime!((outs / 8).max(1)), 2u32);
    reduce_step(acc, lane, comptime!((outs / 16).max(1)), 1u32);
    // Now sum i of unit l is output i + per·(l / spread), equal over the `spread` units.
    let per = comptime!((outs / PLANE).max(1));
    let spread = comptime!((PLANE / outs).max(1));
    if lane as usize & comptime!(spread - 1) == 0 {
        #[unroll]
        for i in 0..per {
            red[plane * outs + i + per * (lane as usize / spread)] = acc[i];
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn lora_down_kernel<F: Float, V: Size>(
    x: &Array<Vector<F, V>>,
    a0: &Array<Vector<F, V>>,
    a1: &Array<Vector<F, V>>,
    a2: &Array<Vector<F, V>>,
    t0: &mut Array<f32>,
    t1: &mut Array<f32>,
    t2: &mut Array<f32>,
    m_rows: u32,
    rank: u32,
    k_vecs: u32,
    #[comptime] mr: usize,
    #[comptime] nc: usize,
    #[comptime] unroll: usize,
) {
    let vs = x.vector_size();
    let outs = comptime!(mr * nc);
    let mut red = SharedMemory::<f32>::new(comptime!(PLANES * mr * nc));
    let lane = UNIT_POS_X;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * PLANE + lane as usize;
    let vecs = k_vecs as usize;
    let rank = rank as usize;
    let m_rows = m_rows as usize;
    // The tile: columns j0.. of adapter s (nc divides the rank), rows row0..
    let col0 = CUBE_POS_X as usize * nc;
    let s = col0 / rank;
    let j0 = col0 % rank;
    let row0 = CUBE_POS_Y as usize * mr;

    let mut acc = Array::<f32>::new(outs);
    #[unroll]
    for o in 0..outs {
        acc[o] = 0.0f32;
    }
    let mut v = tid;
    while v < vecs {
        // Vectors past the end load the last one (in bounds) and are not used.
        let mut av = Array::<Vector<F, V>>::new(comptime!(unroll * nc));
        let mut xv = Array::<Vector<F, V>>::new(comptime!(unroll * mr));
        #[unroll]
        for u in 0..unroll {
            let vu = min(v + u * UNITS, vecs - 1);
            #[unroll]
            for c in 0..nc {
                av[u * nc + c] = load_a::<F, V>(a0, a1, a2, s, (j0 + c) * vecs + vu);
            }
            #[unroll]
            for r in 0..mr {
                // Rows past m compute on the last row and are not stored.
                xv[u * mr + r] = x[min(row0 + r, m_rows - 1) * vecs + vu];
            }
        }
        #[unroll]
        for u in 0..unroll {
            if v + u * UNITS < vecs {
                #[unroll]
                for i in 0..vs {
                    let mut af = Array::<f32>::new(nc);
                    #[unroll]
                    for c in 0..nc {
                        af[c] = f32::cast_from(av[u * nc + c][i]);
                    }
                    #[unroll]
                    for r in 0..mr {
                        let xf = f32::cast_from(xv[u * mr + r][i]);
                        #[unroll]
                        for c in 0..nc {
                            acc[r * nc + c] = fma(xf, af[c], acc[r * nc + c]);
                        }
                    }
                }
            }
        }
        v += comptime!(unroll * UNITS);
    }

    plane_sums(&mut acc, &mut red, lane, plane, outs);
    sync_cube();
    if tid < outs {
        let mut total = red[tid];
        #[unroll]
        for p in 1..PLANES {
            total += red[p * outs + tid];
        }
        let row = row0 + tid / nc;
        if row < m_rows {
            let at = row * rank + j0 + tid % nc;
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

/// Whether [`lora_down`] runs `m` rows of `adapters` adapters of rank `rank` and depth `k` on
/// this client: plane operations with 32-wide planes (CUDA), 1 to 256 rows, 1 to 3 adapters.
pub fn applies<R: Runtime>(
    client: &ComputeClient<R>,
    m: usize,
    adapters: usize,
    rank: usize,
    k: usize,
) -> bool {
    let p = client.properties();
    (1..=MAX_M).contains(&m)
        && (1..=3).contains(&adapters)
        && rank > 0
        && k > 0
        && p.features.plane.contains(Plane::Ops)
        && p.hardware.plane_size_min == PLANE as u32
        && p.hardware.plane_size_max == PLANE as u32
}

/// The tile `(rows, columns)` a cube of [`lora_down`] computes for this shape, or `None` where
/// it does not apply (tests, benchmarks).
pub fn tile<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    adapters: usize,
    rank: usize,
    k: usize,
) -> Option<(usize, usize)> {
    let sms = client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(132)
        .max(1) as usize;
    let (e, vs) = (std::mem::size_of::<F>(), vector_width::<F>(k));
    applies(client, m, adapters, rank, k).then(|| choose_tile(m, adapters, rank, k, e, vs, sms))
}

/// `t_s [m, rank] = x [m, k] · a_sᵀ` in f32 for each adapter `a_s [rank, k]` in `F` (one to
/// three); returns false, launching nothing, where it does not apply (see [`applies`]).
pub fn lora_down<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    a: &[&Handle],
    rank: usize,
    k: usize,
    t: &[&Handle],
) -> bool {
    let segments = a.len();
    let Some((mr, nc)) = tile::<R, F>(client, m, segments, rank, k) else {
        return false;
    };
    assert_eq!(t.len(), segments, "lora_down: one output per adapter");
    let e = std::mem::size_of::<F>() as u64;
    let big = |h: &Handle, len: usize, e: u64| h.size_in_used() >= len as u64 * e;
    assert!(
        big(x, m * k, e)
            && a.iter().all(|h| big(h, rank * k, e))
            && t.iter().all(|h| big(h, m * rank, 4)),
        "lora_down: buffers smaller than x [{m}, {k}], a [{rank}, {k}], t [{m}, {rank}]"
    );
    let vs = vector_width::<F>(k);
    let a = |i: usize| a[i.min(segments - 1)].clone();
    let t = |i: usize| t[i.min(segments - 1)].clone();
    let count = CubeCount::Static((segments * rank / nc) as u32, m.div_ceil(mr) as u32, 1);
    // SAFETY: `x` holds m·k, each adapter rank·k and each output m·rank elements (asserted
    // above; k is a multiple of `vs`), and the lengths given are those. The kernel clamps rows
    // to m and vectors to k / vs; a cube's columns j0..j0+nc lie in one adapter s < segments
    // (nc divides the rank, the grid has segments·rank / nc cubes along x), so A reads stay
    // below rank·k / vs and stores below m·rank, made only for rows < m. Adapters and outputs
    // past `segments` repeat the last and are never used.
    unsafe {
        lora_down_kernel::launch_unchecked::<F, R>(
            client,
            count,
            CubeDim::new_2d(PLANE as u32, PLANES as u32),
            vs,
            ArrayArg::from_raw_parts(x.clone(), m * k / vs),
            ArrayArg::from_raw_parts(a(0), rank * k / vs),
            ArrayArg::from_raw_parts(a(1), rank * k / vs),
            ArrayArg::from_raw_parts(a(2), rank * k / vs),
            ArrayArg::from_raw_parts(t(0), m * rank),
            ArrayArg::from_raw_parts(t(1), m * rank),
            ArrayArg::from_raw_parts(t(2), m * rank),
            m as u32,
            rank as u32,
            (k / vs) as u32,
            mr,
            nc,
            unroll(mr, nc),
        );
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiles divide the rank, and one model takes few compilations over every batch size.
    #[test]
    fn tiles_for_qwen_shapes() {
        for (hidden, inter) in [(3584, 18944), (5120, 27648)] {
            let mut seen = std::collections::BTreeSet::new();
            for rank in [8, 16, 32] {
                for (s, k) in [(3, hidden), (2, hidden), (1, hidden), (1, inter)] {
                    for m in 1..=MAX_M {
                        let (mr, nc) = choose_tile(m, s, rank, k, 2, 8, 132);
                        assert!(rank % nc == 0 && mr <= MAX_TILE && (mr == 1 || mr < 2 * m));
                        if rank == 16 {
                            seen.insert((mr, nc));
                        }
                    }
                }
            }
            eprintln!("hidden {hidden}: tiles at rank 16 {seen:?}");
            assert!(seen.len() <= 4, "{} compilations", seen.len());
        }
    }

    /// On wgpu (lavapipe: no plane operations) the kernel never applies.
    #[cfg(feature = "wgpu")]
    #[test]
    fn not_on_wgpu() {
        type W = cubecl::wgpu::WgpuRuntime;
        let c = W::client(&qerl_kernels::runtime::wgpu_device_or_exit());
        if c.properties().features.plane.contains(Plane::Ops) {
            return;
        }
        assert!(!applies(&c, 1, 3, 16, 3584));
        let h = c.empty(4);
        assert!(!lora_down::<W, f32>(&c, &h, 1, &[&h], 1, 1, &[&h]));
    }
}
