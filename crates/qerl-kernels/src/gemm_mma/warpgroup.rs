//! The staged product on Hopper's warpgroup MMA (`wgmma`, sm_90 only): hand-written CUDA
//! (`warpgroup.cu`), compiled by cubecl's own NVRTC path and launched on cubecl's own stream.
//!
//! Why: the staged kernel (`staged.rs`) is bound by shared memory and issue (ncu, 7B gate/up at
//! batch 64: L1/shared at 82%, 8.8 instructions a `mma`), because each warp reads its `B`
//! fragments (the tokens' `X`) from shared memory itself, 256 bytes a `mma.m16n8k16`. `wgmma`
//! has the tensor cores read `B` from shared memory once for a warpgroup of four warps and all
//! the cube's tokens (one instruction a 16-deep step instead of 8 `mma` and 4 loads a warp),
//! with the decoded weight as its register `A` operand exactly as now. cubecl 0.10 emits no
//! `wgmma` (the shared notes `cubecl-0.10-engine-facts.md` §5).
//!
//! How it reaches the GPU: [`crate::cuda_source`] compiles it by cubecl's own NVRTC path and
//! launches it on cubecl's own stream, configured by `#define`s, its scalars as one struct.
//!
//! The kernel takes the segments kernel's arguments (`X`, then codes, scale bytes, scale table,
//! bias, LoRA `T` and `B`, and `Y` of up to three weights); a single weight is one segment.

use super::launch::Geometry;
use crate::cuda_source::{self, SegmentArgs};
use cubecl::features::Tma;
use cubecl::prelude::*;
use cubecl::server::Handle;

const SOURCE: &str = include_str!("warpgroup.cu");
const ENTRY: &str = "qerl_wgmma_w4a16";

/// Most tokens one cube multiplies (`wgmma`'s N, 8 a token tile): its accumulators are N / 2
/// registers a thread. 128 (64 accumulators, one 8-warp cube a multiprocessor) measured slower
/// at batch 256 on an H200: 25.94 ms a step against 20.76 at 64 (2026-11-28, session 23).
pub(crate) const MAX_TOKENS: usize = 64;

/// Whether this device runs the kernel: CUDA on sm_90 (`wgmma` is sm_90a only; cubecl marks
/// TMA from sm_90 and wide im2col TMA from sm_100).
pub(crate) fn available<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let tma = &client.properties().features.tma;
    crate::cublas::cuda_client(client).is_some()
        && tma.contains(Tma::Base)
        && !tma.contains(Tma::Im2colWide)
}

/// Whether `g` runs on this kernel here: asked for ([`super::MmaKernel::Warpgroup`]), one
/// 16-row tile a warp, at most [`MAX_TOKENS`] tokens a cube, on sm_90.
pub(crate) fn runs<R: Runtime>(client: &ComputeClient<R>, g: &Geometry) -> bool {
    g.warpgroup && g.r_tiles == 1 && 8 * g.m_tiles <= MAX_TOKENS && available(client)
}

/// The texts built so far, by configuration.
static SOURCES: std::sync::LazyLock<cuda_source::SourceCache<Config>> =
    std::sync::LazyLock::new(Default::default);

/// What the kernel text is compiled for (each value a `#define` of `warpgroup.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Config {
    pub warps: usize,
    pub m_tiles: usize,
    pub block: usize,
    pub depth: usize,
    pub has_bias: bool,
    pub has_lora: bool,
    pub split: bool,
    pub m_major: bool,
    pub out_f32: bool,
    pub segments: usize,
    /// 0, or the LoRA rank of the segments whose down-projections the launch folds in
    /// ([`crate::gemm::LoraFold`]).
    pub fold_rank: usize,
}

