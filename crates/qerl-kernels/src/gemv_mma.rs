//! The decode product for a few tokens (M <= 8) on tensor cores: hand-written CUDA
//! (`gemv_mma.cu`) launched through [`crate::cuda_source`] (CUDA, bf16, E2M1 weights, `K` a
//! multiple of 128). Where it applies it replaces [`crate::gemv`]'s kernel inside that module's
//! launches, with the same outputs (`Y`, or f32 K-slices for the caller to add).
//!
//! Why: the CUDA-core decode kernel spends ~4.3 instructions a 4-bit code (shift, mask, a
//! shared-memory table read, an f32 FMA, and the conversion of `X`), which caps it at ~1.5
//! TB/s of weights on an H100 or H200 (ncu, docs/benchmarks/rollout.md sessions 16-17) against
//! 3-4 TB/s of copy bandwidth. On `mma.m16n8k16` two codes take ~4 instructions to decode into a
//! scaled bf16 pair (the staged kernel's spread decoding) and the tensor cores do the products:
//! the seven idle token columns of a batch-1 `mma` cost nothing, the instructions saved do.
//! Each warp keeps [`Plan::depth`] 128-deep chunks of codes and scales in flight; `X` of the
//! cube's K-slice is copied once into shared memory in fragment order.
//!
//! Numbers: the decoded weight is rounded to bf16 (as in the batch kernels), the sums are f32.

use crate::cuda_source::{self, SegmentArgs};
use crate::device::DeviceWeight;
use crate::gemv::Segment;
use crate::splitk;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_format::QuantFormat;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

const SOURCE: &str = include_str!("gemv_mma.cu");
const ENTRY: &str = "qerl_gemv_mma";

/// Reduction depth of one chunk: 16 bytes of codes a lane and row.
pub(crate) const CHUNK: usize = 128;
/// Warps a cube: `8 / kp` row groups of `kp` warps each.
const WARPS: usize = 8;
/// Most tokens: one 8-token tile.
pub(crate) const MAX_M: usize = 8;
/// Time a warp spends outside its K loop (the first loads' latency, the copy of `X`, the
/// epilogue), in chunks: the planner's cost model.
const WARP_OVERHEAD_CHUNKS: f64 = 1.5;
/// What a split costs beyond its waves, in chunks: `SPLIT_CHUNKS` (the reduction's launch, or
/// the engine's norm adding the slices) and `SLICE_CHUNKS` a slice (reading its partial sums:
/// on an H200 at batch 1 the norm after the down product took 6.7 µs with 2 slices, 9.5 with
/// 7 and 13.1 with 14, ncu, 2026-11-28).
const SPLIT_CHUNKS: f64 = 3.0;
const SLICE_CHUNKS: f64 = 0.75;
/// u32 words of shared memory the copy of `X` may take at one row tile a warp (42 KiB: with
/// the scale table and the warps' sums a cube stays under the 48 KiB of static shared memory).
const XS_WORDS: usize = 10_752;
/// u32 words the warps' sums take for each further row tile a warp (`red` in `gemv_mma.cu`:
/// eight warps, four f32 a tile, 32 lanes), which the copy of `X` gives up: at two tiles a
/// warp the full copy made a cube of 52,032 bytes, which ptxas refuses (sass_local.py,
/// 2026-11-29).
const RED_WORDS_A_TILE: usize = WARPS * 4 * 32;
/// Static shared memory a cube may take, and what the scale table takes of it.
const SHARED_BYTES: usize = 48 << 10;
const STAB_BYTES: usize = 1024;
/// Bytes of one stage of the shared ring (`STAGES` > 0) for all warps of a cube: each warp's
/// 16 rows of one chunk, 64 bytes of codes and (NVFP4, the larger) 8 scale bytes a row.
const RING_STAGE_BYTES: usize = WARPS * 16 * (CHUNK / 2 + CHUNK / 16);

