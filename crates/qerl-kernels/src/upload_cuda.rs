//! The staged upload on CUDA (see [`crate::upload`]).
//!
//! cubecl allocates the destination (`empty` / `empty_tensor`, so the layout, pitched rows
//! included, is the one `create` would give); its raw `CUdeviceptr` comes from
//! `client.get_resource`. After `client.sync()` (the allocation is stream-ordered on cubecl's
//! stream), the data goes through two pinned buffers on a cudarc stream of this module: the
//! calling thread copies a chunk into one buffer on every core while the copy engine uploads
//! the other (`cuMemcpyHtoDAsync`, or `cuMemcpy2DAsync` for pitched rows). Each buffer has an
//! event, waited for before the buffer is refilled. The session keeps a handle of every
//! destination (so cubecl cannot reuse the memory) until `finish` synchronises the stream;
//! only then may cubecl's kernels read the weights.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::{Handle, MemoryLayout};
use cubecl::zspace::Shape;
use cudarc::driver::sys::{self, CUDA_MEMCPY2D_st, CUmemorytype};
use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream, DriverError, PinnedHostSlice};
use qerl_format::checkpoint::par;

use crate::upload::{staging_step, State, UploadError};

/// `client` as the CUDA runtime's, when it is one.
pub(crate) fn as_cuda<R: Runtime>(
    client: &ComputeClient<R>,
) -> Option<&ComputeClient<CudaRuntime>> {
    (client as &dyn Any).downcast_ref()
}

/// The stream, the pinned buffers and the destinations still being written.
pub(crate) struct Stager {
    ordinal: i32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    buffers: Vec<(PinnedHostSlice<u8>, CudaEvent)>,
    next: usize,
    in_flight: Vec<Handle>,
}

impl Stager {
    fn new(ordinal: i32, chunk_bytes: usize) -> Result<Self, DriverError> {
        // The primary context: the one cubecl retains, so its pointers are valid here.
        let ctx = CudaContext::new(ordinal as usize)?;
        let stream = ctx.new_stream()?;
        let mut buffers = Vec::with_capacity(2);
        for _ in 0..2 {
            // SAFETY: the memory is zeroed below before any slice of it is made.
            let mut buf = unsafe { ctx.alloc_pinned_with_flags::<u8>(chunk_bytes, 0) }?;
            // SAFETY: `buf` holds `chunk_bytes` bytes; nothing reads it yet.
            unsafe { std::ptr::write_bytes(buf.as_mut_ptr()?, 0, chunk_bytes) };
            buffers.push((buf, ctx.new_event(None)?));
        }
        Ok(Stager {
            ordinal,
            ctx,
            stream,
            buffers,
            next: 0,
            in_flight: Vec::new(),
        })
    }

    /// Waits for every copy, then lets cubecl have the destinations.
    pub(crate) fn finish(&mut self) -> Result<(), UploadError> {
        self.stream
            .synchronize()
            .map_err(|e| device_err("the uploaded weights", "cuStreamSynchronize", e))?;
        self.in_flight.clear();
        Ok(())
    }

    /// Copies `data`, `height` rows of `width` bytes, to `dst` with rows `pitch` bytes apart,
    /// `step` bytes at a time ([`staging_step`]: whole rows, at most one buffer).
    fn copy(
        &mut self,
        dst: u64,
        data: &[u8],
        width: usize,
        pitch: usize,
        step: usize,
    ) -> Result<(), DriverError> {
        let capacity = self.buffers[0].0.len();
        assert!(
            step > 0 && step <= capacity && (width == pitch || step.is_multiple_of(width.max(1))),
            "staged copy: step {step} for rows of {width} bytes and buffers of {capacity}"
        );
        self.ctx.bind_to_thread()?;
        let mut offset = 0;
        for chunk in data.chunks(step) {
            let (buf, event) = &mut self.buffers[self.next];
            self.next = (self.next + 1) % 2;
            // The previous upload out of this buffer is done before it is refilled.
            event.synchronize()?;
            let host = &mut buf.as_mut_slice()?[..chunk.len()];
            par::convert_into(chunk, 1, host, |_, src, out| out.copy_from_slice(src));
            let stream = self.stream.cu_stream();
            if width == pitch {
                // SAFETY: `dst` is a live cubecl allocation of at least `data.len()` bytes
                // (checked by the caller, kept alive in `in_flight`); `host` is pinned and not
                // written again before `event` says this copy is done.
                unsafe { result::memcpy_htod_async(dst + offset as u64, host, stream) }?;
            } else {
                let rows = chunk.len() / width;
                let cpy = CUDA_MEMCPY2D_st {
                    srcMemoryType: CUmemorytype::CU_MEMORYTYPE_HOST,
                    srcHost: host.as_ptr() as *const c_void,
                    srcPitch: width,
                    dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    dstDevice: dst + ((offset / width) * pitch) as u64,
                    dstPitch: pitch,
                    WidthInBytes: width,
                    Height: rows,
                    srcXInBytes: Default::default(),
                    srcY: Default::default(),
                    srcDevice: Default::default(),
                    srcArray: Default::default(),
                    dstXInBytes: Default::default(),
                    dstY: Default::default(),
                    dstHost: Default::default(),
                    dstArray: Default::default(),
                };
                // SAFETY: as above, with the rows inside the pitched allocation (checked by
                // the caller: `pitch * (height - 1) + width` bytes).
                unsafe { sys::cuMemcpy2DAsync_v2(&cpy, stream) }.result()?;
            }
            event.record(&self.stream)?;
            offset += chunk.len();
        }
        Ok(())
    }
}

