//! Decode attention on CUDA tensor cores (`mma.sync.m16n8k16`, bf16/f16 in, f32 accumulate):
//! the semantics, arguments and split/combine scheme of [`attention`](super::attention), with
//! the dot products of `q·Kᵀ` and `P·V` on tensor cores instead of f32 FMAs.
//!
//! Why: at batch 64 on an H100 the SIMT kernel took ~47 µs a layer where its memory bound is
//! ~14 µs, bound by issuing FMAs and shared-memory loads (7 heads x 32 channels of FMAs per
//! position and unit, P·V alike) and by a serial softmax per head.
//!
//! One cube of [`TC_WARPS`] warps per (row, key-value head, split); warp `w` takes the steps of
//! 16 positions starting at `begin + 16·w`, `+ 64`, … of its span and keeps its own online
//! softmax (max and sum per head row, f32) and output accumulator; at the end the warps merge
//! through shared memory (rescaled to the cube's max) into `out` (unsplit) or into the split
//! scratch (`part_o [cube][group][head_dim]`, `part_ml [cube][group][2]` = (max, sum)) that
//! [`combine_kernel`](super::attention) merges unchanged.
//!
//! Fragments (lane = 4g + t; the `M` rows are the group's query heads, rows ≥ `group` padding):
//! * scores `S[16 heads, 16 positions]` = two n-tiles of 8 positions, `head_dim / 16` k-steps.
//!   The reduction order over channels is permuted (a sum does not depend on the order of its
//!   terms): lane (g, t) loads `K[position g of the n-tile][channels t·D/4 .. (t+1)·D/4)` as
//!   16-byte vectors, and word `2s` / `2s + 1` of that run (channel pairs `t·D/4 + 4s + {0,1}`
//!   and `+ {2,3}`) are its `B` registers `b0` / `b1` of k-step `s`. `Q`'s `A` registers follow
//!   the same map: `a0 = Q[g][t·D/4 + 4s + {0,1}]`, `a1` the same of head `g + 8`, `a2 =
//!   Q[g][t·D/4 + 4s + {2,3}]`, `a3` of head `g + 8`, exact in bf16, stored once per cube in
//!   shared memory in fragment order (one 16-byte load per lane and k-step). The softmax scale
//!   multiplies the f32 scores.
//! * `P` (rounded to F) is the `A` operand of `P·V` straight from the scores' accumulators
//!   (FlashAttention-2): `a0`/`a1` = n-tile 0's (row g | g + 8, positions 2t, 2t + 1), `a2`/`a3`
//!   = n-tile 1's (positions 8 + 2t, 9 + 2t).
//! * `V`: output n-tile `jn` column `c` is channel `c·D/8 + jn`, so lane (g, t) loads
//!   `V[position][g·D/8 .. (g+1)·D/8)` (16-byte vectors) for its four positions `2t, 2t + 1,
//!   2t + 8, 2t + 9` of the step, and builds `b0` of n-tile `2w + i` from word `w` of positions
//!   2t and 2t + 1 (low halves for i = 0, high halves for i = 1), `b1` from 2t + 8 and 2t + 9.
//! * `O`: lane (g, t) holds, for n-tile `jn`, rows g and g + 8 at channels `2t·D/8 + jn` and
//!   `(2t + 1)·D/8 + jn`; the merge reads them back in true channel order.
//!
//! Positions past the span or the row's context are masked (score −1e30, weight 0) and their
//! keys and values are read from the last valid position instead: unfilled cache slots may hold
//! anything, and 0·NaN is NaN.

use cubecl::cmma::MmaDefinition;
use cubecl::features::{MmaConfig, Plane};
use cubecl::prelude::*;
use cubecl::server::Handle;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::arrival::{allow_dependents, wait_for_primaries};
use super::attention::AttentionShape;
use super::{grid_rows, row_of_cube};

