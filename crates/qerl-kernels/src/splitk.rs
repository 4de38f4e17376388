//! Split-K: products whose output grid is too small to fill the device split their reduction
//! over `splits` slices (one more grid dimension); each slice writes an f32 partial sum into a
//! workspace `[splits, M, N]`, and [`reduce`] adds the slices, applies the epilogue (bias, LoRA)
//! and writes the output once. Deterministic: no atomics, the slices are summed in order.

use crate::device::{grid_1d, linear_cube};
use cubecl::prelude::*;
use cubecl::server::Handle;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Forced number of K-slices (0: chosen per launch by [`plan`]).
static FORCED: AtomicUsize = AtomicUsize::new(0);

/// Forces every later split-K-capable launch in this process (tensor-core product, dX,
/// `lora_down`, decode kernel) to split its reduction into `splits` slices (clamped to the
/// number of reduction stages), or, with `None`, lets each launch choose. For tests and
/// benchmarks; the default is `None`.
pub fn force_splits(splits: Option<usize>) {
    FORCED.store(splits.unwrap_or(0), Ordering::Relaxed);
}

/// Multiprocessors of the device (132 on an H100 SXM when the runtime does not say).
pub(crate) fn multiprocessors<R: Runtime>(client: &ComputeClient<R>) -> usize {
    client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(132)
        .max(1) as usize
}

/// How a reduction of `stages` stages is split: `(splits, stages per split)`, every split
/// non-empty. `groups` output groups (cubes, or planes for the decode kernel) run without a
/// split; the reduction is split until there are about `target` groups in all, keeping at least
/// `min_stages` stages per split.
pub(crate) fn plan(
    groups: usize,
    stages: usize,
    target: usize,
    min_stages: usize,
) -> (usize, usize) {
    let stages = stages.max(1);
    let forced = FORCED.load(Ordering::Relaxed);
    let want = if forced > 0 {
        forced
    } else if groups >= target {
        1
    } else {
        target
            .div_ceil(groups.max(1))
            .min(stages / min_stages.max(1))
    };
    slices(stages, want)
}

/// `(splits, stages per split)` for about `want` splits of `stages` stages: every split
/// non-empty, the last one possibly shorter.
fn slices(stages: usize, want: usize) -> (usize, usize) {
    let per = stages.div_ceil(want.clamp(1, stages));
    (stages.div_ceil(per), per)
}

/// Time a cube spends on work other than its stages (prologue, epilogue and its stores), in
/// stages: [`plan_waves`]' cost model.
const CUBE_OVERHEAD_STAGES: f64 = 1.0;

/// Cost of the partial sums of one wave of split tiles (`slots` tile-slices written by the
/// product and read back by [`reduce`]), in stages. Measured on an H200 (2026-11-28, ncu, 7B
/// decode at batch 64, 264 slots): with 4 the model split the gate/up product in 4 (592 -> 1184
/// cubes, 2.24 -> 4.48 waves) and it took 94.0 µs and its reduction 12.3 against 93.4 and 8.3 in
/// 2: past two waves a partly full last wave costs little (the other cube of its
/// multiprocessors runs faster), so the partial sums weigh more than the model's waves; 8
/// keeps gate/up at 2 and changes no other batch-64 or batch-256 choice.
const SLICE_WAVE_STAGES: f64 = 8.0;

/// Fixed cost of the reduction launch, in stages (~3 µs a launch at decode sizes).
const REDUCE_LAUNCH_STAGES: f64 = 3.0;

/// [`SLICE_WAVE_STAGES`], or `QERL_SPLIT_SLICE_COST` (read once) for experiments.
fn slice_wave_stages() -> f64 {
    static COST: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *COST.get_or_init(|| {
        std::env::var("QERL_SPLIT_SLICE_COST")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|c: &f64| c.is_finite() && *c >= 0.0)
            .unwrap_or(SLICE_WAVE_STAGES)
    })
}

