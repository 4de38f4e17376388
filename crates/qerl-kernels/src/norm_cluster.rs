//! The residual add + RMSNorm of a decode batch spread over a thread-block cluster, with the
//! LoRA down-projections of the products that read its output: hand-written CUDA
//! (`norm_cluster.cu`, sm_90 clusters) launched through [`crate::cuda_source`].
//!
//! For each row: `e = h + d` (or `h + F(Σ K-slices)` of a split product, or `h` alone), stored
//! back to `h`; `y = F(e / sqrt(mean(e²) + eps) ⊙ gain)`; and for one to three adapters
//! `A_s [rank, dim]` (q/k/v, gate/up; none for a plain norm) `T_s [row, :] = y · A_sᵀ` in f32.
//!
//! Why: at a decode batch of 64 the engine's norm gives a row to one cube of 256 units (64
//! cubes on 132 multiprocessors, each reading its row's nine f32 K-slices of the o or down
//! product, 129 KB): 9.2 µs a launch, latency-bound at 12% occupancy (ncu, H200, 2026-11-29),
//! and the LoRA down-projections that read its output are a second launch of ~6 µs (56 of
//! each a 7B step). Here a row is shared by the eight cubes of a cluster, which meet through
//! distributed shared memory twice: for the sum of squares, and for `T`; a cluster takes 4 rows
//! by default (the adapters' vectors are read once a cluster: 2 rows a cluster measured
//! slower, 8 no faster).
//!
//! Measured (H200, 2026-11-29, 7B, batch 64): 10.9 µs a launch against 9.2 + 6.3 for the norm
//! and the LoRA launch it replaces, a step 6.60-6.67 ms against 6.74-6.80. What binds it: the
//! K-slices' loads, which ptxas interleaves with their additions (see the `.cu`), and the
//! cluster barriers (a fifth of the stall samples). At one row (where the engine's own fused
//! norm + LoRA kernel takes 1 to 8 rows) and at 256 it was slower (3.20-3.25 against
//! 3.17-3.18 ms a step; 16.98 against 16.31), hence the rows it takes by default: 9 to 127.
//!
//! Arithmetic: the norm is the engine's unfused kernel's bit for bit. That kernel's unit `t`
//! of 256 holds the vectors `t, t + 256, ...` and the units' sums meet in a tree with strides
//! 128 to 1; here cube `j` holds the units `32j .. 32j + 32`, one a lane (warp-wide loads of
//! 512 contiguous bytes), the units' sums go through the cluster's shared memory, and every
//! cube adds all 256 by the same tree. A first form gave cube `j` the units `t = j (mod 8)`,
//! whose loads touched 32 cache lines a warp: 7.00 ms a batch-64 step against 6.77 unfused
//! (H200, 2026-11-29). `T` is summed per lane in order, per warp by a shuffle tree and over
//! the cubes in cube order: deterministic, and per row, so batch-invariant.

use crate::cuda_source;
use cubecl::prelude::*;
use cubecl::server::Handle;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

const SOURCE: &str = include_str!("norm_cluster.cu");
const ENTRY: &str = "qerl_norm_cluster";

/// Cubes a cluster (the kernel's `CL`): the unfused kernel's 256 units are 32 a cube.
const CLUSTER: usize = 8;
/// Units of a row in the unfused kernel (the engine's `ROW_CUBE`).
const UNITS: usize = 256;
/// Elements a vector (16 bytes of bf16/f16).
const VEC: usize = 8;
/// Warps a cube.
const WARPS: usize = 8;
/// Most f32 K-slices of a split product the kernel adds (all of a vector's are loaded into
/// registers at once).
pub const MAX_SLICES: usize = 12;
/// Most adapter vectors a lane holds in registers (`AR · LV`).
const MAX_HELD: usize = 32;

/// Tuning knobs, read once from the environment (experiments): `QERL_NORM_CLUSTER=0` turns
/// the kernel off, `QERL_NORM_CLUSTER_RPC` (1, 2, 4 or 8) sets the rows a cluster, and
/// `QERL_NORM_CLUSTER_MIN_ROWS` / `_MAX_ROWS` the batch rows it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Knobs {
    enabled: bool,
    rpc: usize,
    min_rows: usize,
    max_rows: usize,
}

impl Knobs {
    const DEFAULT: Knobs = Knobs {
        enabled: true,
        rpc: 4,
        min_rows: 9,
        max_rows: 127,
    };

    fn get() -> Knobs {
        static KNOBS: OnceLock<Knobs> = OnceLock::new();
        *KNOBS.get_or_init(|| {
            let num = crate::device::env_knob;
            let d = Knobs::DEFAULT;
            Knobs {
                enabled: crate::device::env_switch("QERL_NORM_CLUSTER"),
                rpc: num(
                    "QERL_NORM_CLUSTER_RPC",
                    &|v| v.is_power_of_two() && v <= WARPS,
                    d.rpc,
                ),
                min_rows: num("QERL_NORM_CLUSTER_MIN_ROWS", &|v| v >= 1, d.min_rows),
                max_rows: num("QERL_NORM_CLUSTER_MAX_ROWS", &|v| v >= 1, d.max_rows),
            }
        })
    }
}

