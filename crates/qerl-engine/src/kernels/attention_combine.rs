//! The merge of a split attention's spans, `o = Σ e^(m_s−M) o_s / Σ e^(m_s−M) l_s`, and, on
//! CUDA, the o product's LoRA down-projection `T = o · A_oᵀ` in the same launch.
//!
//! One cube per (row, query head): the span weights in shared memory, then a unit per channel
//! sums the weighted partial outputs. With the LoRA (decode at a few rows, where the attention
//! splits: a 7B step at batch 1 ran the projection as a launch of its own, 3.7-4.3 µs a layer
//! on an H100), each cube also dots its head's channels with the adapter's columns of that head
//! (each plane's `rank` sums by a shuffle butterfly, then the planes' in shared memory; a tree
//! in shared memory over the cube took the merge from 5.0 to 11.1 µs) and stores them; the last
//! cube of the row to finish (an atomic count, behind a device-scope fence) adds the heads'
//! sums in head order and stores the row's `T`.
//! Deterministic (a fixed order of additions) and batch-invariant (a row's sums are its own).
//!
//! The count and its fences are [`super::arrival`]'s, CUDA only: elsewhere the merge runs
//! alone and the caller runs the projection.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::arrival::{allow_dependents, sum_parts, wait_for_primaries};
use super::attention::{AttentionShape, MASKED, MAX_SPLITS, UNITS};
use super::lora_down::plane_sums;
use super::{grid_rows, row_of_cube};

/// The o product's adapter, for the merge to project its output with: `A_o [rank, q_dim]` in
/// `F`, `T [rows, rank]` f32 (the output), the per-head sums `[rows, q_heads, rank]` f32, and
/// one `u32` counter a row, zero when allocated (each launch leaves them zero).
#[derive(Clone, Copy, Debug)]
pub struct OLora<'a> {
    pub a: &'a Handle,
    pub rank: usize,
    pub t: &'a Handle,
    pub head_sums: &'a Handle,
    pub counters: &'a Handle,
}

/// Most adapter rank the merge takes (the sums of a cube live in shared memory).
pub const MAX_RANK: usize = 64;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn combine_kernel<F: Float>(
    part_o: &mut Array<f32>,
    part_ml: &mut Array<f32>,
    out: &mut Array<F>,
    a: &Array<F>,
    head_sums: &mut Array<f32>,
    counters: &mut Array<Atomic<u32>>,
    t_out: &mut Array<f32>,
    heads: u32,
    splits: u32,
    q_heads: u32,
    #[comptime] group: usize,
    #[comptime] head_dim: usize,
    #[comptime] max_splits: usize,
    #[comptime] rank: usize,
    #[comptime] pdl: bool,
) {
    allow_dependents(pdl);
    let cube = row_of_cube();
    // With the LoRA, unit t's column of `A` (the step's constant) before the wait: fetched
    // while the attention still runs.
    let mut av = Array::<f32>::new(comptime!(rank.max(1)));
    if comptime!(rank > 0) {
        let q_dim = q_heads as usize * head_dim;
        let col = min(
            (cube % q_heads as usize) * head_dim + UNIT_POS_X as usize,
            q_dim - 1,
        );
        #[unroll]
        for j in 0..rank {
            av[j] = f32::cast_from(a[j * q_dim + col]);
        }
    }
    wait_for_primaries(pdl);
    let mut w = SharedMemory::<f32>::new(max_splits);
    let mut lw = SharedMemory::<f32>::new(max_splits);
    // Cube = (row, kv head, h): the partials of (row, kv head) are `splits` cubes apart.
    if cube < heads as usize {
        let t = UNIT_POS_X as usize;
        let splits = splits as usize;
        let pair = cube / group;
        let h = cube % group;
        if t < splits {
            w[t] = part_ml[((pair * splits + t) * group + h) * 2];
        }
        sync_cube();
        let mut m = f32::new(MASKED);
        for s in 0..splits {
            m = max(m, w[s]);
        }
        sync_cube();
        if t < splits {
            let at = (pair * splits + t) * group + h;
            let e = f32::exp(part_ml[at * 2] - m);
            w[t] = e;
            lw[t] = e * part_ml[at * 2 + 1];
        }
        sync_cube();
        let mut l = 0.0f32;
        for s in 0..splits {
            l += lw[s];
        }
        // With the LoRA (head_dim <= UNITS), unit t's channel as stored.
        let mut own = 0.0f32;
        let mut d = t;
        while d < head_dim {
            let mut o = Array::<f32>::new(8usize);
            #[unroll]
            for u in 0..8usize {
                o[u] = 0.0f32;
            }
            let mut s0 = 0usize;
            while s0 < splits {
                #[unroll]
                for u in 0..8usize {
                    let s = min(s0 + u, splits - 1);
                    let keep = select(s0 + u < splits, w[s], 0.0f32);
                    o[u] += keep * part_o[((pair * splits + s) * group + h) * head_dim + d];
                }
                s0 += 8;
            }
            let mut total = 0.0f32;
            #[unroll]
            for u in 0..8usize {
                total += o[u];
            }
            let v = F::cast_from(total / l);
            out[cube * head_dim + d] = v;
            own = f32::cast_from(v);
            d += UNITS as usize;
        }
        if rank > 0 {
            project(
                own,
                &av,
                head_sums,
                counters,
                t_out,
                cube,
                q_heads as usize,
                head_dim,
                rank,
            );
        }
    }
}