/// Fewest chunks a warp walks for the shared ring to be taken: on an H200 (2026-11-29, ncu, a
/// 7B step at batch 1) the ring took gate/up (7 chunks a warp) from 31.5 to 30.9 µs and down
/// (13) from 19.7 to 19.0, but q/k/v (4) from 9.1 to 9.7; the one-wave products of a few
/// chunks a warp keep the register ring.
const RING_MIN_CHUNKS: usize = 6;
/// [`RING_MIN_CHUNKS`], or what a test set ([`set_ring_min_chunks`]).
static RING_MIN: AtomicUsize = AtomicUsize::new(RING_MIN_CHUNKS);

/// Sets the fewest chunks a warp walks for the shared ring (tests: 0 takes it wherever it
/// fits); returns the previous value.
pub(crate) fn set_ring_min_chunks(chunks: usize) -> usize {
    RING_MIN.swap(chunks, Ordering::Relaxed)
}

/// Most chunks of a K-slice whose `X` fits the shared copy at `m` tokens (its layout:
/// `m · (64 · chunks + 16)` words) beside the warps' sums of `rt` row tiles a warp, or beside
/// a ring of `stages` (one row tile a warp; the warps' sums then live in the ring).
fn max_slice_chunks(m: usize, stages: usize, rt: usize) -> usize {
    let words = match stages {
        0 => XS_WORDS - (rt.max(1) - 1) * RED_WORDS_A_TILE,
        s => SHARED_BYTES.saturating_sub(STAB_BYTES + s * RING_STAGE_BYTES) / 4,
    };
    (words / m.max(1)).saturating_sub(16) / 64
}

/// Tuning knobs, read once from the environment (experiments): `QERL_GEMV_MMA=0` turns the
/// kernel off, `QERL_GEMV_MMA_RT` (1, 2) sets the 16-row tiles a warp, `QERL_GEMV_MMA_DEPTH`
/// (1 to 4) the chunks in flight, `QERL_GEMV_MMA_CUBES` (1 to 4) the cubes a multiprocessor
/// must hold (the register cap), `QERL_GEMV_MMA_KP` (1, 2, 4, 8) the warps a row group,
/// `QERL_GEMV_MMA_STAGES` (0 to 4) the chunks of the shared ring at one token (3 by default;
/// 0: the register ring of `depth` chunks), `QERL_GEMV_MMA_X_AHEAD=0` copies `X` after the
/// first weight loads, `QERL_GEMV_MMA_RING_MIN` sets [`RING_MIN_CHUNKS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Knobs {
    pub enabled: bool,
    pub rt: usize,
    pub depth: usize,
    pub min_cubes: usize,
    /// 0: chosen by [`Plan::new`].
    pub kp: usize,
    /// Chunks in the shared ring at one token, 0 for none.
    pub stages: usize,
    /// `X` and the scale table loaded ahead of the first weight loads where a thread holds
    /// few items of `X` (`gemv_mma.cu`'s `X_AHEAD`).
    pub x_ahead: bool,
}

impl Knobs {
    /// Two chunks in flight: on an H200 (2026-11-28, ncu, one 7B decode step at batch 1, one
    /// call) 2, 3 and 4 took the step in 3.29, 3.34 and 3.47 ms of GPU time (gate/up 33.6,
    /// 35.1, 36.9 µs), 80 registers each (three 8-warp cubes a multiprocessor).
    ///
    /// The shared ring of three stages at one token, where a warp walks at least
    /// [`RING_MIN_CHUNKS`] chunks: on an H200 (2026-11-29) it took gate/up from 32.6 to 31.2
    /// µs and down from 20.3 to 19.4 at 7B, and the 32B step from 10.81-10.89 to 10.43-10.51
    /// ms in two calls of session 31 (equal in a third) and from 10.60 to 10.33 in session
    /// 32's. It was off in session 31 because the benchmark's check hung in two calls, both
    /// with a copy of `X` that batched its loads (reverted); the ring without it passed the
    /// check in both sessions, and compute-sanitizer's racecheck and memcheck on the kernel
    /// tests (docs/benchmarks/rollout.md, session 32). Session 33 found what those "hangs"
    /// were: a fresh machine's first run compiling ~217 kernels through NVRTC past the check's
    /// time limit (the GPU idle, cubecl's device thread inside NVRTC; tools/device_hang.sh).
    ///
    /// `X` ahead of the weights: on an H200 (2026-11-29, one call) the 7B step at batch 1 took
    /// 3.00 ms of GPU time against 3.09 (o 6.8 µs against 8.2), the 32B step 10.13-10.18 ms
    /// against 10.41-10.49.
    pub(crate) const DEFAULT: Knobs = Knobs {
        enabled: true,
        rt: 1,
        depth: 2,
        min_cubes: 3,
        kp: 0,
        stages: 3,
        x_ahead: true,
    };

