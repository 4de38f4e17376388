//! LoRA down-projections of a decode batch on tensor cores: hand-written CUDA
//! (`lora_down_mma.cu`) launched through [`crate::cuda_source`]. For one to three adapters
//! `A_s [rank, K]` sharing the input `X [m, K]` (q/k/v, gate/up; o and down alone), one launch
//! computes `T_s [m, rank] = X · A_sᵀ` in f32 (bf16 or f16 operands, `K` a multiple of 32, the
//! rank a multiple of 8, at most [`MAX_COLS`] adapter rows, `m` <= [`MAX_M`]).
//!
//! Why: the data are small (at 64 rows and rank 16, X is 0.46 MB and q/k/v's adapters 0.34
//! MB for K = 3584) and already in L2, so what costs is how many multiprocessors read them and
//! how long each waits. The plane kernel of the engine gives a cube a tile of outputs over the
//! whole of K: at 64 rows 16 to 48 cubes, each reading up to 0.6 MB and doing the products in
//! f32 FMAs at 12% occupancy, 5.9-8.6 µs a launch (ncu, H200, 2026-11-28; 112 launches a step,
//! 0.68 ms). Here the products go to `mma.m16n8k16` and K is cut over ~[`Knobs::target`] cubes
//! of each 16-row group, each reading a few KB; the group's last cube adds the cubes' sums.
//!
//! Deterministic and batch-invariant: the cut of K depends on K (and the knobs) alone and the
//! sums are added in a fixed order (steps, warps, cubes), so each output is the same chain of
//! additions whatever `m`; an `mma` output reads only its own row of X.

use crate::cuda_source;
use cubecl::prelude::*;
use cubecl::server::Handle;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

const SOURCE: &str = include_str!("lora_down_mma.cu");
const ENTRY: &str = "qerl_lora_down_mma";

/// Most rows: 16 row groups.
pub const MAX_M: usize = 256;
/// Most adapter rows of one launch (all adapters together): 12 `mma` column tiles.
pub const MAX_COLS: usize = 96;
/// Reduction depth of one step (two `m16n8k16` products).
const STEP: usize = 32;

/// Most cubes of a thread-block cluster every sm_90 device takes.
const MAX_CLUSTER: usize = 8;
/// Bytes of static shared memory a cube may take (the warps' sums).
const SHARED_BYTES: usize = 48 * 1024;

/// Tuning knobs, read once from the environment (experiments): `QERL_LORA_MMA=0` turns the
/// kernel off, `QERL_LORA_MMA_WARPS` (1 to 16, a power of two) sets the warps of a cube,
/// `QERL_LORA_MMA_CUBES` (1 to 64) the cubes a row group aims at, `QERL_LORA_MMA_CLUSTER=0`
/// adds the cubes' sums through global memory and an atomic count alone even where clusters
/// exist, and `QERL_LORA_MMA_LOADS` (4 to 32) the 16-byte loads a lane
/// has in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Knobs {
    enabled: bool,
    warps: usize,
    target: usize,
    cluster: bool,
    loads: usize,
}

impl Knobs {
    const DEFAULT: Knobs = Knobs {
        enabled: true,
        warps: 8,
        target: 8,
        cluster: true,
        loads: 16,
    };

    fn get() -> Knobs {
        static KNOBS: OnceLock<Knobs> = OnceLock::new();
        *KNOBS.get_or_init(|| {
            let num = crate::device::env_knob;
            let d = Knobs::DEFAULT;
            Knobs {
                enabled: crate::device::env_switch("QERL_LORA_MMA"),
                warps: num(
                    "QERL_LORA_MMA_WARPS",
                    &|v| v.is_power_of_two() && v <= 16,
                    d.warps,
                ),
                target: num("QERL_LORA_MMA_CUBES", &|v| (1..=64).contains(&v), d.target),
                cluster: crate::device::env_switch("QERL_LORA_MMA_CLUSTER"),
                loads: num("QERL_LORA_MMA_LOADS", &|v| (4..=32).contains(&v), d.loads),
            }
        })
    }
}

/// One configuration of the kernel: what its text is compiled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Plan {
    warps: usize,
    segments: usize,
    rank: usize,
    /// Steps of [`STEP`] a warp.
    steps: usize,
    /// Cubes a 16-row group (K-chunks of `warps · steps` steps).
    cubes: usize,
    /// Steps whose loads a lane has in flight.
    depth: usize,
    f16: bool,
    /// Cubes a thread-block cluster (sm_90; dividing `cubes`), which add their sums in shared
    /// memory; 1 without clusters.
    cl: usize,
}

