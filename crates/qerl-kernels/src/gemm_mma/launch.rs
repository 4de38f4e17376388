//! When the decode-batch tensor-core product applies, its warp tiles, split-K and the launch.

use super::staged::gemm_mma_staged_kernel;
use super::{gemm_mma_kernel, CHUNK};
use crate::device::DeviceWeight;
use crate::splitk::{self, ReduceEpilogue};
use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_format::QuantFormat;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Most rows (tokens) this kernel takes by default; larger products go to dequantize + cuBLAS
/// or the tiled kernels ([`crate::gemm::Strategy::Auto`]). On an H100 (2026-11-27, 7B decode,
/// NVFP4) this kernel at 128 and 256 rows took 23.7 and 41.2 ms a step against 34.8-36.6 (tiled)
/// and 43.4 / 48.0-55.6 (cuBLAS).
pub const DEFAULT_MAX_M: usize = 256;

/// Most rows [`MmaOptions::max_m`] may allow: each 32 more rows decode the weight once more.
pub const MAX_M_LIMIT: usize = 1024;

/// Warps per cube by default. The cube only shares the two small tables, so this is launch
/// geometry, except that the CUDA compiler caps a thread's registers at 65536 / (32 x warps)
/// (`__launch_bounds__`): 16 warps allow 128, 24 allow 80, 32 allow 64, more warps a
/// multiprocessor at the price of spills.
pub const DEFAULT_WARPS_PER_CUBE: usize = 4;

/// Warps per cube of the staged kernel where [`MmaOptions::warps_per_cube`] is 0 (the
/// default): its cube shares the copy of `X`, so more warps share one copy. On an H100
/// (2026-11-27, ncu, 7B decode at batch 64) 8 warps took the gate product in 60.3 µs and the
/// step in 12.62 ms of GPU time against 62.7 and 12.91 with 4; 16 warps were slower.
pub const STAGED_WARPS_PER_CUBE: usize = 8;

/// Fewest 64-deep chunks per K-slice.
const MIN_SPLIT_CHUNKS: usize = 4;

/// Options of the decode-batch tensor-core product ([`crate::gemm::set_mma_options`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaOptions {
    /// Whether products of up to `max_m` rows take this kernel where it applies (default on;
    /// `QERL_MMA=off` turns it off).
    pub enabled: bool,
    /// `(r_tiles, m_tiles)`: a warp's 16-row weight tiles and 8-token tiles; `None` picks by M
    /// (`QERL_MMA_TILES=4x2` etc. overrides).
    pub tiles: Option<(usize, usize)>,
    /// How E2M1 codes become `F` (`QERL_MMA_DECODE=auto|table|bits|pairs|spread`).
    pub decode: MmaDecode,
    /// Where the `B` fragments come from (`QERL_MMA_KERNEL=auto|direct|staged|warpgroup`).
    pub kernel: MmaKernel,
    /// Chunks of codes the staged kernel keeps in flight, 1 to 4 (`QERL_MMA_PREFETCH`, default
    /// [`DEFAULT_PREFETCH`]).
    pub prefetch: usize,
    /// Chunks of `X` the staged kernel loads ahead of the one it stores, 1 or 2
    /// (`QERL_MMA_X_AHEAD`, default [`DEFAULT_X_AHEAD`]).
    pub x_ahead: usize,
    /// Warps a multiprocessor should hold before the reduction is split
    /// (`QERL_MMA_WARPS_PER_SM`); 0, the default ([`DEFAULT_WARPS_PER_SM`]), picks the split
    /// by whole waves of cubes on the staged kernel ([`crate::splitk`]'s `plan_waves`) and by
    /// M on the direct one: 12 warps up to 8 rows, 24 above.
    pub warps_per_sm: usize,
    /// Fewest rows this kernel takes ahead of the decode kernel (`QERL_MMA_MIN_M`, default
    /// [`DEFAULT_MIN_M`]); below it, up to 8 rows go to [`crate::gemv`].
    pub min_m: usize,
    /// Warps per cube, 1 to 32, or 0 (the default) for each kernel's own:
    /// [`DEFAULT_WARPS_PER_CUBE`] direct, [`STAGED_WARPS_PER_CUBE`] staged (`QERL_MMA_WARPS`).
    pub warps_per_cube: usize,
    /// Most rows this kernel takes (`QERL_MMA_MAX_M`, default [`DEFAULT_MAX_M`], at most
    /// [`MAX_M_LIMIT`]). Above 64 rows the cubes that share weight rows run next to each other
    /// (the token groups are the grid's fastest dimension), so the weight comes from L2 after
    /// the first group.
    pub max_m: usize,
}

