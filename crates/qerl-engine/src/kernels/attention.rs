//! Decode/prefill attention over the KV cache with grouped queries, split along the sequence.
//!
//! One cube per (row, key-value head, split): the `group` query heads that share a key-value
//! head are handled together, so each key and value is read once per row, not once per query
//! head. A row at position `p` of slot `s` attends to the cache positions `0..=p` of slot `s`
//! (causal by construction: prefill rows write their keys before this kernel runs, and no row
//! reads past its own position). Only filled positions are read.
//!
//! Within a cube, positions go in tiles of [`TILE`] with an online softmax in f32: four units
//! score each position, each over a quarter of the channels, against every query head of the
//! group (keys read in 16-byte vectors, the queries from shared memory in vectors of 4 f32),
//! one unit per head takes the tile's maximum and exponentials, then `P·V`: each unit
//! accumulates a 16-byte vector of one head's channels (one load a position, [`PV_BATCH`] in
//! flight) over its share of the tile's positions, rescaling by `exp(m_old − m_new)`; where
//! the group's vectors leave units idle, the positions are shared out among several units per
//! vector, summed once at the end ([`pv_groups`]). [`UNITS`] units per cube keep each unit's
//! chain of dependent steps short: at decode a cube's latency is the step's.
//!
//! Split (flash-decoding): when rows × key-value heads alone would leave most multiprocessors
//! idle (decode at small batch, long contexts), the context is cut into `splits` spans of whole
//! tiles, each cube writes its unnormalised output and its `(max, sum)` per head to a scratch
//! buffer, and [`super::attention_combine`] merges the spans: `o = Σ e^(m_s−M) o_s / Σ e^(m_s−M)
//! l_s`. A span past a row's context writes `(−1e30, 0)` and weighs nothing.

use cubecl::prelude::*;
use cubecl::server::Handle;

pub use super::attention_combine::OLora;
pub use super::attention_tc::AttentionKernel;
use super::{grid_rows, row_of_cube, vector_width};