fn device_err(tensor: &str, op: &'static str, what: impl std::fmt::Debug) -> UploadError {
    UploadError::Device {
        tensor: tensor.to_string(),
        op,
        what: format!("{what:?}"),
    }
}

fn layout_err(tensor: &str, what: String) -> UploadError {
    UploadError::Layout {
        tensor: tensor.to_string(),
        what,
    }
}

/// `(width, height, pitch)` in bytes of a pitched row-major layout, as `cubecl` writes it
/// (`cubecl-cuda` `write_to_gpu`): rows of the last dimension, `strides[rank - 2]` apart.
fn rows(
    tensor: &str,
    len: usize,
    layout: Option<(&Shape, usize)>,
    strides: &[usize],
) -> Result<(usize, usize, usize), UploadError> {
    let Some((shape, elem)) = layout.filter(|(s, _)| s.len() >= 2) else {
        return Ok((len, 1, len));
    };
    let rank = shape.len();
    let width = shape[rank - 1] * elem;
    let height: usize = shape[..rank - 1].iter().product();
    let pitch = strides.get(rank - 2).copied().unwrap_or(0) * elem;
    let row_major = strides.len() == rank
        && strides[rank - 1] == 1
        && (0..rank - 2).all(|i| strides[i] == strides[i + 1] * shape[i + 1]);
    if !row_major || pitch < width || width * height != len {
        return Err(layout_err(
            tensor,
            format!("{len} bytes of shape {shape:?} do not fit strides {strides:?}"),
        ));
    }
    if height == 1 || pitch == width {
        return Ok((len, 1, len));
    }
    Ok((width, height, pitch))
}

/// Allocates the destination through cubecl and stages `data` into it.
pub(crate) fn upload(
    state: &mut State,
    client: &ComputeClient<CudaRuntime>,
    tensor: &str,
    data: &[u8],
    layout: Option<(&Shape, usize)>,
) -> Result<MemoryLayout, UploadError> {
    let out = match layout {
        Some((shape, elem)) => client.empty_tensor(shape.clone(), elem),
        None => MemoryLayout::new(client.empty(data.len()), [1]),
    };
    let (width, height, pitch) = rows(tensor, data.len(), layout, &out.strides)?;
    let chunk_bytes = state.config.chunk_bytes;
    // Pitched rows go one whole row or more a chunk; contiguous data is cut anywhere.
    let step = staging_step(tensor, if width == pitch { 1 } else { width }, chunk_bytes)?;
    let resource = client
        .get_resource(out.memory.clone())
        .map_err(|e| device_err(tensor, "cubecl get_resource", e))?;
    let (ptr, size) = (resource.resource().ptr, resource.resource().size);
    drop(resource);
    let needed = pitch * (height - 1) + width;
    if (size as usize) < needed {
        return Err(layout_err(
            tensor,
            format!("cubecl allocated {size} bytes, the data needs {needed}"),
        ));
    }
    // cubecl allocates on its own stream (`cuMemAllocAsync`): done before this stream writes.
    cubecl::future::block_on(client.sync()).map_err(|e| device_err(tensor, "cubecl sync", e))?;
    // `ptr` is a device pointer of cubecl's (live: `out` holds it).
    let ordinal = crate::cublas::device_ordinal(ptr)
        .map_err(|e| device_err(tensor, "cuPointerGetAttribute", e))? as i32;
    let stager = match &mut state.stager {
        Some(s) if s.ordinal == ordinal => s,
        Some(s) => {
            return Err(layout_err(
                tensor,
                format!(
                    "on device {ordinal}, this upload session's is {}",
                    s.ordinal
                ),
            ))
        }
        None => state.stager.insert(
            Stager::new(ordinal, chunk_bytes)
                .map_err(|e| device_err(tensor, "allocating pinned buffers", e))?,
        ),
    };
    stager
        .copy(ptr, data, width, pitch, step)
        .map_err(|e| device_err(tensor, "cuMemcpyHtoDAsync", e))?;
    stager.in_flight.push(out.memory.clone());
    Ok(out)
}