/// The split-K target by default: 0, by M ([`split_target`]).
pub const DEFAULT_WARPS_PER_SM: usize = 0;

/// Warps a multiprocessor should hold before the reduction is split, for `m` rows. On an H100
/// (2026-11-27, 7B decode) 24 beat 8, 12 and 16 above 8 rows by 2-5% (64 rows: 14.38-14.47
/// ms a step against 15.05 / 15.0-15.24 / 15.89), while at 4 and 8 rows 12 did best (6.84-7.26
/// and 7.61-7.74 ms against 8.15 and 8.04 with 24).
fn split_target(m: usize, o: &MmaOptions) -> usize {
    match o.warps_per_sm {
        0 if m <= 8 => 12,
        0 => 24,
        w => w,
    }
}

/// Registers a unit of the staged kernel holds, as the CUDA compiler allocates them (ncu, H100,
/// 2026-11-28: 126 for the staged kernel at 1x8 tiles and 127 for the segments kernel; the
/// register file is handed out in multiples of 8 a unit).
const STAGED_UNIT_REGISTERS: usize = 128;

/// Cubes of `warps` warps of the staged kernel that one multiprocessor holds at once: its
/// 65,536 registers over [`STAGED_UNIT_REGISTERS`] a unit (2 cubes of 8 warps), at most 64
/// warps. What the split-K planner counts as a wave.
pub(super) fn resident_cubes(warps: usize) -> usize {
    let warps = warps.max(1);
    (65_536 / (STAGED_UNIT_REGISTERS * 32 * warps)).clamp(1, 64 / warps.min(64))
}

/// Chunks of codes in flight in the staged kernel by default. Since its K loop issues no
/// predicated load (2026-11-28, ncu, H100, 7B decode at batch 64, GPU time a step): 2 took
/// 8.54 ms, 3 8.70 and 1 8.68 (the gate/up product 93.2 µs at 2 against 98.2 and 101.6). In
/// 2026-11-27's build 3 and 2 were within noise at batch 64 and 256, and 1 slower at 256.
pub const DEFAULT_PREFETCH: usize = 2;

/// Chunks of `X` loaded ahead in the staged kernel by default.
pub const DEFAULT_X_AHEAD: usize = 1;

/// Fewest rows sent to this kernel by default.
pub const DEFAULT_MIN_M: usize = 2;

