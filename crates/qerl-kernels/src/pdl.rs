//! Programmatic dependent launch (Hopper) of the hand-written products, on cubecl's own stream.
//!
//! Why: at batch 1 a product follows a small, latency-bound kernel (a norm, the attention's
//! merge, SiLU·mul), and its cubes could only start once that kernel had finished: their first
//! weight loads from DRAM then came after a whole launch latency of an idle memory. Launched
//! with `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, a product's cubes start as soon
//! as every cube of the kernel before has run `griddepcontrol.launch_dependents` (which those
//! kernels do first, [`allow_dependents`] in the engine), send their weight loads, and only then
//! wait (`griddepcontrol.wait`, which returns once the kernel before has completed and its
//! writes are visible) to read what it wrote: `X`, LoRA's `T`.
//!
//! How: cubecl launches through `cuLaunchKernel` on its device thread, with no way to add a
//! launch attribute, so this module launches the text itself:
//! - the text is compiled once with NVRTC (cudarc; the options cubecl uses: `sm_90a`,
//!   `-lineinfo`) and loaded into the primary context cubecl also uses;
//! - the buffers' device addresses come from `get_resource`, cached by cubecl's memory id (read
//!   from the handle's `Debug` form, the only place cubecl shows it; ids are never reused);
//! - the first buffer is always asked afresh: that blocking call returns only once cubecl's
//!   device thread has issued every launch queued before it, so the product is queued after
//!   them (without `flush`, which would wait for the GPU);
//! - `cuLaunchKernelEx` on cubecl's stream (found by `cubecl_stream`).
//!
//! Where any of that is missing (not sm_90, no CUPTI, `QERL_PDL=0`), the caller launches
//! through cubecl as before.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cudarc::driver::sys as cu;
use cudarc::driver::{CudaContext, CudaModule};

use crate::cubecl_stream::StreamBlas;
use crate::cuda_source::Source;

/// Whether products go through [`launch`]: `QERL_PDL=1` (off by default: each launch waits for
/// cubecl's device thread to issue what was queued before it, which at batch 1 left the host
/// behind the GPU, 5.3-5.9 ms a 7B step against 3.05-3.48, H200, 2026-11-29).
pub(crate) fn wanted() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::device::env_knob("QERL_PDL", &|v| v <= 1, 0) == 1)
}

/// Whether the products' texts wait (`griddepcontrol.wait`) after their first weight loads
/// rather than loading `X` first: where they are launched programmatically, by [`launch`] or
/// inside a captured step ([`crate::graph`]).
pub(crate) fn texts_wait() -> bool {
    wanted() || (crate::graph::enabled() && crate::graph::programmatic())
}

/// Launches this module made (for reports: whether the path is taken).
static LAUNCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Products launched programmatically so far.
pub fn launches() -> usize {
    LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Why the last programmatic launch fell back to cubecl's, where it failed past the checks.
static FAILURE: Mutex<Option<String>> = Mutex::new(None);

fn note(why: String) {
    if let Ok(mut f) = FAILURE.lock() {
        *f = Some(why);
    }
}

/// Why a programmatic launch last failed (compile or launch), for reports.
pub fn failure() -> Option<String> {
    FAILURE.lock().ok().and_then(|f| f.clone())
}

/// cubecl's memory id of `h`, from its `Debug` form (`... ManagedMemoryId { value: N } ...`):
/// the first number written. Formatting stops there.
fn memory_id(h: &Handle) -> Option<usize> {
    struct FirstNumber(Option<usize>);
    impl std::fmt::Write for FirstNumber {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
                self.0 = s.parse().ok();
                return Err(std::fmt::Error);
            }
            Ok(())
        }
    }
    let mut f = FirstNumber(None);
    let _ = write!(f, "{:?}", h.memory);
    f.0
}

/// One device's state: its context, the loaded kernels by text, the addresses by memory id.
struct Device {
    ctx: Arc<CudaContext>,
    /// Kernels by their text's hash; `None` where compiling failed (then cubecl launches it).
    functions: HashMap<u64, Option<(Arc<CudaModule>, cu::CUfunction)>>,
    addresses: HashMap<(usize, u64), u64>,
}

// SAFETY: the CUfunctions are only used under the mutex, with the context current.
unsafe impl Send for Device {}

/// Most cached addresses before the table is emptied (stale ids of freed buffers pile up).
const MAX_ADDRESSES: usize = 1 << 16;

fn devices() -> &'static Mutex<HashMap<usize, Device>> {
    static ALL: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    ALL.get_or_init(Default::default)
}

