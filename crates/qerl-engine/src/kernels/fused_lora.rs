//! LoRA down-projections fused into the kernel that makes their input, at a few rows: the
//! residual add + RMSNorm with `T_s = xn · A_sᵀ` for the products that read the norm (q/k/v,
//! gate/up), and SiLU·mul with `T = act · Aᵀ` for the down product ([`silu_lora`], CUDA).
//!
//! Why: at batch 1 on an H100 each LoRA down-projection was a launch of its own at ~4 µs,
//! reading the one row the launch before it had just written (ncu, 2026-11-27). Here each cube
//! makes the whole normalised row itself (a few KiB, read from L2 by every cube), the cubes of
//! grid column 0 store it, and every cube dots it with one row of one adapter: a grid of
//! (adapters · rank) x rows cubes, no sums across cubes. Measured on an H100 (7B, batch 1):
//! 6.0 µs a launch against 5.0 for the norm plus 3.9 for the LoRA kernel. At 64 rows, tiles of
//! 4 rows x 4 adapter rows took 23 µs against 11.4 (dropped: [`MAX_ROWS`]).
//!
//! The activation is too long for that (~75 KiB a row at 7B: a SiLU·mul whose every cube made
//! its row's whole activation took 15.4 µs against 3.5 + 3.7 apart). So [`silu_lora`] keeps
//! SiLU·mul's grid, one vector of the activation a unit, and each cube sums its slice's share
//! of `T` (plane butterflies, then the planes in shared memory); the row's last cube adds the
//! slices' sums in order ([`super::arrival`], CUDA only).
//!
//! Arithmetic: the row is the unfused kernel's bit for bit (the same loads and roundings, the
//! same shared-memory tree for the sum of squares), so `xn` equals
//! [`super::norm::add_rms_norm`]'s. Each `T` is summed per unit over its vectors (in order),
//! then over the units by the same tree: deterministic and batch-invariant.
//!
//! The residual: cubes other than column 0 read `h` and `d` while column 0 stores their sum,
//! so the sum goes to another buffer (`h_out`; the engine alternates two). The norm kernel uses
//! shared memory and barriers only: the same code runs on wgpu (lavapipe) for the tests.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::arrival::{allow_dependents, sum_parts, wait_for_primaries};
use super::lora_down::{load_a, plane_sums};
use super::norm::{cube_sum, inv_rms, residual_sum, Residual};
use super::{vector_width, ROW_CUBE};

/// Most rows [`norm_lora`] takes (the decode kernel's batches).
pub const MAX_ROWS: usize = 8;

/// For row `CUBE_POS_Y` and adapter row `CUBE_POS_X` (in the concatenation of the adapters):
/// the residual sum ([`residual_sum`]; stored to `h_out` by column 0), `y = x / sqrt(mean(x²)
/// + eps) ⊙ gain` (stored by column 0), `T_s[row, j] = y · A_s[j]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn norm_lora_kernel<F: Float, V: Size, W: Size>(
    h: &mut Array<Vector<F, V>>,
    d: &mut Array<Vector<F, V>>,
    parts: &mut Array<Vector<f32, W>>,
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
    #[comptime] slices: usize,
    #[comptime] per_unit: usize,
    #[comptime] pdl: bool,
) {
    allow_dependents(pdl);
    let vs = h.vector_size();
    let mut partial = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let t = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    let rank = rank as usize;
    let vecs = dim as usize / vs;
    let col = CUBE_POS_X as usize;
    let (s, j) = (col / rank, col % rank);
    let row = CUBE_POS_Y as usize;
    let stride = rows as usize * dim as usize;
    let writer = col == 0;

    // Every load first, the adapter's then the row's (clamped in bounds; vectors past the
    // row's end are computed on and never stored).
    let mut av = Array::<Vector<F, V>>::new(per_unit);
    let mut e = Array::<Vector<F, V>>::new(per_unit);
    #[unroll]
    for u in 0..per_unit {
        let v = min(t + u * step, vecs - 1);
        av[u] = load_a::<F, V>(a0, a1, a2, s, j * vecs + v);
    }
    // The adapter is the step's constant; the row is the kernels' before.
    wait_for_primaries(pdl);
    #[unroll]
    for u in 0..per_unit {
        let v = min(t + u * step, vecs - 1);
        e[u] = residual_sum::<F, V, W>(h, d, parts, row, v, vecs, stride, add, slices);
    }
    // The norm: the unfused kernel's arithmetic.
    let inv = inv_rms::<F, V>(&e, &mut partial, vecs, dim, eps, per_unit);
    let mut acc = 0.0f32;
    #[unroll]
    for u in 0..per_unit {
        let v = t + u * step;
        if v < vecs {
            let x = e[u];
            let mut out = Vector::<F, V>::empty();
            #[unroll]
            for k in 0..vs {
                out[k] = F::cast_from(f32::cast_from(x[k]) * inv * gain[v * vs + k]);
            }
            if writer {
                if add {
                    h_out[row * vecs + v] = x;
                }
                y[row * vecs + v] = out;
            }
            #[unroll]
            for k in 0..vs {
                acc = fma(f32::cast_from(out[k]), f32::cast_from(av[u][k]), acc);
            }
        }
    }
    // Every unit has read the norm: the shared sums may be overwritten.
    sync_cube();
    partial[t] = acc;
    sync_cube();
    cube_sum(&mut partial);
    if t == 0 {
        let at = row * rank + j;
        if s == 0 {
            t0[at] = partial[0];
        } else if s == 1 {
            t1[at] = partial[0];
        } else {
            t2[at] = partial[0];
        }
    }
}

