//! Two or three staged products of one input (q/k/v, gate/up) as one launch: `y_s[M, N_s] =
//! X[M, K] · deq(W_s)ᵀ (+ bias_s) (+ s_s·T_s·B_sᵀ)` for each segment `s`.
//!
//! Why: at decode batch 64 on an H100 (7B Qwen2.5, NVFP4, ncu) q took 20.5 µs + a 7.8-µs
//! split-K reduction and k and v (N = 512: 4 cubes of rows) 9.8 + 5.2 µs each: each launch
//! fills the device alone, by splitting its short reduction, and pays a reduction launch.
//! Here the segments' row groups share one grid (the columns of all segments side by side,
//! `N = sum N_s`), split-K is planned for that grid, and one reduction
//! ([`crate::splitk::reduce_segments`]) writes every segment's output with its bias.
//!
//! Layout: every `N_s` is a multiple of the cube's column width (`warps · 16 · r_tiles`), so a
//! cube's rows lie in one segment; each cube finds it from its position along `N` (uniform per
//! cube) and runs the staged body ([`super::staged::staged_body`], inlined once per segment at
//! the top level, no branch inside the K loop) on that segment's own codes, scales, 256-entry
//! scale table (a per-tensor scale each), bias and LoRA `T`/`B`: no weight is copied.
//! Unsplit, each segment writes its own `y`; split, every segment writes f32 partial sums into
//! one workspace `[splits, M, N]` at its column offset (LoRA in slice 0, as unsegmented).

use super::launch::Geometry;
use super::staged::staged_body;
use crate::gemv::Segment;
use crate::splitk::{self, ReduceSegment};
use cubecl::prelude::*;
use cubecl::server::Handle;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// The staged kernel over two or three weights (see the module documentation): segment 0 owns
/// the grid's first `cubes0` cubes along `N`, segment 1 those up to `cubes1`, segment 2 the
/// rest; `n0..n2` are the segments' widths, `n_total` their sum (the workspace's width when
/// split).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gemm_mma_segments_kernel<F: Float, O: Float, P: Size, Q: Size>(
    x: &Array<Vector<u32, Q>>,
    codes0: &Array<Vector<u32, P>>,
    scale_bytes0: &Array<u32>,
    scale_table0: &Array<f32>,
    bias0: &Array<F>,
    lora_t0: &Array<f32>,
    lora_b0: &Array<Vector<F, P>>,
    y0: &mut Array<O>,
    codes1: &Array<Vector<u32, P>>,
    scale_bytes1: &Array<u32>,
    scale_table1: &Array<f32>,
    bias1: &Array<F>,
    lora_t1: &Array<f32>,
    lora_b1: &Array<Vector<F, P>>,
    y1: &mut Array<O>,
    codes2: &Array<Vector<u32, P>>,
    scale_bytes2: &Array<u32>,
    scale_table2: &Array<f32>,
    bias2: &Array<F>,
    lora_t2: &Array<f32>,
    lora_b2: &Array<Vector<F, P>>,
    y2: &mut Array<O>,
    m_rows: u32,
    n0: u32,
    n1: u32,
    n2: u32,
    n_total: u32,
    cubes0: u32,
    cubes1: u32,
    k_dim: u32,
    split_chunks: u32,
    rank: u32,
    scale0: f32,
    scale1: f32,
    scale2: f32,
    #[comptime] warps: usize,
    #[comptime] r_tiles: usize,
    #[comptime] m_tiles: usize,
    #[comptime] block: usize,
    #[comptime] depth: usize,
    #[comptime] x_ahead: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
    #[comptime] split: bool,
    #[comptime] m_major: bool,
    #[comptime] segments: usize,
) {
    let mut cube_n = CUBE_POS_X as usize;
    if m_major {
        cube_n = CUBE_POS_Y as usize;
    }
    let width = comptime!(warps * 16 * r_tiles);
    let total = n_total as usize;
    let (e0, e1) = (cubes0 as usize, cubes1 as usize);
    if cube_n < e0 {
        staged_body::<F, O, P, Q>(
            x,
            codes0,
            scale_bytes0,
            scale_table0,
            bias0,
            lora_t0,
            lora_b0,
            y0,
            m_rows,
            n0,
            k_dim,
            split_chunks,
            rank,
            scale0,
            0usize,
            total,
            0usize,
            warps,
            r_tiles,
            m_tiles,
            block,
            depth,
            x_ahead,
            has_bias,
            has_lora,
            split,
            m_major,
            true,
        );
    } else if cube_n < e1 {
        // With two segments `cubes1` is the whole grid: segment 1 takes the rest.
        staged_body::<F, O, P, Q>(
            x,
            codes1,
            scale_bytes1,
            scale_table1,
            bias1,
            lora_t1,
            lora_b1,
            y1,
            m_rows,
            n1,
            k_dim,
            split_chunks,
            rank,
            scale1,
            e0,
            total,
            e0 * width,
            warps,
            r_tiles,
            m_tiles,
            block,
            depth,
            x_ahead,
            has_bias,
            has_lora,
            split,
            m_major,
            true,
        );
    } else if comptime!(segments > 2) {
        staged_body::<F, O, P, Q>(
            x,
            codes2,
            scale_bytes2,
            scale_table2,
            bias2,
            lora_t2,
            lora_b2,
            y2,
            m_rows,
            n2,
            k_dim,
            split_chunks,
            rank,
            scale2,
            e1,
            total,
            e1 * width,
            warps,
            r_tiles,
            m_tiles,
            block,
            depth,
            x_ahead,
            has_bias,
            has_lora,
            split,
            m_major,
            true,
        );
    }
}

