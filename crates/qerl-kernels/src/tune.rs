//! Which implementation runs a product too large for the decode kernel. By default
//! ([`Strategy::Auto`]) the rows decide, with no tuning pass: the `mma` kernel for E2M1 weights
//! up to its rows, then the tensor-core kernel, and dequantize + cuBLAS from [`cublas_min_m`]
//! rows. With [`Strategy::Tuned`] CubeCL's autotuner picks,
//! per (M bucket, N, K, product, LoRA rank, bias, element type), among the tensor-core kernel's
//! three tile configurations and, on CUDA with libcublas for bf16/f16, dequantize + cuBLAS
//! ([`crate::cublas`]). The first product of a key times every candidate (a few runs each) and
//! the choice is kept in CubeCL's tuning cache on disk (`target/autotune/` under the nearest
//! directory with a `Cargo.toml`, else `~/.cache/cubecl`), so later processes start tuned.
//!
//! Two rules keep a tuning pass from touching the training step it interrupts:
//! * candidates are timed into a scratch output of the product's size, never into the caller's
//!   `y` (CubeCL's tuner replays the inputs its generator returns about 13 times per
//!   candidate; with a plain clone those were the live training buffers), so the live output is
//!   written once, by the chosen candidate, after tuning;
//! * the first product of a key in a process first asks the device for errors of earlier work
//!   ([`surface_earlier_errors`]): CubeCL's warm-up flushes the stream's error list and drops it,
//!   and the cuBLAS candidate's sync takes it as its own failure, so a launch that failed just
//!   before would otherwise leave its output unwritten with nobody told.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::tune::{local_tuner, LocalTuner, Tunable, TunableSet};
use cubecl::AutotuneKey;
use serde::{Deserialize, Serialize};

use crate::device::{DeviceWeight, KernelError};
use crate::gemm_tc::{self, TcEpilogue, TcProduct, Tiles};

/// How a product above the decode kernel's rows runs where the tensor cores apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// The default: by rows, with no tuning pass. Up to the `mma` kernel's rows that kernel
    /// ([`crate::gemm_mma`]), then the tensor-core kernel, and from [`cublas_min_m`] rows
    /// dequantize + cuBLAS where it runs (CUDA, bf16/f16, libcublas present).
    Auto,
    /// The autotuner's choice.
    Tuned,
    /// The tensor-core kernel, tiles picked by cube count (no tuning).
    TensorCores,
    /// The tensor-core kernel with one tile configuration.
    TensorCoresTiles(TileConfig),
    /// Dequantize + cuBLAS; an error where it is unavailable (not CUDA, no libcublas, f32).
    Cublas,
}

/// Output tile per cube of the tensor-core kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TileConfig {
    /// 128x128, 8 planes of 64x32.
    M128N128,
    /// 64x128, 8 planes of 32x32.
    M64N128,
    /// 32x128, 4 planes of 32x32.
    M32N128,
}

impl TileConfig {
    pub const ALL: [TileConfig; 3] = [Self::M128N128, Self::M64N128, Self::M32N128];

    fn tiles(self) -> Tiles {
        match self {
            Self::M128N128 => gemm_tc::BIG,
            Self::M64N128 => gemm_tc::MID,
            Self::M32N128 => gemm_tc::SMALL,
        }
    }

    /// The tuner's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::M128N128 => "tc_128x128",
            Self::M64N128 => "tc_64x128",
            Self::M32N128 => "tc_32x128",
        }
    }
}

/// The environment variable that picks the strategy of a process: `auto` (the default), `tc`,
/// `tuned` or `cublas`.
pub const STRATEGY_ENV: &str = "QERL_GEMM";

/// Fewest rows [`Strategy::Auto`] sends to dequantize + cuBLAS (E2M1 weights take the `mma`
/// kernel up to its own 256 rows first). On an H100 (2026-11-27, 7B, NVFP4 + LoRA) the prefill
/// of 256 prompts of 256 tokens took 3.0 s through cuBLAS against 7.5 s on the tiled kernel.
pub const DEFAULT_CUBLAS_MIN_M: usize = 256;

/// Fewest rows [`Strategy::Auto`] sends to dequantize + cuBLAS: `QERL_CUBLAS_MIN_M`, read once,
/// else [`DEFAULT_CUBLAS_MIN_M`].
pub fn cublas_min_m() -> usize {
    static MIN_M: OnceLock<usize> = OnceLock::new();
    *MIN_M.get_or_init(|| {
        std::env::var("QERL_CUBLAS_MIN_M")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_CUBLAS_MIN_M)
    })
}

const UNSET: u8 = u8::MAX;
static STRATEGY: AtomicU8 = AtomicU8::new(UNSET);