/// One configuration of the kernel: what its text is compiled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Plan {
    /// Rows a cluster.
    rpc: usize,
    /// Vectors a unit of the unfused kernel holds (and a lane of the LoRA sums).
    per_unit: usize,
    segments: usize,
    rank: usize,
    /// Adapter rows a warp.
    ar: usize,
    add: bool,
    slices: usize,
    f16: bool,
}

impl Plan {
    /// The plan for a row of `dim` with `segments` adapters of rank `rank`, or `None` where
    /// the kernel does not take the shape.
    fn new(
        dim: usize,
        segments: usize,
        rank: usize,
        (add, slices): (bool, usize),
        f16: bool,
        rpc: usize,
    ) -> Option<Plan> {
        let vecs = dim / VEC;
        let per_unit = vecs.div_ceil(UNITS);
        let na = segments * rank;
        let ar = na.div_ceil(WARPS);
        let ok = dim.is_multiple_of(VEC)
            && vecs >= CLUSTER
            && segments <= 3
            && (segments == 0 || rank > 0)
            && ar * per_unit <= MAX_HELD
            && slices <= MAX_SLICES
            && (add || slices == 0)
            && rpc.is_power_of_two()
            && rpc <= WARPS;
        ok.then_some(Plan {
            rpc,
            per_unit,
            segments,
            rank: if segments == 0 { 1 } else { rank },
            ar: ar.max(1),
            add,
            slices,
            f16,
        })
    }

    fn source(&self) -> String {
        let mut text = cuda_source::defines(&[
            ("WARPS", WARPS),
            ("RPC", self.rpc),
            ("PER_UNIT", self.per_unit),
            ("SEGMENTS", self.segments),
            ("RANK", self.rank),
            ("AR", self.ar),
            ("LV", self.per_unit),
            ("ADD", self.add as usize),
            ("SLICES", self.slices),
            ("IS_F16", self.f16 as usize),
        ]);
        text.push_str(cuda_source::COMMON);
        text.push_str(SOURCE);
        text
    }
}

static LAUNCHES: AtomicUsize = AtomicUsize::new(0);
static SOURCES: std::sync::LazyLock<cuda_source::SourceCache<Plan>> =
    std::sync::LazyLock::new(Default::default);

/// Launches this kernel has run in this process (tests check that it ran).
pub fn launches() -> usize {
    LAUNCHES.load(Ordering::Relaxed)
}

/// What the norm adds to the residual stream first.
#[derive(Clone, Copy, Debug)]
pub enum Add<'a> {
    /// Nothing.
    None,
    /// A product's output `d [rows, dim]` in `F`.
    Dense(&'a Handle),
    /// A split product's f32 K-slices `[slices, rows, dim]`, added in slice order.
    Parts(&'a Handle, usize),
}

impl Add<'_> {
    fn mode(&self) -> (bool, usize) {
        match self {
            Add::None => (false, 0),
            Add::Dense(_) => (true, 0),
            Add::Parts(_, s) => (true, *s),
        }
    }
}

/// The plan where the kernel runs here: CUDA with clusters (sm_90), bf16 or f16, rows inside
/// the knobs' range and a shape [`Plan::new`] takes; `rpc` overrides the knob.
fn plan<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    rows: usize,
    dim: usize,
    segments: usize,
    rank: usize,
    add: (bool, usize),
    rpc: Option<usize>,
) -> Option<Plan> {
    let knobs = Knobs::get();
    let f16 = crate::lora_down_mma::is_f16::<F>()?;
    let here = knobs.enabled
        && rows >= 1
        && (rpc.is_some() || (knobs.min_rows..=knobs.max_rows).contains(&rows))
        && crate::cublas::cuda_client(client).is_some()
        // Clusters came with sm_90, as did TMA (which cubecl reports).
        && client
            .properties()
            .features
            .tma
            .contains(cubecl::features::Tma::Base);
    here.then(|| Plan::new(dim, segments, rank, add, f16, rpc.unwrap_or(knobs.rpc)))
        .flatten()
}

