//! Sampling on the device, fed straight back: for each logits row, the next token, its
//! log-probability under the sampling distribution, and the slot's state (next input token,
//! position, generated count, finished flag), so the next step is enqueued without the host.
//!
//! Temperature sampling is the Gumbel-max trick: `argmax(l/T + g)` with `g = −ln(−ln u)`, `u`
//! drawn from a counter-based hash of `(seed, request id, token index, vocabulary id)`. The draw
//! of a sequence therefore depends only on its request and step, never on which other sequences
//! share the batch or which slot it landed in. `T = 0` is greedy (ties to the lowest id).
//! Two launches: one cube per (row, chunk of the vocabulary) keeps its best key and an online
//! log-sum-exp (so a batch of one row still spreads over the device), then one cube per row
//! merges its chunks and advances the slot.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::fill::hash4;
use super::{grid_rows, row_of_cube, ROW_CUBE};

/// The `s` of `(m1, s1)` merged with `(m2, s2)` under the new maximum `m = max(m1, m2)`, for a
/// log-sum-exp kept as `m + ln s`.
#[cube]
fn lse_rescaled(m1: f32, s1: f32, m2: f32, s2: f32, m: f32) -> f32 {
    s1 * f32::exp(m1 - m) + s2 * f32::exp(m2 - m)
}

/// Vocabulary entries one cube of [`partial_kernel`] scans (eight per unit).
pub const CHUNK: usize = ROW_CUBE as usize * 8;

/// The best key (and its id) and the log-sum-exp `(m, s)` of this unit's values, reduced over
/// the cube in shared memory; unit 0 ends with the cube's.
#[cube]
#[allow(clippy::too_many_arguments)]
fn reduce_cube(
    best_key: &mut SharedMemory<f32>,
    best_id: &mut SharedMemory<u32>,
    lse_m: &mut SharedMemory<f32>,
    lse_s: &mut SharedMemory<f32>,
    key: f32,
    id: u32,
    m: f32,
    s: f32,
) {
    let t = UNIT_POS_X as usize;
    best_key[t] = key;
    best_id[t] = id;
    lse_m[t] = m;
    lse_s[t] = s;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if t < stride {
            let k2 = best_key[t + stride];
            let i2 = best_id[t + stride];
            if k2 > best_key[t] || (k2 == best_key[t] && i2 < best_id[t]) {
                best_key[t] = k2;
                best_id[t] = i2;
            }
            let m_new = max(lse_m[t], lse_m[t + stride]);
            lse_s[t] = lse_rescaled(
                lse_m[t],
                lse_s[t],
                lse_m[t + stride],
                lse_s[t + stride],
                m_new,
            );
            lse_m[t] = m_new;
        }
        sync_cube();
        stride /= 2;
    }
}

/// Bisection steps of the top-k / top-p thresholds, over `[max − TRUNCATION_WINDOW, max]`.
const TRUNCATION_STEPS: usize = 40;
/// Width of the logit window the thresholds are searched in below the row's maximum (tokens
/// further below have relative probability under e^-64), as in `qerl_model::sampling`.
const TRUNCATION_WINDOW: f32 = 64.0;

/// Sum of `v` over the cube, in shared memory; every unit gets it. Ends with a barrier so the
/// buffer can be reused at once.
#[cube]
fn cube_total(partial: &mut SharedMemory<f32>, v: f32) -> f32 {
    let t = UNIT_POS_X as usize;
    partial[t] = v;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if t < stride {
            partial[t] += partial[t + stride];
        }
        sync_cube();
        stride /= 2;
    }
    let total = partial[0];
    sync_cube();
    total
}