/// Sets the strategy for every later product in this process (benchmarks and tests time and
/// check each one alone), overriding [`STRATEGY_ENV`].
pub fn set_strategy(strategy: Strategy) {
    let v = match strategy {
        Strategy::Tuned => 0,
        Strategy::TensorCores => 1,
        Strategy::Cublas => 2,
        Strategy::TensorCoresTiles(t) => 3 + t as u8,
        Strategy::Auto => 6,
    };
    STRATEGY.store(v, Ordering::Relaxed);
}

/// The strategy in force: the last [`set_strategy`], else [`STRATEGY_ENV`], else
/// [`Strategy::Auto`].
pub fn strategy() -> Result<Strategy, KernelError> {
    Ok(match STRATEGY.load(Ordering::Relaxed) {
        0 => Strategy::Tuned,
        1 => Strategy::TensorCores,
        2 => Strategy::Cublas,
        v @ 3..=5 => Strategy::TensorCoresTiles(TileConfig::ALL[(v - 3) as usize]),
        6 => Strategy::Auto,
        _ => {
            let s = parse_strategy(std::env::var(STRATEGY_ENV).as_deref().unwrap_or(""))?;
            set_strategy(s);
            s
        }
    })
}

/// The value of [`STRATEGY_ENV`] (empty: the default).
fn parse_strategy(value: &str) -> Result<Strategy, KernelError> {
    match value {
        "" | "auto" => Ok(Strategy::Auto),
        "tc" => Ok(Strategy::TensorCores),
        "tuned" => Ok(Strategy::Tuned),
        "cublas" => Ok(Strategy::Cublas),
        other => Err(KernelError::Shape {
            kernel: "matmul",
            what: format!("{STRATEGY_ENV}={other}: expected auto, tc, tuned or cublas"),
        }),
    }
}

/// Whether dequantize + cuBLAS can run a product of `F` on this client.
pub fn cublas_usable<R: Runtime, F: Float>(client: &ComputeClient<R>) -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::cublas::available()
            && crate::cublas::data_type::<F>().is_some()
            && crate::cublas::cuda_client(client).is_some()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = client;
        false
    }
}

/// The tuning key. `m` is bucketed to powers of two; the layer's shape is exact.
#[derive(AutotuneKey, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct ProductKey {
    #[autotune(anchor)]
    m: usize,
    n: usize,
    k: usize,
    transposed: bool,
    rank: usize,
    bias: bool,
    elem: String,
}

/// One product's inputs, owned so the tuner can replay it.
#[derive(Clone)]
pub(crate) struct Product<R: Runtime> {
    pub client: ComputeClient<R>,
    /// `X[M, K]` (forward) or `dY[M, N]` (transposed).
    pub x: Handle,
    pub m: usize,
    pub weight: DeviceWeight,
    pub bias: Option<Handle>,
    /// `(T [M, r] f32, B [N, r], r, s)`.
    pub lora: Option<(Handle, Handle, usize, f32)>,
    /// `Y[M, N]` (forward) or `dX[M, K]` (transposed).
    pub y: Handle,
    pub transposed: bool,
}

impl<R: Runtime> Product<R> {
    /// The same product writing into a fresh buffer of `y`'s size: what the tuner times, so that
    /// its replays never write a buffer the caller (or anything else) holds.
    fn with_scratch_output(&self) -> Product<R> {
        Product {
            y: self.client.empty(self.y.size() as usize),
            ..self.clone()
        }
    }
}

fn key<R: Runtime, F: Float>(p: &Product<R>) -> ProductKey {
    ProductKey::new(
        p.m,
        p.weight.n,
        p.weight.k,
        p.transposed,
        p.lora.as_ref().map_or(0, |l| l.2),
        p.bias.is_some(),
        std::any::type_name::<F>()
            .rsplit("::")
            .next()
            .unwrap_or("?")
            .to_string(),
    )
}

fn tensor_cores<R: Runtime, F: Float>(p: &Product<R>, tiles: Option<Tiles>) {
    let (product, epilogue) = if p.transposed {
        let none = TcEpilogue {
            bias: None,
            lora: None,
        };
        (TcProduct::Transposed(&p.weight), none)
    } else {
        let epilogue = TcEpilogue {
            bias: p.bias.clone(),
            lora: p.lora.clone(),
        };
        (TcProduct::Forward(&p.weight), epilogue)
    };
    gemm_tc::launch::<R, F, F>(&p.client, &p.x, p.m, product, epilogue, &p.y, tiles);
}