/// Warps per cube; a cube step covers `16·TC_WARPS` positions.
pub const TC_WARPS: usize = 4;
/// Units per cube.
const TC_UNITS: u32 = 32 * TC_WARPS as u32;
/// Positions of one warp step (two n-tiles of 8).
const STEP: usize = 16;
/// Largest group (query heads per key-value head): the 16 rows of an `mma` tile.
pub const TC_MAX_GROUP: usize = 16;
/// Largest head dimension: the output accumulator takes `head_dim / 2` registers a lane.
pub const TC_MAX_HEAD_DIM: usize = 128;
/// Score of a masked position (its exponential is 0); the SIMT kernel's value.
const MASKED: f32 = -1.0e30;
/// Floats between the 64-float records of the merge buffer: odd, so that reading the
/// channels in order walks the banks.
const RED_STRIDE: usize = 65;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn attention_tc_kernel<F: Float, P: Size, KV: Size, VV: Size, QV: Size>(
    q: &mut Array<u32>,
    k_cache: &mut Array<Vector<u32, KV>>,
    v_cache: &mut Array<Vector<u32, VV>>,
    slot: &mut Array<u32>,
    pos: &mut Array<u32>,
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
) {
    // CUDA only: programmatic in a captured step (`super::WAITING_KERNELS`).
    allow_dependents(true);
    wait_for_primaries(true);
    let ksteps = comptime!(head_dim / 16);
    let ntiles = comptime!(head_dim / 8);
    // Words (channel pairs) of V a lane reads per position.
    let vw = comptime!(head_dim / 16);
    let vvs = v_cache.vector_size();
    let halves = comptime!(if group > 8 { 2usize } else { 1usize });
    let record = comptime!(halves * (head_dim / 8) * RED_STRIDE);
    let mut qs = SharedMemory::<Vector<u32, QV>>::new(comptime!(head_dim / 16 * 32));
    let mut red =
        SharedMemory::<f32>::new(comptime!(TC_WARPS * halves * (head_dim / 8) * RED_STRIDE));
    let mut wm = SharedMemory::<f32>::new(comptime!(TC_WARPS * 16));
    let mut wl = SharedMemory::<f32>::new(comptime!(TC_WARPS * 16));

    let cube = row_of_cube();
    let kv_heads = kv_heads as usize;
    let splits = splits as usize;
    let r = cube / (kv_heads * splits);
    let kvh = (cube / splits) % kv_heads;
    let sp = cube % splits;
    // The whole cube takes the same branch, so the barriers inside are uniform.
    if r < rows as usize {
        let tid = UNIT_POS_X as usize;
        let lane = tid % 32;
        let warp = tid / 32;
        let g = lane / 4;
        let t = lane % 4;
        let len = pos[r] as usize + 1;
        let begin = sp * span as usize;
        let end = min(begin + span as usize, len);
        let q0 = (r * kv_heads + kvh) * comptime!(group * head_dim);

        // Q's A registers of k-step s for lane `ln` at qs[s·32 + ln]: (a0, a1, a2, a3).
        let mut i = tid;
        while i < comptime!(head_dim / 16 * 32) {
            let s = i / 32;
            let gg = (i % 32) / 4;
            let w0 = q0 / 2 + (i % 4) * comptime!(head_dim / 8) + 2 * s;
            let mut v = Vector::<u32, QV>::new(0u32);
            if gg < group {
                v[0] = q[w0 + gg * comptime!(head_dim / 2)];
                v[2] = q[w0 + gg * comptime!(head_dim / 2) + 1];
            }
            if gg + 8 < group {
                v[1] = q[w0 + (gg + 8) * comptime!(head_dim / 2)];
                v[3] = q[w0 + (gg + 8) * comptime!(head_dim / 2) + 1];
            }
            qs[i] = v;
            i += TC_UNITS as usize;
        }

        let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
        let mut o = Sequence::<Array<Vector<f32, P>>>::new();
        #[unroll]
        for _ in 0..ntiles {
            let mut a = Array::<Vector<f32, P>>::new(2usize);
            a[0] = Vector::<f32, P>::new(0.0f32);
            a[1] = Vector::<f32, P>::new(0.0f32);
            o.push(a);
        }
        // Running max and (this lane's share of the) sum of rows g and g + 8.
        let mut m_run = Array::<f32>::new(2usize);
        let mut l_run = Array::<f32>::new(2usize);
        #[unroll]
        for h in 0..2usize {
            m_run[h] = MASKED;
            l_run[h] = 0.0f32;
        }
        let kvs = k_cache.vector_size();
        let mut kr = Array::<Vector<u32, KV>>::new(comptime!(2 * (head_dim / 8) / kvs));
        let mut vr = Array::<Vector<u32, VV>>::new(comptime!(4 * (head_dim / 16) / vvs));
        let kbase =
            (slot[r] as usize * kv_heads + kvh) * capacity as usize * comptime!(head_dim / 2);
        let stride = comptime!(TC_WARPS * STEP);
        let mut j0 = begin + warp * STEP;
        if j0 < end {
            load_k::<KV>(k_cache, &mut kr, kbase, j0, end, g, t, head_dim);
        }
        sync_cube();

        // Every step holds at least one valid position (j0 < end), so each row's max is a real
        // score after its first step and masked positions weigh exactly 0.
        while j0 < end {
            // This step's values, in flight during the scores and the softmax.
            load_v::<VV>(v_cache, &mut vr, kbase, j0, end, g, t, head_dim);
            let mut sc = Sequence::<Array<Vector<f32, P>>>::new();
            #[unroll]
            for _ in 0..2usize {
                let mut a = Array::<Vector<f32, P>>::new(2usize);
                a[0] = Vector::<f32, P>::new(0.0f32);
                a[1] = Vector::<f32, P>::new(0.0f32);
                sc.push(a);
            }
            #[unroll]
            for s in 0..ksteps {
                let qa = qs[s * 32 + lane];
                let mut a = Array::<Vector<F, P>>::new(4usize);
                #[unroll]
                for k in 0..4usize {
                    a[k] = Vector::<F, P>::reinterpret(qa[k]);
                }
                #[unroll]
                for j in 0..2usize {
                    let w = comptime!(j * (head_dim / 8) + 2 * s);
                    let mut b = Array::<Vector<F, P>>::new(2usize);
                    b[0] = Vector::<F, P>::reinterpret(kr[comptime!(w / kvs)][comptime!(w % kvs)]);
                    b[1] = Vector::<F, P>::reinterpret(
                        kr[comptime!((w + 1) / kvs)][comptime!((w + 1) % kvs)],
                    );
                    def.execute_inplace(&a, &b, sc.index_mut(j));
                }
            }
            // The next step's keys, in flight during the softmax and P·V.
            if j0 + stride < end {
                load_k::<KV>(k_cache, &mut kr, kbase, j0 + stride, end, g, t, head_dim);
            }

            // Online softmax of rows g (h = 0) and g + 8 (h = 1): x[j·4 + h·2 + e] is position
            // 8j + 2t + e of the step.
            let mut x = Array::<f32>::new(8usize);
            let mut alpha = Array::<f32>::new(2usize);
            #[unroll]
            for h in 0..2usize {
                let mut mx = f32::new(MASKED);
                #[unroll]
                for j in 0..2usize {
                    let c = sc.index(j);
                    let cv = c[h];
                    #[unroll]
                    for e in 0..2usize {
                        let p = j0 + j * 8 + 2 * t + e;
                        let v = select(p < end, cv[e] * scale, f32::new(MASKED));
                        x[comptime!(j * 4 + h * 2 + e)] = v;
                        mx = max(mx, v);
                    }
                }
                // The row's four lanes (the quad) share its max.
                mx = max(mx, plane_shuffle_xor(mx, 1u32));
                mx = max(mx, plane_shuffle_xor(mx, 2u32));
                let m_new = max(m_run[h], mx);
                let a = f32::exp(m_run[h] - m_new);
                let mut sum = 0.0f32;
                #[unroll]
                for j in 0..2usize {
                    #[unroll]
                    for e in 0..2usize {
                        let pe = f32::exp(x[comptime!(j * 4 + h * 2 + e)] - m_new);
                        x[comptime!(j * 4 + h * 2 + e)] = pe;
                        sum += pe;
                    }
                }
                l_run[h] = l_run[h] * a + sum;
                m_run[h] = m_new;
                alpha[h] = a;
            }
            #[unroll]
            for jn in 0..ntiles {
                let acc = o.index_mut(jn);
                acc[0] = acc[0] * Vector::<f32, P>::new(alpha[0]);
                acc[1] = acc[1] * Vector::<f32, P>::new(alpha[1]);
            }
            // P as the A operand: register k is n-tile k / 2, row half k % 2.
            let mut pa = Array::<Vector<F, P>>::new(4usize);
            #[unroll]
            for k in 0..4usize {
                let mut v = Vector::<F, P>::empty();
                v[0] = F::cast_from(x[comptime!((k / 2) * 4 + (k % 2) * 2)]);
                v[1] = F::cast_from(x[comptime!((k / 2) * 4 + (k % 2) * 2 + 1)]);
                pa[k] = v;
            }
            // P·V: word w of the lane's four positions (2t, 2t+1, 2t+8, 2t+9) gives the B
            // registers of n-tiles 2w (low halves) and 2w + 1 (high halves).
            #[unroll]
            for w in 0..vw {
                let wa = vr[comptime!(w / vvs)][comptime!(w % vvs)];
                let wb = vr[comptime!((vw + w) / vvs)][comptime!((vw + w) % vvs)];
                let wc = vr[comptime!((2 * vw + w) / vvs)][comptime!((2 * vw + w) % vvs)];
                let wd = vr[comptime!((3 * vw + w) / vvs)][comptime!((3 * vw + w) % vvs)];
                let mut lo = Array::<Vector<F, P>>::new(2usize);
                lo[0] = Vector::<F, P>::reinterpret((wa & 0xffffu32) | (wb << 16u32));
                lo[1] = Vector::<F, P>::reinterpret((wc & 0xffffu32) | (wd << 16u32));
                def.execute_inplace(&pa, &lo, o.index_mut(comptime!(2 * w)));
                let mut hi = Array::<Vector<F, P>>::new(2usize);
                hi[0] = Vector::<F, P>::reinterpret((wa >> 16u32) | (wb & 0xffff_0000u32));
                hi[1] = Vector::<F, P>::reinterpret((wc >> 16u32) | (wd & 0xffff_0000u32));
                def.execute_inplace(&pa, &hi, o.index_mut(comptime!(2 * w + 1)));
            }
            j0 += stride;
        }

        // The warp's sums over the quad; its max, sums and output into shared memory.
        #[unroll]
        for h in 0..2usize {
            let mut l = l_run[h];
            l += plane_shuffle_xor(l, 1u32);
            l += plane_shuffle_xor(l, 2u32);
            l_run[h] = l;
        }
        if t == 0 {
            #[unroll]
            for h in 0..2usize {
                wm[warp * 16 + h * 8 + g] = m_run[h];
                wl[warp * 16 + h * 8 + g] = l_run[h];
            }
        }
        #[unroll]
        for h in 0..halves {
            #[unroll]
            for jn in 0..ntiles {
                let acc = o.index(jn);
                let v = acc[h];
                #[unroll]
                for e in 0..2usize {
                    red[warp * record + (h * ntiles + jn) * RED_STRIDE + lane * 2 + e] = v[e];
                }
            }
        }
        sync_cube();

        // Merge: a unit per (head, channel) in order, the warps weighted by e^(m_w − M).
        let mut i = tid;
        while i < comptime!(group * head_dim) {
            let h = i / head_dim;
            let d = i % head_dim;
            let c = d / ntiles;
            let jn = d % ntiles;
            let src = ((h / 8) * ntiles + jn) * RED_STRIDE + ((h % 8) * 4 + c / 2) * 2 + c % 2;
            let mut mx = f32::new(MASKED);
            #[unroll]
            for w in 0..TC_WARPS {
                mx = max(mx, wm[w * 16 + h]);
            }
            let mut l = 0.0f32;
            let mut acc = 0.0f32;
            #[unroll]
            for w in 0..TC_WARPS {
                let a = f32::exp(wm[w * 16 + h] - mx);
                l += a * wl[w * 16 + h];
                acc += a * red[w * record + src];
            }
            if split {
                part_o[cube * comptime!(group * head_dim) + i] = acc;
                // A span past the row's context: every warp empty, (−1e30, 0) and zeros.
                if d == 0 {
                    part_ml[(cube * group + h) * 2] = mx;
                    part_ml[(cube * group + h) * 2 + 1] = l;
                }
            } else {
                out[q0 + i] = F::cast_from(acc / l);
            }
            i += TC_UNITS as usize;
        }
    }
}

