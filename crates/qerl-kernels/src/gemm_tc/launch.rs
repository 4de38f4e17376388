//! Tile configurations of the tensor-core product, the choice of split-K, and the launch.

use super::{gemm_tc_kernel, BK, KV};
use crate::device::DeviceWeight;
use crate::splitk::{self, ReduceEpilogue};
use cubecl::prelude::*;
use cubecl::server::Handle;

/// A tile configuration: planes along M and N, 16x16 fragments per plane along M and N.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tiles {
    pub warps_m: usize,
    pub warps_n: usize,
    pub frags_m: usize,
    pub frags_n: usize,
}

impl Tiles {
    pub fn bm(&self) -> usize {
        self.warps_m * self.frags_m * 16
    }
    pub fn bn(&self) -> usize {
        self.warps_n * self.frags_n * 16
    }
    pub fn threads(&self) -> usize {
        32 * self.warps_m * self.warps_n
    }
}

/// 128x128 output per cube, 8 planes of 64x32.
pub(crate) const BIG: Tiles = Tiles {
    warps_m: 2,
    warps_n: 4,
    frags_m: 4,
    frags_n: 2,
};
/// 64x128, 8 planes of 32x32.
pub(crate) const MID: Tiles = Tiles {
    warps_m: 2,
    warps_n: 4,
    frags_m: 2,
    frags_n: 2,
};
/// 32x128, 4 planes of 32x32 (few rows).
pub(crate) const SMALL: Tiles = Tiles {
    warps_m: 1,
    warps_n: 4,
    frags_m: 2,
    frags_n: 2,
};
/// The configuration for `m` rows and `n` output columns: up to 64 rows (a decode step's
/// batch) the shortest tile that covers them, 32x128 or 64x128 (split-K fills the machine),
/// otherwise the largest that still gives every multiprocessor about two cubes.
/// `QERL_TC_TILES` (`small`, `mid`, `big`, or `cubes`: the choice by cube count alone)
/// overrides it for experiments. On an H100 (2026-11-26, 7B-shaped NVFP4 decode, 64 rows) this
/// took a step from 22.06 ms (by cube count: 32x128 tiles on the 3,584-wide products) to
/// 20.38 ms; a 16x64 tile at 16 rows was slower than 32x128 (14.21 against 13.12 ms).
pub(crate) fn pick_tiles(m: usize, n: usize) -> Tiles {
    let cubes = |t: Tiles| m.div_ceil(t.bm()) * n.div_ceil(t.bn());
    match tiles_override() {
        Some(TilesOverride::Fixed(t)) => return t,
        Some(TilesOverride::ByCubes) => {}
        None if m <= 32 => return SMALL,
        None if m <= 64 => return MID,
        None => {}
    }
    if cubes(BIG) >= 264 {
        BIG
    } else if m > 32 && cubes(MID) >= 132 {
        MID
    } else {
        SMALL
    }
}

#[derive(Clone, Copy)]
enum TilesOverride {
    Fixed(Tiles),
    ByCubes,
}

/// `QERL_TC_TILES`, read once.
fn tiles_override() -> Option<TilesOverride> {
    static CHOICE: std::sync::OnceLock<Option<TilesOverride>> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        let v = std::env::var("QERL_TC_TILES").ok()?;
        match v.as_str() {
            "small" => Some(TilesOverride::Fixed(SMALL)),
            "mid" => Some(TilesOverride::Fixed(MID)),
            "big" => Some(TilesOverride::Fixed(BIG)),
            "cubes" => Some(TilesOverride::ByCubes),
            _ => None,
        }
    })
}

/// Whether the tensor-core path can run a product with reduction depth `k` in `F` here.
pub(crate) fn applies<R: Runtime, F: Float>(client: &ComputeClient<R>, k: usize) -> bool {
    k.is_multiple_of(BK) && crate::device::has_f32_mma::<R, F>(client, (16, 16, 16), true)
}

