//! cuBLAS on cubecl's own CUDA stream, so that a product crossing to cuBLAS waits for nothing.
//!
//! Why: cubecl 0.10 keeps its `CUstream` private, so [`crate::cublas`] first ordered cuBLAS
//! against cubecl through the host: wait for cubecl's stream, run the GEMMs on a stream of our
//! own, wait for them. Each crossing left the GPU idle for the host's round trips: on an H200
//! (2026-11-28), the 7B o product at 1,024 rows took 57 us through qerl's call for a 40-us GEMM,
//! the very cuBLAS kernel torch runs (`tools/device_cublas_ab.sh`, Nsight Compute). Queued on
//! cubecl's stream, the GEMMs run behind the kernels queued before them and ahead of the next
//! ones, and the host does not wait.
//!
//! How the stream is found ([`StreamBlas::find`]): once per cubecl stream (a host thread's
//! `StreamId`) and device, CUPTI's callback on `cuLaunchKernel` is switched on, a one-unit probe
//! kernel that writes a fresh buffer is launched through cubecl and flushed, and the launch whose
//! first argument is that buffer's address names the stream; then the callback is switched off.
//! Where CUPTI cannot be loaded or subscribed to (Nsight Compute holds the only subscription), or
//! with `QERL_CUBLAS_STREAM=host`, there is no [`StreamBlas`] and cuBLAS keeps the host-ordered
//! path.
//!
//! Memory: the caller's buffers are held (cubecl's `ManagedResource`, which keeps the pool from
//! handing them out again) until an event recorded after the GEMMs has completed;
//! [`StreamBlas::enqueue`] releases the finished ones on each call and waits for the oldest when
//! more than [`HELD_LIMIT`] bytes are held. Within one cubecl stream the pool's reuse is ordered after the
//! GEMMs anyway; the hold covers buffers owned by another thread's stream.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::cupti::sys as cupti;
use cudarc::driver::sys as cu;

use crate::device::KernelError;

/// Bytes of caller buffers held for GEMMs still queued, past which a call waits for the oldest.
pub(crate) const HELD_LIMIT: u64 = 1 << 30;

fn err(what: impl std::fmt::Display) -> KernelError {
    KernelError::Vendor {
        what: what.to_string(),
    }
}

/// A cuBLAS handle bound to one cubecl stream, with the buffers its queued GEMMs still read.
pub(crate) struct StreamBlas {
    state: Mutex<State>,
}

struct State {
    handle: blas_sys::cublasHandle_t,
    stream: cu::CUstream,
    /// GEMM batches in queue order.
    pending: VecDeque<Pending>,
    held: u64,
}

/// One queued batch of GEMMs: the event after them, the buffers they read, their bytes.
struct Pending {
    event: cu::CUevent,
    _held: Vec<Box<dyn Send>>,
    bytes: u64,
}

/// Found streams by (device ordinal, cubecl `StreamId`); `None` where none can be found.
type StreamTable = HashMap<(usize, u64), Option<Arc<StreamBlas>>>;

// SAFETY: the handle, stream and events are used only under the mutex; CUDA objects may be
// used from any thread once their context is current, which `enqueue`'s caller ensures.
unsafe impl Send for State {}

