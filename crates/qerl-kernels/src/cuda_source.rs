//! Hand-written CUDA kernels, compiled by cubecl's own NVRTC path and launched on cubecl's own
//! stream (CUDA builds only).
//!
//! cubecl 0.10 emits neither `wgmma` nor the register-level bit tricks some products need (the
//! shared notes `cubecl-0.10-engine-facts.md` §5), and exposes no stream to launch on. It does
//! compile whatever text a [`CubeTask`] returns and runs it through
//! [`ComputeClient::launch_unchecked`] in order with every other kernel of the step, so no host
//! synchronisation is needed. [`SourceTask`] compiles a one-line `#[cube]` frame for the
//! representation cubecl's CUDA backend asks of every kernel (only its dynamic shared memory, 0
//! here: these kernels' shared memory is static), then swaps in the text. Its [`KernelId`]
//! hashes the whole text, so an edited kernel never meets an old cache entry.
//!
//! The scalars go as a custom info block ([`MetadataBindingInfo::custom`], the form cubecl
//! offers for externally compiled kernels) with no dynamic part, so cubecl passes it by value as
//! the kernel's last argument; with a dynamic part it would upload it and insert a pointer
//! argument before it (the first launch's illegal address, 2026-11-28).

use crate::device::DeviceWeight;
use cubecl::cuda::{CudaCompiler, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::{Binding, Handle, KernelArguments, MetadataBindingInfo};
use cubecl::{CompilationError, CubeTask};
use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};

/// A frame whose compiled form gives cubecl the representation it asks of every CUDA kernel;
/// its text is never used.
#[cube(launch_unchecked)]
fn source_frame(out: &mut Array<u32>) {
    out[0] = 0u32;
}

/// One CUDA text with its entry point, as a task cubecl compiles, caches and launches.
struct SourceTask {
    source: Arc<str>,
    entry: &'static str,
    hash: u64,
    cube_dim: CubeDim,
    frame: KernelTask<CudaCompiler, source_frame::SourceFrame<CudaRuntime>>,
}

impl KernelMetadata for SourceTask {
    fn id(&self) -> KernelId {
        KernelId::new::<Self>()
            .info(self.hash)
            .cube_dim(self.cube_dim)
    }

    fn address_type(&self) -> StorageType {
        self.frame.address_type()
    }
}

impl CubeTask<CudaCompiler> for SourceTask {
    fn compile(
        &self,
        compiler: &mut CudaCompiler,
        options: &<CudaCompiler as cubecl::Compiler>::CompilationOptions,
        mode: ExecutionMode,
        address_type: StorageType,
    ) -> Result<CompiledKernel<CudaCompiler>, CompilationError> {
        let mut kernel = self.frame.compile(compiler, options, mode, address_type)?;
        kernel.source = self.source.to_string();
        kernel.entrypoint_name = self.entry.to_string();
        kernel.debug_name = Some(self.entry);
        kernel.cube_dim = self.cube_dim;
        Ok(kernel)
    }
}

/// A kernel text and the hash of it (with its entry point) that names it in cubecl's caches.
#[derive(Clone)]
pub(crate) struct Source {
    text: Arc<str>,
    hash: u64,
}

/// Kernel texts by configuration, built once: building and hashing a text (15 KiB) took more
/// host time than a launch, which at batch 1 is what the host has to keep ahead of the GPU.
pub(crate) type SourceCache<K> = Mutex<HashMap<K, Source>>;

/// `key`'s text from `cache`, built by `build` (and hashed with `entry`) the first time.
pub(crate) fn cached<K: Hash + Eq + Clone>(
    cache: &SourceCache<K>,
    key: &K,
    entry: &str,
    build: impl FnOnce() -> String,
) -> Source {
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    map.entry(key.clone())
        .or_insert_with(|| {
            let text = build();
            let mut h = DefaultHasher::new();
            text.hash(&mut h);
            entry.hash(&mut h);
            Source {
                text: text.into(),
                hash: h.finish(),
            }
        })
        .clone()
}

/// The types and helpers the hand-written kernels share (`cuda_common.cu`), prepended to their
/// texts right after the `#define`s.
pub(crate) const COMMON: &str = include_str!("cuda_common.cu");

/// The E2M1 pair decoding the 4-bit products share (`spread_bits`) and their bf16 helpers,
/// prepended to their texts after [`COMMON`].
pub(crate) const E2M1_SPREAD: &str = include_str!("e2m1_spread.cu");