/// Keys of the step at `j0` into `kr`: n-tile j's position `j0 + 8j + g` (clamped to the last
/// valid one, `end − 1`), channels `t·D/4 .. (t+1)·D/4` (`D/8` words).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_k<KV: Size>(
    k_cache: &Array<Vector<u32, KV>>,
    kr: &mut Array<Vector<u32, KV>>,
    kbase: usize,
    j0: usize,
    end: usize,
    g: usize,
    t: usize,
    #[comptime] head_dim: usize,
) {
    let kvs = k_cache.vector_size();
    let per = comptime!(head_dim / 8 / kvs);
    #[unroll]
    for j in 0..2usize {
        let p = min(j0 + j * 8 + g, end - 1);
        let at = (kbase + p * comptime!(head_dim / 2) + t * comptime!(head_dim / 8)) / kvs;
        #[unroll]
        for u in 0..per {
            kr[comptime!(j * per + u)] = k_cache[at + u];
        }
    }
}

/// Values of the step at `j0` into `vr`: slot i is position `j0 + 2t + (i % 2) + 8·(i / 2)`
/// (clamped to `end − 1`), channels `g·D/8 .. (g+1)·D/8` (`D/16` words).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_v<VV: Size>(
    v_cache: &Array<Vector<u32, VV>>,
    vr: &mut Array<Vector<u32, VV>>,
    kbase: usize,
    j0: usize,
    end: usize,
    g: usize,
    t: usize,
    #[comptime] head_dim: usize,
) {
    let vvs = v_cache.vector_size();
    let per = comptime!(head_dim / 16 / vvs);
    #[unroll]
    for i in 0..4usize {
        let p = min(j0 + 2 * t + comptime!(i % 2 + 8 * (i / 2)), end - 1);
        let at = (kbase + p * comptime!(head_dim / 2) + g * comptime!(head_dim / 16)) / vvs;
        #[unroll]
        for u in 0..per {
            vr[comptime!(i * per + u)] = v_cache[at + u];
        }
    }
}