/// How a reduction of `stages` stages is split (`(splits, stages per split)`, every split
/// non-empty) for a kernel that runs one cube per output tile and split, `tiles` tiles, when
/// `slots` cubes fit on the device at once: the split with the least estimated time.
///
/// Why not [`plan`]'s "split until there are `target` groups": the cubes run in waves of
/// `slots`, and a last wave that is partly full costs a whole one. On the staged `mma` product
/// at batch 64 (2 cubes a multiprocessor, 264 slots on an H100) that planner gave the down
/// product 15 slices of 20 stages (420 cubes: 1.59 waves, ncu found the multiprocessors busy
/// 83% of the time), o 14 of 4 (392 cubes: 1.48 waves, 72%) and q/k/v 10 of 6 (360 cubes: 1.36
/// waves, 73%), where 9, 8 and 7 slices fill one wave with fewer partial sums: on an H200
/// (2026-11-28, ncu, one step, both planners in one call) down 56.2 -> 47.6 µs, o 19.2 -> 15.6,
/// q/k/v 20.9 -> 16.3, their reductions 6.5 -> 4.7 and 7.8 -> 7.2, the step 8.03 -> 7.45 ms of
/// GPU time. The estimate,
/// in stages: `waves · (per + CUBE_OVERHEAD_STAGES)`, plus, when split,
/// `SLICE_WAVE_STAGES · tiles · splits / slots + REDUCE_LAUNCH_STAGES`; ties go to fewer
/// splits. [`force_splits`] overrides it as it does [`plan`].
pub(crate) fn plan_waves(
    tiles: usize,
    stages: usize,
    slots: usize,
    min_stages: usize,
) -> (usize, usize) {
    plan_waves_with(tiles, stages, slots, min_stages, slice_wave_stages())
}

/// [`plan_waves`] with the cost of a wave of tile-slices given.
fn plan_waves_with(
    tiles: usize,
    stages: usize,
    slots: usize,
    min_stages: usize,
    slice_cost: f64,
) -> (usize, usize) {
    let stages = stages.max(1);
    let (tiles, slots) = (tiles.max(1), slots.max(1));
    let forced = FORCED.load(Ordering::Relaxed);
    if forced > 0 {
        return slices(stages, forced);
    }
    let most = (stages / min_stages.max(1)).max(1);
    let cost = |splits: usize, per: usize| {
        let waves = (tiles * splits).div_ceil(slots) as f64;
        let mut t = waves * (per as f64 + CUBE_OVERHEAD_STAGES);
        if splits > 1 {
            t += slice_cost * (tiles * splits) as f64 / slots as f64 + REDUCE_LAUNCH_STAGES;
        }
        t
    };
    let mut best = (1, stages, cost(1, stages));
    for want in 2..=most {
        let (splits, per) = slices(stages, want);
        let t = cost(splits, per);
        if t < best.2 - 1e-9 {
            best = (splits, per, t);
        }
    }
    (best.0, best.1)
}

/// Most slices for which [`reduce`] gives each unit four outputs. On an H200 (2026-11-27, ncu,
/// 7B decode at batch 64) four outputs a unit took the gate/up reductions (3 slices) from 9.8
/// to 7.1 µs, but the q/o/down ones (14-15 slices) from 6.5 to 7.3 and the k/v ones (14) from
/// 4.9 to 5.9: with many slices a unit's loads come one after the other, and a quarter of the
/// units keep a quarter of the loads in flight.
const VECTOR_MAX_SPLITS: usize = 4;

/// Most slices for which [`reduce_segments`] gives each unit four outputs. On an H200
/// (2026-11-28, ncu, 7B decode at batch 64) the q/k/v reduction of 7 slices took 5.9 µs with
/// four outputs a unit against 7.2 with one, while the o and down reductions (8 and 9 slices)
/// took 5.3 against 4.7: the segmented grid is the smaller one (288 cubes against 1,152).
const SEGMENTS_VECTOR_MAX_SPLITS: usize = 8;