/// One cube per row: the truncation of the tempered distribution `l = logits / T` as two
/// thresholds, `thresh [rows, 2]`: a token is kept when `l >= thresh[0]` (top-k: the k-th
/// largest value, ties kept) and `l > thresh[1]` (top-p over the top-k renormalised
/// distribution: the tokens strictly more likely than a kept one hold less than `p`; the most
/// likely token is always kept), transformers' warpers found by bisection instead of a sort.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn truncation_kernel(
    logits: &Array<f32>,
    thresh: &mut Array<f32>,
    rows: u32,
    vocab: u32,
    inv_temperature: f32,
    top_k: u32,
    top_p: f32,
    #[comptime] use_k: bool,
    #[comptime] use_p: bool,
) {
    let mut partial = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let i = row_of_cube();
    if i < rows as usize {
        let t = UNIT_POS_X as usize;
        let vocab = vocab as usize;
        let row = i * vocab;
        let step = ROW_CUBE as usize;
        // The row's maximum, by a tree of maxima.
        let mut m = f32::new(-3.0e38);
        let mut v = t;
        while v < vocab {
            m = max(m, logits[row + v] * inv_temperature);
            v += step;
        }
        partial[t] = m;
        sync_cube();
        let mut stride = CUBE_DIM_X as usize / 2;
        while stride > 0 {
            if t < stride {
                partial[t] = max(partial[t], partial[t + stride]);
            }
            sync_cube();
            stride /= 2;
        }
        let m = partial[0];
        sync_cube();
        let floor = m - TRUNCATION_WINDOW;
        let mut tk = f32::new(-3.0e38);
        if use_k {
            // Largest threshold with at least k tokens at or above it.
            let mut lo = floor;
            let mut hi = m;
            for _ in 0..TRUNCATION_STEPS {
                let mid = 0.5f32 * (lo + hi);
                let mut count = 0.0f32;
                let mut v = t;
                while v < vocab {
                    if logits[row + v] * inv_temperature >= mid {
                        count += 1.0f32;
                    }
                    v += step;
                }
                if cube_total(&mut partial, count) >= f32::cast_from(top_k) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            tk = lo;
        }
        let mut tp = f32::new(-3.0e38);
        if use_p {
            // Mass of the top-k set, then the largest threshold whose strictly-greater mass
            // still reaches p (its cut token is kept).
            let mut z = 0.0f32;
            let mut v = t;
            while v < vocab {
                let l = logits[row + v] * inv_temperature;
                if l >= tk {
                    z += f32::exp(l - m);
                }
                v += step;
            }
            let want = top_p * cube_total(&mut partial, z);
            let mut lo = max(floor, tk);
            let mut hi = m;
            for _ in 0..TRUNCATION_STEPS {
                let mid = 0.5f32 * (lo + hi);
                let mut mass = 0.0f32;
                let mut v = t;
                while v < vocab {
                    let l = logits[row + v] * inv_temperature;
                    if l > mid && l >= tk {
                        mass += f32::exp(l - m);
                    }
                    v += step;
                }
                if cube_total(&mut partial, mass) >= want {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            tp = lo;
        }
        if t == 0 {
            thresh[i * 2] = tk;
            thresh[i * 2 + 1] = tp;
        }
    }
}

/// One cube per (row, chunk of [`CHUNK`] vocabulary entries): the chunk's best Gumbel key and
/// its id, and its log-sum-exp, into `part_f [rows, chunks, 3]` (key, m, s) and
/// `part_id [rows, chunks]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn partial_kernel(
    logits: &Array<f32>,
    slot_of: &Array<u32>,
    generated: &Array<u32>,
    rng_id: &Array<u32>,
    thresh: &Array<f32>,
    part_f: &mut Array<f32>,
    part_id: &mut Array<u32>,
    rows: u32,
    vocab: u32,
    chunks: u32,
    inv_temperature: f32,
    seed: u32,
    #[comptime] greedy: bool,
    #[comptime] truncated: bool,
) {
    let mut best_key = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let mut best_id = SharedMemory::<u32>::new(ROW_CUBE as usize);
    let mut lse_m = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let mut lse_s = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let cube = row_of_cube();
    let chunks = chunks as usize;
    let i = cube / chunks;
    let c = cube % chunks;
    if i < rows as usize {
        let t = UNIT_POS_X as usize;
        let vocab = vocab as usize;
        let slot = slot_of[i] as usize;
        let req = rng_id[slot];
        let gen = generated[slot];
        let mut key = f32::new(-3.0e38);
        let mut id = 0u32;
        let mut m = f32::new(-3.0e38);
        let mut s = 0.0f32;
        let end = min((c + 1) * CHUNK, vocab);
        let mut keep_at = f32::new(-3.0e38);
        let mut keep_above = f32::new(-3.0e38);
        if truncated {
            keep_at = thresh[i * 2];
            keep_above = thresh[i * 2 + 1];
        }
        let mut v = c * CHUNK + t;
        while v < end {
            let x = logits[i * vocab + v] * inv_temperature;
            let m_new = max(m, x);
            s = lse_rescaled(m, s, x, 1.0f32, m_new);
            m = m_new;
            let mut k = x;
            if !greedy {
                let h = hash4(seed, req, gen, v as u32, 7u32);
                let u = (f32::cast_from(h >> 8) + 0.5f32) * (1.0f32 / 16_777_216.0f32);
                k = x - f32::ln(-f32::ln(u));
            }
            // Truncated tokens can never win (the log-sum-exp above still counts them: the
            // log-probability is the untruncated tempered one, as the training forward's).
            if truncated && (x < keep_at || x <= keep_above) {
                k = f32::new(-3.0e38);
            }
            if k > key {
                key = k;
                id = v as u32;
            }
            v += ROW_CUBE as usize;
        }
        reduce_cube(
            &mut best_key,
            &mut best_id,
            &mut lse_m,
            &mut lse_s,
            key,
            id,
            m,
            s,
        );
        if t == 0 {
            part_f[cube * 3] = best_key[0];
            part_f[cube * 3 + 1] = lse_m[0];
            part_f[cube * 3 + 2] = lse_s[0];
            part_id[cube] = best_id[0];
        }
    }
}

/// One cube per row: merges the row's chunks, then records the token and advances the slot.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn sample_kernel(
    logits: &Array<f32>,
    part_f: &Array<f32>,
    part_id: &Array<u32>,
    slot_of: &Array<u32>,
    eos: &Array<u32>,
    tokens: &mut Array<u32>,
    pos: &mut Array<u32>,
    generated: &mut Array<u32>,
    done: &mut Array<u32>,
    request: &Array<u32>,
    max_new: &Array<u32>,
    out_tokens: &mut Array<u32>,
    out_logprob: &mut Array<f32>,
    rows: u32,
    vocab: u32,
    chunks: u32,
    n_eos: u32,
    capacity_new: u32,
    inv_temperature: f32,
) {
    let mut best_key = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let mut best_id = SharedMemory::<u32>::new(ROW_CUBE as usize);
    let mut lse_m = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let mut lse_s = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let i = row_of_cube();
    if i < rows as usize {
        let t = UNIT_POS_X as usize;
        let vocab = vocab as usize;
        let chunks = chunks as usize;
        let slot = slot_of[i] as usize;
        let gen = generated[slot];
        let mut key = f32::new(-3.0e38);
        let mut id = 0u32;
        let mut m = f32::new(-3.0e38);
        let mut s = 0.0f32;
        // Chunks in increasing order per unit: ties keep the lowest id.
        let mut c = t;
        while c < chunks {
            let at = i * chunks + c;
            let k2 = part_f[at * 3];
            let i2 = part_id[at];
            if k2 > key || (k2 == key && i2 < id) {
                key = k2;
                id = i2;
            }
            let m2 = part_f[at * 3 + 1];
            let m_new = max(m, m2);
            s = lse_rescaled(m, s, m2, part_f[at * 3 + 2], m_new);
            m = m_new;
            c += ROW_CUBE as usize;
        }
        reduce_cube(
            &mut best_key,
            &mut best_id,
            &mut lse_m,
            &mut lse_s,
            key,
            id,
            m,
            s,
        );
        if t == 0 && done[slot] == 0u32 {
            let tok = best_id[0];
            let logprob =
                logits[i * vocab + tok as usize] * inv_temperature - (lse_m[0] + f32::ln(lse_s[0]));
            let o = request[slot] as usize * capacity_new as usize + gen as usize;
            out_tokens[o] = tok;
            out_logprob[o] = logprob;
            let mut finished = gen + 1u32 >= max_new[slot];
            for e in 0..n_eos as usize {
                if eos[e] == tok {
                    finished = true;
                }
            }
            if finished {
                done[slot] = 1u32;
            }
            generated[slot] = gen + 1u32;
            tokens[slot] = tok;
            pos[slot] = pos[slot] + 1u32;
        }
    }
}

/// The per-chunk results of [`sample`] for up to `rows` logits rows, allocated once.
#[derive(Debug)]
pub struct SampleScratch {
    thresh: Handle,
    part_f: Handle,
    part_id: Handle,
    rows: usize,
    chunks: usize,
}

impl SampleScratch {
    pub fn new<R: Runtime>(client: &ComputeClient<R>, rows: usize, vocab: usize) -> Self {
        let chunks = vocab.div_ceil(CHUNK).max(1);
        let n = rows.max(1) * chunks;
        SampleScratch {
            thresh: client.empty(rows.max(1) * 2 * 4),
            part_f: client.empty(n * 3 * 4),
            part_id: client.empty(n * 4),
            rows: rows.max(1),
            chunks,
        }
    }
}

/// Truncation of the sampling distribution (transformers' top-k then top-p warpers): `top_k`
/// 0 and `top_p` 1 keep every token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Truncation {
    pub top_k: usize,
    pub top_p: f32,
}