impl Config {
    /// The full CUDA text: the configuration, the shared types and helpers (`cuda_common.cu`),
    /// the shared E2M1 decoding (`e2m1_spread.cu`), then `warpgroup.cu` with `wgmma_step` for
    /// this cube's tokens.
    fn source(&self) -> String {
        let (lbo, sbo) = DESCRIPTOR_STRIDES;
        // The staged kernel's registers a unit (128: two 8-warp cubes a multiprocessor), which
        // the split-K planner counts on. Three cubes (85 registers) measured slower on an H200
        // (2026-11-28, 7B decode: batch 64 8.24 and 8.46 ms a step against 7.92 and 7.75;
        // batch 256 18.84 and 19.14 against 17.56 and 18.34).
        let min_cubes = super::launch::resident_cubes(self.warps);
        let mut text = cuda_source::defines(&[
            ("WARPS", self.warps),
            ("M_TILES", self.m_tiles),
            ("BLOCK", self.block),
            ("DEPTH", self.depth),
            ("HAS_BIAS", self.has_bias as usize),
            ("HAS_LORA", self.has_lora as usize),
            ("SPLIT", self.split as usize),
            ("M_MAJOR", self.m_major as usize),
            ("OUT_F32", self.out_f32 as usize),
            ("SEGMENTS", self.segments),
            ("MIN_CUBES", min_cubes),
            ("LBO", lbo),
            ("SBO", sbo),
            ("FOLD_NT", self.segments * self.fold_rank / 8),
            ("FOLD_RANK", self.fold_rank),
            ("SPREAD_SHIFTS", cuda_source::spread_shifts()),
        ]);
        text.push_str(cuda_source::COMMON);
        text.push_str(cuda_source::E2M1_SPREAD);
        text.push_str(&SOURCE.replace("// @wgmma_step@", &wgmma_step(8 * self.m_tiles)));
        text
    }
}

/// `(LBO, SBO)` of the `X` descriptor in bytes (a K-major operand without swizzle): 128 between
/// the two cores of a 16-deep step along K, 1024 between groups of 8 tokens, as the PTX manual's
/// canonical layout reads; the CUDA tests confirmed it on an H200 (2026-11-28).
const DESCRIPTOR_STRIDES: (usize, usize) = (128, 1024);

/// `wgmma_step(d, a0..a3, desc)`: `d[N/2] += A[64x16] · B[16xN]` for the warpgroup, `A` from
/// registers (the four `m16n8k16` `A` registers of each warp's 16 rows), `B` K-major from
/// shared memory, f32 accumulators in the `mma` layout of each 8-token tile.
fn wgmma_step(n: usize) -> String {
    let regs = n / 2;
    let d: Vec<String> = (0..regs).map(|i| format!("%{i}")).collect();
    let outs: Vec<String> = (0..regs).map(|i| format!("\"+f\"(d[{i}])")).collect();
    format!(
        "__device__ __forceinline__ void wgmma_step(float* d, u32 a0, u32 a1, u32 a2, u32 a3, \
         u64 desc) {{\n  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{p}, 0;\\n\"\n  \
         \"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, {{%{a0}, %{a1}, \
         %{a2}, %{a3}}}, %{desc}, p, 1, 1, 0;\\n}}\\n\"\n  : {outs}\n  : \"r\"(a0), \"r\"(a1), \
         \"r\"(a2), \"r\"(a3), \"l\"(desc), \"r\"(1));\n}}\n",
        p = regs + 5,
        d = d.join(", "),
        a0 = regs,
        a1 = regs + 1,
        a2 = regs + 2,
        a3 = regs + 3,
        desc = regs + 4,
        outs = outs.join(", "),
    )
}

/// Whether a folded down-projection takes `segments` adapters of rank `rank`: a multiple of 8,
/// at most 48 columns in all (their loads are in registers).
pub(crate) fn fold_takes(rank: usize, segments: usize) -> bool {
    rank > 0 && rank.is_multiple_of(8) && rank * segments <= 48
}