impl MmaOptions {
    fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok();
        let tiles = var("QERL_MMA_TILES").and_then(|v| {
            let (r, m) = v.split_once('x')?;
            let (r, m) = (r.parse().ok()?, m.parse().ok()?);
            valid_tiles(r, m).then_some((r, m))
        });
        MmaOptions {
            enabled: var("QERL_MMA").is_none_or(|v| v != "off" && v != "0"),
            tiles,
            decode: match var("QERL_MMA_DECODE").as_deref() {
                Some("table") => MmaDecode::Table,
                Some("bits") => MmaDecode::Bits,
                Some("pairs") => MmaDecode::Pairs,
                Some("spread") => MmaDecode::Spread,
                _ => MmaDecode::Auto,
            },
            kernel: match var("QERL_MMA_KERNEL").as_deref() {
                Some("direct") => MmaKernel::Direct,
                Some("staged") => MmaKernel::Staged,
                Some("warpgroup") => MmaKernel::Warpgroup,
                _ => MmaKernel::Auto,
            },
            prefetch: var("QERL_MMA_PREFETCH")
                .and_then(|v| v.parse().ok())
                .filter(|d| (1..=4).contains(d))
                .unwrap_or(DEFAULT_PREFETCH),
            x_ahead: var("QERL_MMA_X_AHEAD")
                .and_then(|v| v.parse().ok())
                .filter(|d| (1..=2).contains(d))
                .unwrap_or(DEFAULT_X_AHEAD),
            warps_per_sm: var("QERL_MMA_WARPS_PER_SM")
                .and_then(|v| v.parse().ok())
                .filter(|w| (0..=64).contains(w))
                .unwrap_or(DEFAULT_WARPS_PER_SM),
            min_m: var("QERL_MMA_MIN_M")
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_MIN_M),
            warps_per_cube: var("QERL_MMA_WARPS")
                .and_then(|v| v.parse().ok())
                .filter(|w| (0..=32).contains(w))
                .unwrap_or(0),
            max_m: var("QERL_MMA_MAX_M")
                .and_then(|v| v.parse().ok())
                .filter(|m| (1..=MAX_M_LIMIT).contains(m))
                .unwrap_or(DEFAULT_MAX_M),
        }
    }
}

/// How the kernel turns E2M1 codes into `F` (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmaDecode {
    /// 16-entry f32 table, f32 product with the scale rounded once.
    Table,
    /// Bit placement into bf16 (bf16 only; the table elsewhere).
    Bits,
    /// 256-entry table of code pairs, one pair multiply by the scale.
    Pairs,
    /// Bit placement of codes `i` and `i + 4` of a word, half the instructions of `Bits`
    /// (bf16 only; the table elsewhere).
    Spread,
    /// The default: spread bit placement above 8 rows in bf16, the pair table up to 8 rows.
    /// On an H100 (2026-11-27, 7B decode, one warm machine) the spread placement took a
    /// batch-64 step in 13.51 ms and a batch-256 step in 32.77 ms against 14.71 and 39.92 for
    /// the byte placement (`Bits`, the default before), which had itself beaten the pair table
    /// above 8 rows (batch 64: 15.0-15.2 ms against 15.9-16.2 in four calls, 2026-11-26/27).
    Auto,
}

impl MmaDecode {
    /// The concrete decodings (what [`MmaDecode::Auto`] chooses between, and the table).
    pub const ALL: [MmaDecode; 4] = [Self::Table, Self::Bits, Self::Pairs, Self::Spread];
    pub const DEFAULT: MmaDecode = MmaDecode::Auto;

    /// The decoding `Auto` stands for at `m` rows.
    fn resolve(self, m: usize) -> MmaDecode {
        match self {
            MmaDecode::Auto if m > 8 => MmaDecode::Spread,
            MmaDecode::Auto => MmaDecode::Pairs,
            d => d,
        }
    }
}

/// Which kernel multiplies: each warp loading its own `X` ([`MmaKernel::Direct`]), or the cube
/// staging `X` through shared memory once ([`MmaKernel::Staged`], `gemm_mma/staged.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmaKernel {
    /// Every warp loads `X` from global memory and builds its `B` fragments.
    Direct,
    /// `X` copied into shared memory in fragment order once per cube and chunk (bf16 with the
    /// spread decoding only; the direct kernel elsewhere).
    Staged,
    /// The staged kernel's tiles and split on Hopper's warpgroup MMA, `B` read by the tensor
    /// cores from shared memory (`gemm_mma/warpgroup.cu`; CUDA sm_90 only, the staged kernel
    /// elsewhere).
    Warpgroup,
    /// The default: staged wherever it applies, on warpgroup MMA from [`WARPGROUP_MIN_M`]
    /// rows where the device has it (sm_90).
    Auto,
}