    fn get() -> Knobs {
        static KNOBS: OnceLock<Knobs> = OnceLock::new();
        *KNOBS.get_or_init(|| {
            let num = crate::device::env_knob;
            let d = Knobs::DEFAULT;
            // `QERL_GEMV_MMA_RING_MIN`: the fewest chunks a warp walks for the shared ring.
            if let Ok(Ok(v)) = std::env::var("QERL_GEMV_MMA_RING_MIN").map(|v| v.parse()) {
                RING_MIN.store(v, Ordering::Relaxed);
            }
            Knobs {
                enabled: crate::device::env_switch("QERL_GEMV_MMA"),
                rt: num("QERL_GEMV_MMA_RT", &|v| v == 1 || v == 2, d.rt),
                depth: num("QERL_GEMV_MMA_DEPTH", &|v| (1..=4).contains(&v), d.depth),
                min_cubes: num(
                    "QERL_GEMV_MMA_CUBES",
                    &|v| (1..=4).contains(&v),
                    d.min_cubes,
                ),
                kp: num("QERL_GEMV_MMA_KP", &|v| [1, 2, 4, 8].contains(&v), d.kp),
                stages: num("QERL_GEMV_MMA_STAGES", &|v| v <= 4, d.stages),
                x_ahead: crate::device::env_switch("QERL_GEMV_MMA_X_AHEAD"),
            }
        })
    }
}

static LAUNCHES: AtomicUsize = AtomicUsize::new(0);

/// The texts built so far, by plan, block size, `(bias, LoRA)` and segments.
type SourceKey = (Plan, usize, (bool, bool), usize);
static SOURCES: std::sync::LazyLock<cuda_source::SourceCache<SourceKey>> =
    std::sync::LazyLock::new(Default::default);

/// Products this kernel has run in this process (tests check that it ran).
pub fn launches() -> usize {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Whether this kernel runs `m` rows of `weight` in `F` here: CUDA with `mma.m16n8k16` for
/// bf16, at most [`MAX_M`] rows, an E2M1 weight (NVFP4, MXFP4) with `K` a multiple of
/// [`CHUNK`], an even LoRA rank.
pub(crate) fn applies<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    weight: &DeviceWeight,
    lora_rank: Option<usize>,
) -> bool {
    Knobs::get().enabled
        && (1..=MAX_M).contains(&m)
        && F::as_type_native_unchecked() == half::bf16::as_type_native_unchecked()
        && weight.format != QuantFormat::Nf4
        && weight.k.is_multiple_of(CHUNK)
        && lora_rank.is_none_or(|r| r.is_multiple_of(2))
        && crate::cublas::cuda_client(client).is_some()
        && crate::device::has_f32_mma::<R, F>(client, (16, 8, 16), false)
}

/// Whether [`launch_segments`] takes these products: each applies, all share `K`, format,
/// epilogue terms and LoRA rank, and every `N` but the last fills whole cubes.
pub(crate) fn segments_apply<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    segs: &[Segment<'_>],
) -> bool {
    let Some(first) = segs.first() else {
        return false;
    };
    let rank = first.lora.map(|l| l.2);
    let ns: Vec<usize> = segs.iter().map(|s| s.weight.n).collect();
    let sms = splitk::multiprocessors(client);
    let Some(plan) = Plan::new(&ns, m, first.weight.k, sms, Knobs::get(), true) else {
        return false;
    };
    (2..=3).contains(&segs.len())
        && segs.iter().all(|s| {
            applies::<R, F>(client, m, s.weight, rank)
                && s.weight.k == first.weight.k
                && s.weight.format == first.weight.format
                && s.bias.is_some() == first.bias.is_some()
                && s.lora.map(|l| l.2) == rank
        })
        && ns[..ns.len() - 1]
            .iter()
            .all(|n| n.is_multiple_of(plan.width()))
}