/// `default`, or `QERL_REDUCE_VECTOR_MAX_SPLITS` (read once, both reductions) for experiments.
fn vector_max_splits(default: usize) -> usize {
    static MAX: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    MAX.get_or_init(|| {
        std::env::var("QERL_REDUCE_VECTOR_MAX_SPLITS")
            .ok()
            .and_then(|v| v.parse().ok())
    })
    .unwrap_or(default)
}

/// The end of a decode product split into `splits` K-slices (`parts`, slice 0 holding the
/// epilogue terms): the slices and their count back to the caller when `keep` (`y` unwritten,
/// see [`crate::gemm::matmul_or_parts`]), else their sum into `y` and `None`.
pub(crate) fn reduce_unless_kept<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    parts: Handle,
    splits: usize,
    m: usize,
    n: usize,
    y: &Handle,
    keep: bool,
) -> Option<(Handle, usize)> {
    if keep {
        return Some((parts, splits));
    }
    let epilogue = ReduceEpilogue {
        bias: None,
        lora: None,
    };
    reduce::<R, F, F>(client, parts, splits, m, n, epilogue, y);
    None
}

/// A workspace for `splits` partial products of `m x n` f32: fresh, or, while this thread
/// records or replays a pass ([`crate::gemm::WorkspaceArena`]), the recorded one.
pub(crate) fn workspace<R: Runtime>(
    client: &ComputeClient<R>,
    splits: usize,
    m: usize,
    n: usize,
) -> Handle {
    let bytes = splits * m * n * std::mem::size_of::<f32>();
    crate::workspace_arena::workspace(bytes, || client.empty(bytes))
}

/// One unit per vector of `vs` consecutive outputs (16-byte loads of the partial sums where
/// `N` and the slice count allow, see [`reduce`]): each element's slices summed in order, then
/// its bias and LoRA term.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn reduce_kernel<F: Float, O: Float, V: Size>(
    part: &Array<Vector<f32, V>>,
    bias: &Array<F>,
    lora_t: &Array<f32>,
    lora_b: &Array<F>,
    y: &mut Array<Vector<O, V>>,
    m_rows: u32,
    n_cols: u32,
    splits: u32,
    rank: u32,
    lora_scale: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_lora: bool,
) {
    let vs = part.vector_size();
    let idx = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let n_cols = n_cols as usize;
    let total = m_rows as usize * n_cols / vs;
    if idx < total {
        let mut v = Vector::<f32, V>::new(0.0f32);
        for s in 0..splits as usize {
            v += part[s * total + idx];
        }
        let mut out = Vector::<O, V>::empty();
        #[unroll]
        for e in 0..vs {
            let i = idx * vs + e;
            let n = i % n_cols;
            let mut x = v[e];
            if has_bias {
                x += f32::cast_from(bias[n]);
            }
            if has_lora {
                let m = i / n_cols;
                let rank = rank as usize;
                let mut l = 0.0f32;
                for j in 0..rank {
                    l += lora_t[m * rank + j] * f32::cast_from(lora_b[n * rank + j]);
                }
                x += lora_scale * l;
            }
            out[e] = O::cast_from(x);
        }
        y[idx] = out;
    }
}

/// Epilogue inputs of [`reduce`]: bias `[N]`, LoRA `T[M, r]` (f32), `B[N, r]`, rank, scale.
pub(crate) struct ReduceEpilogue {
    pub bias: Option<Handle>,
    pub lora: Option<(Handle, Handle, usize, f32)>,
}