impl MmaKernel {
    /// The concrete kernels (what the CUDA test loops over).
    pub const ALL: [MmaKernel; 3] = [Self::Direct, Self::Staged, Self::Warpgroup];
}

fn valid_tiles(r: usize, m: usize) -> bool {
    [1, 2, 4].contains(&r) && [1, 2, 4, 8].contains(&m)
}

/// Fewer rows than this keep the staged kernel under [`MmaKernel::Auto`] on sm_90: there it
/// runs 2x2 or 2x4 tiles, which the warpgroup kernel does not. On an H200 (2026-11-28, 7B
/// decode, ncu GPU time a step) the warpgroup kernel took batch 64 in 7.31 ms against 7.43
/// (down 40.2 against 47.8 µs, o 13.5 against 15.6, gate/up 98.8 against 93.7) and batch 256
/// in 18.27 against 20.40 (every product faster: gate/up 281.7 against 306.7, down 134.3
/// against 172.0); at batch 16 (1x2 tiles) 5.43 ms a step against 5.36 wall.
pub const WARPGROUP_MIN_M: usize = 33;

static OPTIONS: Mutex<Option<MmaOptions>> = Mutex::new(None);

/// The options in force: those set last, else the environment's.
pub fn options() -> MmaOptions {
    let mut o = OPTIONS.lock().unwrap_or_else(|e| e.into_inner());
    *o.get_or_insert_with(MmaOptions::from_env)
}

/// Replaces the options for every later launch in this process (tests, benchmarks).
pub fn set_options(options: MmaOptions) {
    assert!(
        options.tiles.is_none_or(|(r, m)| valid_tiles(r, m)),
        "MmaOptions::tiles: r_tiles in {{1, 2, 4}}, m_tiles in {{1, 2, 4, 8}}"
    );
    assert!(
        (1..=4).contains(&options.prefetch),
        "MmaOptions::prefetch: 1 to 4"
    );
    assert!(
        (1..=2).contains(&options.x_ahead),
        "MmaOptions::x_ahead: 1 or 2"
    );
    assert!(
        (0..=32).contains(&options.warps_per_cube),
        "MmaOptions::warps_per_cube: 0 (by kernel) or 1 to 32"
    );
    assert!(
        (1..=MAX_M_LIMIT).contains(&options.max_m),
        "MmaOptions::max_m: 1 to {MAX_M_LIMIT}"
    );
    *OPTIONS.lock().unwrap_or_else(|e| e.into_inner()) = Some(options);
}

static LAUNCHES: AtomicUsize = AtomicUsize::new(0);

/// Products this kernel has run in this process (tests check that a path was taken).
pub fn launches() -> usize {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Whether this kernel runs `m` rows against `weight` in `F` here: CUDA `mma.m16n8k16` for
/// `F x F -> f32` with 32-wide planes, an E2M1 format (NVFP4, MXFP4), `K` a multiple of 64 and
/// an even LoRA rank.
pub(crate) fn applies<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    weight: &DeviceWeight,
    lora_rank: Option<usize>,
) -> bool {
    let o = options();
    if !(o.enabled && m <= o.max_m) {
        return false;
    }
    weight.format != QuantFormat::Nf4
        && weight.k.is_multiple_of(CHUNK)
        && lora_rank.is_none_or(|r| r.is_multiple_of(2))
        && crate::device::has_f32_mma::<R, F>(client, (16, 8, 16), false)
}