#[cfg(feature = "cuda")]
fn cublas<R: Runtime, F: Float>(p: &Product<R>) -> Result<(), KernelError> {
    if p.transposed {
        crate::cublas::transposed::<R, F>(&p.client, &p.x, p.m, &p.weight, &p.y)
    } else {
        let lora = p.lora.as_ref().map(|(t, b, r, s)| (t, b, *r, *s));
        let bias = p.bias.as_ref();
        crate::cublas::forward::<R, F>(&p.client, &p.x, p.m, &p.weight, bias, lora, &p.y)
    }
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::extra_unused_type_parameters)] // the same signature as the CUDA build's
fn cublas<R: Runtime, F: Float>(_: &Product<R>) -> Result<(), KernelError> {
    Err(KernelError::Vendor {
        what: "this build has no CUDA (feature `cuda`)".into(),
    })
}

/// Runs a product on which the tensor cores apply, by the current [`Strategy`].
pub(crate) fn run<R: Runtime, F: Float>(p: Product<R>) -> Result<(), KernelError> {
    match strategy()? {
        Strategy::Auto if p.m >= cublas_min_m() && cublas_usable::<R, F>(&p.client) => {
            cublas::<R, F>(&p)
        }
        Strategy::Auto | Strategy::TensorCores => {
            tensor_cores::<R, F>(&p, None);
            Ok(())
        }
        Strategy::TensorCoresTiles(t) => {
            tensor_cores::<R, F>(&p, Some(t.tiles()));
            Ok(())
        }
        Strategy::Cublas => cublas::<R, F>(&p),
        Strategy::Tuned => tuned::<R, F>(p),
    }
}

/// Before the first product of `key` in this process (the call that may start a tuning pass),
/// waits until cubecl has handed everything queued on this thread's stream to the device (not
/// until the device has run it) and returns the errors recorded for that work: launches the
/// driver refused or cubecl could not prepare (a kernel that did not compile, a buffer that was
/// never bound, a failed copy). See the module doc for why a tuning pass would otherwise lose
/// them.
fn surface_earlier_errors<R: Runtime>(
    client: &ComputeClient<R>,
    key: &ProductKey,
) -> Result<(), KernelError> {
    static SEEN: OnceLock<Mutex<HashSet<ProductKey>>> = OnceLock::new();
    let first = SEEN
        .get_or_init(Default::default)
        .lock()
        .map(|mut seen| seen.insert(key.clone()))
        // A poisoned set only costs one more check.
        .unwrap_or(true);
    if !first {
        return Ok(());
    }
    client.flush().map_err(|e| KernelError::Device {
        kernel: "matmul",
        what: format!("{e:?}"),
    })
}

fn tuned<R: Runtime, F: Float>(p: Product<R>) -> Result<(), KernelError> {
    static TUNER: LocalTuner<ProductKey, String> = local_tuner!("product");
    surface_earlier_errors(&p.client, &key::<R, F>(&p))?;
    let vendor = cublas_usable::<R, F>(&p.client);
    let set = TUNER.init(move || {
        let mut set = TunableSet::new(key::<R, F>, |_: &ProductKey, p: &Product<R>| {
            p.with_scratch_output()
        });
        for t in TileConfig::ALL {
            set = set.with(Tunable::new(t.name(), move |p: Product<R>| {
                tensor_cores::<R, F>(&p, Some(t.tiles()));
                Ok::<(), String>(())
            }));
        }
        if vendor {
            set.with(Tunable::new("dequant_cublas", |p: Product<R>| {
                cublas::<R, F>(&p).map_err(|e| e.to_string())
            }))
        } else {
            set
        }
    });
    let client = p.client.clone();
    let id = R::name(&client).to_string();
    #[cfg(feature = "cuda")]
    crate::cublas::host_ordered(|| TUNER.execute(&id, &client, set, p));
    #[cfg(not(feature = "cuda"))]
    TUNER.execute(&id, &client, set, p);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_env_values() {
        assert_eq!(parse_strategy("").unwrap(), Strategy::Auto);
        assert_eq!(parse_strategy("auto").unwrap(), Strategy::Auto);
        assert_eq!(parse_strategy("tc").unwrap(), Strategy::TensorCores);
        assert_eq!(parse_strategy("tuned").unwrap(), Strategy::Tuned);
        assert_eq!(parse_strategy("cublas").unwrap(), Strategy::Cublas);
        let err = parse_strategy("cuBLAS").unwrap_err().to_string();
        assert!(
            err.contains("QERL_GEMM=cuBLAS") && err.contains("tuned"),
            "{err}"
        );
    }

    #[test]
    fn every_strategy_round_trips_through_the_switch() {
        let all = [
            Strategy::Auto,
            Strategy::Tuned,
            Strategy::TensorCores,
            Strategy::Cublas,
        ]
        .into_iter()
        .chain(TileConfig::ALL.map(Strategy::TensorCoresTiles));
        for s in all {
            set_strategy(s);
            assert_eq!(strategy().unwrap(), s);
        }
        set_strategy(Strategy::Auto);
    }
}