/// `y[M, N] = sum over slices of part[s, M, N] (+ bias) (+ s·T·Bᵀ)`, cast to `O`.
pub(crate) fn reduce<R: Runtime, F: Float, O: Float>(
    client: &ComputeClient<R>,
    part: Handle,
    splits: usize,
    m: usize,
    n: usize,
    epilogue: ReduceEpilogue,
    y: &Handle,
) {
    let total = m * n;
    let has_bias = epilogue.bias.is_some();
    let bias = epilogue.bias.unwrap_or_else(|| part.clone());
    let has_lora = epilogue.lora.is_some();
    let (t, b, rank, scale) = epilogue
        .lora
        .unwrap_or_else(|| (part.clone(), part.clone(), 0, 0.0));
    // Four outputs a unit where rows are whole vectors of them, `y` starts on a vector and
    // there are few slices ([`VECTOR_MAX_SPLITS`]).
    let aligned = y
        .offset_start
        .is_none_or(|o| o.is_multiple_of(4 * std::mem::size_of::<O>() as u64));
    // ... and only where that still leaves a cube a multiprocessor: at one row (the batch-1
    // down product, 2 slices, N = 3584) four outputs a unit left 4 cubes, and the reduction
    // took 13 µs (ncu, H100, 2026-11-27).
    let sms = multiprocessors(client);
    let vs = if n.is_multiple_of(4)
        && aligned
        && splits <= vector_max_splits(VECTOR_MAX_SPLITS)
        && total / 4 >= 256 * sms
    {
        4
    } else {
        1
    };
    // Few outputs: small cubes, so that more multiprocessors share them.
    let units = if (total / vs).div_ceil(256) < 2 * sms {
        64
    } else {
        256
    };
    // SAFETY: `part` holds splits*m*n f32 (from `workspace`), the caller checked `y`, bias and
    // the LoRA buffers; every access is bounded by m*n, the rank and the splits.
    unsafe {
        reduce_kernel::launch_unchecked::<F, O, R>(
            client,
            grid_1d((total / vs).div_ceil(units)),
            CubeDim::new_1d(units as u32),
            vs,
            ArrayArg::from_raw_parts(part.clone(), splits * total / vs),
            ArrayArg::from_raw_parts(bias, n),
            ArrayArg::from_raw_parts(t, m * rank.max(1)),
            ArrayArg::from_raw_parts(b, n * rank.max(1)),
            ArrayArg::from_raw_parts(y.clone(), total / vs),
            m as u32,
            n as u32,
            splits as u32,
            rank as u32,
            scale,
            has_bias,
            has_lora,
        );
    }
}

/// The reduction of a segmented product (`gemm_mma/segments.rs`): `part [splits, M, N]` holds
/// two or three products side by side along `N` (columns `0 .. end0`, `end0 .. end1`,
/// `end1 .. N`); each unit sums its `vs` outputs' slices in order, as [`reduce_kernel`] does, and
/// writes them with their segment's bias into that segment's `y [M, N_s]`. A vector never
/// straddles two segments (every boundary is a multiple of `vs`), so the segment is uniform
/// per unit.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn reduce_segments_kernel<F: Float, O: Float, V: Size>(
    part: &Array<Vector<f32, V>>,
    bias0: &Array<F>,
    bias1: &Array<F>,
    bias2: &Array<F>,
    y0: &mut Array<Vector<O, V>>,
    y1: &mut Array<Vector<O, V>>,
    y2: &mut Array<Vector<O, V>>,
    m_rows: u32,
    n_cols: u32,
    end0: u32,
    end1: u32,
    splits: u32,
    #[comptime] has_bias: bool,
    #[comptime] segments: usize,
) {
    let vs = part.vector_size();
    let idx = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let n_cols = n_cols as usize;
    let total = m_rows as usize * n_cols / vs;
    if idx < total {
        let mut v = Vector::<f32, V>::new(0.0f32);
        for s in 0..splits as usize {
            v += part[s * total + idx];
        }
        let m = idx * vs / n_cols;
        let n = idx * vs % n_cols;
        let (e0, e1) = (end0 as usize, end1 as usize);
        if n < e0 {
            store_segment::<F, O, V>(v, bias0, y0, m, n, e0, vs, has_bias);
        } else if segments > 2 {
            if n < e1 {
                store_segment::<F, O, V>(v, bias1, y1, m, n - e0, e1 - e0, vs, has_bias);
            } else {
                store_segment::<F, O, V>(v, bias2, y2, m, n - e1, n_cols - e1, vs, has_bias);
            }
        } else {
            store_segment::<F, O, V>(v, bias1, y1, m, n - e0, n_cols - e0, vs, has_bias);
        }
    }
}