/// 0 off, 1 on, anything else: not read yet (`QERL_MMA_SEGMENTS`).
static ENABLED: AtomicU8 = AtomicU8::new(u8::MAX);
static LAUNCHES: AtomicUsize = AtomicUsize::new(0);

/// Whether products sharing an input may run as one segmented launch: the last
/// [`set_enabled`], else on unless `QERL_MMA_SEGMENTS=0` (read once).
pub fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        0 => false,
        1 => true,
        _ => {
            let on = std::env::var("QERL_MMA_SEGMENTS").as_deref() != Ok("0");
            ENABLED.store(u8::from(on), Ordering::Relaxed);
            on
        }
    }
}

/// Turns segmented launches on or off for every later product in this process (tests,
/// benchmarks), overriding `QERL_MMA_SEGMENTS`.
pub fn set_enabled(on: bool) {
    ENABLED.store(u8::from(on), Ordering::Relaxed);
}

/// Segmented launches run in this process (tests check that the path was taken).
pub fn launches() -> usize {
    LAUNCHES.load(Ordering::Relaxed)
}

/// A segmented launch's geometry, planned by [`plan`] for the sum of the segments' `N`.
pub(crate) struct SegmentPlan(Geometry);

impl SegmentPlan {
    /// Whether this launch of `segments` products with LoRA adapters of rank `rank` can compute
    /// the adapters' down-projections itself ([`crate::gemm::LoraFold`]): on the warpgroup
    /// kernel (CUDA sm_90) at the ranks it takes, unless `QERL_LORA_FOLD=0` (read once).
    pub(crate) fn folds<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        rank: usize,
        segments: usize,
    ) -> bool {
        #[cfg(feature = "cuda")]
        {
            static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let on = *ON.get_or_init(|| std::env::var("QERL_LORA_FOLD").as_deref() != Ok("0"));
            on && super::warpgroup::runs(client, &self.0)
                && super::warpgroup::fold_takes(rank, segments)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (client, rank, segments);
            false
        }
    }
}

