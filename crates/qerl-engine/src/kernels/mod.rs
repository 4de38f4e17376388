//! The engine's own kernels (the 4-bit products come from `qerl_kernels::gemm`).
//!
//! Every kernel takes `Array` arguments and scalars only (no per-launch metadata upload on
//! CUDA), launches a static grid, and reduces in shared memory, so the same code runs on CUDA
//! and on wgpu (lavapipe, which has no plane operations) for the tests. The exceptions run
//! only where their runtime has what they need, with a portable kernel beside them:
//! [`attention_tc`] (tensor cores; else [`attention`]'s SIMT kernel), [`lora_down`] (plane
//! operations; else [`dense`]) and the LoRA projection in [`attention_combine`] (a device-scope
//! fence, CUDA; else the LoRA kernel runs after the merge).

pub mod act;
mod arrival;
pub mod attention;
pub mod attention_combine;
pub mod attention_tc;
pub mod dense;
pub mod fill;
pub mod fused_lora;
pub mod lora_down;
pub mod norm;
pub mod rope;
pub mod sample;

use cubecl::prelude::*;

/// The entry points (cubecl's names: the function's, before its type suffixes) of the kernels
/// that call `arrival::wait_for_primaries` on CUDA before they read anything another kernel of
/// a decode step wrote, so that a captured step may launch them programmatically after the
/// kernel before (`qerl_kernels::graph`): the norms with their LoRA, RoPE, attention on tensor
/// cores, the spans' merge, SiLU·mul with its LoRA. A kernel listed here that did not wait
/// would race with the one before it.
pub const WAITING_KERNELS: [&str; 5] = [
    "norm_lora_kernel",
    "rope_kv_kernel",
    "attention_tc_kernel",
    "combine_kernel",
    "silu_lora_kernel",
];

/// Units per cube of the row kernels (a power of two for the tree reductions).
pub const ROW_CUBE: u32 = 256;

/// Most cubes along one grid dimension that every runtime accepts.
const MAX_GRID_DIM: u32 = 65_535;

/// A grid of `cubes` cubes over x and y (no dimension above 65535); kernels recover the
/// linear index with [`row_of_cube`].
pub(crate) fn grid_rows(cubes: usize) -> CubeCount {
    grid_rows_by(cubes, 1)
}

/// [`grid_rows`] with `z` cubes along z for each of them (a row's work spread over z).
pub(crate) fn grid_rows_by(cubes: usize, z: usize) -> CubeCount {
    let cubes = cubes.max(1) as u32;
    let x = cubes.min(MAX_GRID_DIM);
    CubeCount::Static(x, cubes.div_ceil(x), z.max(1) as u32)
}

/// Linear index of this cube in a [`grid_rows`] grid (may exceed the requested count on the
/// last row of the grid: kernels bound it).
#[cube]
pub(crate) fn row_of_cube() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// The widest vector (at most 16 bytes) of `F` that divides `n`: the vector size of kernels
/// that read rows of `n` elements in 16-byte loads.
pub(crate) fn vector_width<F: Float>(n: usize) -> usize {
    let mut v = (16 / std::mem::size_of::<F>()).max(1);
    while v > 1 && !n.is_multiple_of(v) {
        v /= 2;
    }
    v
}

/// Whether the switch `name` is on: unset or anything but `0`, read once into `cell`.
pub(crate) fn switch_on(cell: &'static std::sync::OnceLock<bool>, name: &str) -> bool {
    *cell.get_or_init(|| std::env::var(name).map_or(true, |v| v != "0"))
}

/// Whether the engine hands a split product's K-slices to the kernel after it (gate/up to
/// [`act::silu_mul_parts`], q/k/v to [`rope::rope_kv_parts`]) rather than reducing them first
/// (default on); `QERL_FUSED_REDUCE=0` turns it off, for A/B timing.
pub fn fused_reduce_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch_on(&ON, "QERL_FUSED_REDUCE")
}

/// Whether the o and down products past [`fused_lora::MAX_ROWS`] hand their K-slices to the
/// next norm ([`norm::Residual::Parts`]) rather than reducing them first (default on, with
/// [`fused_reduce_enabled`]); `QERL_RESIDUAL_PARTS=0` keeps their reductions, for A/B timing.
pub fn residual_parts_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    fused_reduce_enabled() && switch_on(&ON, "QERL_RESIDUAL_PARTS")
}

/// Whether [`fused_reduce_enabled`] applies to q/k/v too ([`rope::rope_kv_parts`]);
/// `QERL_ROPE_PARTS=0` keeps their reduction, for A/B timing.
pub fn rope_parts_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch_on(&ON, "QERL_ROPE_PARTS")
}