/// Whether the engine fuses at a few rows (read once): `QERL_FUSED_LORA=0` keeps the norm and
/// the LoRA kernels apart ([`norm_lora`] declines), o's LoRA out of the attention's merge and the
/// down product's reduction its own launch, for A/B timing.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::switch_on(&ON, "QERL_FUSED_LORA")
}

/// Residual add ([`Residual`]; the sum to `h_out`, not `h`) and RMSNorm of `rows` rows of
/// `h [rows, dim]` into `y [rows, dim]`, with the LoRA down-projections
/// `t[s] [rows, rank] = y · a[s]ᵀ` (f32) of one to three adapters `a[s] [rank, dim]` in `F`.
/// Returns false, launching nothing, where it does not apply (more than [`MAX_ROWS`] rows, no
/// adapter or more than three, rank 0, or `QERL_FUSED_LORA=0`): the caller runs
/// [`super::norm::add_rms_norm`] and the LoRA kernel.
#[allow(clippy::too_many_arguments)]
pub fn norm_lora<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    h: &Handle,
    d: Residual<'_>,
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
        || !(1..=MAX_ROWS).contains(&rows)
        || !(1..=3).contains(&adapters)
        || t.len() != adapters
        || rank == 0
        || dim == 0
    {
        return false;
    }
    let (add, slices) = d.mode();
    let (d_h, parts) = d.buffers(h);
    let e = std::mem::size_of::<F>() as u64;
    let big = |h: &Handle, len: usize, e: u64| h.size_in_used() >= len as u64 * e;
    assert!(
        [h, h_out, y, d_h].iter().all(|b| big(b, rows * dim, e))
            && (slices == 0 || big(parts, slices * rows * dim, 4))
            && a.iter().all(|b| big(b, rank * dim, e))
            && t.iter().all(|b| big(b, rows * rank, 4)),
        "norm_lora: buffers smaller than h [{rows}, {dim}], a [{rank}, {dim}], t [{rows}, {rank}]"
    );
    let vs = vector_width::<F>(dim);
    let vecs = dim / vs;
    let per_unit = vecs.div_ceil(ROW_CUBE as usize);
    let a = |i: usize| a[i.min(adapters - 1)].clone();
    let t = |i: usize| t[i.min(adapters - 1)].clone();
    // SAFETY: lengths asserted above (`vs` divides `dim`); the kernel clamps its loads to
    // vector `vecs - 1` of its row (below `rows`: the grid's y), and a cube's adapter row lies
    // below `adapters · rank` (the grid's x). Without `d`, `h` stands in and is not read.
    unsafe {
        norm_lora_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static((adapters * rank) as u32, rows as u32, 1),
            CubeDim::new_1d(ROW_CUBE),
            vs,
            super::norm::parts_width(vs),
            ArrayArg::from_raw_parts(h.clone(), rows * vecs),
            ArrayArg::from_raw_parts(d_h.clone(), rows * vecs),
            ArrayArg::from_raw_parts(
                parts.clone(),
                if slices > 0 {
                    slices * rows * dim / super::norm::parts_width(vs)
                } else {
                    1
                },
            ),
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
            add,
            slices,
            per_unit,
            R::name(client) == "cuda",
        );
    }
    true
}

/// Units a cube of [`silu_lora`]: one vector of the activation each.
const SILU_UNITS: usize = 256;