/// The plan of one segmented launch of `segs` at `m` rows, or `None` where it does not apply:
/// switched off, not 1 to 3 segments (one: a single product that keeps its K-slices, which
/// only this launch offers), not the staged kernel (bf16 with the spread decoding,
/// see [`Geometry::plan`]), or segments that differ in `K`, format, block, bias presence or
/// LoRA rank, or whose `N` is not a multiple of the cube's column width (planned for the sum
/// of the `N`s). The caller checked that the mma kernel applies to each weight.
pub(crate) fn plan<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    segs: &[Segment<'_>],
) -> Option<SegmentPlan> {
    let first = segs.first()?;
    let w = first.weight;
    let rank = first.lora.map(|l| l.2);
    let same = segs.iter().all(|s| {
        s.weight.k == w.k
            && s.weight.format == w.format
            && s.weight.block() == w.block()
            && s.bias.is_some() == first.bias.is_some()
            && s.lora.map(|l| l.2) == rank
    });
    if !(enabled() && (1..=3).contains(&segs.len()) && same) {
        return None;
    }
    let n: usize = segs.iter().map(|s| s.weight.n).sum();
    let bf16 = F::as_type_native_unchecked() == half::bf16::as_type_native_unchecked();
    let sms = splitk::multiprocessors(client);
    let hopper = super::warpgroup_available(client);
    let g = Geometry::plan(m, n, w.k, &super::options(), sms, bf16, hopper);
    let width = g.warps * 16 * g.r_tiles;
    (g.staged && segs.iter().all(|s| s.weight.n.is_multiple_of(width))).then_some(SegmentPlan(g))
}

/// Launches `segs` (checked by [`plan`], which gave `plan`, and buffers checked by the caller) as
/// one staged kernel and, when split, one segmented reduction; or, split with `keep_parts`,
/// returns the partial sums `[splits, M, ΣN]` (each segment's columns after the previous ones',
/// the LoRA term in slice 0, the biases not added) and their count instead, no `y` written.
/// With `fold` (where [`SegmentPlan::folds`]), every segment's LoRA `T` is computed in the
/// launch.
pub(crate) fn launch<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    segs: &[Segment<'_>],
    plan: &SegmentPlan,
    keep_parts: bool,
    fold: Option<&crate::gemm::LoraFold<'_>>,
) -> Option<(Handle, usize)> {
    let g = &plan.0;
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let splits = g.grid.2;
    if splits == 1 {
        run::<R, F, F>(client, x, m, segs, g, None, fold);
        return None;
    }
    let n: usize = segs.iter().map(|s| s.weight.n).sum();
    let part = splitk::workspace(client, splits, m, n);
    run::<R, F, f32>(client, x, m, segs, g, Some(&part), fold);
    if keep_parts {
        return Some((part, splits));
    }
    if let [s] = segs {
        // One product: the plain reduction (the segmented one takes two or three).
        let epilogue = splitk::ReduceEpilogue {
            bias: s.bias.cloned(),
            lora: None,
        };
        splitk::reduce::<R, F, F>(client, part, splits, m, s.weight.n, epilogue, s.y);
        return None;
    }
    let reduce: Vec<ReduceSegment<'_>> = segs
        .iter()
        .map(|s| ReduceSegment {
            n: s.weight.n,
            bias: s.bias,
            y: s.y,
        })
        .collect();
    splitk::reduce_segments::<R, F, F>(client, part, splits, m, &reduce);
    None
}