/// The LoRA part of [`combine_kernel`] for cube `cube` = (row, query head) whose unit `t`
/// holds channel `t`'s output `own` (0 past the head) and that channel's column of `A` in `av`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn project(
    own: f32,
    av: &Array<f32>,
    head_sums: &mut Array<f32>,
    counters: &mut Array<Atomic<u32>>,
    t_out: &mut Array<f32>,
    cube: usize,
    q_heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] rank: usize,
) {
    let t = UNIT_POS_X as usize;
    let row = cube / q_heads;
    let head = cube % q_heads;
    // The head's channels are the first `head_dim / 32` planes' units.
    let planes = comptime!(head_dim.div_ceil(32));
    let mut red = SharedMemory::<f32>::new(comptime!(planes * rank));
    let plane = t / 32;
    if plane < planes {
        let live = t < head_dim;
        let mut acc = Array::<f32>::new(rank);
        #[unroll]
        for j in 0..rank {
            acc[j] = select(live, own * av[j], 0.0f32);
        }
        plane_sums(&mut acc, &mut red, (t % 32) as u32, plane, rank);
    }
    sync_cube();
    // The head's sums, then the row's last head adds them all.
    sum_parts(
        &red, head_sums, counters, t_out, row, head, q_heads, planes, rank,
    );
}

/// Merges `splits` spans of the attention of shape `s` into `out`; with `o_lora`, on CUDA (32-wide
/// planes), where the rank and head size allow (a power of two up to [`MAX_RANK`],
/// `head_dim <= UNITS`), also the o product's LoRA down-projection into `o_lora.t`. Returns
/// whether it did.
pub(super) fn combine<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: &AttentionShape,
    (part_o, part_ml, part_len): (&Handle, &Handle, usize),
    splits: usize,
    out: &Handle,
    o_lora: Option<&OLora<'_>>,
) -> bool {
    let d = s.head_dim;
    let group = s.q_heads / s.kv_heads;
    let heads = s.rows * s.q_heads;
    let lora = o_lora.filter(|l| {
        l.rank.is_power_of_two()
            && l.rank <= MAX_RANK
            && d <= UNITS as usize
            && R::name(client) == "cuda"
            && client.properties().hardware.plane_size_max == 32
            && client.properties().hardware.plane_size_min == 32
    });
    let rank = lora.map_or(0, |l| l.rank);
    let q_dim = s.q_heads * d;
    // Without the LoRA its buffers are bound to the partial outputs and never touched.
    let (a, sums, counters, t) = match lora {
        Some(l) => (l.a, l.head_sums, l.counters, l.t),
        None => (part_o, part_o, part_o, part_o),
    };
    let len = |n: usize| if lora.is_some() { n } else { 1 };
    // SAFETY: the partials hold `part_len` (row, kv head, span) groups of `group` heads, `out`
    // `rows * q_dim` elements; with the LoRA, `a` holds `rank * q_dim`, the head sums
    // `rows * q_heads * rank`, the counters `rows` and `t` `rows * rank` (sized by the engine
    // from the same shape). The kernel reads spans below `splits`, channels below `head_dim`.
    unsafe {
        combine_kernel::launch_unchecked::<F, R>(
            client,
            grid_rows(heads),
            CubeDim::new_1d(UNITS),
            ArrayArg::from_raw_parts(part_o.clone(), part_len * d),
            ArrayArg::from_raw_parts(part_ml.clone(), part_len * 2),
            ArrayArg::from_raw_parts(out.clone(), s.rows * q_dim),
            ArrayArg::from_raw_parts(a.clone(), len(rank * q_dim)),
            ArrayArg::from_raw_parts(sums.clone(), len(heads * rank)),
            ArrayArg::from_raw_parts(counters.clone(), len(s.rows)),
            ArrayArg::from_raw_parts(t.clone(), len(s.rows * rank)),
            heads as u32,
            splits as u32,
            s.q_heads as u32,
            group,
            d,
            MAX_SPLITS,
            rank,
            R::name(client) == "cuda",
        );
    }
    lora.is_some()
}
