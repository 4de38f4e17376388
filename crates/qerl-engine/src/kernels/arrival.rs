//! Cross-cube sums without a second launch (CUDA): each cube of a group stores its part, and
//! the group's last cube to finish, found by an atomic count, adds the parts in a fixed order.
//!
//! The stores must be visible to the last cube before it counts: `__threadfence()` on both
//! sides, which cubecl 0.10 does not expose. It goes into the CUDA source through a comment
//! (`comment!` with a newline is written as a C block comment, which the text closes and
//! reopens), so kernels that use this run on CUDA only (WGSL has no device-scope fence, and
//! would get the text as code). A buffer the other cubes write during the launch must be bound
//! read-write (`&mut`): cubecl binds read-only arrays as `const __restrict__`, which the CUDA
//! compiler may read through the non-coherent cache.

use cubecl::prelude::*;

/// `__threadfence()` in the CUDA source (see the module documentation).
#[cube]
pub(crate) fn device_fence() {
    comment!("\n*/ __threadfence(); /*\n");
}

/// Called by every unit of the cube after its part's stores: counts the cube at
/// `counters[group]` and returns, to every unit, whether it was the last of `parts`. The last
/// resets the count to 0 (for the next launch) and fences before it reads the other parts.
#[cube]
pub(crate) fn last_arrival(counters: &mut Array<Atomic<u32>>, group: usize, parts: u32) -> bool {
    let mut last = SharedMemory::<u32>::new(1usize);
    device_fence();
    sync_cube();
    if UNIT_POS == 0 {
        let before = counters[group].fetch_add(1u32);
        let is_last = before == parts - 1;
        last[0] = u32::cast_from(is_last);
        if is_last {
            counters[group].store(0u32);
        }
    }
    sync_cube();
    let is_last = last[0] == 1u32;
    if is_last {
        device_fence();
    }
    is_last
}

/// The end of a sum of `rank` values over the `count` cubes of group `group`, this cube being
/// `index` of them; every unit calls it, after the barrier that follows the planes' stores of
/// their sums into `red [planes, rank]`: adds the planes' sums in plane order, stores the cube's
/// part at `parts[(group · count + index) · rank ..]`, and the group's last cube to finish adds
/// the `count` parts in order into `out[group · rank ..]`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn sum_parts(
    red: &SharedMemory<f32>,
    parts: &mut Array<f32>,
    counters: &mut Array<Atomic<u32>>,
    out: &mut Array<f32>,
    group: usize,
    index: usize,
    count: usize,
    #[comptime] planes: usize,
    #[comptime] rank: usize,
) {
    let t = UNIT_POS as usize;
    if t < rank {
        let mut total = red[t];
        #[unroll]
        for p in 1..planes {
            total += red[p * rank + t];
        }
        parts[(group * count + index) * rank + t] = total;
    }
    let is_last = last_arrival(counters, group, count as u32);
    if is_last && t < rank {
        let mut total = 0.0f32;
        for i in 0..count {
            total += parts[(group * count + i) * rank + t];
        }
        out[group * rank + t] = total;
    }
}

/// `griddepcontrol.launch_dependents` in the CUDA source where `on` (compiled for sm_90 and
/// later only): a product launched programmatically after this kernel (an edge of a captured
/// step, `qerl_kernels::graph`) may then start its cubes and send its weight loads; they wait
/// for this kernel's completion before they read anything it wrote. Called first thing by the
/// kernels that come right before a product at batch 1 (the norms, the attention's merge,
/// SiLU·mul); `on` only on CUDA.
#[cube]
pub(crate) fn allow_dependents(#[comptime] on: bool) {
    if comptime!(on) {
        comment!(
            "\n*/\n#if __CUDA_ARCH__ >= 900\nasm volatile(\"griddepcontrol.launch_dependents;\");\n#endif\n/*\n"
        );
    }
}

/// `griddepcontrol.wait` in the CUDA source where `on` (sm_90 and later): returns once the
/// kernel before this one (launched before it on a programmatic edge of a captured step) has
/// completed and its stores are visible; a no-op for a kernel launched the usual way. Every
/// unit calls it before it reads anything a kernel of the step wrote, and such inputs are bound
/// `&mut`: cubecl binds read-only arrays `const __restrict__`, whose loads the CUDA compiler
/// may treat as invariant and move above the wait (the race session 34 found in the products).
/// The kernels that call it are listed in [`super::WAITING_KERNELS`].
#[cube]
pub(crate) fn wait_for_primaries(#[comptime] on: bool) {
    if comptime!(on) {
        comment!(
            "\n*/\n#if __CUDA_ARCH__ >= 900\nasm volatile(\"griddepcontrol.wait;\" ::: \"memory\");\n#endif\n/*\n"
        );
    }
}