/// Launches the kernel for `g` (the staged kernel's tiles, grid and split) over 1 to 3
/// segments, into f32 partial sums when `out_f32`, else bf16 outputs; `has_bias`, `has_lora`
/// as the staged kernel's flags; with `fold`, every segment with LoRA of a rank
/// [`fold_takes`], whose `T` the launch computes first. The caller checked [`available`], the buffers, and
/// that every segment's `N` but the last is a multiple of the cube's `16 · warps` rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    k: usize,
    block: usize,
    g: &Geometry,
    segs: &[SegmentArgs],
    (has_bias, has_lora, out_f32): (bool, bool, bool),
    rank: usize,
    fold: Option<&crate::gemm::LoraFold<'_>>,
) {
    super::WARPGROUP_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let Some(client) = crate::cublas::cuda_client(client) else {
        unreachable!("warpgroup::launch on a runtime other than CUDA (see `available`)");
    };
    let config = Config {
        warps: g.warps,
        m_tiles: g.m_tiles,
        block,
        depth: g.prefetch,
        has_bias,
        has_lora,
        split: g.grid.2 > 1,
        m_major: g.m_major,
        out_f32,
        segments: segs.len(),
        fold_rank: if fold.is_some() { rank } else { 0 },
    };
    debug_assert!(fold
        .is_none_or(|f| { f.a.len() == segs.len() && has_lora && fold_takes(rank, segs.len()) }));
    let seg = |i: usize| &segs[i.min(segs.len() - 1)];
    let n_total: usize = segs.iter().map(|s| s.n).sum();
    let (cubes0, cubes1) = cuda_source::segment_starts(segs, 16 * g.warps);
    let mut buffers = cuda_source::segment_bindings(x, segs);
    for i in 0..3 {
        let a = fold.map_or(x, |f| f.a[i.min(f.a.len() - 1)]);
        buffers.push(a.clone().binding());
    }
    buffers.push(fold.map_or(x, |f| f.counters).clone().binding());
    // With a fold, one dimension: its cubes (one a 16-token group) first, then the product's.
    let fold_cubes = if fold.is_some() { m.div_ceil(16) } else { 0 };
    let grid = match fold {
        Some(_) => ((fold_cubes + g.grid.0 * g.grid.1 * g.grid.2) as u32, 1, 1),
        None => (g.grid.0 as u32, g.grid.1 as u32, g.grid.2 as u32),
    };
    // `Info` of warpgroup.cu: ten u32, three f32, three u32.
    let words32: [u32; 16] = [
        m as u32,
        seg(0).n as u32,
        seg(1).n as u32,
        seg(2).n as u32,
        n_total as u32,
        cubes0,
        cubes1,
        k as u32,
        g.per as u32,
        rank as u32,
        seg(0).lora_scale.to_bits(),
        seg(1).lora_scale.to_bits(),
        seg(2).lora_scale.to_bits(),
        fold_cubes as u32,
        g.grid.0 as u32,
        g.grid.1 as u32,
    ];
    // SAFETY: the kernel bounds rows by each segment's N, tokens by M, chunks by K / 64 and
    // LoRA columns by the rank; every buffer is the size the staged kernel takes (checked by
    // the caller; a fold's `A` is `[rank, K]` and its counters two u32), and the scalars are
    // `Info`'s layout.
    unsafe {
        cuda_source::launch(
            client,
            cuda_source::cached(&SOURCES, &config, ENTRY, || config.source()),
            ENTRY,
            (32 * g.warps) as u32,
            grid,
            buffers,
            &words32,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated text names every operand once, in order, and every `#define` the kernel
    /// reads (a GPU is needed to compile it; this checks what the host builds).
    #[test]
    fn source_defines_the_configuration_and_the_step() {
        let c = Config {
            warps: 8,
            m_tiles: 8,
            block: 16,
            depth: 2,
            has_bias: false,
            has_lora: true,
            split: true,
            m_major: false,
            out_f32: true,
            segments: 2,
            fold_rank: 0,
        };
        let s = c.source();
        for d in [
            "WARPS 8",
            "M_TILES 8",
            "BLOCK 16",
            "DEPTH 2",
            "HAS_LORA 1",
            "SPLIT 1",
            "OUT_F32 1",
            "SEGMENTS 2",
            "MIN_CUBES 2",
            "LBO 128",
            "SBO 1024",
            "FOLD_NT 0",
            "FOLD_RANK 0",
        ] {
            assert!(s.contains(&format!("#define {d}\n")), "{d}");
        }
        assert!(!s.contains("@wgmma_step@"));
        assert_eq!(s.matches("unsigned int spread_bits(").count(), 1);
        assert!(s.is_ascii(), "NVRTC gets the text as it is");
        assert!(s.contains("m64n64k16.f32.bf16.bf16 {%0, %1,"));
        assert!(s.contains("%31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;"));
        assert!(s.contains("setp.ne.b32 p, %37, 0;"));
        assert!(s.contains("\"+f\"(d[31])") && !s.contains("d[32]"));
    }
}
