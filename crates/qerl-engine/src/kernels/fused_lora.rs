//! The LoRA down-projections of the products that read a norm's output (q/k/v, gate/up),
//! fused into that norm at a few rows: residual add + RMSNorm + `T_s = xn · A_sᵀ`.
//!
//! Why: at batch 1 on an H100 each LoRA down-projection was a launch of its own at ~4 µs,
//! reading the one row the launch before it had just written (ncu, 2026-11-27). Here each cube
//! makes the whole normalised row itself (a few KiB, read from L2 by every cube), the cubes of
//! grid column 0 store it, and every cube dots it with one row of one adapter: a grid of
//! (adapters · rank) x rows cubes, no sums across cubes. Measured on an H100 (7B, batch 1):
//! 6.0 µs a launch against 5.0 for the norm plus 3.9 for the LoRA kernel. At 64 rows, tiles of
//! 4 rows x 4 adapter rows took 23 µs against 11.4 (dropped: [`MAX_ROWS`]); a SiLU·mul with
//! the down adapter's projection, each cube making its row's whole activation (~75 KiB), took
//! 15.4 µs against 7.2 (dropped).
//!
//! Arithmetic: the row is the unfused kernel's bit for bit (the same loads and roundings, the
//! same shared-memory tree for the sum of squares), so `xn` equals
//! [`super::norm::add_rms_norm`]'s. Each `T` is summed per unit over its vectors (in order),
//! then over the units by the same tree: deterministic and batch-invariant.
//!
//! The residual: cubes other than column 0 read `h` and `d` while column 0 stores their sum,
//! so the sum goes to another buffer (`h_out`; the engine alternates two).
//! Shared memory and barriers only: the same code runs on wgpu (lavapipe) for the tests.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::lora_down::load_a;
use super::norm::{cube_sum, inv_rms, residual_sum, Residual};
use super::{vector_width, ROW_CUBE};

/// Most rows [`norm_lora`] takes (the decode kernel's batches).
pub const MAX_ROWS: usize = 8;

/// For row `CUBE_POS_Y` and adapter row `CUBE_POS_X` (in the concatenation of the adapters):
/// the residual sum ([`residual_sum`]; stored to `h_out` by column 0), `y = x / sqrt(mean(x²)
/// + eps) ⊙ gain` (stored by column 0), `T_s[row, j] = y · A_s[j]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn norm_lora_kernel<F: Float, V: Size>(
    h: &Array<Vector<F, V>>,
    d: &Array<Vector<F, V>>,
    parts: &Array<f32>,
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
) {
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
    #[unroll]
    for u in 0..per_unit {
        let v = min(t + u * step, vecs - 1);
        e[u] = residual_sum::<F, V>(h, d, parts, row, v, vecs, stride, add, slices);
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
    *ON.get_or_init(|| std::env::var("QERL_FUSED_LORA").map_or(true, |v| v != "0"))
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
            ArrayArg::from_raw_parts(h.clone(), rows * vecs),
            ArrayArg::from_raw_parts(d_h.clone(), rows * vecs),
            ArrayArg::from_raw_parts(
                parts.clone(),
                if slices > 0 { slices * rows * dim } else { 1 },
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
        );
    }
    true
}