/// Launches `source`'s `entry` on `count` cubes of `threads` units with `buffers` and the
/// scalar block `scalars` (as [`crate::cuda_source::launch`] takes them), programmatically
/// after the kernel queued before it. Returns `false`, having launched nothing, where this
/// path is not available; the caller then launches through cubecl.
///
/// # Safety
/// As [`crate::cuda_source::launch`]; the kernel must read what the kernel before wrote only
/// after `griddepcontrol.wait`, and write nothing before it.
pub(crate) unsafe fn launch(
    client: &ComputeClient<CudaRuntime>,
    source: &Source,
    entry: &'static str,
    threads: u32,
    count: (u32, u32, u32),
    buffers: &[Handle],
    scalars: &[u32],
) -> bool {
    if !wanted() || buffers.is_empty() {
        return false;
    }
    // The first buffer afresh: the blocking call that orders this launch after cubecl's.
    let Some(on) = ordered_stream(client, &buffers[0]) else {
        return false;
    };
    let mut all = match devices().lock() {
        Ok(a) => a,
        Err(_) => return false,
    };
    let Some(dev) = all.get_mut(&on.ordinal) else {
        return false;
    };
    let (first, stream) = (on.ptr, on.stream);
    let function = dev
        .functions
        .entry(source.hash())
        .or_insert_with(|| compile(&dev.ctx, source.text(), entry))
        .as_ref()
        .map(|(_, f)| *f);
    let Some(function) = function else {
        return false;
    };
    // Addresses: the first as fetched, the others cached by memory id and offsets.
    if dev.addresses.len() > MAX_ADDRESSES {
        dev.addresses.clear();
    }
    let mut ptrs: Vec<u64> = Vec::with_capacity(buffers.len());
    ptrs.push(first);
    for h in &buffers[1..] {
        let key = memory_id(h).map(|id| (id, h.offset_start.unwrap_or(0)));
        let cached = key.and_then(|k| dev.addresses.get(&k).copied());
        let ptr = match cached {
            Some(p) => p,
            None => {
                let Ok(r) = client.get_resource(h.clone()) else {
                    return false;
                };
                let p = r.resource().ptr;
                if let Some(k) = key {
                    dev.addresses.insert(k, p);
                }
                p
            }
        };
        ptrs.push(ptr);
    }
    let mut block: Vec<u64> = scalars
        .chunks(2)
        .map(|p| p[0] as u64 | (p.get(1).copied().unwrap_or(0) as u64) << 32)
        .collect();
    let mut params: Vec<*mut std::ffi::c_void> = ptrs
        .iter_mut()
        .map(|p| p as *mut u64 as *mut std::ffi::c_void)
        .collect();
    params.push(block.as_mut_ptr() as *mut std::ffi::c_void);
    // SAFETY: a zeroed attribute is a valid value of the union; the id and field set below.
    let mut attr: cu::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = cu::CUlaunchConfig {
        gridDimX: count.0,
        gridDimY: count.1,
        gridDimZ: count.2,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the caller's contract: the kernel takes these buffers in order, then the scalar
    // block by value; the stream is cubecl's, live, of this context.
    let launched = unsafe {
        cu::cuLaunchKernelEx(&config, function, params.as_mut_ptr(), std::ptr::null_mut())
    };
    if launched != cu::CUresult::CUDA_SUCCESS {
        note(format!("cuLaunchKernelEx of {entry}: {launched:?}"));
        return false;
    }
    LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    true
}

/// cubecl's stream, ready for launches of ours: see [`ordered_stream`].
pub(crate) struct OrderedStream {
    pub ordinal: usize,
    pub stream: cu::CUstream,
    /// The device address of the handle asked.
    pub ptr: u64,
}

/// `handle`'s address, through the blocking call that returns once cubecl's device thread has
/// issued everything queued before it (so a launch of ours goes in after it); the device's
/// context made current on this thread; cubecl's stream (`cubecl_stream`). `None` where any is
/// missing, or the device is not sm_90 (what `griddepcontrol` and these texts need).
pub(crate) fn ordered_stream(
    client: &ComputeClient<CudaRuntime>,
    handle: &Handle,
) -> Option<OrderedStream> {
    let first = client.get_resource(handle.clone()).ok()?;
    let ptr = first.resource().ptr;
    let mut ordinal: i32 = 0;
    // SAFETY: a live allocation of cubecl's; the attribute is an int.
    let found = unsafe {
        cu::cuPointerGetAttribute(
            &mut ordinal as *mut i32 as *mut std::ffi::c_void,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    if found != cu::CUresult::CUDA_SUCCESS {
        return None;
    }
    let ordinal = ordinal as usize;
    {
        let mut all = devices().lock().ok()?;
        if !all.contains_key(&ordinal) {
            let ctx = CudaContext::new(ordinal).ok()?;
            if ctx
                .compute_capability()
                .map_or(true, |(major, _)| major != 9)
            {
                return None;
            }
            all.insert(
                ordinal,
                Device {
                    ctx,
                    functions: HashMap::new(),
                    addresses: HashMap::new(),
                },
            );
        }
        all.get(&ordinal)?.ctx.bind_to_thread().ok()?;
    }
    let stream = StreamBlas::find(client, ordinal).ok()??.stream();
    (!stream.is_null()).then_some(OrderedStream {
        ordinal,
        stream,
        ptr,
    })
}

/// `text` compiled for sm_90a and loaded; `None` (with a warning) where that fails.
fn compile(
    ctx: &Arc<CudaContext>,
    text: &str,
    entry: &str,
) -> Option<(Arc<CudaModule>, cu::CUfunction)> {
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some("sm_90a"),
        options: vec!["-lineinfo".into()],
        ..Default::default()
    };
    let ptx = match cudarc::nvrtc::compile_ptx_with_opts(text, opts) {
        Ok(p) => p,
        Err(e) => {
            note(format!("NVRTC on {entry}: {e:?}"));
            return None;
        }
    };
    let module = ctx.load_module(ptx).ok()?;
    let function = module.load_function(entry).ok()?;
    let f = function.cu_function();
    Some((module, f))
}

#[cfg(test)]
mod tests {
    use super::memory_id;
    use cubecl::server::Handle;

    #[test]
    fn memory_ids_are_read_from_the_handle() {
        let stream = cubecl::stream_id::StreamId::current();
        let a = Handle::new(stream, 64);
        let b = Handle::new(stream, 64);
        let (ia, ib) = (memory_id(&a), memory_id(&b));
        assert!(ia.is_some() && ib.is_some());
        assert_ne!(ia, ib);
        assert_eq!(memory_id(&a.clone()), ia);
    }
}
