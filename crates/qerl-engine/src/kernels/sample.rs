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
    part_f: &mut Array<f32>,
    part_id: &mut Array<u32>,
    rows: u32,
    vocab: u32,
    chunks: u32,
    inv_temperature: f32,
    seed: u32,
    #[comptime] greedy: bool,
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
            part_f: client.empty(n * 3 * 4),
            part_id: client.empty(n * 4),
            rows: rows.max(1),
            chunks,
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
    scratch: &SampleScratch,
) {
    assert!(
        rows <= scratch.rows && vocab.div_ceil(CHUNK) == scratch.chunks,
        "sample: {rows} rows of {vocab} logits exceed the scratch"
    );
    let chunks = scratch.chunks;
    let greedy = temperature <= 0.0;
    let inv_t = if greedy { 1.0 } else { 1.0 / temperature };
    let n = state.slots;
    let out = state.requests * state.capacity_new;
    // SAFETY: `logits` holds `rows * vocab` f32, `slot_of` `rows` slots below `slots`, `eos`
    // `max(n_eos, 1)` ids; request rows are below `requests`, and the engine never lets a
    // slot's generated count reach `capacity_new` before it is finished (max_new <=
    // capacity_new).
    unsafe {
        partial_kernel::launch_unchecked::<R>(
            client,
            grid_rows(rows * chunks),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(logits.clone(), rows * vocab),
            ArrayArg::from_raw_parts(slot_of.clone(), rows),
            ArrayArg::from_raw_parts(state.generated.clone(), n),
            ArrayArg::from_raw_parts(state.rng_id.clone(), n),
            ArrayArg::from_raw_parts(scratch.part_f.clone(), rows * chunks * 3),
            ArrayArg::from_raw_parts(scratch.part_id.clone(), rows * chunks),
            rows as u32,
            vocab as u32,
            chunks as u32,
            inv_t,
            seed,
            greedy,
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