/// `(r_tiles, m_tiles)` for `m` rows: up to 8 rows, 4 weight tiles of one token tile; above,
/// 2 weight tiles of 2 or 4 token tiles (at 64 rows two warps cover the tokens). Measured on an
/// H100 with the decoding [`MmaDecode::Auto`] picks (docs/benchmarks/rollout.md, session 10):
/// 2x2 at 16 rows 8.27 ms a step (4x2 8.48), 2x4 at 32 rows 9.86 (4x4 10.45), 2x4 at 64
/// rows 14.97 (2x8 16.45, 4x4 15.64).
fn pick_tiles(m: usize, o: &MmaOptions, staged: bool, warpgroup: bool) -> (usize, usize) {
    if let Some(t) = o.tiles {
        return t;
    }
    if warpgroup {
        // One 16-row tile a warp (a warpgroup: 64 rows), all the cube's tokens in one `wgmma`.
        return (1, m.div_ceil(8).clamp(1, 8));
    }
    if staged {
        // One decoded A fragment feeds every token tile of the cube's copy: up to 64 tokens.
        // Above 32 rows one 16-row tile a warp: on an H100 (2026-11-27, ncu, 7B decode at batch
        // 64) its products took 6.47 ms of GPU time a step against 7.31 with 2x8 (and 7.84 for
        // the direct kernel's 2x4): twice the row groups, half the split-K, fewer registers.
        return match m {
            0..=16 => (2, 2),
            17..=32 => (2, 4),
            _ => (1, 8),
        };
    }
    match m {
        0..=8 => (4, 1),
        9..=16 => (2, 2),
        _ => (2, 4),
    }
}

/// `Y[M, N] = X[M, K] · deq(W)ᵀ (+ bias) (+ s·T·Bᵀ)`; the caller checked buffers and
/// [`applies`].
pub(crate) fn launch<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    weight: &DeviceWeight,
    bias: Option<Handle>,
    lora: Option<(Handle, Handle, usize, f32)>,
    y: &Handle,
) {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let (n, k) = (weight.n, weight.k);
    let bf16 = F::as_type_native_unchecked() == half::bf16::as_type_native_unchecked();
    let sms = splitk::multiprocessors(client);
    let hopper = super::warpgroup_available(client);
    let geometry = Geometry::plan(m, n, k, &options(), sms, bf16, hopper);
    let splits = geometry.grid.2;
    if splits == 1 {
        geometry.run::<R, F, F>(client, x, weight, bias, lora, y);
        return;
    }
    let part = splitk::workspace(client, splits, m, n);
    geometry.run::<R, F, f32>(client, x, weight, None, lora, &part);
    let epilogue = ReduceEpilogue { bias, lora: None };
    splitk::reduce::<R, F, F>(client, part, splits, m, n, epilogue, y);
}

pub(super) struct Geometry {
    pub(super) m: usize,
    pub(super) r_tiles: usize,
    pub(super) m_tiles: usize,
    pub(super) warps: usize,
    pub(super) grid: (usize, usize, usize),
    /// Token groups along the grid's x (fastest) dimension, weight rows along y.
    pub(super) m_major: bool,
    pub(super) per: usize,
    pub(super) decode: u32,
    /// `X` through shared memory ([`MmaKernel::Staged`]).
    pub(super) staged: bool,
    /// The staged product on warpgroup MMA where the device has it ([`MmaKernel::Warpgroup`];
    /// read by the CUDA build only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) warpgroup: bool,
    pub(super) prefetch: usize,
    pub(super) x_ahead: usize,
}