/// Positions per tile.
pub const TILE: u32 = 64;
/// Units per cube: [`QUARTERS`] units score each position of a tile, each over a quarter of
/// the head's channels, so that one unit's chain of dependent steps stays short.
pub const UNITS: u32 = 256;
/// Units per position in the scores (`UNITS / TILE`).
const QUARTERS: usize = 4;
/// Key vectors (16 bytes each) loaded before they are used.
const K_BATCH: usize = 4;
/// Value vectors (16 bytes each) loaded before they are used.
const PV_BATCH: usize = 4;
/// Score of a position outside the span (its exponential is 0).
pub(super) const MASKED: f32 = -1.0e30;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn attention_kernel<F: Float, V: Size, QV: Size>(
    q: &Array<F>,
    k_cache: &Array<Vector<F, V>>,
    v_cache: &Array<Vector<F, V>>,
    slot: &Array<u32>,
    pos: &Array<u32>,
    out: &mut Array<F>,
    part_o: &mut Array<f32>,
    part_ml: &mut Array<f32>,
    rows: u32,
    kv_heads: u32,
    capacity: u32,
    span: u32,
    splits: u32,
    scale: f32,
    #[comptime] group: usize,
    #[comptime] head_dim: usize,
    #[comptime] split: bool,
    #[comptime] pv_groups: usize,
    #[comptime] qw: usize,
) {
    let tile = TILE as usize;
    let units = UNITS as usize;
    let vs = k_cache.vector_size();
    // Key vectors of one quarter of a head.
    let qvecs = comptime!(head_dim / QUARTERS / vs);
    // P·V: an item is a vector of channels of one head; the units form `pv_groups` groups,
    // each over its share of a tile's positions, each unit taking `per_unit` items.
    let cvs = comptime!(head_dim / vs);
    let items = comptime!(group * head_dim / vs);
    let lanes = comptime!(UNITS as usize / pv_groups);
    let per_unit = comptime!(items.div_ceil(UNITS as usize / pv_groups));
    let share = comptime!(TILE as usize / pv_groups);
    let mut red = SharedMemory::<f32>::new(comptime!(if pv_groups > 1 {
        pv_groups * group * head_dim
    } else {
        1
    }));
    // The scaled queries as vectors of `qw` (the `QV` vector size, up to 4 f32: one shared load
    // serves `qw` channels of the scores).
    let mut qs = SharedMemory::<Vector<f32, QV>>::new(comptime!(group * head_dim / qw));
    let mut sq = SharedMemory::<f32>::new(comptime!(QUARTERS * group * TILE as usize));
    let mut ps = SharedMemory::<f32>::new(comptime!(group * TILE as usize));
    let mut m_run = SharedMemory::<f32>::new(group);
    let mut l_run = SharedMemory::<f32>::new(group);
    let mut alpha = SharedMemory::<f32>::new(group);

    let cube = row_of_cube();
    let kv_heads = kv_heads as usize;
    let splits = splits as usize;
    let r = cube / (kv_heads * splits);
    let kvh = (cube / splits) % kv_heads;
    let sp = cube % splits;
    // The whole cube takes the same branch, so the barriers inside are uniform.
    if r < rows as usize {
        let t = UNIT_POS_X as usize;
        let capacity = capacity as usize;
        let len = pos[r] as usize + 1;
        let begin = sp * span as usize;
        let end = min(begin + span as usize, len);
        let q_heads = kv_heads * group;
        let q0 = (r * q_heads + kvh * group) * head_dim;
        let mut i = t;
        while i < comptime!(group * head_dim / qw) {
            let mut v = Vector::<f32, QV>::empty();
            #[unroll]
            for e in 0..qw {
                v[e] = f32::cast_from(q[q0 + i * qw + e]) * scale;
            }
            qs[i] = v;
            i += units;
        }
        if t < group {
            m_run[t] = MASKED;
            l_run[t] = 0.0f32;
        }
        let kv0 = (slot[r] as usize * kv_heads + kvh) * capacity * head_dim;
        let mut acc = Array::<f32>::new(comptime!(per_unit * vs));
        #[unroll]
        for a in 0..comptime!(per_unit * vs) {
            acc[a] = 0.0f32;
        }
        let pg = t / lanes;
        let li = t % lanes;
        // Score unit: a position of the tile and a quarter of the channels.
        let p = t % tile;
        let quarter = t / tile;
        let d_begin = quarter * comptime!(head_dim / QUARTERS);
        sync_cube();

        let mut j0 = begin;
        while j0 < end {
            let j = j0 + p;
            let mut s = Array::<f32>::new(group);
            #[unroll]
            for h in 0..group {
                s[h] = 0.0f32;
            }
            if j < end {
                let row = (kv0 + j * head_dim + d_begin) / vs;
                for b in 0..comptime!(qvecs.div_ceil(K_BATCH)) {
                    let mut kv = Array::<Vector<F, V>>::new(K_BATCH);
                    #[unroll]
                    for u in 0..K_BATCH {
                        kv[u] = k_cache[row + min(b * K_BATCH + u, qvecs - 1)];
                    }
                    #[unroll]
                    for u in 0..K_BATCH {
                        if b * K_BATCH + u < qvecs {
                            let d0 = d_begin + (b * K_BATCH + u) * vs;
                            let mut kf = Array::<f32>::new(vs);
                            #[unroll]
                            for e in 0..vs {
                                kf[e] = f32::cast_from(kv[u][e]);
                            }
                            // Channels in order for each head, as one scalar loop would.
                            #[unroll]
                            for e4 in 0..comptime!(vs / qw) {
                                #[unroll]
                                for h in 0..group {
                                    let qv = qs[(h * head_dim + d0) / qw + e4];
                                    #[unroll]
                                    for e in 0..qw {
                                        s[h] += qv[e] * kf[e4 * qw + e];
                                    }
                                }
                            }
                        }
                    }
                }
            }
            #[unroll]
            for h in 0..group {
                sq[(quarter * group + h) * tile + p] = s[h];
            }
            sync_cube();
            // The quarters summed: one unit per (head, position) pair.
            let mut i = t;
            while i < group * tile {
                let h = i / tile;
                let pp = i % tile;
                let mut total = f32::new(MASKED);
                if j0 + pp < end {
                    total = 0.0f32;
                    #[unroll]
                    for qd in 0..QUARTERS {
                        total += sq[(qd * group + h) * tile + pp];
                    }
                }
                ps[i] = total;
                i += units;
            }
            sync_cube();
            // Softmax statistics: one unit per head, eight running maxima and sums.
            if t < group {
                let mut mx = Array::<f32>::new(8usize);
                #[unroll]
                for u in 0..8usize {
                    mx[u] = MASKED;
                }
                for i in 0..comptime!(TILE as usize / 8) {
                    #[unroll]
                    for u in 0..8usize {
                        mx[u] = max(mx[u], ps[t * tile + i * 8 + u]);
                    }
                }
                let mut m_tile = mx[0];
                #[unroll]
                for u in 1..8usize {
                    m_tile = max(m_tile, mx[u]);
                }
                let m_old = m_run[t];
                let m_new = max(m_old, m_tile);
                let mut sums = Array::<f32>::new(8usize);
                #[unroll]
                for u in 0..8usize {
                    sums[u] = 0.0f32;
                }
                for i in 0..comptime!(TILE as usize / 8) {
                    #[unroll]
                    for u in 0..8usize {
                        let e = f32::exp(ps[t * tile + i * 8 + u] - m_new);
                        ps[t * tile + i * 8 + u] = e;
                        sums[u] += e;
                    }
                }
                let mut sum = 0.0f32;
                #[unroll]
                for u in 0..8usize {
                    sum += sums[u];
                }
                let a = f32::exp(m_old - m_new);
                alpha[t] = a;
                l_run[t] = l_run[t] * a + sum;
                m_run[t] = m_new;
            }
            sync_cube();
            // P·V: this unit's items over its group's positions of the tile, value vectors
            // (16 bytes) PV_BATCH positions in flight.
            let valid = min(tile, end - j0);
            let lo = pg * share;
            let hi = min(lo + share, valid);
            #[unroll]
            for c in 0..per_unit {
                let item = li + c * lanes;
                if item < items {
                    let h = item / cvs;
                    let a = alpha[h];
                    #[unroll]
                    for e in 0..vs {
                        acc[c * vs + e] *= a;
                    }
                    let base = (kv0 + j0 * head_dim) / vs + item % cvs;
                    let mut i0 = lo;
                    while i0 < hi {
                        let mut vv = Array::<Vector<F, V>>::new(PV_BATCH);
                        #[unroll]
                        for u in 0..PV_BATCH {
                            // Past the span: a valid position's value, weighted 0 below.
                            let iu = min(i0 + u, hi - 1);
                            vv[u] = v_cache[base + iu * cvs];
                        }
                        #[unroll]
                        for u in 0..PV_BATCH {
                            let w = select(i0 + u < hi, ps[h * tile + min(i0 + u, hi - 1)], 0.0f32);
                            #[unroll]
                            for e in 0..vs {
                                acc[c * vs + e] += w * f32::cast_from(vv[u][e]);
                            }
                        }
                        i0 += PV_BATCH;
                    }
                }
            }
            sync_cube();
            j0 += tile;
        }
        // The position groups' sums meet in shared memory; group 0 adds them in order and
        // writes.
        if comptime!(pv_groups > 1) {
            #[unroll]
            for c in 0..per_unit {
                let item = li + c * lanes;
                if item < items {
                    #[unroll]
                    for e in 0..vs {
                        red[(pg * items + item) * vs + e] = acc[c * vs + e];
                    }
                }
            }
            sync_cube();
        }
        if pg == 0 {
            #[unroll]
            for c in 0..per_unit {
                let item = li + c * lanes;
                if item < items {
                    let h = item / cvs;
                    #[unroll]
                    for e in 0..vs {
                        let idx = item * vs + e;
                        let mut o = acc[c * vs + e];
                        if comptime!(pv_groups > 1) {
                            o = 0.0f32;
                            for g in 0..pv_groups {
                                o += red[(g * items + item) * vs + e];
                            }
                        }
                        if split {
                            part_o[cube * group * head_dim + idx] = o;
                        } else {
                            out[q0 + idx] = F::cast_from(o / l_run[h]);
                        }
                    }
                }
            }
        }
        if split && t < group {
            part_ml[(cube * group + t) * 2] = m_run[t];
            part_ml[(cube * group + t) * 2 + 1] = l_run[t];
        }
    }
}