/// Which attention kernel [`attention_with`](super::attention::attention_with) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernel {
    /// Tensor cores where [`tc_applies`], unless `QERL_ATTN=simt`.
    Auto,
    /// The SIMT kernel (every runtime and type).
    Simt,
    /// The tensor-core kernel; panics where it does not apply.
    TensorCore,
}

/// `QERL_ATTN`, read once: `simt` turns the tensor-core kernel off, `tc` or unset leaves it on
/// where it applies; any other value is reported once on stderr and treated as unset.
fn env_allows_tc() -> bool {
    static ALLOW: OnceLock<bool> = OnceLock::new();
    *ALLOW.get_or_init(|| match std::env::var("QERL_ATTN") {
        Err(std::env::VarError::NotPresent) => true,
        Ok(v) if v.is_empty() || v == "tc" => true,
        Ok(v) if v == "simt" => false,
        other => {
            eprintln!(
                "warning: QERL_ATTN={other:?} is neither `simt` nor `tc`; using the default \
                 (tensor cores where they apply)"
            );
            true
        }
    })
}

/// Whether the tensor-core kernel runs this shape here: F is bf16 or f16, the runtime is CUDA
/// with `mma.m16n8k16` for `F x F -> f32`, plane operations and 32-wide planes, the group is at
/// most [`TC_MAX_GROUP`] and the head dimension a multiple of 16 up to [`TC_MAX_HEAD_DIM`].
pub fn tc_applies<R: Runtime, F: Float>(client: &ComputeClient<R>, s: &AttentionShape) -> bool {
    let ty = F::as_type_native_unchecked();
    let half =
        ty == half::bf16::as_type_native_unchecked() || ty == half::f16::as_type_native_unchecked();
    let kv = s.kv_heads.max(1);
    let group = s.q_heads / kv;
    if !half
        || R::name(client) != "cuda"
        || !s.q_heads.is_multiple_of(kv)
        || !(1..=TC_MAX_GROUP).contains(&group)
        || !s.head_dim.is_multiple_of(16)
        || !(16..=TC_MAX_HEAD_DIM).contains(&s.head_dim)
    {
        return false;
    }
    let props = client.properties();
    let cfg = MmaConfig {
        a_type: ty.storage_type(),
        b_type: ty.storage_type(),
        cd_type: f32::as_type_native_unchecked().storage_type(),
        m: 16,
        n: 8,
        k: 16,
    };
    props.features.matmul.mma.contains(&cfg)
        && props.features.plane.contains(Plane::Ops)
        && props.hardware.plane_size_min == 32
        && props.hardware.plane_size_max == 32
}