/// The kernel launch: into each segment's `y` (`O = F`), or with `part` into that workspace
/// `[splits, M, N]` for every segment (`O = f32`, the bias left to the reduction); `fold` only
/// on the warpgroup kernel.
fn run<R: Runtime, F: Float, O: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    segs: &[Segment<'_>],
    g: &Geometry,
    part: Option<&Handle>,
    fold: Option<&crate::gemm::LoraFold<'_>>,
) {
    let w = segs[0].weight;
    let k = w.k;
    let seg = |i: usize| &segs[i.min(segs.len() - 1)];
    let n = |i: usize| seg(i).weight.n;
    let n_total: usize = segs.iter().map(|s| s.weight.n).sum();
    let width = g.warps * 16 * g.r_tiles;
    let cubes0 = n(0) / width;
    let cubes1 = cubes0 + n(1) / width;
    let has_bias = part.is_none() && segs[0].bias.is_some();
    let has_lora = segs[0].lora.is_some();
    let rank = segs[0].lora.map_or(0, |l| l.2);
    let unused = w.code_table.clone();
    let splits = g.grid.2;
    let y_len = |i: usize| match part {
        Some(_) => splits * m * n_total,
        None => m * n(i),
    };
    // SAFETY (of each `from_raw_parts`): the lengths are the buffers' own (checked by the
    // caller, the workspace from `splitk::workspace`); the kernel bounds rows by each segment's
    // N, tokens by M, chunks by K / 64 and LoRA columns by the rank; segments past
    // `segs.len()` repeat the last one and get no cubes.
    let args = |i: usize| unsafe {
        let s = seg(i);
        let (t, b, scale) = match s.lora {
            Some((t, b, _, scale)) => (t.clone(), b.clone(), scale),
            None => (unused.clone(), unused.clone(), 0.0),
        };
        let bias = s.bias.filter(|_| has_bias).cloned();
        (
            ArrayArg::from_raw_parts(s.weight.codes.clone(), s.weight.words() / 2),
            ArrayArg::from_raw_parts(s.weight.scale_bytes.clone(), s.weight.scale_words()),
            ArrayArg::from_raw_parts(s.weight.scale_table.clone(), s.weight.scale_table_len()),
            ArrayArg::from_raw_parts(bias.unwrap_or_else(|| unused.clone()), n(i)),
            ArrayArg::from_raw_parts(t, m * rank.max(1)),
            ArrayArg::from_raw_parts(b, (n(i) * rank / 2).max(1)),
            ArrayArg::from_raw_parts(part.unwrap_or(s.y).clone(), y_len(i)),
            scale,
        )
    };
    #[cfg(feature = "cuda")]
    if super::warpgroup::runs(client, g) {
        let wsegs: Vec<crate::cuda_source::SegmentArgs> = segs
            .iter()
            .map(|s| {
                let (t, b, scale) = match s.lora {
                    Some((t, b, _, scale)) => (t.clone(), b.clone(), scale),
                    None => (unused.clone(), unused.clone(), 0.0),
                };
                let bias = s.bias.filter(|_| has_bias).unwrap_or(&unused).clone();
                let y = part.unwrap_or(s.y).clone();
                crate::cuda_source::SegmentArgs::new(s.weight, bias, (t, b, scale), y)
            })
            .collect();
        let out_f32 = part.is_some();
        let flags = (has_bias, has_lora, out_f32);
        super::warpgroup::launch(client, x, m, k, w.block(), g, &wsegs, flags, rank, fold);
        return;
    }
    assert!(
        fold.is_none(),
        "a LoRA fold on a kernel other than the warpgroup one"
    );
    let (a0, a1, a2) = (args(0), args(1), args(2));
    let count = CubeCount::Static(g.grid.0 as u32, g.grid.1 as u32, g.grid.2 as u32);
    // SAFETY: as above; `X` is read as 16-byte vectors (K is a multiple of 64).
    unsafe {
        gemm_mma_segments_kernel::launch_unchecked::<F, O, R>(
            client,
            count,
            CubeDim::new_1d((32 * g.warps) as u32),
            2,
            4,
            ArrayArg::from_raw_parts(x.clone(), m * k / 8),
            a0.0,
            a0.1,
            a0.2,
            a0.3,
            a0.4,
            a0.5,
            a0.6,
            a1.0,
            a1.1,
            a1.2,
            a1.3,
            a1.4,
            a1.5,
            a1.6,
            a2.0,
            a2.1,
            a2.2,
            a2.3,
            a2.4,
            a2.5,
            a2.6,
            m as u32,
            n(0) as u32,
            n(1) as u32,
            n(2) as u32,
            n_total as u32,
            cubes0 as u32,
            cubes1 as u32,
            k as u32,
            g.per as u32,
            rank as u32,
            a0.7,
            a1.7,
            a2.7,
            g.warps,
            g.r_tiles,
            g.m_tiles,
            w.block(),
            g.prefetch,
            g.x_ahead,
            has_bias,
            has_lora,
            splits > 1,
            g.m_major,
            segs.len(),
        );
    }
}
