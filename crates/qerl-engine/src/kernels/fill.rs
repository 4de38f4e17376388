//! Device-side fills: counter-based random bits for benchmark weights (a 7B model's 4-bit
//! codes are generated where they live, in milliseconds, instead of being quantized on the host
//! and uploaded), and scatters of per-slot state when the host refills a batch slot.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{grid_rows, ROW_CUBE};

/// murmur3's 32-bit finalizer: a bijection that spreads every input bit over the output.
#[cube]
pub(crate) fn mix32(x: u32) -> u32 {
    let mut h = x;
    h ^= h >> 16;
    h *= 0x85eb_ca6bu32;
    h ^= h >> 13;
    h *= 0xc2b2_ae35u32;
    h ^= h >> 16;
    h
}

/// Random bits of counter `(a, b, c, d)` under `seed`: independent of launch geometry.
#[cube]
pub(crate) fn hash4(seed: u32, a: u32, b: u32, c: u32, d: u32) -> u32 {
    let mut h = mix32(seed ^ 0x9e37_79b9u32);
    h = mix32(h ^ a);
    h = mix32(h ^ (b * 0x27d4_eb2fu32));
    h = mix32(h ^ (c * 0x1656_67b1u32));
    mix32(h ^ (d * 0x9e37_79b1u32))
}

#[cube]
fn linear_unit() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize
}

#[cube(launch_unchecked)]
fn fill_bits_kernel(out: &mut Array<u32>, len: u32, seed: u32, mask: u32, set: u32) {
    let i = linear_unit();
    if i < len as usize {
        out[i] = (hash4(seed, i as u32, 0u32, 0u32, 0u32) & mask) | set;
    }
}

#[cube(launch_unchecked)]
fn fill_uniform_kernel<F: Float>(out: &mut Array<F>, len: u32, seed: u32, bound: f32) {
    let i = linear_unit();
    if i < len as usize {
        let h = hash4(seed, i as u32, 1u32, 0u32, 0u32);
        let u = f32::cast_from(h >> 8) * (1.0f32 / 16_777_216.0f32);
        out[i] = F::cast_from((2.0f32 * u - 1.0f32) * bound);
    }
}

#[cube(launch_unchecked)]
fn scatter_kernel(target: &mut Array<u32>, index: &Array<u32>, value: &Array<u32>, len: u32) {
    let i = linear_unit();
    if i < len as usize {
        let j = index[i] as usize;
        target[j] = value[i];
    }
}

fn grid(len: usize) -> CubeCount {
    grid_rows(len.div_ceil(ROW_CUBE as usize))
}

/// `out[i] = (random bits of (seed, i)) & mask | set` for `len` u32 words.
pub fn fill_bits<R: Runtime>(
    client: &ComputeClient<R>,
    out: &Handle,
    len: usize,
    seed: u32,
    mask: u32,
    set: u32,
) {
    // SAFETY: `out` holds `len` words; stores are bounded by `len`.
    unsafe {
        fill_bits_kernel::launch_unchecked::<R>(
            client,
            grid(len),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(out.clone(), len),
            len as u32,
            seed,
            mask,
            set,
        );
    }
}

/// `out[i]` uniform in `[-bound, bound)` from `(seed, i)`, for `len` elements of `F`.
pub fn fill_uniform<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    out: &Handle,
    len: usize,
    seed: u32,
    bound: f32,
) {
    // SAFETY: `out` holds `len` elements; stores are bounded by `len`.
    unsafe {
        fill_uniform_kernel::launch_unchecked::<F, R>(
            client,
            grid(len),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(out.clone(), len),
            len as u32,
            seed,
            bound,
        );
    }
}

/// `target[index[i]] = value[i]` for `i < len` (indices distinct and in bounds: the caller's).
pub fn scatter<R: Runtime>(
    client: &ComputeClient<R>,
    target: &Handle,
    target_len: usize,
    index: &Handle,
    value: &Handle,
    len: usize,
) {
    // SAFETY: `index` and `value` hold `len` words; the engine's indices are slots below
    // `target_len`.
    unsafe {
        scatter_kernel::launch_unchecked::<R>(
            client,
            grid(len),
            CubeDim::new_1d(ROW_CUBE),
            ArrayArg::from_raw_parts(target.clone(), target_len),
            ArrayArg::from_raw_parts(index.clone(), len),
            ArrayArg::from_raw_parts(value.clone(), len),
            len as u32,
        );
    }
}