/// Whether `kernel` means the tensor-core kernel for this launch.
pub(super) fn use_tc<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: &AttentionShape,
    kernel: AttentionKernel,
) -> bool {
    match kernel {
        AttentionKernel::Simt => false,
        AttentionKernel::Auto => env_allows_tc() && tc_applies::<R, F>(client, s),
        AttentionKernel::TensorCore => {
            assert!(
                tc_applies::<R, F>(client, s),
                "attention: the tensor-core kernel does not apply to {s:?} here"
            );
            true
        }
    }
}

static LAUNCHES: AtomicUsize = AtomicUsize::new(0);

/// Launches of the tensor-core kernel in this process (tests check that a path was taken).
pub fn tc_launches() -> usize {
    LAUNCHES.load(Ordering::Relaxed)
}

/// The widest vector of u32 words (up to 4: 16 bytes) dividing `words`.
fn word_vector(words: usize) -> usize {
    [4, 2, 1]
        .into_iter()
        .find(|v| words.is_multiple_of(*v))
        .unwrap_or(1)
}

/// One launch of the tensor-core kernel: `splits` cubes per (row, key-value head), spans of
/// `span` positions, the partials into `part_o` / `part_ml` (`part_len` (cube, head) pairs) when
/// split. The caller checked [`tc_applies`] and the scratch.
pub(super) fn launch<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: &AttentionShape,
    [q, k_cache, v_cache, slot, pos, out]: [&Handle; 6],
    (part_o, part_ml, part_len): (&Handle, &Handle, usize),
    splits: usize,
    span: usize,
) {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let d = s.head_dim;
    let group = s.q_heads / s.kv_heads;
    let words = s.slots * s.kv_heads * s.capacity * d / 2;
    let (kvs, vvs) = (word_vector(d / 8), word_vector(d / 16));
    // SAFETY: buffers sized by the engine from these shapes (as for the SIMT kernel); `tc_applies`
    // holds (2-byte F, head_dim a multiple of 16, so rows of the cache are whole vectors of
    // `kvs` and `vvs` words); every cache read is clamped to a filled position of the row's
    // slot; the scratch is only written when split and holds `rows·kv_heads·splits` cubes.
    unsafe {
        attention_tc_kernel::launch_unchecked::<F, R>(
            client,
            grid_rows(s.rows * s.kv_heads * splits),
            CubeDim::new_1d(TC_UNITS),
            2,
            kvs,
            vvs,
            4,
            ArrayArg::from_raw_parts(q.clone(), s.rows * s.q_heads * d / 2),
            ArrayArg::from_raw_parts(k_cache.clone(), words / kvs),
            ArrayArg::from_raw_parts(v_cache.clone(), words / vvs),
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
            splits > 1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::word_vector;

    #[test]
    fn word_vectors_divide_the_rows() {
        assert_eq!(word_vector(16), 4);
        assert_eq!(word_vector(8), 4);
        assert_eq!(word_vector(6), 2);
        assert_eq!(word_vector(2), 2);
        assert_eq!(word_vector(1), 1);
    }
}