/// Shapes of one [`attention`] launch.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub rows: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub capacity: usize,
    pub slots: usize,
    /// Positions any row of the launch attends to at most (`pos + 1`, at most `capacity`):
    /// the spans of a split cover `0..context`, so a short context early in a long rollout
    /// is not cut by the capacity. `capacity` when unknown.
    pub context: usize,
}

impl AttentionShape {
    /// The context the spans cover: `context` within `1..=capacity`.
    fn covered(&self) -> usize {
        self.context.clamp(1, self.capacity.max(1))
    }
}

/// Cubes per multiprocessor the split aims for by default.
pub const CUBES_PER_SM: usize = 2;

/// Cubes per multiprocessor the split aims for with the tensor-core kernel, whose cubes have
/// 128 units. On an H100 (2026-11-27, ncu, 7B decode at batch 64: 256 cubes) one a
/// multiprocessor left the attention unsplit, 17.9 µs a layer and no combine launch, against
/// 21.3 + 6.4 µs split in two with [`CUBES_PER_SM`].
pub const TC_CUBES_PER_SM: usize = 1;

/// `QERL_ATTN_CUBES_PER_SM`, 1 to 32, when set.
fn cubes_per_sm_env() -> Option<usize> {
    std::env::var("QERL_ATTN_CUBES_PER_SM")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|c| (1..=32).contains(c))
}