impl Plan {
    /// The cut of `k` for `segments` adapters of rank `rank` (independent of the rows), or
    /// `None` where the kernel does not take the shape. `cluster`: the device has clusters
    /// (and the knob allows them): at most [`MAX_CLUSTER`] cubes a group.
    fn new(
        segments: usize,
        rank: usize,
        k: usize,
        f16: bool,
        cluster: bool,
        knobs: Knobs,
    ) -> Option<Plan> {
        let ok = (1..=3).contains(&segments)
            && rank > 0
            && rank.is_multiple_of(8)
            && segments * rank <= MAX_COLS
            && k > 0
            && k.is_multiple_of(STEP);
        if !ok {
            return None;
        }
        let k_steps = k / STEP;
        let tiles = segments * rank / 8;
        // The warps' sums (16 rows by 8·tiles f32 each) fit the shared memory.
        let mut warps = knobs.warps;
        while warps > 1 && warps * 16 * 8 * tiles * 4 > SHARED_BYTES {
            warps /= 2;
        }
        let steps = k_steps.div_ceil(warps * knobs.target);
        let mut cubes = k_steps.div_ceil(warps * steps);
        // Clusters as even as they come: 14 cubes are two of 7, 30 four of 8 (two idle cubes).
        let mut cl = 1;
        if cluster && cubes > 1 {
            cl = cubes.div_ceil(cubes.div_ceil(MAX_CLUSTER));
            cubes = cubes.div_ceil(cl) * cl;
        }
        let depth = (knobs.loads / (2 + tiles)).clamp(1, 8).min(steps);
        Some(Plan {
            warps,
            segments,
            rank,
            steps,
            cubes,
            depth: 1 << depth.ilog2(),
            f16,
            cl,
        })
    }

    fn source(&self) -> String {
        let mut text = cuda_source::defines(&[
            ("WARPS", self.warps),
            ("SEGMENTS", self.segments),
            ("RANK", self.rank),
            ("NT", self.segments * self.rank / 8),
            ("STEPS", self.steps),
            ("CUBES", self.cubes),
            ("DEPTH", self.depth),
            ("IS_F16", self.f16 as usize),
            ("CL", self.cl),
        ]);
        text.push_str(cuda_source::COMMON);
        text.push_str(SOURCE);
        text
    }

    /// f32 values of the sums a row group stores (one a cluster, or one a cube without
    /// clusters; none when it is one cluster or one cube) at `m` rows.
    fn scratch_floats(&self, m: usize) -> usize {
        match self.cubes / self.cl {
            1 => 0,
            parts => m.div_ceil(16) * parts * 16 * self.segments * self.rank,
        }
    }
}

static LAUNCHES: AtomicUsize = AtomicUsize::new(0);
static SOURCES: std::sync::LazyLock<cuda_source::SourceCache<Plan>> =
    std::sync::LazyLock::new(Default::default);

/// Launches this kernel has run in this process (tests check that it ran).
pub fn launches() -> usize {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Whether `F` is f16 (else bf16), or `None` for another type.
pub(crate) fn is_f16<F: Float>() -> Option<bool> {
    let ty = F::as_type_native_unchecked();
    if ty == half::bf16::as_type_native_unchecked() {
        Some(false)
    } else if ty == half::f16::as_type_native_unchecked() {
        Some(true)
    } else {
        None
    }
}

/// The plan for this shape where the kernel runs here: CUDA with bf16/f16 `mma.m16n8k16`,
/// 1 to [`MAX_M`] rows and a shape [`Plan::new`] takes.
fn plan<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    adapters: usize,
    rank: usize,
    k: usize,
) -> Option<Plan> {
    let knobs = Knobs::get();
    let f16 = is_f16::<F>()?;
    let here = knobs.enabled
        && (1..=MAX_M).contains(&m)
        && crate::cublas::cuda_client(client).is_some()
        && crate::device::has_f32_mma::<R, F>(client, (16, 8, 16), false);
    // Clusters came with sm_90, as did TMA (which cubecl reports).
    let cluster = knobs.cluster
        && client
            .properties()
            .features
            .tma
            .contains(cubecl::features::Tma::Base);
    here.then(|| Plan::new(adapters, rank, k, f16, cluster, knobs))
        .flatten()
}

/// Whether [`lora_down_mma`] runs this shape on this client.
pub fn applies<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    adapters: usize,
    rank: usize,
    k: usize,
) -> bool {
    plan::<R, F>(client, m, adapters, rank, k).is_some()
}

/// The f32 values of scratch ("sums") [`lora_down_mma`] may need at up to `m` rows of depth
/// `k`, whatever the adapters (the most columns it takes, [`MAX_COLS`]); 0 where it does not
/// run here. Callers size one buffer with the largest over their depths.
pub fn scratch_floats<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    k: usize,
) -> usize {
    (8..=MAX_COLS)
        .step_by(8)
        .filter_map(|cols| plan::<R, F>(client, m, 1, cols, k))
        .map(|p| p.scratch_floats(m))
        .max()
        .unwrap_or(0)
}