/// A launch's shape: `rt` 16-row tiles a warp, `kp` warps a row group (each every `kp`-th
/// chunk), `cubes` along x (the segments' in order), `splits` K-slices of `per` chunks,
/// `stages` chunks a warp in the shared ring (0: `depth` in registers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Plan {
    pub m: usize,
    pub rt: usize,
    pub kp: usize,
    pub depth: usize,
    pub min_cubes: usize,
    pub cubes: usize,
    pub splits: usize,
    pub per: usize,
    pub stages: usize,
}

impl Plan {
    /// For weights of `ns` rows (one launch), `m` tokens and depth `k` on `sms`
    /// multiprocessors: the warps a row group (1, 2, 4, 8) and the K-slices (one weight only,
    /// never `unsplit`; forced ones as [`splitk::force_splits`] says) of least estimated time,
    /// `waves · (chunks a warp + WARP_OVERHEAD_CHUNKS)` (+ `SPLIT_CHUNKS` and `SLICE_CHUNKS` a
    /// slice when split), with
    /// `knobs.min_cubes` cubes a multiprocessor, each slice's `X` fitting the shared copy.
    /// Waves count: at batch 1 the kernel is bound by issue, so a partial last wave idles
    /// the multiprocessors it leaves out. The shared ring (`knobs.stages`) is taken at one
    /// token with one row tile a warp, where an unsplit launch still fits it and a warp walks
    /// at least [`RING_MIN_CHUNKS`] chunks. `None`:
    /// `unsplit` and `X` does not fit.
    pub(crate) fn new(
        ns: &[usize],
        m: usize,
        k: usize,
        sms: usize,
        knobs: Knobs,
        unsplit: bool,
    ) -> Option<Plan> {
        let rows = 16 * knobs.rt;
        let chunks = (k / CHUNK).max(1);
        let stages = match m == 1 && knobs.rt == 1 {
            true => knobs.stages,
            false => 0,
        };
        if stages > 0 && unsplit && chunks > max_slice_chunks(m, stages, knobs.rt) {
            return Plan::new(ns, m, k, sms, Knobs { stages: 0, ..knobs }, unsplit);
        }
        let most = max_slice_chunks(m, stages, knobs.rt);
        let slots = sms * knobs.min_cubes;
        // `splitk::plan` answers its forced count for any shape when one is set.
        let forced = splitk::plan(1, chunks, 1, 1).0;
        let splits_range = match (unsplit, forced) {
            (true, _) => 1..=1,
            (false, f) if f > 1 => f..=f,
            _ => 1..=chunks.min(16),
        };
        let kps: &[usize] = match knobs.kp {
            0 => &[1, 2, 4, 8],
            kp => &[kp][..],
        };
        let mut best: Option<(f64, Plan)> = None;
        for &kp in kps {
            let width = rows * (WARPS / kp);
            let cubes: usize = ns.iter().map(|n| n.div_ceil(width)).sum();
            for want in splits_range.clone() {
                let per = chunks.div_ceil(want);
                let splits = chunks.div_ceil(per);
                if per > most {
                    continue;
                }
                let waves = (cubes * splits).div_ceil(slots) as f64;
                let mut cost = waves * (per.div_ceil(kp) as f64 + WARP_OVERHEAD_CHUNKS);
                if splits > 1 {
                    cost += SPLIT_CHUNKS + SLICE_CHUNKS * splits as f64;
                }
                let plan = Plan {
                    m,
                    rt: knobs.rt,
                    kp,
                    depth: knobs.depth,
                    min_cubes: knobs.min_cubes,
                    cubes,
                    splits,
                    per,
                    stages,
                };
                if best.as_ref().is_none_or(|b| cost < b.0 - 1e-9) {
                    best = Some((cost, plan));
                }
            }
        }
        if let Some((_, plan)) = best {
            if plan.stages > 0 && plan.per.div_ceil(plan.kp) < RING_MIN.load(Ordering::Relaxed) {
                return Plan::new(ns, m, k, sms, Knobs { stages: 0, ..knobs }, unsplit);
            }
            return Some(plan);
        }
        // Forced or too few slices for the shared copy of `X`: the fewest that fit.
        if unsplit || most == 0 {
            return None;
        }
        let kp = kps[0];
        let per = chunks.div_ceil(chunks.div_ceil(most));
        Some(Plan {
            m,
            rt: knobs.rt,
            kp,
            depth: knobs.depth,
            min_cubes: knobs.min_cubes,
            cubes: ns.iter().map(|n| n.div_ceil(rows * (WARPS / kp))).sum(),
            splits: chunks.div_ceil(per),
            per,
            stages,
        })
    }

