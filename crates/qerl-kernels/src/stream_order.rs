//! Orders a foreign CUDA stream (cuBLAS's) against cubecl's stream on the device, with no host
//! round trip.
//!
//! cubecl 0.10 exposes neither its `CUstream` nor an event, so the first cuBLAS path waited on
//! the host: sync cubecl's stream, launch the GEMM, wait for it, return. Each product then left
//! the GPU idle twice (while the host launched the GEMM, and while it queued the next cubecl
//! kernels) and kept the host from running ahead. Here two 4-byte flags in device memory carry
//! the order instead, one pair per cubecl stream:
//!
//! ```text
//! cubecl stream:  ... producers ─ signal(ready = s) ───────────────── wait_for(done >= s) ─ consumers ...
//! cuBLAS stream:                    cuStreamWaitValue32(ready >= s) ─ GEMMs ─ cuStreamWriteValue32(done = s)
//! ```
//!
//! `signal` runs after every kernel queued before it on cubecl's stream has finished, so the
//! GEMMs see the producers' writes; the write of `done` follows the GEMMs with a memory fence
//! (`CU_STREAM_WRITE_VALUE_DEFAULT`), and the one-unit `wait_for` kernel holds cubecl's stream
//! until it reads it, so every later cubecl kernel (a consumer, or a reuse of a buffer the GEMMs
//! read) runs after the GEMMs. Comparisons are cyclic (`(int)(seen - s) >= 0`), as the driver's
//! `CU_STREAM_WAIT_VALUE_GEQ` is.
//!
//! Why the pair is per cubecl stream: with one pair shared by two streams, one stream's
//! `ready = s + 1` would release a GEMM waiting for the other's `ready >= s` before its
//! producers had finished. Why this cannot deadlock: every wait points at work queued before it
//! (the `signal` is submitted to the GPU before the cuBLAS stream is told to wait for it, and
//! `wait_for` is queued after the GEMM it waits for), so no wait depends on later work.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::stream_id::StreamId;

use crate::device::KernelError;

fn err(what: impl std::fmt::Display) -> KernelError {
    KernelError::Vendor {
        what: what.to_string(),
    }
}

/// `flag[0] = value`, after every kernel queued before it.
#[cube(launch_unchecked)]
fn signal_kernel(flag: &mut Array<Atomic<u32>>, value: u32) {
    flag[0].store(value);
}

/// Returns once `flag[0]` has reached `value` (cyclically), holding the stream until then.
#[cube(launch_unchecked)]
fn wait_kernel(flag: &Array<Atomic<u32>>, value: u32) {
    loop {
        let seen = flag[0].load();
        if i32::cast_from(seen - value) >= 0 {
            break;
        }
    }
}

/// The flags of one cubecl stream on one device.
struct Flags {
    ready: Handle,
    done: Handle,
    last: u32,
}

fn flags() -> &'static Mutex<HashMap<(usize, u64), Flags>> {
    static ALL: OnceLock<Mutex<HashMap<(usize, u64), Flags>>> = OnceLock::new();
    ALL.get_or_init(Default::default)
}

/// One crossing of cubecl's stream to a foreign stream and back; see the module doc.
pub(crate) struct Crossing {
    key: (usize, u64),
    ready: Handle,
    done: Handle,
    /// The value of the signal (`None` before it).
    last: Option<u32>,
}

/// The flags of the caller's cubecl stream on the device `ordinal`; nothing is launched yet.
pub(crate) fn begin(
    client: &ComputeClient<CudaRuntime>,
    ordinal: usize,
) -> Result<Crossing, KernelError> {
    let key = (ordinal, StreamId::current().value);
    let known = |all: &HashMap<(usize, u64), Flags>| {
        all.get(&key).map(|f| (f.ready.clone(), f.done.clone()))
    };
    let mut found = known(&*flags().lock().map_err(|_| err("stream flags poisoned"))?);
    if found.is_none() {
        // Made outside the lock: a cubecl call may wait for cubecl's device thread, which may
        // itself be in here (a tuning pass runs cuBLAS candidates there).
        let (ready, done) = (
            client.create_from_slice(u32::as_bytes(&[0])),
            client.create_from_slice(u32::as_bytes(&[0])),
        );
        let mut all = flags().lock().map_err(|_| err("stream flags poisoned"))?;
        all.entry(key).or_insert(Flags {
            ready,
            done,
            last: 0,
        });
        found = known(&all);
    }
    let (ready, done) = found.ok_or_else(|| err("stream flags missing"))?;
    Ok(Crossing {
        key,
        ready,
        done,
        last: None,
    })
}

impl Crossing {
    /// Queues `signal(ready = s)` on cubecl's stream, after everything queued so far, and
    /// returns `s`, the value the foreign stream waits for (`ready >= s`).
    pub(crate) fn signal(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
    ) -> Result<u32, KernelError> {
        let value = {
            let mut all = flags().lock().map_err(|_| err("stream flags poisoned"))?;
            let f = all
                .get_mut(&self.key)
                .ok_or_else(|| err("stream flags missing"))?;
            f.last = f.last.wrapping_add(1);
            f.last
        };
        // SAFETY: the flag holds one u32 (made in `begin`); one unit writes element 0.
        unsafe {
            signal_kernel::launch_unchecked::<CudaRuntime>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                ArrayArg::from_raw_parts(self.ready.clone(), 1),
                value,
            );
        }
        self.last = Some(value);
        Ok(value)
    }

    /// Device addresses of the `ready` and `done` flags. `get_resource` blocks until cubecl's
    /// device thread has run every task queued before it (or runs inline on that thread), so
    /// the signal has been launched on the GPU when this returns, before the foreign stream
    /// waits for it. The flags' memory stays valid: the map never drops their handles.
    pub(crate) fn pointers(
        &self,
        client: &ComputeClient<CudaRuntime>,
    ) -> Result<(u64, u64), KernelError> {
        let ptr = |h: &Handle, what: &str| -> Result<u64, KernelError> {
            let r = client
                .get_resource(h.clone())
                .map_err(|e| err(format!("stream flag {what}: {e:?}")))?;
            Ok(r.resource().ptr)
        };
        Ok((ptr(&self.ready, "ready")?, ptr(&self.done, "done")?))
    }

    /// Queues `wait_for(done >= s)` (`s`, the signal's value) on cubecl's stream: every cubecl
    /// kernel queued after it runs after the foreign stream's write of `done = s`.
    pub(crate) fn finish(self, client: &ComputeClient<CudaRuntime>) {
        let Some(value) = self.last else { return };
        // SAFETY: the flag holds one u32; one unit reads element 0.
        unsafe {
            wait_kernel::launch_unchecked::<CudaRuntime>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                ArrayArg::from_raw_parts(self.done.clone(), 1),
                value,
            );
        }
    }
}