impl StreamBlas {
    /// The handle for the caller's cubecl stream on device `ordinal` (whose context is current),
    /// found and cached on first use; `None` where cubecl's stream cannot be found here.
    pub(crate) fn find(
        client: &ComputeClient<CudaRuntime>,
        ordinal: usize,
    ) -> Result<Option<Arc<StreamBlas>>, KernelError> {
        static FOUND: OnceLock<Mutex<StreamTable>> = OnceLock::new();
        static HOST: OnceLock<bool> = OnceLock::new();
        if *HOST.get_or_init(|| std::env::var("QERL_CUBLAS_STREAM").is_ok_and(|v| v == "host")) {
            return Ok(None);
        }
        let key = (ordinal, cubecl::stream_id::StreamId::current().value);
        let mut found = FOUND
            .get_or_init(Default::default)
            .lock()
            .map_err(|_| err("cuBLAS stream table poisoned"))?;
        if let Some(known) = found.get(&key) {
            return Ok(known.clone());
        }
        let made = match discover(client) {
            Some(stream) => {
                let handle =
                    blas::create_handle().map_err(|e| err(format!("cublasCreate: {e:?}")))?;
                // SAFETY: a live handle and cubecl's live stream of the current context.
                unsafe { blas::set_stream(handle, stream as _) }
                    .map_err(|e| err(format!("cublasSetStream: {e:?}")))?;
                Some(Arc::new(StreamBlas {
                    state: Mutex::new(State {
                        handle,
                        stream,
                        pending: VecDeque::new(),
                        held: 0,
                    }),
                }))
            }
            None => None,
        };
        found.insert(key, made.clone());
        Ok(made)
    }

    /// cubecl's stream this handle queues on.
    pub(crate) fn stream(&self) -> cu::CUstream {
        self.state.lock().map_or(std::ptr::null_mut(), |s| s.stream)
    }

    /// Queues the GEMMs (`launch` with this stream's handle) on cubecl's stream, after
    /// releasing the holds of batches that have finished; `held` (with its byte count) stays
    /// held until these GEMMs have finished too. Does not wait for them.
    pub(crate) fn enqueue(
        &self,
        held: Vec<Box<dyn Send>>,
        bytes: u64,
        launch: impl FnOnce(blas_sys::cublasHandle_t) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        let mut s = self
            .state
            .lock()
            .map_err(|_| err("cuBLAS handle poisoned"))?;
        s.release(false)?;
        let launched = launch(s.handle);
        // Hold the buffers past whatever was queued, also when a launch failed part way.
        let event =
            cudarc::driver::result::event::create(cu::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| err(format!("CUDA event: {e:?}")))?;
        // SAFETY: a fresh event and cubecl's live stream.
        unsafe { cudarc::driver::result::event::record(event, s.stream) }
            .map_err(|e| err(format!("CUDA event record: {e:?}")))?;
        s.pending.push_back(Pending {
            event,
            _held: held,
            bytes,
        });
        s.held += bytes;
        while s.held > HELD_LIMIT && s.pending.len() > 1 {
            s.release(true)?;
        }
        launched
    }
}

impl State {
    /// Drops the holds of finished batches, oldest first; with `wait`, waits for the oldest.
    fn release(&mut self, wait: bool) -> Result<(), KernelError> {
        let mut first = true;
        while let Some(&Pending { event, bytes, .. }) = self.pending.front() {
            // SAFETY: `event` was created and recorded by `enqueue` and not yet destroyed.
            let done = if wait && first {
                unsafe { cu::cuEventSynchronize(event) }.result().is_ok()
            } else {
                (unsafe { cu::cuEventQuery(event) }) == cu::CUresult::CUDA_SUCCESS
            };
            first = false;
            if !done {
                break;
            }
            // SAFETY: the event has completed; nothing else refers to it.
            unsafe { cu::cuEventDestroy_v2(event) }
                .result()
                .map_err(|e| err(format!("CUDA event destroy: {e:?}")))?;
            self.pending.pop_front();
            self.held -= bytes;
            if wait {
                break;
            }
        }
        Ok(())
    }
}

/// Streams found so far (for reports: whether this path is taken).
static FOUND_COUNT: AtomicU64 = AtomicU64::new(0);

pub(crate) fn found() -> usize {
    FOUND_COUNT.load(Ordering::Relaxed) as usize
}

/// The address the probe kernel writes (0 when no discovery runs), and the stream of the launch
/// that carried it.
static PROBE: AtomicU64 = AtomicU64::new(0);
static PROBED_STREAM: AtomicU64 = AtomicU64::new(0);