/// For row `CUBE_POS_Y` and its slice `CUBE_POS_X` of [`SILU_UNITS`] vectors:
/// `out = silu(gate) ⊙ up` ([`super::act::silu_mul`]'s arithmetic), the slice's share of
/// `T[row, j] = out · A[j]` for every `j < rank` into `slice_sums [rows, slices, rank]`, and
/// from the row's last slice to finish, `T`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn silu_lora_kernel<F: Float, V: Size>(
    gate: &mut Array<Vector<F, V>>,
    up: &mut Array<Vector<F, V>>,
    a: &Array<Vector<F, V>>,
    out: &mut Array<Vector<F, V>>,
    slice_sums: &mut Array<f32>,
    counters: &mut Array<Atomic<u32>>,
    t_out: &mut Array<f32>,
    vecs: u32,
    #[comptime] rank: usize,
) {
    allow_dependents(true);
    let vs = gate.vector_size();
    let planes = comptime!(SILU_UNITS / 32);
    let mut red = SharedMemory::<f32>::new(comptime!(planes * rank));
    let t = UNIT_POS_X as usize;
    let vecs = vecs as usize;
    let slice = CUBE_POS_X as usize;
    let slices = CUBE_COUNT_X as usize;
    let row = CUBE_POS_Y as usize;
    let v = slice * SILU_UNITS + t;
    let live = v < vecs;
    let vc = min(v, vecs - 1);
    // Every load first: the adapter's columns of this vector, then gate and up.
    let mut av = Array::<Vector<F, V>>::new(rank);
    #[unroll]
    for j in 0..rank {
        av[j] = a[j * vecs + vc];
    }
    wait_for_primaries(true);
    let g = gate[row * vecs + vc];
    let u = up[row * vecs + vc];
    let mut o = Vector::<F, V>::empty();
    #[unroll]
    for k in 0..vs {
        let x = f32::cast_from(g[k]);
        let silu = x / (1.0f32 + f32::exp(-x));
        o[k] = F::cast_from(silu * f32::cast_from(u[k]));
    }
    if live {
        out[row * vecs + v] = o;
    }
    let mut acc = Array::<f32>::new(rank);
    #[unroll]
    for j in 0..rank {
        let mut sum = 0.0f32;
        #[unroll]
        for k in 0..vs {
            sum = fma(f32::cast_from(o[k]), f32::cast_from(av[j][k]), sum);
        }
        acc[j] = select(live, sum, 0.0f32);
    }
    plane_sums(&mut acc, &mut red, (t % 32) as u32, t / 32, rank);
    sync_cube();
    // The slice's sums, then the row's last slice adds them all.
    sum_parts(
        &red, slice_sums, counters, t_out, row, slice, slices, planes, rank,
    );
}

/// Slices of [`silu_lora`] a row of `width` elements of `F` takes, so the slice sums hold
/// `rows · slices · rank` f32.
pub fn silu_slices<F: Float>(width: usize) -> usize {
    (width / vector_width::<F>(width)).div_ceil(SILU_UNITS)
}

/// `out [rows, width] = silu(gate) ⊙ up` with the LoRA down-projection `t [rows, rank] = out ·
/// aᵀ` (f32) of the adapter `a [rank, width]` in `F`; `slice_sums` holds at least
/// `rows · silu_slices(width) · rank` f32 and `counters` `rows` zeroed `u32` (left zero).
/// Returns false, launching nothing, where it does not apply (not CUDA with 32-wide planes,
/// more than [`MAX_ROWS`] rows, a rank that is not a power of two up to 64, or
/// `QERL_FUSED_LORA=0`): the caller runs [`super::act::silu_mul`] and the LoRA kernel.
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
    slice_sums: &Handle,
    counters: &Handle,
) -> bool {
    let hw = &client.properties().hardware;
    if !enabled()
        || R::name(client) != "cuda"
        || hw.plane_size_min != 32
        || hw.plane_size_max != 32
        || !(1..=MAX_ROWS).contains(&rows)
        || !rank.is_power_of_two()
        || rank > 64
        || width == 0
    {
        return false;
    }
    let vs = vector_width::<F>(width);
    let vecs = width / vs;
    let slices = silu_slices::<F>(width);
    let e = std::mem::size_of::<F>() as u64;
    let big = |h: &Handle, len: usize, e: u64| h.size_in_used() >= len as u64 * e;
    assert!(
        [gate, up, out].iter().all(|b| big(b, rows * width, e))
            && big(a, rank * width, e)
            && big(t, rows * rank, 4)
            && big(slice_sums, rows * slices * rank, 4)
            && big(counters, rows, 4),
        "silu_lora: buffers smaller than gate [{rows}, {width}], a [{rank}, {width}], \
         t [{rows}, {rank}], {slices} slice sums a row, {rows} counters"
    );
    // SAFETY: lengths asserted above (`vs` divides `width`); the kernel reads vector
    // `min(v, vecs - 1)` of its row (below `rows`: the grid's y) and stores vectors below
    // `vecs`, sums below `rows · slices · rank` and `T` below `rows · rank`.
    unsafe {
        silu_lora_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(slices as u32, rows as u32, 1),
            CubeDim::new_1d(SILU_UNITS as u32),
            vs,
            ArrayArg::from_raw_parts(gate.clone(), rows * vecs),
            ArrayArg::from_raw_parts(up.clone(), rows * vecs),
            ArrayArg::from_raw_parts(a.clone(), rank * vecs),
            ArrayArg::from_raw_parts(out.clone(), rows * vecs),
            ArrayArg::from_raw_parts(slice_sums.clone(), rows * slices * rank),
            ArrayArg::from_raw_parts(counters.clone(), rows),
            ArrayArg::from_raw_parts(t.clone(), rows * rank),
            vecs as u32,
            rank,
        );
    }
    true
}