    /// Weight rows a cube covers.
    pub(crate) fn width(&self) -> usize {
        16 * self.rt * (WARPS / self.kp)
    }

    /// The kernel text for this plan and these flags: the configuration, the shared E2M1
    /// decoding (`e2m1_spread.cu`), then `gemv_mma.cu`.
    fn source(&self, block: usize, flags: (bool, bool), segments: usize) -> String {
        let mut text = cuda_source::defines(&[
            ("WARPS", WARPS),
            ("KP", self.kp),
            ("RT", self.rt),
            ("M_TILES", 1),
            ("BLOCK", block),
            ("DEPTH", self.depth),
            ("HAS_BIAS", flags.0 as usize),
            ("HAS_LORA", flags.1 as usize),
            ("SPLIT", (self.splits > 1) as usize),
            ("SEGMENTS", segments),
            ("MIN_CUBES", self.min_cubes),
            ("XS_TOKENS", self.m),
            ("XS_CHUNKS", self.per),
            ("STAGES", self.stages),
            ("SPREAD_SHIFTS", cuda_source::spread_shifts()),
            ("X_AHEAD_ON", Knobs::get().x_ahead as usize),
            ("PDL", crate::graph::texts_wait() as usize),
        ]);
        text.push_str(cuda_source::COMMON);
        text.push_str(cuda_source::E2M1_SPREAD);
        text.push_str(SOURCE);
        text
    }
}

/// `weight`'s segment with its optional bias and LoRA epilogue (`T`, `B`, rank, scale): what
/// is absent is bound to a buffer the kernel never reads.
fn segment_args(
    weight: &DeviceWeight,
    bias: Option<Handle>,
    lora: Option<(Handle, Handle, usize, f32)>,
    y: Handle,
) -> SegmentArgs {
    let unused = weight.code_table.clone();
    let (t, b, _, scale) = lora.unwrap_or_else(|| (unused.clone(), unused.clone(), 0, 0.0));
    SegmentArgs::new(weight, bias.unwrap_or(unused), (t, b, scale), y)
}