/// 1 where `QERL_SPREAD_SHIFTS=1` asks the 4-bit products' decoding for the two shifts and two
/// masks a code pair of sessions 12-31 instead of the multiply (an A/B experiment).
pub(crate) fn spread_shifts() -> usize {
    static ON: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::device::env_knob("QERL_SPREAD_SHIFTS", &|v| v <= 1, 0))
}

/// `#define NAME value` lines for a kernel's configuration, ahead of its text.
pub(crate) fn defines(values: &[(&str, usize)]) -> String {
    values
        .iter()
        .map(|(k, v)| format!("#define {k} {v}\n"))
        .collect()
}

/// Launches `source`'s `entry` (`extern "C" __global__`) on `count` cubes of `threads` units:
/// its arguments are `buffers` in order, then one struct passed by value holding `scalars`
/// (32-bit words, little-endian, padded to 8 bytes).
///
/// # Safety
/// The kernel must read and write the buffers only in bounds and take exactly these
/// arguments, the last one a struct of `scalars`' layout.
pub(crate) unsafe fn launch(
    client: &ComputeClient<CudaRuntime>,
    source: Source,
    entry: &'static str,
    threads: u32,
    count: (u32, u32, u32),
    buffers: Vec<Binding>,
    scalars: &[u32],
) {
    let cube_dim = CubeDim::new_1d(threads);
    let settings = KernelSettings::default().cube_dim(cube_dim);
    let frame = source_frame::SourceFrame::<CudaRuntime>::new(
        settings,
        client.clone(),
        ArrayCompilationArg { inplace: None },
    );
    let task = SourceTask {
        source: source.text,
        entry,
        hash: source.hash,
        cube_dim,
        frame: KernelTask::new(frame),
    };
    let data: Vec<u64> = scalars
        .chunks(2)
        .map(|p| p[0] as u64 | (p.get(1).copied().unwrap_or(0) as u64) << 32)
        .collect();
    let mut args = KernelArguments::new();
    args.buffers = buffers;
    // All of it is the scalar block, passed by value (see the module documentation).
    let words = data.len();
    args.info = MetadataBindingInfo::custom(data);
    args.info.dynamic_metadata_offset = words;
    let count = CubeCount::Static(count.0, count.1, count.2);
    // SAFETY: the caller's contract (buffers in bounds, the argument list as given).
    unsafe { client.launch_unchecked(Box::new(task), count, args) };
}

/// One weight's buffers and scalars as the hand-written products take them (one of up to three
/// segments sharing `X`: q/k/v, gate/up).
pub(crate) struct SegmentArgs {
    pub codes: Handle,
    pub scale_bytes: Handle,
    pub scale_table: Handle,
    pub bias: Handle,
    pub lora_t: Handle,
    pub lora_b: Handle,
    pub y: Handle,
    pub n: usize,
    pub lora_scale: f32,
}

impl SegmentArgs {
    /// `weight`'s codes and scales with its bias (any buffer when there is none), LoRA `T`, `B`
    /// and scale (any buffers and 0 when there is none) and output `y`.
    pub(crate) fn new(
        weight: &DeviceWeight,
        bias: Handle,
        (lora_t, lora_b, lora_scale): (Handle, Handle, f32),
        y: Handle,
    ) -> Self {
        SegmentArgs {
            codes: weight.codes.clone(),
            scale_bytes: weight.scale_bytes.clone(),
            scale_table: weight.scale_table.clone(),
            bias,
            lora_t,
            lora_b,
            y,
            n: weight.n,
            lora_scale,
        }
    }
}

/// The products' buffer arguments: `x`, then codes, scale bytes, scale table, bias, LoRA `T`,
/// LoRA `B` and `Y` of three segments (the last one repeated where there are fewer).
pub(crate) fn segment_bindings(x: &Handle, segs: &[SegmentArgs]) -> Vec<Binding> {
    let mut buffers: Vec<Binding> = vec![x.clone().binding()];
    for i in 0..3 {
        let s = &segs[i.min(segs.len() - 1)];
        for h in [
            &s.codes,
            &s.scale_bytes,
            &s.scale_table,
            &s.bias,
            &s.lora_t,
            &s.lora_b,
            &s.y,
        ] {
            buffers.push(h.clone().binding());
        }
    }
    buffers
}

/// The first cube of segments 1 and 2 for cubes of `width` rows (`u32::MAX` for one segment):
/// every segment's `N` but the last is a multiple of `width`.
pub(crate) fn segment_starts(segs: &[SegmentArgs], width: usize) -> (u32, u32) {
    match segs {
        [_] => (u32::MAX, u32::MAX),
        [a, b, ..] => ((a.n / width) as u32, ((a.n + b.n) / width) as u32),
        [] => unreachable!("no segments"),
    }
}