impl Geometry {
    /// Tiles, grid (with split-K) and decoding for `m` rows of an `n x k` weight on a device of
    /// `sms` multiprocessors; `bf16`: the activations are bf16 (the bit placement is exact
    /// for bf16 only); `hopper`: the device runs the warpgroup kernel (sm_90).
    pub(super) fn plan(
        m: usize,
        n: usize,
        k: usize,
        o: &MmaOptions,
        sms: usize,
        bf16: bool,
        hopper: bool,
    ) -> Geometry {
        let decode = match o.decode.resolve(m) {
            MmaDecode::Table => super::DECODE_TABLE,
            MmaDecode::Bits if bf16 => super::DECODE_BITS,
            MmaDecode::Bits => super::DECODE_TABLE,
            MmaDecode::Spread if bf16 => super::DECODE_SPREAD,
            MmaDecode::Spread => super::DECODE_TABLE,
            MmaDecode::Pairs | MmaDecode::Auto => super::DECODE_PAIRS,
        };
        let staged = decode == super::DECODE_SPREAD && o.kernel != MmaKernel::Direct;
        let warpgroup = staged
            && match o.kernel {
                MmaKernel::Warpgroup => true,
                MmaKernel::Auto => hopper && m >= WARPGROUP_MIN_M,
                _ => false,
            };
        let (r_tiles, m_tiles) = pick_tiles(m, o, staged, warpgroup);
        let row_groups = n.div_ceil(16 * r_tiles);
        let m_groups = m.div_ceil(8 * m_tiles);
        let warps = match o.warps_per_cube {
            0 if staged => STAGED_WARPS_PER_CUBE,
            0 => DEFAULT_WARPS_PER_CUBE,
            w => w,
        };
        let cubes_n = row_groups.div_ceil(warps);
        let (splits, per) = if staged && o.warps_per_sm == 0 {
            let slots = sms * resident_cubes(warps);
            splitk::plan_waves(cubes_n * m_groups, k / CHUNK, slots, MIN_SPLIT_CHUNKS)
        } else {
            let target = split_target(m, o) * sms;
            splitk::plan(row_groups * m_groups, k / CHUNK, target, MIN_SPLIT_CHUNKS)
        };
        // Up to 64 rows (at most 2 token groups) the grid stays as measured: weight rows
        // fastest.
        let m_major = m_groups > 2;
        Geometry {
            m,
            r_tiles,
            m_tiles,
            warps,
            grid: match m_major {
                true => (m_groups, cubes_n, splits),
                false => (cubes_n, m_groups, splits),
            },
            m_major,
            per,
            decode,
            staged,
            warpgroup: warpgroup && r_tiles == 1,
            prefetch: o.prefetch,
            x_ahead: o.x_ahead,
        }
    }

