//! Sampling on the device, fed straight back: for each logits row, the next token, its
//! log-probability under the sampling distribution, and the slot's state (next input token,
//! position, generated count, finished flag), so the next step is enqueued without the host.
//!
//! Temperature sampling is the Gumbel-max trick: `argmax(l/T + g)` with `g = −ln(−ln u)`, `u`
//! drawn from a counter-based hash of `(seed, request id, token index, vocabulary id)`. The draw
//! of a sequence therefore depends only on its request and step, never on which other sequences
//! share the batch or which slot it landed in. `T = 0` is greedy (ties to the lowest id).
//! One cube per row: each unit scans a strided part of the vocabulary keeping its best key and
//! an online log-sum-exp, and the cube reduces both in shared memory.

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

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn sample_kernel(
    logits: &Array<f32>,
    slot_of: &Array<u32>,
    eos: &Array<u32>,
    tokens: &mut Array<u32>,
    pos: &mut Array<u32>,
    generated: &mut Array<u32>,
    done: &mut Array<u32>,
    request: &Array<u32>,
    rng_id: &Array<u32>,
    max_new: &Array<u32>,
    out_tokens: &mut Array<u32>,
    out_logprob: &mut Array<f32>,
    rows: u32,
    vocab: u32,
    n_eos: u32,
    capacity_new: u32,
    inv_temperature: f32,
    seed: u32,
    #[comptime] greedy: bool,
) {
    let mut best_key = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let mut best_id = SharedMemory::<u32>::new(ROW_CUBE as usize);
    let mut lse_m = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let mut lse_s = SharedMemory::<f32>::new(ROW_CUBE as usize);
    let i = row_of_cube();
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
        let mut v = t;
        while v < vocab {
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
) {
    let greedy = temperature <= 0.0;
    let inv_t = if greedy { 1.0 } else { 1.0 / temperature };
    let n = state.slots;
    let out = state.requests * state.capacity_new;
    // SAFETY: `logits` holds `rows * vocab` f32, `slot_of` `rows` slots below `slots`, `eos`
    // `max(n_eos, 1)` ids; request rows are below `requests`, and the engine never lets a
    // slot's generated count reach `capacity_new` before it is finished (max_new <=
    // capacity_new).
    unsafe {
        sample_kernel::launch_unchecked::<R>(
            client,
            grid_rows(rows),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(logits.clone(), rows * vocab),
            ArrayArg::from_raw_parts(slot_of.clone(), rows),
            ArrayArg::from_raw_parts(eos.clone(), n_eos.max(1)),
            ArrayArg::from_raw_parts(state.tokens.clone(), n),
            ArrayArg::from_raw_parts(state.pos.clone(), n),
            ArrayArg::from_raw_parts(state.generated.clone(), n),
            ArrayArg::from_raw_parts(state.done.clone(), n),
            ArrayArg::from_raw_parts(state.request.clone(), n),
            ArrayArg::from_raw_parts(state.rng_id.clone(), n),
            ArrayArg::from_raw_parts(state.max_new.clone(), n),
            ArrayArg::from_raw_parts(state.out_tokens.clone(), out),
            ArrayArg::from_raw_parts(state.out_logprob.clone(), out),
            rows as u32,
            vocab as u32,
            n_eos as u32,
            state.capacity_new as u32,
            inv_t,
            seed,
            greedy,
        );
    }
}