/// Fewest context positions a split takes: [`TILE`], or `QERL_ATTN_SPLIT_POSITIONS` (read
/// once, a multiple of the tile) for experiments.
fn split_positions() -> usize {
    static POSITIONS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *POSITIONS.get_or_init(|| {
        std::env::var("QERL_ATTN_SPLIT_POSITIONS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map(|v| v.div_ceil(TILE as usize).max(1) * TILE as usize)
            .unwrap_or(TILE as usize)
    })
}

/// Most spans one (row, key-value head) is cut into.
pub const MAX_SPLITS: usize = UNITS as usize;

/// Scratch of the split attention: partial outputs and `(max, sum)` of up to `cubes` cubes,
/// allocated once per engine.
#[derive(Debug)]
pub struct AttentionScratch {
    part_o: Handle,
    part_ml: Handle,
    cubes: usize,
    /// Cubes the split aims for (about two per multiprocessor).
    target: usize,
}

impl AttentionScratch {
    /// Room for twice `target` cubes of `q_heads / kv_heads` heads of `head_dim` channels
    /// (a split only happens when rows × key-value heads is below `target`).
    pub fn new<R: Runtime>(
        client: &ComputeClient<R>,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        target: usize,
    ) -> Self {
        let group = q_heads / kv_heads.max(1);
        let cubes = 2 * target.max(1);
        AttentionScratch {
            part_o: client.empty(cubes * group * head_dim * 4),
            part_ml: client.empty(cubes * group * 2 * 4),
            cubes,
            target: target.max(1),
        }
    }

    /// The default target: [`CUBES_PER_SM`] cubes per multiprocessor of this device
    /// (`QERL_ATTN_CUBES_PER_SM` overrides, 1 to 32).
    pub fn target_for<R: Runtime>(client: &ComputeClient<R>) -> usize {
        let sms = client
            .properties()
            .hardware
            .num_streaming_multiprocessors
            .unwrap_or(32)
            .max(1) as usize;
        cubes_per_sm_env().unwrap_or(CUBES_PER_SM) * sms
    }

    /// The split's target for the tensor-core kernel: [`TC_CUBES_PER_SM`] cubes a
    /// multiprocessor where the scratch has the default [`CUBES_PER_SM`] (an explicit
    /// `QERL_ATTN_CUBES_PER_SM` holds for both kernels).
    fn tc_target(&self) -> usize {
        match cubes_per_sm_env() {
            Some(_) => self.target,
            None => (self.target / CUBES_PER_SM * TC_CUBES_PER_SM).max(1),
        }
    }

    /// Splits for `rows` rows: enough to reach the target, at most one per tile of the
    /// context, within the scratch.
    pub fn splits(&self, s: &AttentionShape) -> usize {
        self.splits_to(s, self.target)
    }

    fn splits_to(&self, s: &AttentionShape, target: usize) -> usize {
        let base = (s.rows * s.kv_heads).max(1);
        let by_context = s.covered().div_ceil(split_positions()).max(1);
        let want = target.div_ceil(base).min(by_context);
        want.min(self.cubes / base).clamp(1, MAX_SPLITS)
    }
}

/// Groups of units that share out a tile's positions in `P·V`: the largest power of two (at
/// most [`TILE`]) that leaves every group a unit per channel vector of the `group` heads
/// (`vectors = group · head_dim / vector width`), 1 when there are more vectors than units.
/// On an H100 at batch 64 (Qwen2.5-7B: 7 heads of 128 bf16 channels, 112 vectors) this is 2.
fn pv_groups(vectors: usize) -> usize {
    let mut p = 1;
    while p < TILE as usize && 2 * p * vectors <= UNITS as usize {
        p *= 2;
    }
    p
}

/// `out [rows, q_heads·D] = softmax(q·Kᵀ/√D)·V` over each row's filled cache positions
/// `0..=pos[r]` of slot `slot[r]`. The context is split over `splits` cubes per (row,
/// key-value head) (`None`: the scratch's plan; 1: no split) and the spans merged after.
/// On CUDA in bf16/f16 the tensor-core kernel ([`super::attention_tc`]) runs where it applies
/// (`QERL_ATTN=simt` turns it off), the SIMT kernel elsewhere.
#[allow(clippy::too_many_arguments)]
pub fn attention<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: AttentionShape,
    q: &Handle,
    k_cache: &Handle,
    v_cache: &Handle,
    slot: &Handle,
    pos: &Handle,
    out: &Handle,
    scratch: &AttentionScratch,
    splits: Option<usize>,
) {
    let io = [q, k_cache, v_cache, slot, pos, out];
    attention_with::<R, F>(client, s, io, scratch, splits, AttentionKernel::Auto, None);
}