/// `t_s [m, rank] = x [m, k] · a_sᵀ` in f32 for each adapter `a_s [rank, k]` in `F` (one to
/// three), on tensor cores. `sums` holds [`scratch_floats`] f32 values (any buffer when 0),
/// `counters` at least `ceil(m / 16)` u32 that are 0 (and are 0 again after the launch).
/// Returns false, launching nothing, where it does not apply (see [`applies`]).
#[allow(clippy::too_many_arguments)]
pub fn lora_down_mma<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    a: &[&Handle],
    rank: usize,
    k: usize,
    t: &[&Handle],
    sums: &Handle,
    counters: &Handle,
) -> bool {
    let segments = a.len();
    let Some(plan) = plan::<R, F>(client, m, segments, rank, k) else {
        return false;
    };
    let Some(cuda) = crate::cublas::cuda_client(client) else {
        return false;
    };
    assert_eq!(t.len(), segments, "lora_down_mma: one output per adapter");
    let e = std::mem::size_of::<F>() as u64;
    let big = |h: &Handle, len: usize, e: u64| h.size_in_used() >= len as u64 * e;
    let groups = m.div_ceil(16);
    assert!(
        big(x, m * k, e)
            && a.iter().all(|h| big(h, rank * k, e))
            && t.iter().all(|h| big(h, m * rank, 4))
            && big(sums, plan.scratch_floats(m), 4)
            && big(counters, groups, 4),
        "lora_down_mma: buffers smaller than x [{m}, {k}], a [{rank}, {k}], t [{m}, {rank}], \
         {} sums, {groups} counters",
        plan.scratch_floats(m)
    );
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let buffers = [
        x,
        a[0],
        a[1.min(segments - 1)],
        a[2.min(segments - 1)],
        t[0],
        t[1.min(segments - 1)],
        t[2.min(segments - 1)],
        sums,
        counters,
    ]
    .map(|h| h.clone().binding())
    .to_vec();
    let scalars = [m as u32, (k / 8) as u32, (k / STEP) as u32];
    // SAFETY: x holds m·k, each adapter rank·k and each output m·rank elements and `sums` the
    // plan's scratch (asserted above). The kernel clamps rows to m − 1 and steps to k / 32 − 1
    // (k a multiple of 32: `Plan::new`), reads adapter rows below segments·rank (its column
    // tiles), stores T only for rows below m and columns below the rank of their adapter, and
    // its sums at `(group · cubes + cube) · 16 · segments · rank` below the scratch size; it
    // counts at `counters[group]`, group < ceil(m / 16). The scalars are `Info`'s layout.
    unsafe {
        cuda_source::launch(
            cuda,
            cuda_source::cached(&SOURCES, &plan, ENTRY, || plan.source()),
            ENTRY,
            (32 * plan.warps) as u32,
            (plan.cubes as u32, groups as u32, 1),
            buffers,
            &scalars,
        )
    };
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cut of K for the Qwen2.5 shapes: whole steps, every step in exactly one warp, and
    /// the scratch of 64 rows of q/k/v under 1 MB.
    #[test]
    fn plans_cover_k() {
        for cluster in [true, false] {
            for k in [896, 3584, 5120, 18944, 27648, 4864] {
                for (segments, rank) in [(3, 16), (2, 16), (1, 16), (3, 32), (1, 64), (1, 8)] {
                    let p = Plan::new(segments, rank, k, false, cluster, Knobs::DEFAULT).unwrap();
                    let per_cube = p.warps * p.steps;
                    assert!(p.cubes * per_cube >= k / STEP, "{k} {p:?}");
                    assert!(p.depth.is_power_of_two() && p.depth <= p.steps.max(1));
                    assert!(p.scratch_floats(64) * 4 <= 1 << 20, "{k} {p:?}");
                    assert!(p.warps * 16 * segments * rank * 4 <= SHARED_BYTES);
                    assert!(
                        p.cl <= MAX_CLUSTER && p.cubes.is_multiple_of(p.cl),
                        "{k} {p:?}"
                    );
                    assert!(cluster || p.cl == 1);
                    let idle = p.cubes - (k / STEP).div_ceil(per_cube);
                    assert!(idle < p.cl, "{k} {p:?}: {idle} idle cubes");
                }
            }
        }
        let d = Knobs::DEFAULT;
        assert!(Plan::new(3, 48, 3584, false, true, d).is_none());
        assert!(Plan::new(1, 12, 3584, false, true, d).is_none());
        assert!(Plan::new(1, 16, 1000, false, true, d).is_none());
    }

    /// The text names every define it uses.
    #[test]
    fn source_defines_the_configuration() {
        let p = Plan::new(3, 16, 3584, false, true, Knobs::DEFAULT).unwrap();
        let text = p.source();
        let names = [
            "WARPS", "SEGMENTS", "RANK", "NT", "STEPS", "CUBES", "DEPTH", "IS_F16",
        ];
        for name in names.into_iter().chain(["CL"]) {
            assert!(text.contains(&format!("#define {name} ")), "{name}");
        }
        assert!(text.contains("#define NT 6\n") && text.contains(ENTRY));
    }
}