#[cube(launch_unchecked)]
fn stream_probe_kernel(out: &mut Array<u32>) {
    if UNIT_POS == 0 {
        out[0] = 1u32;
    }
}

/// CUPTI's driver-API callback: on entry to a `cuLaunchKernel` whose first argument holds the
/// probe's address, remember the launch's stream.
unsafe extern "C" fn on_launch(
    _user: *mut std::ffi::c_void,
    domain: cupti::CUpti_CallbackDomain,
    cbid: cupti::CUpti_CallbackId,
    data: *const std::ffi::c_void,
) {
    let probe = PROBE.load(Ordering::Acquire);
    if probe == 0
        || domain != cupti::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API
        || cbid
            != cupti::CUpti_driver_api_trace_cbid_enum::CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel
                as u32
        || data.is_null()
    {
        return;
    }
    // SAFETY: CUPTI passes a `CUpti_CallbackData` for driver-API callbacks, whose parameters
    // are `cuLaunchKernel`'s for this callback id. cubecl passes every buffer as a pointer to
    // its 8-byte device address, and the probe kernel's first argument is its buffer.
    unsafe {
        let data = &*(data as *const cupti::CUpti_CallbackData);
        if data.callbackSite != cupti::CUpti_ApiCallbackSite::CUPTI_API_ENTER
            || data.functionParams.is_null()
        {
            return;
        }
        let params = &*(data.functionParams as *const cupti::cuLaunchKernel_params);
        if params.kernelParams.is_null() || params.gridDimX != 1 || params.blockDimX != 1 {
            return;
        }
        let first = *params.kernelParams as *const u64;
        if !first.is_null() && *first == probe {
            PROBED_STREAM.store(params.hStream as u64, Ordering::Release);
        }
    }
}

/// cubecl's stream for the caller's `StreamId` on `client`'s device, through CUPTI (see the
/// module doc); `None` where CUPTI is missing or busy, or the probe was not seen.
fn discover(client: &ComputeClient<CudaRuntime>) -> Option<cu::CUstream> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().ok()?;
    // SAFETY: only tries to dlopen the library names cudarc knows.
    if !unsafe { cupti::is_culib_present() } {
        return None;
    }
    let probe = client.empty(16);
    let address = client.get_resource(probe.clone()).ok()?.resource().ptr;
    let mut subscriber: cupti::CUpti_SubscriberHandle = std::ptr::null_mut();
    // SAFETY: `on_launch` only reads CUPTI's callback data; the subscription ends below.
    let subscribed =
        unsafe { cupti::cuptiSubscribe(&mut subscriber, Some(on_launch), std::ptr::null_mut()) };
    if subscribed != cupti::CUptiResult::CUPTI_SUCCESS {
        return None;
    }
    PROBED_STREAM.store(0, Ordering::Release);
    PROBE.store(address, Ordering::Release);
    // SAFETY: a live subscriber; the domain and id are CUPTI's.
    let enabled = unsafe {
        cupti::cuptiEnableCallback(
            1,
            subscriber,
            cupti::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API,
            cupti::CUpti_driver_api_trace_cbid_enum::CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel as u32,
        )
    };
    if enabled == cupti::CUptiResult::CUPTI_SUCCESS {
        // SAFETY: the kernel writes element 0 of a 4-element buffer.
        unsafe {
            stream_probe_kernel::launch_unchecked::<CudaRuntime>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                ArrayArg::from_raw_parts(probe.clone(), 4),
            );
        }
        // The device thread launches queued work when flushed; the callback runs inside.
        let _ = client.flush();
    }
    PROBE.store(0, Ordering::Release);
    // SAFETY: the subscriber made above.
    unsafe { cupti::cuptiUnsubscribe(subscriber) };
    let stream = PROBED_STREAM.swap(0, Ordering::AcqRel);
    if stream != 0 {
        FOUND_COUNT.fetch_add(1, Ordering::Relaxed);
    }
    (stream != 0).then_some(stream as cu::CUstream)
}