impl Default for Truncation {
    fn default() -> Self {
        Truncation {
            top_k: 0,
            top_p: 1.0,
        }
    }
}

/// Per-slot decoding state on the device (`slots` u32 each) and the output arrays
/// (`[requests, capacity_new]`, row `request[slot]`).
#[derive(Clone, Debug)]
pub struct SlotState {
    pub tokens: Handle,
    pub pos: Handle,
    pub generated: Handle,
    pub done: Handle,
    /// The slot's row in the output arrays.
    pub request: Handle,
    /// The id its random draws are keyed by (the caller's request id).
    pub rng_id: Handle,
    pub max_new: Handle,
    pub out_tokens: Handle,
    pub out_logprob: Handle,
    pub slots: usize,
    pub requests: usize,
    pub capacity_new: usize,
}

/// Samples one token for each of the `rows` logits rows (`[rows, vocab]` f32; row `i` belongs
/// to slot `slot_of[i]`) and advances that slot's state. A finished slot keeps its state.
#[allow(clippy::too_many_arguments)]
pub fn sample<R: Runtime>(
    client: &ComputeClient<R>,
    logits: &Handle,
    rows: usize,
    vocab: usize,
    slot_of: &Handle,
    eos: &Handle,
    n_eos: usize,
    state: &SlotState,
    temperature: f32,
    seed: u32,
    truncation: Truncation,
    scratch: &SampleScratch,
) {
    assert!(
        rows <= scratch.rows && vocab.div_ceil(CHUNK) == scratch.chunks,
        "sample: {rows} rows of {vocab} logits exceed the scratch"
    );
    let chunks = scratch.chunks;
    let greedy = temperature <= 0.0;
    // Greedy picks the most likely token, which every truncation keeps.
    let use_k = !greedy && truncation.top_k > 0 && truncation.top_k < vocab;
    let use_p = !greedy && truncation.top_p < 1.0;
    let truncated = use_k || use_p;
    let inv_t = if greedy { 1.0 } else { 1.0 / temperature };
    let n = state.slots;
    let out = state.requests * state.capacity_new;
    // SAFETY: `logits` holds `rows * vocab` f32, `slot_of` `rows` slots below `slots`, `eos`
    // `max(n_eos, 1)` ids; request rows are below `requests`, and the engine never lets a
    // slot's generated count reach `capacity_new` before it is finished (max_new <=
    // capacity_new).
    unsafe {
        if truncated {
            truncation_kernel::launch_unchecked::<R>(
                client,
                grid_rows(rows),
                CubeDim::new_1d(ROW_CUBE),
                ArrayArg::from_raw_parts(logits.clone(), rows * vocab),
                ArrayArg::from_raw_parts(scratch.thresh.clone(), rows * 2),
                rows as u32,
                vocab as u32,
                inv_t,
                truncation.top_k as u32,
                truncation.top_p,
                use_k,
                use_p,
            );
        }
        partial_kernel::launch_unchecked::<R>(
            client,
            grid_rows(rows * chunks),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(logits.clone(), rows * vocab),
            ArrayArg::from_raw_parts(slot_of.clone(), rows),
            ArrayArg::from_raw_parts(state.generated.clone(), n),
            ArrayArg::from_raw_parts(state.rng_id.clone(), n),
            ArrayArg::from_raw_parts(scratch.thresh.clone(), rows * 2),
            ArrayArg::from_raw_parts(scratch.part_f.clone(), rows * chunks * 3),
            ArrayArg::from_raw_parts(scratch.part_id.clone(), rows * chunks),
            rows as u32,
            vocab as u32,
            chunks as u32,
            inv_t,
            seed,
            greedy,
            truncated,
        );
        sample_kernel::launch_unchecked::<R>(
            client,
            grid_rows(rows),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(logits.clone(), rows * vocab),
            ArrayArg::from_raw_parts(scratch.part_f.clone(), rows * chunks * 3),
            ArrayArg::from_raw_parts(scratch.part_id.clone(), rows * chunks),
            ArrayArg::from_raw_parts(slot_of.clone(), rows),
            ArrayArg::from_raw_parts(eos.clone(), n_eos.max(1)),
            ArrayArg::from_raw_parts(state.tokens.clone(), n),
            ArrayArg::from_raw_parts(state.pos.clone(), n),
            ArrayArg::from_raw_parts(state.generated.clone(), n),
            ArrayArg::from_raw_parts(state.done.clone(), n),
            ArrayArg::from_raw_parts(state.request.clone(), n),
            ArrayArg::from_raw_parts(state.max_new.clone(), n),
            ArrayArg::from_raw_parts(state.out_tokens.clone(), out),
            ArrayArg::from_raw_parts(state.out_logprob.clone(), out),
            rows as u32,
            vocab as u32,
            chunks as u32,
            n_eos as u32,
            state.capacity_new as u32,
            inv_t,
        );
    }
}