/// One launch of `plan` over 1 to 3 segments into their `y` (or into `part` when split).
#[allow(clippy::too_many_arguments)]
fn run(
    client: &ComputeClient<CudaRuntime>,
    x: &Handle,
    m: usize,
    k: usize,
    block: usize,
    plan: &Plan,
    segs: &[SegmentArgs],
    flags: (bool, bool),
    rank: usize,
    part: Handle,
) {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let seg = |i: usize| &segs[i.min(segs.len() - 1)];
    let (cubes0, cubes1) = cuda_source::segment_starts(segs, plan.width());
    let mut buffers = cuda_source::segment_bindings(x, segs);
    buffers.push(part.binding());
    // `Info` of gemv_mma.cu: nine u32, then three f32.
    let scalars = [
        m as u32,
        seg(0).n as u32,
        seg(1).n as u32,
        seg(2).n as u32,
        cubes0,
        cubes1,
        k as u32,
        plan.per as u32,
        rank as u32,
        seg(0).lora_scale.to_bits(),
        seg(1).lora_scale.to_bits(),
        seg(2).lora_scale.to_bits(),
    ];
    // SAFETY: the kernel clamps weight rows to each segment's N, tokens to M and chunks to
    // K / 128 (K a multiple of 128: `applies`), and bounds its stores by N and M and its LoRA
    // columns by the rank; the caller checked every buffer's size, `part` holds `splits·M·N`
    // f32 when split, and the scalars are `Info`'s layout.
    unsafe {
        cuda_source::launch(
            client,
            cuda_source::cached(&SOURCES, &(*plan, block, flags, segs.len()), ENTRY, || {
                plan.source(block, flags, segs.len())
            }),
            ENTRY,
            (32 * WARPS) as u32,
            (plan.cubes as u32, 1, plan.splits as u32),
            buffers,
            &scalars,
        )
    };
}

/// [`crate::gemv::launch`] on this kernel (the caller checked buffers and [`applies`]): split
/// along K, it ends in [`splitk::reduce`] unless `keep_parts`, which returns the partial sums
/// and their slice count instead, `y` unwritten.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    weight: &DeviceWeight,
    bias: Option<Handle>,
    lora: Option<(Handle, Handle, usize, f32)>,
    y: &Handle,
    keep_parts: bool,
) -> Option<(Handle, usize)> {
    let Some(cuda) = crate::cublas::cuda_client(client) else {
        unreachable!("gemv_mma::launch on a runtime other than CUDA (see `applies`)");
    };
    let (n, k) = (weight.n, weight.k);
    let sms = splitk::multiprocessors(client);
    let Some(plan) = Plan::new(&[n], m, k, sms, Knobs::get(), false) else {
        unreachable!("a split plan always fits the shared copy of X at M <= {MAX_M}");
    };
    let flags = (bias.is_some(), lora.is_some());
    let rank = lora.as_ref().map_or(0, |l| l.2);
    let seg = segment_args(weight, bias, lora, y.clone());
    let split = plan.splits > 1;
    // Unsplit, `part` is never written: bound to the code table.
    let part = match split {
        true => splitk::workspace(client, plan.splits, m, n),
        false => weight.code_table.clone(),
    };
    let block = weight.block();
    run(
        cuda,
        x,
        m,
        k,
        block,
        &plan,
        &[seg],
        flags,
        rank,
        part.clone(),
    );
    if !split {
        return None;
    }
    splitk::reduce_unless_kept::<R, F>(client, part, plan.splits, m, n, y, keep_parts)
}