/// The splits [`attention_with`] takes by default for `kernel`.
fn default_splits<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: &AttentionShape,
    scratch: &AttentionScratch,
    kernel: AttentionKernel,
) -> usize {
    match super::attention_tc::use_tc::<R, F>(client, s, kernel) {
        true => scratch.splits_to(s, scratch.tc_target()),
        false => scratch.splits(s),
    }
}

/// Positions a span of `splits` covers: whole tiles.
fn span_of(s: &AttentionShape, splits: usize) -> usize {
    s.covered().div_ceil(splits).div_ceil(TILE as usize) * TILE as usize
}

/// What of the launches of [`attention`] (default splits) depends on the context length: the
/// splits and the span, which a captured decode step bakes in.
pub fn split_plan<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: &AttentionShape,
    scratch: &AttentionScratch,
) -> (usize, usize) {
    let splits = default_splits::<R, F>(client, s, scratch, AttentionKernel::Auto).max(1);
    (splits, span_of(s, splits))
}

/// [`attention`] with the kernel chosen by the caller (tests compare the two kernels);
/// `io` is `[q, k_cache, v_cache, slot, pos, out]`. With `o_lora`, where the context is split
/// and the spans' merge can take it ([`super::attention_combine`]), the merge also computes the
/// o product's LoRA down-projection; returns whether it did.
pub fn attention_with<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: AttentionShape,
    io: [&Handle; 6],
    scratch: &AttentionScratch,
    splits: Option<usize>,
    kernel: AttentionKernel,
    o_lora: Option<&OLora<'_>>,
) -> bool {
    let [q, k_cache, v_cache, slot, pos, out] = io;
    let tc = super::attention_tc::use_tc::<R, F>(client, &s, kernel);
    let d = s.head_dim;
    let cache = s.slots * s.kv_heads * s.capacity * d;
    let group = s.q_heads / s.kv_heads;
    let vs = vector_width::<F>(d / QUARTERS);
    // Query vectors in shared memory: up to 4 f32, dividing the key vectors.
    let qw = vs.min(4);
    let base = s.rows * s.kv_heads;
    let splits = splits
        .unwrap_or_else(|| default_splits::<R, F>(client, &s, scratch, kernel))
        .max(1);
    let split = splits > 1;
    assert!(
        !split || (base * splits <= scratch.cubes && splits <= MAX_SPLITS),
        "attention: {splits} splits of {base} cubes exceed the scratch ({} cubes)",
        scratch.cubes
    );
    let span = span_of(&s, splits);
    // Unsplit, the scratch is bound but never written.
    let (part_o, part_ml) = (scratch.part_o.clone(), scratch.part_ml.clone());
    let part_len = if split { base * splits * group } else { 1 };
    if tc {
        let parts = (&part_o, &part_ml, part_len);
        super::attention_tc::launch::<R, F>(client, &s, io, parts, splits, span);
    }
    // SAFETY: buffers sized by the engine from these shapes; positions below `capacity`,
    // slots below `slots`, `q_heads` a multiple of `kv_heads` (checked by the model shape);
    // the scratch holds `base * splits` cubes (asserted above) and is only written when split.
    unsafe {
        if !tc {
            attention_kernel::launch_unchecked::<F, R>(
                client,
                grid_rows(base * splits),
                CubeDim::new_1d(UNITS),
                vs,
                qw,
                ArrayArg::from_raw_parts(q.clone(), s.rows * s.q_heads * d),
                ArrayArg::from_raw_parts(k_cache.clone(), cache / vs),
                ArrayArg::from_raw_parts(v_cache.clone(), cache / vs),
                ArrayArg::from_raw_parts(slot.clone(), s.rows),
                ArrayArg::from_raw_parts(pos.clone(), s.rows),
                ArrayArg::from_raw_parts(out.clone(), s.rows * s.q_heads * d),
                ArrayArg::from_raw_parts(part_o.clone(), part_len * d),
                ArrayArg::from_raw_parts(part_ml.clone(), part_len * 2),
                s.rows as u32,
                s.kv_heads as u32,
                s.capacity as u32,
                span as u32,
                splits as u32,
                1.0f32 / (d as f32).sqrt(),
                group,
                d,
                split,
                pv_groups(group * d / vs),
                qw,
            );
        }
    }
    if !split {
        return false;
    }
    let parts = (&scratch.part_o, &scratch.part_ml, part_len);
    super::attention_combine::combine::<R, F>(client, &s, parts, splits, out, o_lora)
}

#[cfg(test)]
mod tests {
    use super::pv_groups;

    #[test]
    fn position_groups_fill_the_cube_without_exceeding_it() {
        // Qwen2.5-7B in bf16 (7 heads x 16 vectors), in f32 (x 32), small test heads.
        assert_eq!(pv_groups(112), 2);
        assert_eq!(pv_groups(224), 1);
        assert_eq!(pv_groups(12), 16);
        assert_eq!(pv_groups(1), 64);
        assert_eq!(pv_groups(300), 1);
        for v in 1..600 {
            let p = pv_groups(v);
            assert!(p.is_power_of_two() && p <= 64);
            assert!(p == 1 || p * v <= 256);
        }
    }
}
