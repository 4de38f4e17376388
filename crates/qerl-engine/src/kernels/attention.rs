//! Decode/prefill attention over the KV cache with grouped queries.
//!
//! One cube per (row, key-value head): the `group` query heads that share a key-value head are
//! handled together, so each key and value is read once per row, not once per query head. A row
//! at position `p` of slot `s` attends to the cache positions `0..=p` of slot `s` (causal by
//! construction: prefill rows write their keys before this kernel runs, and no row reads past
//! its own position; a position past the context scores −1e30, whose exponential is 0), in tiles of [`TILE`] positions with an online softmax in f32:
//! per tile, each unit scores one position against every query head of the group, one unit per
//! head takes the tile's maximum and exponentials, and the units accumulate `P·V` for their
//! (head, channel) pairs, rescaling by `exp(m_old − m_new)`. Only filled positions are read.
//! Not yet split along the sequence (flash-decoding) for long contexts: one cube walks the whole
//! context of its row.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::grid_rows;

/// Positions per tile, and units per cube.
pub const TILE: u32 = 128;
/// Loads issued together in the inner loops (head sizes are multiples of it).
const CHUNK: usize = 8;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn attention_kernel<F: Float>(
    q: &Array<F>,
    k_cache: &Array<F>,
    v_cache: &Array<F>,
    slot: &Array<u32>,
    pos: &Array<u32>,
    out: &mut Array<F>,
    rows: u32,
    kv_heads: u32,
    capacity: u32,
    scale: f32,
    #[comptime] group: usize,
    #[comptime] head_dim: usize,
) {
    let tile = TILE as usize;
    let pairs = comptime!((group * head_dim).div_ceil(TILE as usize));
    let mut qs = SharedMemory::<f32>::new(comptime!(group * head_dim));
    let mut ps = SharedMemory::<f32>::new(comptime!(group * TILE as usize));
    let mut m_run = SharedMemory::<f32>::new(group);
    let mut l_run = SharedMemory::<f32>::new(group);
    let mut alpha = SharedMemory::<f32>::new(group);

    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let kv_heads = kv_heads as usize;
    let r = cube / kv_heads;
    let kvh = cube % kv_heads;
    // The whole cube takes the same branch, so the barriers inside are uniform.
    if r < rows as usize {
        let t = UNIT_POS_X as usize;
        let capacity = capacity as usize;
        let len = pos[r] as usize + 1;
        let q_heads = kv_heads * group;
        let q0 = (r * q_heads + kvh * group) * head_dim;
        let mut i = t;
        while i < group * head_dim {
            qs[i] = f32::cast_from(q[q0 + i]) * scale;
            i += tile;
        }
        if t < group {
            m_run[t] = f32::new(-1.0e30);
            l_run[t] = 0.0f32;
        }
        let kv0 = (slot[r] as usize * kv_heads + kvh) * capacity * head_dim;
        let mut acc = Array::<f32>::new(pairs);
        #[unroll]
        for c in 0..pairs {
            acc[c] = 0.0f32;
        }
        sync_cube();

        let mut j0 = 0usize;
        while j0 < len {
            // Scores: unit t takes position j0 + t for every head of the group.
            let j = j0 + t;
            let mut s = Array::<f32>::new(group);
            #[unroll]
            for h in 0..group {
                s[h] = f32::new(-1.0e30);
            }
            if j < len {
                #[unroll]
                for h in 0..group {
                    s[h] = 0.0f32;
                }
                let row = kv0 + j * head_dim;
                // Eight channels loaded before they are used: eight loads in flight, not one.
                for dc in 0..comptime!(head_dim / CHUNK) {
                    let mut kd = Array::<f32>::new(CHUNK);
                    #[unroll]
                    for u in 0..CHUNK {
                        kd[u] = f32::cast_from(k_cache[row + dc * CHUNK + u]);
                    }
                    #[unroll]
                    for h in 0..group {
                        #[unroll]
                        for u in 0..CHUNK {
                            s[h] += qs[h * head_dim + dc * CHUNK + u] * kd[u];
                        }
                    }
                }
            }
            #[unroll]
            for h in 0..group {
                ps[h * tile + t] = s[h];
            }
            sync_cube();
            // Softmax statistics: one unit per head.
            if t < group {
                // CHUNK independent running maxima and sums: a dependency chain of
                // tile / CHUNK steps instead of tile.
                let mut mx = Array::<f32>::new(CHUNK);
                #[unroll]
                for u in 0..CHUNK {
                    mx[u] = f32::new(-1.0e30);
                }
                for i in 0..comptime!(TILE as usize / CHUNK) {
                    #[unroll]
                    for u in 0..CHUNK {
                        mx[u] = max(mx[u], ps[t * tile + i * CHUNK + u]);
                    }
                }
                let mut m_tile = mx[0];
                #[unroll]
                for u in 1..CHUNK {
                    m_tile = max(m_tile, mx[u]);
                }
                let m_old = m_run[t];
                let m_new = max(m_old, m_tile);
                let mut sums = Array::<f32>::new(CHUNK);
                #[unroll]
                for u in 0..CHUNK {
                    sums[u] = 0.0f32;
                }
                for i in 0..comptime!(TILE as usize / CHUNK) {
                    #[unroll]
                    for u in 0..CHUNK {
                        let p = f32::exp(ps[t * tile + i * CHUNK + u] - m_new);
                        ps[t * tile + i * CHUNK + u] = p;
                        sums[u] += p;
                    }
                }
                let mut sum = 0.0f32;
                #[unroll]
                for u in 0..CHUNK {
                    sum += sums[u];
                }
                let a = f32::exp(m_old - m_new);
                alpha[t] = a;
                l_run[t] = l_run[t] * a + sum;
                m_run[t] = m_new;
            }
            sync_cube();
            // P·V for this unit's (head, channel) pairs.
            let valid = min(tile, len - j0);
            #[unroll]
            for c in 0..pairs {
                let idx = t + c * tile;
                if idx < group * head_dim {
                    let h = idx / head_dim;
                    let d = idx % head_dim;
                    let mut o = acc[c] * alpha[h];
                    let base = kv0 + j0 * head_dim + d;
                    // Whole chunks of positions with their loads issued together, then the rest.
                    let full = valid / CHUNK;
                    for i in 0..full {
                        let mut vv = Array::<f32>::new(CHUNK);
                        #[unroll]
                        for u in 0..CHUNK {
                            vv[u] = f32::cast_from(v_cache[base + (i * CHUNK + u) * head_dim]);
                        }
                        #[unroll]
                        for u in 0..CHUNK {
                            o += ps[h * tile + i * CHUNK + u] * vv[u];
                        }
                    }
                    for i in full * CHUNK..valid {
                        o += ps[h * tile + i] * f32::cast_from(v_cache[base + i * head_dim]);
                    }
                    acc[c] = o;
                }
            }
            sync_cube();
            j0 += tile;
        }
        #[unroll]
        for c in 0..pairs {
            let idx = t + c * tile;
            if idx < group * head_dim {
                let h = idx / head_dim;
                out[q0 + idx] = F::cast_from(acc[c] / l_run[h]);
            }
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
}

/// `out [rows, q_heads·D] = softmax(q·Kᵀ/√D)·V` over each row's filled cache positions
/// `0..=pos[r]` of slot `slot[r]`.
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
) {
    let d = s.head_dim;
    let cache = s.slots * s.kv_heads * s.capacity * d;
    let group = s.q_heads / s.kv_heads;
    // SAFETY: buffers sized by the engine from these shapes; positions below `capacity`,
    // slots below `slots`, `q_heads` a multiple of `kv_heads` (checked by the model shape).
    unsafe {
        attention_kernel::launch_unchecked::<F, R>(
            client,
            grid_rows(s.rows * s.kv_heads),
            CubeDim::new_1d(TILE),
            ArrayArg::from_raw_parts(q.clone(), s.rows * s.q_heads * d),
            ArrayArg::from_raw_parts(k_cache.clone(), cache),
            ArrayArg::from_raw_parts(v_cache.clone(), cache),
            ArrayArg::from_raw_parts(slot.clone(), s.rows),
            ArrayArg::from_raw_parts(pos.clone(), s.rows),
            ArrayArg::from_raw_parts(out.clone(), s.rows * s.q_heads * d),
            s.rows as u32,
            s.kv_heads as u32,
            s.capacity as u32,
            1.0f32 / (d as f32).sqrt(),
            group,
            d,
        );
    }
}