/// `h += residual` (in place), `y = rmsnorm(h) ⊙ gain` and `t_s = y · a_sᵀ` (f32) for `rows`
/// rows of width `dim` (see the module documentation): `h`, `y`, `d` `[rows, dim]` in `F`,
/// the K-slices `[slices, rows, dim]` f32, `gain [dim]` f32, each adapter `a_s [rank, dim]` in
/// `F`, each `t_s [rows, rank]` f32; no adapters for a plain norm. `rows_per_cluster` overrides
/// the knob (tests). Returns false, launching nothing, where the kernel does not apply here.
#[allow(clippy::too_many_arguments)]
pub fn add_norm_lora<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    h: &Handle,
    add: Add<'_>,
    gain: &Handle,
    rows: usize,
    dim: usize,
    eps: f32,
    y: &Handle,
    (a, rank, t): (&[&Handle], usize, &[&Handle]),
    rows_per_cluster: Option<usize>,
) -> bool {
    let segments = a.len();
    let Some(plan) = plan::<R, F>(
        client,
        rows,
        dim,
        segments,
        rank,
        add.mode(),
        rows_per_cluster,
    ) else {
        return false;
    };
    let Some(cuda) = crate::cublas::cuda_client(client) else {
        return false;
    };
    assert_eq!(t.len(), segments, "add_norm_lora: one output per adapter");
    let e = std::mem::size_of::<F>() as u64;
    let big = |h: &Handle, len: usize, e: u64| h.size_in_used() >= len as u64 * e;
    let (d, parts) = match add {
        Add::None => (h, h),
        Add::Dense(d) => (d, h),
        Add::Parts(p, _) => (h, p),
    };
    assert!(
        big(h, rows * dim, e)
            && big(y, rows * dim, e)
            && big(gain, dim, 4)
            && (!matches!(add, Add::Dense(_)) || big(d, rows * dim, e))
            && (!matches!(add, Add::Parts(..)) || big(parts, plan.slices * rows * dim, 4))
            && a.iter().all(|h| big(h, rank * dim, e))
            && t.iter().all(|h| big(h, rows * rank, 4)),
        "add_norm_lora: buffers smaller than h, y [{rows}, {dim}], gain [{dim}], \
         {} slices, a [{rank}, {dim}], t [{rows}, {rank}]",
        plan.slices
    );
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let pick = |v: &[&Handle], i: usize| (*v.get(i.min(v.len().max(1) - 1)).unwrap_or(&h)).clone();
    let buffers = [
        h.clone(),
        d.clone(),
        parts.clone(),
        gain.clone(),
        pick(a, 0),
        pick(a, 1),
        pick(a, 2),
        y.clone(),
        pick(t, 0),
        pick(t, 1),
        pick(t, 2),
    ]
    .map(|h| h.binding())
    .to_vec();
    let scalars = [
        rows as u32,
        (dim / VEC) as u32,
        (dim as f32).to_bits(),
        eps.to_bits(),
    ];
    // SAFETY: h, y and d hold rows·dim elements, the K-slices slices·rows·dim f32, gain dim
    // f32, each adapter rank·dim and each T rows·rank (asserted above). The kernel clamps its
    // rows to rows − 1 and its vectors to dim / 8 − 1 (dim a multiple of 8: `Plan::new`), reads
    // adapter rows below segments·rank and stores h, y and T only for rows below `rows`. The
    // scalars are `Info`'s layout.
    unsafe {
        cuda_source::launch(
            cuda,
            cuda_source::cached(&SOURCES, &plan, ENTRY, || plan.source()),
            ENTRY,
            (32 * WARPS) as u32,
            (CLUSTER as u32, rows.div_ceil(plan.rpc) as u32, 1),
            buffers,
            &scalars,
        )
    };
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Qwen2.5 widths are taken with three adapters of rank 16 and 32 (and none), a
    /// 9-slice split; ranks that would hold too many registers, 13 slices, or slices without an
    /// add, are not.
    #[test]
    fn plans_take_the_qwen_widths() {
        for dim in [896, 1536, 2048, 3584, 5120, 8192] {
            let wide = if dim <= 3584 { (3, 32) } else { (1, 32) };
            for (segments, rank) in [(3, 16), (2, 16), wide, (0, 0)] {
                let p = Plan::new(dim, segments, rank, (true, 9), false, 4)
                    .unwrap_or_else(|| panic!("{dim} {segments} {rank}"));
                assert!(p.per_unit * UNITS * VEC >= dim && p.ar * WARPS >= segments * rank);
            }
        }
        assert!(Plan::new(3584, 3, 128, (true, 0), false, 4).is_none());
        assert!(Plan::new(3584, 3, 16, (false, 2), false, 4).is_none());
        assert!(Plan::new(3588, 3, 16, (true, 0), false, 4).is_none());
        assert!(Plan::new(3584, 3, 16, (true, 0), false, 3).is_none());
        assert!(Plan::new(3584, 3, 16, (true, MAX_SLICES + 1), false, 4).is_none());
    }

    /// The text names every define it uses.
    #[test]
    fn source_defines_the_configuration() {
        let p = Plan::new(3584, 3, 16, (true, 9), false, 4).unwrap();
        let text = p.source();
        for name in [
            "WARPS", "RPC", "PER_UNIT", "SEGMENTS", "RANK", "AR", "LV", "ADD", "SLICES", "IS_F16",
        ] {
            assert!(text.contains(&format!("#define {name} ")), "{name}");
        }
        assert!(text.contains("#define AR 6\n") && text.contains(ENTRY));
    }
}