/// What [`launch`] computes.
pub(crate) enum TcProduct<'a> {
    /// `Y[M, N] = X[M, K] · deq(W)ᵀ`, bias and LoRA optional.
    Forward(&'a DeviceWeight),
    /// `dX[M, K] = dY[M, N] · deq(W)`.
    Transposed(&'a DeviceWeight),
    /// `Y[M, n] = X[M, K] · D[n, K]ᵀ` with a dense row-major `D` (the LoRA down-projection).
    Dense { d: &'a Handle, n: usize, k: usize },
}

/// Optional epilogue inputs of [`launch`]; unused ones are bound to a buffer never read.
pub(crate) struct TcEpilogue {
    pub bias: Option<Handle>,
    pub lora: Option<(Handle, Handle, usize, f32)>,
}

/// Fewest reduction stages (of 32) per K-slice.
const MIN_SPLIT_STAGES: usize = 8;

/// Cubes per multiprocessor the split-K aims for: 4, or `QERL_TC_CUBES_PER_SM` (1 to 16) for
/// experiments. On an H100 (2026-11-24, 7B-shaped NVFP4 decode) 4 took a step at 64 rows from
/// 24.5 to 22.2 ms and at 16 rows from 14.4 to 13.5 ms against 2; 8 did no better.
fn cubes_per_sm() -> usize {
    static CUBES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CUBES.get_or_init(|| {
        std::env::var("QERL_TC_CUBES_PER_SM")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|c| (1..=16).contains(c))
            .unwrap_or(4)
    })
}

/// Launches the tensor-core product; the caller has checked buffers and [`applies`] (and, for
/// `Transposed`, `N % 32 == 0`). `x` holds `M x reduction` elements of `F`, `y` receives
/// `M x columns` elements of `O`. When the output tiles give fewer than two cubes per
/// multiprocessor, the reduction is split (see [`crate::splitk`]). `tiles`: a configuration
/// (the autotuner's), or `None` for [`pick_tiles`].
pub(crate) fn launch<R: Runtime, F: Float, O: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    product: TcProduct<'_>,
    epilogue: TcEpilogue,
    y: &Handle,
    tiles: Option<Tiles>,
) {
    // (output columns, reduction length, weight K)
    let (cols, red, wk) = match &product {
        TcProduct::Forward(w) => (w.n, w.k, w.k),
        TcProduct::Transposed(w) => (w.k, w.n, w.k),
        TcProduct::Dense { n, k, .. } => (*n, *k, *k),
    };
    let tiles = tiles.unwrap_or_else(|| pick_tiles(m, cols));
    let grid = (cols.div_ceil(tiles.bn()), m.div_ceil(tiles.bm()));
    let target = cubes_per_sm() * splitk::multiprocessors(client);
    let (splits, per) = splitk::plan(grid.0 * grid.1, red / BK, target, MIN_SPLIT_STAGES);
    let launch = Launch {
        x,
        m,
        cols,
        red,
        wk,
        tiles,
        grid,
        splits,
        per,
        product: &product,
    };
    if splits == 1 {
        launch.run::<R, F, O>(client, epilogue.bias, epilogue.lora, y);
        return;
    }
    let part = splitk::workspace(client, splits, m, cols);
    launch.run::<R, F, f32>(client, None, epilogue.lora, &part);
    let bias = ReduceEpilogue {
        bias: epilogue.bias,
        lora: None,
    };
    splitk::reduce::<R, F, O>(client, part, splits, m, cols, bias, y);
}

/// One launch of the kernel: shapes, tiles and the K-slices.
struct Launch<'a> {
    x: &'a Handle,
    m: usize,
    cols: usize,
    red: usize,
    wk: usize,
    tiles: Tiles,
    grid: (usize, usize),
    splits: usize,
    per: usize,
    product: &'a TcProduct<'a>,
}

impl Launch<'_> {
    /// Runs the kernel into `y` (`splits` blocks of `M x columns` elements of `O`).
    fn run<R: Runtime, F: Float, O: Float>(
        &self,
        client: &ComputeClient<R>,
        bias: Option<Handle>,
        lora: Option<(Handle, Handle, usize, f32)>,
        y: &Handle,
    ) {
        let (m, cols, red, tiles) = (self.m, self.cols, self.red, self.tiles);
        let words = KV * tiles.bn() / tiles.threads();
        let count = CubeCount::Static(self.grid.0 as u32, self.grid.1 as u32, self.splits as u32);
        let unused = self.x.clone();
        let (w, dense, dense_b, transposed) = match self.product {
            TcProduct::Forward(w) => (Some(*w), unused.clone(), false, false),
            TcProduct::Transposed(w) => (Some(*w), unused.clone(), false, true),
            TcProduct::Dense { d, .. } => (None, (*d).clone(), true, false),
        };
        let dense_len = if dense_b { cols * red / 8 } else { m * red / 8 };
        let (codes, codes_len, sb, sbl, st, stl, ct, block, byte_scales) = match w {
            Some(w) => (
                w.codes.clone(),
                w.words() / words,
                w.scale_bytes.clone(),
                w.scale_words(),
                w.scale_table.clone(),
                w.scale_table_len(),
                w.code_table.clone(),
                w.block(),
                w.byte_scales(),
            ),
            None => (
                unused.clone(),
                1,
                unused.clone(),
                1,
                unused.clone(),
                1,
                unused.clone(),
                16,
                true,
            ),
        };
        let has_bias = bias.is_some();
        let bias = bias.unwrap_or_else(|| unused.clone());
        let has_lora = lora.is_some();
        let (t, lb, rank, scale) = lora.unwrap_or_else(|| (unused.clone(), unused.clone(), 0, 0.0));
        // SAFETY: buffer sizes were checked by the caller (the workspace holds `splits` blocks);
        // every global read is bounded by the m rows, the weight's rows and columns and the
        // reduction length (a multiple of BK, checked by `applies`), every write by m, the
        // output columns and the slice index.
        unsafe {
            gemm_tc_kernel::launch_unchecked::<F, O, R>(
                client,
                count,
                CubeDim::new_1d(tiles.threads() as u32),
                8,
                words,
                ArrayArg::from_raw_parts(self.x.clone(), m * red / 8),
                ArrayArg::from_raw_parts(codes, codes_len),
                ArrayArg::from_raw_parts(dense, dense_len),
                ArrayArg::from_raw_parts(sb, sbl),
                ArrayArg::from_raw_parts(st, stl),
                ArrayArg::from_raw_parts(ct, 16),
                ArrayArg::from_raw_parts(bias, cols),
                ArrayArg::from_raw_parts(t, m * rank.max(1)),
                ArrayArg::from_raw_parts(lb, cols * rank.max(1)),
                ArrayArg::from_raw_parts(y.clone(), self.splits * m * cols),
                m as u32,
                cols as u32,
                red as u32,
                self.wk as u32,
                self.per as u32,
                rank as u32,
                scale,
                tiles.warps_m,
                tiles.warps_n,
                tiles.frags_m,
                tiles.frags_n,
                words,
                block,
                byte_scales,
                dense_b,
                transposed,
                has_bias,
                has_lora,
                self.splits > 1,
            );
        }
    }
}