    /// One launch into `y` (`splits` blocks of `M x N` elements of `O`).
    fn run<R: Runtime, F: Float, O: Float>(
        &self,
        client: &ComputeClient<R>,
        x: &Handle,
        weight: &DeviceWeight,
        bias: Option<Handle>,
        lora: Option<(Handle, Handle, usize, f32)>,
        y: &Handle,
    ) {
        let (m, n, k) = (self.m, weight.n, weight.k);
        let has_bias = bias.is_some();
        let bias = bias.unwrap_or_else(|| weight.code_table.clone());
        let has_lora = lora.is_some();
        let (t, b, rank, scale) = lora.unwrap_or_else(|| {
            let u = weight.code_table.clone();
            (u.clone(), u, 0, 0.0)
        });
        #[cfg(feature = "cuda")]
        if super::warpgroup::runs(client, self) {
            let seg = crate::cuda_source::SegmentArgs::new(weight, bias, (t, b, scale), y.clone());
            let out_f32 = O::as_type_native_unchecked() == f32::as_type_native_unchecked();
            let flags = (has_bias, has_lora, out_f32);
            super::warpgroup::launch(
                client,
                x,
                m,
                k,
                weight.block(),
                self,
                &[seg],
                flags,
                rank,
                None,
            );
            return;
        }
        let count = CubeCount::Static(self.grid.0 as u32, self.grid.1 as u32, self.grid.2 as u32);
        if self.staged {
            // SAFETY: as below; `X` is read as 16-byte vectors (K is a multiple of 64).
            unsafe {
                gemm_mma_staged_kernel::launch_unchecked::<F, O, R>(
                    client,
                    count,
                    CubeDim::new_1d((32 * self.warps) as u32),
                    2,
                    4,
                    ArrayArg::from_raw_parts(x.clone(), m * k / 8),
                    ArrayArg::from_raw_parts(weight.codes.clone(), weight.words() / 2),
                    ArrayArg::from_raw_parts(weight.scale_bytes.clone(), weight.scale_words()),
                    ArrayArg::from_raw_parts(weight.scale_table.clone(), weight.scale_table_len()),
                    ArrayArg::from_raw_parts(bias, n),
                    ArrayArg::from_raw_parts(t, m * rank.max(1)),
                    ArrayArg::from_raw_parts(b, (n * rank / 2).max(1)),
                    ArrayArg::from_raw_parts(y.clone(), self.grid.2 * m * n),
                    m as u32,
                    n as u32,
                    k as u32,
                    self.per as u32,
                    rank as u32,
                    scale,
                    self.warps,
                    self.r_tiles,
                    self.m_tiles,
                    weight.block(),
                    self.prefetch,
                    self.x_ahead,
                    has_bias,
                    has_lora,
                    self.grid.2 > 1,
                    self.m_major,
                );
            }
            return;
        }
        // SAFETY: the caller checked x (M*K), y (splits*M*N of O), bias (N), T (M*r), B (N*r)
        // and `applies` (K a multiple of 64, even rank); the kernel bounds rows by N, tokens by
        // M, chunks by K / 64 and LoRA columns by the rank.
        unsafe {
            gemm_mma_kernel::launch_unchecked::<F, O, R>(
                client,
                count,
                CubeDim::new_1d((32 * self.warps) as u32),
                2,
                4,
                ArrayArg::from_raw_parts(x.clone(), m * k / 4),
                ArrayArg::from_raw_parts(weight.codes.clone(), weight.words() / 2),
                ArrayArg::from_raw_parts(weight.scale_bytes.clone(), weight.scale_words()),
                ArrayArg::from_raw_parts(weight.scale_table.clone(), weight.scale_table_len()),
                ArrayArg::from_raw_parts(weight.code_table.clone(), 16),
                ArrayArg::from_raw_parts(bias, n),
                ArrayArg::from_raw_parts(t, m * rank.max(1)),
                ArrayArg::from_raw_parts(b, (n * rank / 2).max(1)),
                ArrayArg::from_raw_parts(y.clone(), self.grid.2 * m * n),
                m as u32,
                n as u32,
                k as u32,
                self.per as u32,
                rank as u32,
                scale,
                self.warps,
                self.r_tiles,
                self.m_tiles,
                weight.block(),
                self.decode,
                has_bias,
                has_lora,
                self.grid.2 > 1,
                self.m_major,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> MmaOptions {
        MmaOptions {
            enabled: true,
            tiles: None,
            decode: MmaDecode::Auto,
            kernel: MmaKernel::Auto,
            prefetch: DEFAULT_PREFETCH,
            x_ahead: DEFAULT_X_AHEAD,
            warps_per_sm: DEFAULT_WARPS_PER_SM,
            min_m: DEFAULT_MIN_M,
            warps_per_cube: 0,
            max_m: DEFAULT_MAX_M,
        }
    }

    /// Up to 64 rows the grid keeps weight rows along x (as measured); past two token groups
    /// the token groups go along x, so the cubes reading the same weight rows run together.
    #[test]
    fn token_groups_lead_the_grid_past_64_rows() {
        let o = defaults();
        // 7B gate/up: N = 37888, K = 3584, 132 multiprocessors (an H100 SXM)
        let g = Geometry::plan(64, 37888, 3584, &o, 132, true, false);
        assert_eq!((g.r_tiles, g.m_tiles), (1, 8));
        assert!(g.staged && !g.m_major);
        assert_eq!((g.grid.0, g.grid.1), (37888usize.div_ceil(16 * 8), 1));
        let direct = MmaOptions {
            kernel: MmaKernel::Direct,
            ..o
        };
        let g = Geometry::plan(64, 37888, 3584, &direct, 132, true, false);
        assert_eq!((g.r_tiles, g.m_tiles), (2, 4));
        assert!(!g.staged && !g.m_major);
        assert_eq!((g.grid.0, g.grid.1), (37888usize.div_ceil(32 * 4), 2));
        let g = Geometry::plan(256, 37888, 3584, &o, 132, true, false);
        assert!(g.m_major);
        assert_eq!((g.grid.0, g.grid.1), (4, 37888usize.div_ceil(16 * 8)));
        assert_eq!(g.decode, super::super::DECODE_SPREAD);
        let g = Geometry::plan(1, 4608, 3584, &o, 132, true, false);
        assert_eq!((g.r_tiles, g.m_tiles, g.m_major), (4, 1, false));
        assert_eq!(g.decode, super::super::DECODE_PAIRS);
        assert!(!g.staged);
        // the bit placement only for bf16
        let g = Geometry::plan(100, 512, 3584, &o, 132, false, false);
        assert!(g.m_major && !g.staged);
        assert_eq!(g.decode, super::super::DECODE_TABLE);
    }

    /// The staged kernel splits by whole waves (two 8-warp cubes a multiprocessor): the 7B
    /// batch-64 down and o products fill one wave of 264 cubes; an explicit warp target keeps
    /// the earlier planner.
    #[test]
    fn staged_splits_fill_whole_waves() {
        let o = defaults();
        assert_eq!(resident_cubes(STAGED_WARPS_PER_CUBE), 2);
        let down = Geometry::plan(64, 3584, 18944, &o, 132, true, false);
        assert!(down.staged);
        assert_eq!((down.grid, down.per), ((28, 1, 9), 33));
        let out = Geometry::plan(64, 3584, 3584, &o, 132, true, false);
        assert_eq!((out.grid, out.per), ((28, 1, 8), 7));
        let target = MmaOptions {
            warps_per_sm: 24,
            ..o
        };
        let down = Geometry::plan(64, 3584, 18944, &target, 132, true, false);
        assert_eq!((down.grid, down.per), ((28, 1, 15), 20));
    }

    /// On sm_90 the default runs the warpgroup kernel from [`WARPGROUP_MIN_M`] rows, with the
    /// staged kernel's 1x8 tiles and split; below, and where asked for the staged kernel, not.
    #[test]
    fn warpgroup_by_default_on_hopper_from_33_rows() {
        let o = defaults();
        let g = Geometry::plan(64, 37888, 3584, &o, 132, true, true);
        assert!(g.staged && g.warpgroup);
        let s = Geometry::plan(64, 37888, 3584, &o, 132, true, false);
        assert!(!s.warpgroup);
        assert_eq!(
            (g.r_tiles, g.m_tiles, g.grid, g.per),
            (s.r_tiles, s.m_tiles, s.grid, s.per)
        );
        assert!(!Geometry::plan(16, 37888, 3584, &o, 132, true, true).warpgroup);
        assert!(Geometry::plan(256, 3584, 18944, &o, 132, true, true).warpgroup);
        let staged = MmaOptions {
            kernel: MmaKernel::Staged,
            ..o
        };
        assert!(!Geometry::plan(64, 37888, 3584, &staged, 132, true, true).warpgroup);
        let asked = MmaOptions {
            kernel: MmaKernel::Warpgroup,
            ..o
        };
        let g = Geometry::plan(16, 37888, 3584, &asked, 132, true, true);
        assert!(g.warpgroup && (g.r_tiles, g.m_tiles) == (1, 2));
    }

    /// Every row of the grid's token groups is covered once: groups x 8 x m_tiles >= M.
    #[test]
    fn token_groups_cover_every_row() {
        let o = defaults();
        for m in [2usize, 8, 9, 16, 17, 33, 64, 65, 100, 150, 255, 256] {
            let g = Geometry::plan(m, 512, 1024, &o, 132, true, false);
            let groups = if g.m_major { g.grid.0 } else { g.grid.1 };
            assert!(groups * 8 * g.m_tiles >= m, "M = {m}");
            assert!(
                (groups - 1) * 8 * g.m_tiles < m,
                "M = {m}: an empty token group"
            );
        }
    }
}