/// [`crate::gemv::launch_segments`] on this kernel, one unsplit launch (the caller checked
/// buffers and [`segments_apply`]).
pub(crate) fn launch_segments<R: Runtime>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    segs: &[Segment<'_>],
) {
    let Some(cuda) = crate::cublas::cuda_client(client) else {
        unreachable!("gemv_mma::launch_segments on a runtime other than CUDA");
    };
    let first = segs[0].weight;
    let ns: Vec<usize> = segs.iter().map(|s| s.weight.n).collect();
    let sms = splitk::multiprocessors(client);
    let Some(plan) = Plan::new(&ns, m, first.k, sms, Knobs::get(), true) else {
        unreachable!("gemv_mma::launch_segments without segments_apply");
    };
    let flags = (segs[0].bias.is_some(), segs[0].lora.is_some());
    let rank = segs[0].lora.map_or(0, |l| l.2);
    let args: Vec<SegmentArgs> = segs
        .iter()
        .map(|s| {
            let lora = s.lora.map(|(t, b, r, sc)| (t.clone(), b.clone(), r, sc));
            segment_args(s.weight, s.bias.cloned(), lora, s.y.clone())
        })
        .collect();
    let part = first.code_table.clone();
    run(
        cuda,
        x,
        m,
        first.k,
        first.block(),
        &plan,
        &args,
        flags,
        rank,
        part,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 7B shapes at batch 1 on 132 multiprocessors (three cubes each): gate/up in three whole
    /// waves (four warps a row group), the narrow products in one with eight, down split.
    #[test]
    fn plans_fill_whole_waves() {
        let k = Knobs::DEFAULT;
        let plan = |ns: &[usize], m, kd, unsplit| Plan::new(ns, m, kd, 132, k, unsplit).unwrap();
        let gate_up = plan(&[18944, 18944], 1, 3584, true);
        assert_eq!((gate_up.kp, gate_up.splits, gate_up.width()), (4, 1, 32));
        assert_eq!(gate_up.cubes, 2 * 18944 / 32);
        let qkv = plan(&[3584, 512, 512], 1, 3584, true);
        assert_eq!((qkv.kp, qkv.splits, qkv.width()), (8, 1, 16));
        let down = plan(&[3584], 1, 18944, false);
        assert_eq!((down.kp, down.splits), (4, 3));
        assert!(down.per * down.splits >= 18944 / CHUNK);
        assert!(down.cubes * down.splits <= 3 * 132, "{down:?}");
        let o = plan(&[3584], 1, 3584, false);
        assert_eq!((o.kp, o.splits), (8, 1));
        let rt2 = Plan::new(&[18944], 1, 3584, 132, Knobs { rt: 2, ..k }, true).unwrap();
        assert_eq!(rt2.width() % 32, 0);
        let kp2 = Plan::new(&[18944], 1, 3584, 132, Knobs { kp: 2, ..k }, true).unwrap();
        assert_eq!(kp2.kp, 2);
    }

    /// The shared copy of `X` bounds a slice: at 8 tokens a deep K is split further, and an
    /// unsplit launch that does not fit is refused.
    #[test]
    fn slices_fit_the_shared_copy_of_x() {
        let k = Knobs::DEFAULT;
        assert_eq!(max_slice_chunks(1, 0, 1), 167);
        assert_eq!(max_slice_chunks(1, 0, 2), 151);
        let p = Plan::new(&[4096], 8, 8192, 132, k, false).unwrap();
        assert!(p.per <= max_slice_chunks(8, 0, 1) && p.per * p.splits >= 64);
        assert!(8 * (64 * p.per + 16) <= XS_WORDS);
        assert!(Plan::new(&[3584, 512], 8, 3584, 132, k, true).is_none());
        let down32 = Plan::new(&[5120], 1, 27648, 132, k, false).unwrap();
        assert!(down32.per <= 167 && down32.splits >= 2);
        // The copy of `X`, the scale table and the warps' sums (four f32 a row tile, lane and
        // warp) within the static shared memory, at one and two row tiles a warp.
        for rt in [1, 2] {
            let knobs = Knobs { rt, stages: 0, ..k };
            for m in [1, 3, 8] {
                let p = Plan::new(&[4096], m, 27648, 132, knobs, false).unwrap();
                let red = WARPS * rt * 4 * 32 * 4;
                let xs = 4 * m * (64 * p.per + 16);
                assert!(
                    STAB_BYTES + red + xs <= SHARED_BYTES,
                    "rt {rt} m {m}: {p:?}"
                );
            }
        }
    }

    /// At one token the shared ring is taken, and the ring, the copy of `X` and the scale
    /// table stay within the static shared memory (the warps' sums live in the ring); where an
    /// unsplit launch would not fit beside the ring, or a warp would walk fewer than
    /// [`RING_MIN_CHUNKS`] chunks, the register ring is taken.
    #[test]
    fn the_shared_ring_fits() {
        let k = Knobs {
            stages: 3,
            ..Knobs::DEFAULT
        };
        for (ns, kd, unsplit) in [
            (&[18944, 18944][..], 3584, true),
            (&[3584][..], 18944, false),
            (&[27648, 27648][..], 5120, true),
            (&[5120, 1024, 1024][..], 5120, true),
            (&[5120][..], 27648, false),
        ] {
            for stages in 1..=4 {
                let p = Plan::new(ns, 1, kd, 132, Knobs { stages, ..k }, unsplit).unwrap();
                assert_eq!(p.stages, stages, "{ns:?} {kd}");
                let xs = 4 * (64 * p.per + 16);
                assert!(
                    STAB_BYTES + stages * RING_STAGE_BYTES + xs <= SHARED_BYTES,
                    "{p:?}"
                );
            }
            let at8 = Plan::new(ns, 8, kd, 132, k, unsplit);
            assert!(at8.is_none_or(|p| p.stages == 0));
        }
        // 7B's q/k/v and o, one wave of four chunks a warp: the register ring.
        for (ns, unsplit) in [(&[3584, 512, 512][..], true), (&[3584][..], false)] {
            let p = Plan::new(ns, 1, 3584, 132, k, unsplit).unwrap();
            assert_eq!((p.stages, p.per.div_ceil(p.kp)), (0, 4), "{ns:?}");
        }
        // 100 chunks unsplit do not fit beside four stages: the register ring.
        let wide = Plan::new(&[4096], 1, 12800, 132, Knobs { stages: 4, ..k }, true);
        assert!(wide.is_some_and(|p| p.stages == 0));
    }

    /// `spread_bits` in `gemv_mma.cu` and `warpgroup.cu` places a code pair with one multiply
    /// where sessions 12-31 shifted twice: the same bits for every word (both depend on the
    /// pair's two nibbles only, so every pair of nibbles at every place is every case).
    #[test]
    fn the_multiply_places_what_the_shifts_placed() {
        let shifts = |w: u32, i: u32| {
            let s = w >> (4 * i);
            ((s << 6) & 0x01C0_01C0) | ((s << 12) & 0x8000_8000)
        };
        let multiply = |w: u32, i: u32| {
            let v = if i >= 2 {
                ((w as u64 * (1 << 24)) >> 32) as u32
            } else {
                w
            };
            let z = v & (0x000F_000F << (4 * (i & 1)));
            z.wrapping_mul(if i & 1 == 1 { 260 } else { 4160 }) & 0x81C0_81C0
        };
        for i in 0..4 {
            for lo in 0..16u32 {
                for hi in 0..16u32 {
                    // The pair's nibbles, and every other nibble set (they must not leak in).
                    let pair = (lo << (4 * i)) | (hi << (4 * i + 16));
                    let rest = !((0xF << (4 * i)) | (0xF << (4 * i + 16)));
                    for w in [pair, pair | rest, pair | (rest & 0x5A5A_A5A5)] {
                        assert_eq!(multiply(w, i), shifts(w, i), "word {w:#010x} pair {i}");
                    }
                }
            }
        }
    }

    /// The text carries every `#define` the kernel reads, and is ASCII (NVRTC takes it as is).
    #[test]
    fn source_defines_the_configuration() {
        let p = Plan::new(&[4096], 1, 4096, 132, Knobs::DEFAULT, false).unwrap();
        let s = p.source(16, (true, false), 1);
        for d in [
            "WARPS 8",
            "RT 1",
            "M_TILES 1",
            "BLOCK 16",
            "DEPTH 2",
            "HAS_BIAS 1",
            "HAS_LORA 0",
            "SEGMENTS 1",
            "MIN_CUBES 3",
            "XS_TOKENS 1",
            "STAGES 0",
            "X_AHEAD_ON 1",
        ] {
            assert!(s.contains(&format!("#define {d}\n")), "{d}");
        }
        assert!(s.contains(&format!("#define KP {}\n", p.kp)));
        assert_eq!(s.matches("unsigned int spread_bits(").count(), 1);
        assert!(s.contains(&format!("#define XS_CHUNKS {}\n", p.per)));
        assert!(s.contains(&format!("#define SPLIT {}\n", (p.splits > 1) as usize)));
        assert!(s.is_ascii());
        assert!(s.contains(
            "extern \"C\" __global__ void __launch_bounds__(THREADS, MIN_CUBES) qerl_gemv_mma("
        ));
    }
}