/// Outputs `n .. n + vs` of row `m` of a segment `[M, n_cols]`: the summed slices `v`, then
/// the bias, cast to `O` (the order of [`reduce_kernel`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_segment<F: Float, O: Float, V: Size>(
    v: Vector<f32, V>,
    bias: &Array<F>,
    y: &mut Array<Vector<O, V>>,
    m: usize,
    n: usize,
    n_cols: usize,
    #[comptime] vs: usize,
    #[comptime] has_bias: bool,
) {
    let mut out = Vector::<O, V>::empty();
    #[unroll]
    for e in 0..vs {
        let mut x = v[e];
        if has_bias {
            x += f32::cast_from(bias[n + e]);
        }
        out[e] = O::cast_from(x);
    }
    y[(m * n_cols + n) / vs] = out;
}

/// One segment of [`reduce_segments`]: its width `N_s`, bias `[N_s]` and output `y [M, N_s]`.
pub(crate) struct ReduceSegment<'a> {
    pub n: usize,
    pub bias: Option<&'a Handle>,
    pub y: &'a Handle,
}

/// `y_s[M, N_s] = sum over slices of part[s, M, N_0 + .. + N_s-1 ..][..N_s] (+ bias_s)` for two
/// or three segments laid side by side in `part [splits, M, sum N_s]`; one launch. The caller
/// checked every buffer, and every segment has a bias or none does.
pub(crate) fn reduce_segments<R: Runtime, F: Float, O: Float>(
    client: &ComputeClient<R>,
    part: Handle,
    splits: usize,
    m: usize,
    segs: &[ReduceSegment<'_>],
) {
    assert!(
        (2..=3).contains(&segs.len()),
        "reduce_segments: 2 or 3 segments"
    );
    let seg = |i: usize| &segs[i.min(segs.len() - 1)];
    let n: usize = segs.iter().map(|s| s.n).sum();
    let total = m * n;
    let has_bias = segs[0].bias.is_some();
    let bias = |i: usize| seg(i).bias.cloned().unwrap_or_else(|| part.clone());
    let aligned = |h: &Handle| {
        h.offset_start
            .is_none_or(|o| o.is_multiple_of(4 * std::mem::size_of::<O>() as u64))
    };
    let vs = if segs.iter().all(|s| s.n.is_multiple_of(4) && aligned(s.y))
        && splits <= vector_max_splits(SEGMENTS_VECTOR_MAX_SPLITS)
    {
        4
    } else {
        1
    };
    let end0 = segs[0].n;
    let end1 = end0 + segs[1].n;
    // SAFETY (of each `from_raw_parts`): the lengths are the buffers' own (checked by the
    // caller); the kernel bounds every access by m*n, each segment's width and the splits, and
    // segment indices past `segs.len()` are never reached (comptime `segments`).
    let y = |i: usize| unsafe { ArrayArg::from_raw_parts(seg(i).y.clone(), m * seg(i).n / vs) };
    let b = |i: usize| unsafe { ArrayArg::from_raw_parts(bias(i), seg(i).n) };
    unsafe {
        reduce_segments_kernel::launch_unchecked::<F, O, R>(
            client,
            grid_1d((total / vs).div_ceil(256)),
            CubeDim::new_1d(256),
            vs,
            ArrayArg::from_raw_parts(part.clone(), splits * total / vs),
            b(0),
            b(1),
            b(2),
            y(0),
            y(1),
            y(2),
            m as u32,
            n as u32,
            end0 as u32,
            end1 as u32,
            splits as u32,
            has_bias,
            segs.len(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{
        plan, plan_waves_with, reduce, reduce_segments, ReduceEpilogue, ReduceSegment,
        SLICE_WAVE_STAGES,
    };
    use cubecl::prelude::*;
    use rand::{Rng, SeedableRng};

    /// The reduction against the host on random slices (wgpu, f32): four outputs a unit where
    /// `N` is a multiple of 4 and the slices few, one elsewhere, with bias and with or without
    /// a LoRA term;
    /// the slices are added in order, then the bias, as on the host, so without LoRA the
    /// results are equal bit for bit.
    #[cfg(feature = "wgpu")]
    #[test]
    fn reduction_adds_the_slices_in_order_then_the_epilogue() {
        type R = cubecl::wgpu::WgpuRuntime;
        let c = R::client(&crate::runtime::wgpu_device_or_exit());
        let seed: u64 = rand::rng().random();
        let mut g = rand::rngs::StdRng::seed_from_u64(seed);
        let mut uniform =
            |len: usize| -> Vec<f32> { (0..len).map(|_| g.random_range(-1.0f32..1.0)).collect() };
        for (m, n, splits, rank) in [
            (3, 40, 3, 2),
            (5, 18, 14, 0),
            (2, 64, 1, 4),
            (7, 9, 2, 2),
            (4, 32, 6, 2),
        ] {
            let (part, bias, t, b) = (
                uniform(splits * m * n),
                uniform(n),
                uniform(m * rank.max(1)),
                uniform(n * rank.max(1)),
            );
            let up = |v: &[f32]| c.create_from_slice(f32::as_bytes(v));
            let (ph, bh, th, bbh) = (up(&part), up(&bias), up(&t), up(&b));
            for lora in [false, true] {
                let y = up(&vec![f32::NAN; m * n]);
                let epilogue = ReduceEpilogue {
                    bias: Some(bh.clone()),
                    lora: (lora && rank > 0).then(|| (th.clone(), bbh.clone(), rank, 0.5)),
                };
                reduce::<R, f32, f32>(&c, ph.clone(), splits, m, n, epilogue, &y);
                let got = f32::from_bytes(&c.read_one(y).unwrap()).to_vec();
                let want: Vec<f32> = (0..m * n)
                    .map(|i| {
                        let (r, col) = (i / n, i % n);
                        let mut v = 0f32;
                        for s in 0..splits {
                            v += part[s * m * n + i];
                        }
                        v += bias[col];
                        if lora && rank > 0 {
                            let mut l = 0f32;
                            for j in 0..rank {
                                l += t[r * rank + j] * b[col * rank + j];
                            }
                            v += 0.5 * l;
                        }
                        v
                    })
                    .collect();
                if lora {
                    // The LoRA sum may be contracted into FMAs by the device compiler.
                    for (g, w) in got.iter().zip(&want) {
                        let ok = (g - w).abs() <= 1e-5 * (1.0 + w.abs());
                        assert!(ok, "{g} vs {w}: m {m} n {n} splits {splits}, seed {seed}");
                    }
                } else {
                    assert_eq!(got, want, "m {m} n {n} splits {splits}, seed {seed}");
                }
            }
        }
    }

    /// The segmented reduction against the host (wgpu, f32): two and three segments side by
    /// side, four outputs a unit (few slices) and one (many, or a width not a multiple of 4),
    /// with and without bias; each segment's output equals the host's sum in order, then its
    /// bias, bit for bit.
    #[cfg(feature = "wgpu")]
    #[test]
    fn segmented_reduction_writes_each_segment_with_its_bias() {
        type R = cubecl::wgpu::WgpuRuntime;
        let c = R::client(&crate::runtime::wgpu_device_or_exit());
        let seed: u64 = rand::rng().random();
        let mut g = rand::rngs::StdRng::seed_from_u64(seed);
        let mut uniform =
            |len: usize| -> Vec<f32> { (0..len).map(|_| g.random_range(-1.0f32..1.0)).collect() };
        let cases: [(usize, &[usize], usize); 6] = [
            (3, &[8, 12, 4], 3),
            (5, &[8, 4, 12], 7),
            (5, &[16, 4], 2),
            (2, &[4, 8, 20], 14),
            (7, &[6, 3, 5], 2),
            (4, &[32, 32], 1),
        ];
        for (m, widths, splits) in cases {
            let n: usize = widths.iter().sum();
            let part = uniform(splits * m * n);
            let biases: Vec<Vec<f32>> = widths.iter().map(|&w| uniform(w)).collect();
            let up = |v: &[f32]| c.create_from_slice(f32::as_bytes(v));
            let ph = up(&part);
            let bh: Vec<_> = biases.iter().map(|b| up(b)).collect();
            for bias in [false, true] {
                let ys: Vec<_> = widths.iter().map(|&w| up(&vec![f32::NAN; m * w])).collect();
                let segs: Vec<ReduceSegment<'_>> = widths
                    .iter()
                    .enumerate()
                    .map(|(i, &w)| ReduceSegment {
                        n: w,
                        bias: bias.then_some(&bh[i]),
                        y: &ys[i],
                    })
                    .collect();
                reduce_segments::<R, f32, f32>(&c, ph.clone(), splits, m, &segs);
                let mut col0 = 0;
                for (i, &w) in widths.iter().enumerate() {
                    let got = f32::from_bytes(&c.read_one(ys[i].clone()).unwrap()).to_vec();
                    let want: Vec<f32> = (0..m * w)
                        .map(|j| {
                            let (r, col) = (j / w, j % w);
                            let mut v = 0f32;
                            for s in 0..splits {
                                v += part[s * m * n + r * n + col0 + col];
                            }
                            if bias {
                                v += biases[i][col];
                            }
                            v
                        })
                        .collect();
                    assert_eq!(got, want, "segment {i} of {widths:?}, m {m}, seed {seed}");
                    col0 += w;
                }
            }
        }
    }

    /// The batch-64 products of a 7B model on the staged kernel (128-row tiles, 64-deep
    /// stages, 264 slots): each narrow product fills one wave with fewer slices than the
    /// warp-target planner gave (15, 14 and 10), and every plan covers the reduction.
    #[test]
    fn wave_plans_fill_whole_waves() {
        // down: 28 tiles, 296 stages
        assert_eq!(plan_waves_with(28, 296, 264, 4, SLICE_WAVE_STAGES), (9, 33));
        // o: 28 tiles, 56 stages
        assert_eq!(plan_waves_with(28, 56, 264, 4, SLICE_WAVE_STAGES), (8, 7));
        // q/k/v as one launch: 36 tiles
        assert_eq!(plan_waves_with(36, 56, 264, 4, SLICE_WAVE_STAGES), (7, 8));
        // gate/up as one launch (296 tiles): 2 slices, as the warp target gave
        assert_eq!(plan_waves_with(296, 56, 264, 4, SLICE_WAVE_STAGES), (2, 28));
        // enough tiles for several full waves: no split
        assert_eq!(
            plan_waves_with(1056, 56, 264, 4, SLICE_WAVE_STAGES),
            (1, 56)
        );
        for tiles in [1, 7, 28, 100, 263, 264, 265, 1184] {
            for stages in [1, 2, 3, 17, 56, 100, 296, 592] {
                let (s, per) = plan_waves_with(tiles, stages, 264, 4, SLICE_WAVE_STAGES);
                assert!(s >= 1 && per * s >= stages && per * (s - 1) < stages);
                assert!(
                    s == 1 || per >= 4.min(stages),
                    "{tiles} {stages}: {s} x {per}"
                );
            }
        }
    }

    #[test]
    fn plans_cover_the_reduction_with_non_empty_slices() {
        // 7B down at M = 16 on the tensor-core path: 28 cubes, 592 stages.
        let (s, per) = plan(28, 592, 264, 8);
        assert_eq!((s, per), (10, 60));
        assert!(per * (s - 1) < 592 && per * s >= 592);
        // Enough cubes: no split.
        assert_eq!(plan(300, 592, 264, 8), (1, 592));
        // Short reductions are not split below `min_stages` per slice.
        assert_eq!(plan(1, 12, 264, 8), (1, 12));
        for groups in [1, 7, 28, 100, 263] {
            for stages in [1, 2, 3, 17, 100, 592, 1184] {
                let (s, per) = plan(groups, stages, 264, 4);
                assert!(s >= 1 && per * s >= stages && per * (s - 1) < stages);
            }
        }
    }
}
