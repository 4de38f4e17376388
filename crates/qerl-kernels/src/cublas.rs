//! cuBLAS on cubecl's buffers: the vendor half of the "dequantize, then GEMM" strategy.
//!
//! cubecl 0.10 emits no `wgmma`, so on Hopper its tensor-core kernels reach a fraction of the
//! chip's bf16 rate; cuBLAS reaches most of it. For large M the decode of a 4-bit weight into a
//! dense buffer ([`crate::dense`]) is cheap next to the product, so decoding once and handing the
//! product to cuBLAS wins. libcublas is loaded at run time (cudarc's dynamic loading, the same
//! way cubecl-cuda loads the driver and NVRTC); without it this path reports itself unavailable.
//!
//! cubecl does not expose its CUDA stream, so cuBLAS runs on a stream of its own, and [`run`]
//! orders the two sides:
//! 1. take every buffer's device pointer (`get_resource`), which holds its memory and, for a
//!    buffer last used on another cubecl stream (another host thread's `StreamId`), queues a wait
//!    for that stream on the caller's;
//! 2. make the GEMMs wait for the caller's cubecl stream, which now covers those waits too;
//! 3. run the GEMMs on our stream (same primary context, same device memory) under the
//!    device's lock (one cuBLAS handle and stream serve every thread), and make every later
//!    cubecl kernel wait for them before any pointer is released to cubecl's pool.
//!
//! By default steps 2 and 3 wait on the device ([`crate::stream_order`]: a flag cubecl's stream
//! sets and cuBLAS's stream waits for, then a flag cuBLAS's stream sets and a one-unit kernel on
//! cubecl's stream waits for), so the host never blocks and the GPU never idles between the two
//! sides. With `QERL_CUBLAS_ORDER=host`, or if the driver refuses the stream wait, both waits
//! are on the host: sync cubecl's stream, launch, synchronize ours.
//!
//! The autotuner times these waits as part of the strategy, so it is picked only where it still
//! wins.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cudarc::cublas::{result as blas, sys, CudaBlas};
use cudarc::driver::{CudaContext, CudaStream};

use crate::dense::{self, BlasShape, ExtraColumn};
use crate::device::{DeviceWeight, KernelError};

fn err(what: impl std::fmt::Display) -> KernelError {
    KernelError::Vendor {
        what: what.to_string(),
    }
}

/// Whether libcublas can be loaded here.
pub fn available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library names cudarc knows.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// The cuBLAS element type of `F`: bf16 and f16 (f32 stays on the cubecl kernels: cuBLAS would
/// run it as TF32 or on CUDA cores, neither what a caller of an f32 product expects).
pub(crate) fn data_type<F: 'static>() -> Option<sys::cudaDataType> {
    let t = TypeId::of::<F>();
    if t == TypeId::of::<half::bf16>() {
        Some(sys::cudaDataType::CUDA_R_16BF)
    } else if t == TypeId::of::<half::f16>() {
        Some(sys::cudaDataType::CUDA_R_16F)
    } else {
        None
    }
}

/// The cuBLAS type of an output element `O`: as [`data_type`], plus f32 (a bf16 product into f32
/// logits).
fn output_type<O: 'static>() -> Option<sys::cudaDataType> {
    match TypeId::of::<O>() == TypeId::of::<f32>() {
        true => Some(sys::cudaDataType::CUDA_R_32F),
        false => data_type::<O>(),
    }
}

/// The client as a CUDA client, or `None` on another runtime.
pub(crate) fn cuda_client<R: Runtime>(
    client: &ComputeClient<R>,
) -> Option<&ComputeClient<CudaRuntime>> {
    (client as &dyn Any).downcast_ref::<ComputeClient<CudaRuntime>>()
}

/// One product `C = alpha·op(A)·op(B) + beta·C` (see [`BlasShape`]) on cubecl buffers.
pub(crate) struct Gemm<'a> {
    pub shape: BlasShape,
    pub a: &'a Handle,
    pub b: &'a Handle,
    pub c: &'a Handle,
    pub ab_type: sys::cudaDataType,
    pub c_type: sys::cudaDataType,
    pub alpha: f32,
    pub beta: f32,
    /// Where `A` and `C` start in their buffers, in elements (a piece of a bigger product).
    pub a_offset: usize,
    pub c_offset: usize,
    /// The stage of the caller's cubecl work (see [`run_staged`]) this GEMM needs finished.
    pub stage: usize,
}

impl<'a> Gemm<'a> {
    /// A whole product of `A` and `B` into `C`, needing everything queued before it.
    pub(crate) fn new(shape: BlasShape, (a, b, c): (&'a Handle, &'a Handle, &'a Handle)) -> Self {
        Gemm {
            shape,
            a,
            b,
            c,
            ab_type: sys::cudaDataType::CUDA_R_16BF,
            c_type: sys::cudaDataType::CUDA_R_16BF,
            alpha: 1.0,
            beta: 0.0,
            a_offset: 0,
            c_offset: 0,
            stage: 0,
        }
    }

    /// The element types: `ab` for `A` and `B`, `c` for `C`.
    pub(crate) fn types(mut self, ab: sys::cudaDataType, c: sys::cudaDataType) -> Self {
        (self.ab_type, self.c_type) = (ab, c);
        self
    }
}

/// cuBLAS on one device. The handle and its stream are shared by every host thread (and by the
/// autotuner, which runs candidates on cubecl's device thread), so `blas` is locked from the
/// first launch until the stream has been waited for: a cuBLAS handle must not be used by two
/// threads at once, and a thread must not return while another's GEMM on its buffers is queued.
struct DeviceBlas {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Mutex<CudaBlas>,
}

fn device_blas(ordinal: usize) -> Result<Arc<DeviceBlas>, KernelError> {
    static ALL: OnceLock<Mutex<HashMap<usize, Arc<DeviceBlas>>>> = OnceLock::new();
    let mut all = ALL
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| err("cuBLAS state poisoned"))?;
    if let Some(d) = all.get(&ordinal) {
        return Ok(d.clone());
    }
    let ctx =
        CudaContext::new(ordinal).map_err(|e| err(format!("CUDA context {ordinal}: {e:?}")))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| err(format!("CUDA stream: {e:?}")))?;
    let blas = CudaBlas::new(stream.clone()).map_err(|e| err(format!("cublasCreate: {e:?}")))?;
    let d = Arc::new(DeviceBlas {
        ctx,
        stream,
        blas: Mutex::new(blas),
    });
    all.insert(ordinal, d.clone());
    Ok(d)
}

fn elem_bytes(t: sys::cudaDataType) -> usize {
    match t {
        sys::cudaDataType::CUDA_R_32F => 4,
        _ => 2,
    }
}

/// Runs `gemms` in order after everything queued on `client` so far (on any cubecl stream, for
/// the buffers they touch); every cubecl kernel queued after it sees their results. See the
/// module doc for the order.
pub(crate) fn run<R: Runtime>(
    client: &ComputeClient<R>,
    gemms: &[Gemm<'_>],
) -> Result<(), KernelError> {
    run_staged(client, gemms, 0, &mut |_| Ok(()))
}

/// [`run`] with the GEMMs' inputs still to be made: `produce(i)` queues stage `i` of `stages`
/// on cubecl's stream (stage 0 after everything queued so far), and a GEMM waits only for the
/// stages up to its own [`Gemm::stage`]. Ordered on the device, a GEMM then runs while cubecl
/// makes the next stage's input (the decode of the next rows of a weight); ordered through the
/// host, every stage is made first. `stages = 0`: nothing to make, as [`run`].
pub(crate) fn run_staged<R: Runtime>(
    client: &ComputeClient<R>,
    gemms: &[Gemm<'_>],
    stages: usize,
    produce: &mut dyn FnMut(usize) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let client = cuda_client(client).ok_or_else(|| err("cuBLAS needs the CUDA runtime"))?;
    // 1. Pointers, each with the guard that keeps its memory out of the pool until we are done.
    // (A buffer a stage writes is only held here; it is written on the device later, in order.)
    let mut held = Vec::new();
    let mut ptr = |h: &Handle, need: usize, what: &str| -> Result<u64, KernelError> {
        let r = client
            .get_resource(h.clone())
            .map_err(|e| err(format!("{what}: {e:?}")))?;
        let res = r.resource();
        if (res.size as usize) < need {
            return Err(err(format!(
                "{what} holds {} bytes, the product needs {need}",
                res.size
            )));
        }
        let p = res.ptr;
        held.push(r);
        Ok(p)
    };
    let mut launches = Vec::with_capacity(gemms.len());
    for g in gemms {
        let (ea, eb, ec) = g.shape.extents();
        let (ab, cb) = (elem_bytes(g.ab_type), elem_bytes(g.c_type));
        let a = ptr(g.a, (g.a_offset + ea) * ab, "A")? + (g.a_offset * ab) as u64;
        let b = ptr(g.b, eb * ab, "B")?;
        let c = ptr(g.c, (g.c_offset + ec) * cb, "C")? + (g.c_offset * cb) as u64;
        if stages > 0 && g.stage >= stages {
            return Err(err(format!("a GEMM needs stage {} of {stages}", g.stage)));
        }
        launches.push((a, b, c));
    }
    let Some(&(first, _, _)) = launches.first() else {
        for stage in 0..stages {
            produce(stage)?;
        }
        return Ok(());
    };
    let mut ordinal: i32 = 0;
    // SAFETY: `first` is a live device allocation of cubecl's (held above); the attribute is an int.
    unsafe {
        cudarc::driver::sys::cuPointerGetAttribute(
            &mut ordinal as *mut i32 as *mut std::ffi::c_void,
            cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            first,
        )
        .result()
        .map_err(|e| err(format!("device of a buffer: {e:?}")))?;
    }
    let dev = device_blas(ordinal as usize)?;
    let mut produced = 0;
    if crate::blas::device_ordering()? {
        let mut crossing = crate::stream_order::begin(client, ordinal as usize)?;
        // 2a. The stages, each followed by its signal (one signal when there is nothing to make).
        let mut ready = Vec::with_capacity(stages.max(1));
        for stage in 0..stages {
            produce(stage)?;
            ready.push(crossing.signal(client)?);
        }
        produced = stages;
        if stages == 0 {
            ready.push(crossing.signal(client)?);
        }
        match run_device_ordered(client, &dev, crossing, &ready, gemms, &launches) {
            Ordered::Done(result) => return result,
            Ordered::Unavailable(why) => {
                crate::blas::set_device_ordering(false);
                eprintln!(
                    "qerl: cuBLAS ordered on the device failed ({why}); ordering it through the host from now on"
                );
            }
        }
    }
    for stage in produced..stages {
        produce(stage)?;
    }
    // 2. Everything that writes or last read these buffers has finished on the device.
    cubecl::future::block_on(client.sync()).map_err(|e| err(format!("cubecl sync: {e:?}")))?;
    dev.ctx
        .bind_to_thread()
        .map_err(|e| err(format!("CUDA context: {e:?}")))?;
    // 3. No cubecl call from here on: the device thread may need this lock (a tuning pass runs
    // the cuBLAS candidate there).
    let blas = dev.blas.lock().map_err(|_| err("cuBLAS handle poisoned"))?;
    let launched = launch_all(&blas, gemms, &launches, &mut |_| Ok(()));
    let waited = dev
        .stream
        .synchronize()
        .map_err(|e| err(format!("cuBLAS stream: {e:?}")));
    drop(blas);
    // Only now may the pool hand these buffers to the next reservation.
    drop(held);
    launched.and(waited)
}

/// What [`run_device_ordered`] did.
enum Ordered {
    /// The GEMMs ran (or failed) ordered on the device; nothing of theirs is left to wait for
    /// on the host.
    Done(Result<(), KernelError>),
    /// The foreign stream could not be made to wait; no GEMM was launched.
    Unavailable(String),
}

/// Steps 2-3 without a host round trip ([`crate::stream_order`]): before each GEMM, cuBLAS's
/// stream waits on the device for the signal of the stage it needs (`ready[stage]`), and
/// cubecl's stream waits on the device for the last GEMM. The caller's buffer guards may be
/// released as soon as this returns: every later cubecl kernel, a reuse of their memory
/// included, is queued behind the wait.
fn run_device_ordered(
    client: &ComputeClient<CudaRuntime>,
    dev: &DeviceBlas,
    crossing: crate::stream_order::Crossing,
    ready: &[u32],
    gemms: &[Gemm<'_>],
    launches: &[(u64, u64, u64)],
) -> Ordered {
    use cudarc::driver::sys::{
        cuStreamWaitValue32_v2, cuStreamWriteValue32_v2, CUstreamWaitValue_flags,
        CUstreamWriteValue_flags,
    };
    let (ready_ptr, done_ptr) = match crossing.pointers(client) {
        Ok(p) => p,
        Err(e) => return Ordered::Unavailable(e.to_string()),
    };
    let Some(done) = crossing.done_value() else {
        return Ordered::Unavailable("no signal".into());
    };
    if let Err(e) = dev.ctx.bind_to_thread() {
        return Ordered::Unavailable(format!("CUDA context: {e:?}"));
    }
    let blas = match dev.blas.lock() {
        Ok(b) => b,
        Err(_) => return Ordered::Done(Err(err("cuBLAS handle poisoned"))),
    };
    let stream = dev.stream.cu_stream();
    // Before GEMM `i`: wait for its stage's signal, unless an earlier wait already covers it.
    let mut waited_for: Option<usize> = None;
    let mut wait = |i: usize| -> Result<(), KernelError> {
        let stage = gemms[i].stage.min(ready.len() - 1);
        if waited_for.is_some_and(|w| w >= stage) {
            return Ok(());
        }
        // SAFETY: `ready` is a live u32 of cubecl's on this device; the signal that sets it
        // has been launched on the GPU (`Crossing::pointers`).
        unsafe {
            cuStreamWaitValue32_v2(
                stream,
                ready_ptr,
                ready[stage],
                CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        }
        .result()
        .map_err(|e| err(format!("cuStreamWaitValue32: {e:?}")))?;
        waited_for = Some(stage);
        Ok(())
    };
    // The first wait tells whether the driver takes stream waits at all.
    if let Err(e) = wait(0) {
        return Ordered::Unavailable(e.to_string());
    }
    let launched = launch_all(&blas, gemms, launches, &mut wait);
    // SAFETY: `done` is a live u32 of cubecl's on this device. The default flag fences the
    // GEMMs' writes before this one.
    let written = unsafe {
        cuStreamWriteValue32_v2(
            stream,
            done_ptr,
            done,
            CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    }
    .result()
    .map_err(|e| err(format!("cuStreamWriteValue32: {e:?}")));
    if launched.is_err() || written.is_err() {
        // No wait is queued on cubecl's side: finish what was queued here before returning
        // (every signal it may wait for has been launched).
        let waited = dev
            .stream
            .synchronize()
            .map_err(|e| err(format!("cuBLAS stream: {e:?}")));
        return Ordered::Done(launched.and(written).and(waited));
    }
    drop(blas);
    crossing.finish(client);
    Ordered::Done(Ok(()))
}

fn op(transposed: bool) -> sys::cublasOperation_t {
    if transposed {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// Queues the GEMMs on the handle's stream, `before(i)` ahead of GEMM `i` (a stream wait); stops
/// at the first failure (the caller still waits for the ones already queued).
fn launch_all(
    blas: &CudaBlas,
    gemms: &[Gemm<'_>],
    pointers: &[(u64, u64, u64)],
    before: &mut dyn FnMut(usize) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    for (i, (g, &(a, b, c))) in gemms.iter().zip(pointers).enumerate() {
        before(i)?;
        let s = g.shape;
        let dims = [s.m, s.n, s.k, s.lda, s.ldb, s.ldc];
        if dims.iter().any(|&d| d == 0 || d > i32::MAX as usize) {
            return Err(err(format!("cuBLAS dimensions out of range: {dims:?}")));
        }
        // SAFETY: the pointers are live cubecl allocations of the checked sizes, held by the
        // caller until the stream has been waited for; alpha and beta are host f32 (the handle's
        // default pointer mode) matching CUBLAS_COMPUTE_32F.
        unsafe {
            blas::gemm_ex(
                *blas.handle(),
                op(s.trans_a),
                op(s.trans_b),
                s.m as i32,
                s.n as i32,
                s.k as i32,
                &g.alpha as *const f32 as *const _,
                a as *const _,
                g.ab_type,
                s.lda as i32,
                b as *const _,
                g.ab_type,
                s.ldb as i32,
                &g.beta as *const f32 as *const _,
                c as *mut _,
                g.c_type,
                s.ldc as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(|e| err(format!("cublasGemmEx {}x{}x{}: {e:?}", s.m, s.n, s.k)))?;
        }
    }
    Ok(())
}

/// `total` split into about `count` pieces, each but the last a multiple of `align`.
fn pieces(total: usize, count: usize, align: usize) -> Vec<std::ops::Range<usize>> {
    let step = total.div_ceil(count.max(1)).next_multiple_of(align).max(align);
    (0..total)
        .step_by(step)
        .map(|start| start..(start + step).min(total))
        .collect()
}

/// Piece boundaries sit at multiples of this many rows or columns (16-byte aligned pointers for
/// cuBLAS, whole words of codes for the decode).
const PIECE_ALIGN: usize = 64;

/// `Y[M, N] = X · deq(W)ᵀ (+ bias) (+ s·T·Bᵀ)`: `W` decoded into a dense buffer, bias and LoRA
/// folded in as extra columns ([`crate::dense`]). `lora` is `(T [M, r] f32, B [N, r] F, r, s)`;
/// the caller has checked every buffer's size.
///
/// Where `K <= N` (q/k/v, gate/up) the extra columns widen both operands and one GEMM runs over
/// `K + r + 1`: copying `X` costs less than a second pass over the wider `Y`. Where `K > N`
/// (o, down) the copy of `X` would cost more, and hold `M·K` more elements (3 GB for a 7B
/// down-projection at 80k rows), so the plain product runs first and a second GEMM over the
/// extra columns alone adds to `Y` (`beta = 1`).
///
/// The decode goes in [`crate::blas::decode_pieces`] pieces of rows of `W`; ordered on the
/// device, the GEMM of one piece's outputs runs while the next piece decodes.
pub(crate) fn forward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    weight: &DeviceWeight,
    bias: Option<&Handle>,
    lora: Option<(&Handle, &Handle, usize, f32)>,
    y: &Handle,
) -> Result<(), KernelError> {
    let ty = data_type::<F>().ok_or_else(|| err("cuBLAS runs bf16 and f16 products only"))?;
    let (n, k) = (weight.n, weight.k);
    let size = std::mem::size_of::<F>();
    let rows = pieces(n, crate::blas::decode_pieces(m, n, k), PIECE_ALIGN);
    let last = rows.len() - 1;
    // One GEMM per piece of rows of the decoded weight `w` (row stride `ld`): Y's columns.
    // (shape, A offset, C offset, stage) of each piece's GEMM
    let piece_shapes = |ld: usize| -> Vec<(BlasShape, usize, usize, usize)> {
        rows.iter()
            .enumerate()
            .map(|(i, r)| {
                let mut shape = BlasShape::forward(m, r.len(), ld);
                shape.ldc = n;
                (shape, r.start * ld, r.start, i)
            })
            .collect()
    };
    let decode = |w: &Handle, ld: usize, i: usize| {
        dense::dequantize_block::<R, F>(client, weight, w, ld, rows[i].clone(), 0..k)
    };
    if (lora.is_none() && bias.is_none()) || k > n {
        // the plain product (then the extra columns' own GEMM) on the decoded weight
        let w = client.empty(n * k * size);
        let extra = extra_operands::<R, F>(client, m, n, bias, lora)?;
        let mut gemms: Vec<Gemm<'_>> = piece_shapes(k)
            .into_iter()
            .map(|(shape, a_offset, c_offset, stage)| Gemm {
                a_offset,
                c_offset,
                stage,
                ..Gemm::new(shape, (&w, x, y)).types(ty, ty)
            })
            .collect();
        if let Some((ew, ex, ld)) = &extra {
            gemms.push(Gemm {
                beta: 1.0,
                stage: last,
                ..Gemm::new(BlasShape::forward(m, n, *ld), (ew, ex, y)).types(ty, ty)
            });
        }
        return run_staged(client, &gemms, rows.len(), &mut |i| decode(&w, k, i));
    }
    let rank = lora.map_or(0, |l| l.2);
    let (bias_w, bias_x) = match bias {
        Some(b) => (ExtraColumn::PerRow(b), ExtraColumn::Ones),
        None => (ExtraColumn::None, ExtraColumn::None),
    };
    let tail_w = lora.map(|(_, b, r, _)| (b, r, 1.0));
    let tail_x = lora.map(|(t, _, r, s)| (t, r, s));
    let ld = dense::widened_ld(k, rank, bias.is_some());
    let w = client.empty(n * ld * size);
    // columns K.. of every row now, columns ..K piece by piece below
    dense::widen::<R, F, F>(client, None, tail_w, bias_w, &w, n, k, ld)?;
    let xw = client.empty(m * ld * size);
    dense::widen::<R, F, f32>(client, Some(x), tail_x, bias_x, &xw, m, k, ld)?;
    let gemms: Vec<Gemm<'_>> = piece_shapes(ld)
        .into_iter()
        .map(|(shape, a_offset, c_offset, stage)| Gemm {
            a_offset,
            c_offset,
            stage,
            ..Gemm::new(shape, (&w, &xw, y)).types(ty, ty)
        })
        .collect();
    run_staged(client, &gemms, rows.len(), &mut |i| decode(&w, ld, i))
}

/// The two small operands of the extra columns' GEMM (`[s·T | 1 | 0..]` for the rows of `X`,
/// `[B | bias | 0..]` for the rows of `W`) and their row stride; `None` without bias and LoRA.
fn extra_operands<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    n: usize,
    bias: Option<&Handle>,
    lora: Option<(&Handle, &Handle, usize, f32)>,
) -> Result<Option<(Handle, Handle, usize)>, KernelError> {
    if lora.is_none() && bias.is_none() {
        return Ok(None);
    }
    let size = std::mem::size_of::<F>();
    let (bias_w, bias_x) = match bias {
        Some(b) => (ExtraColumn::PerRow(b), ExtraColumn::Ones),
        None => (ExtraColumn::None, ExtraColumn::None),
    };
    let ld = dense::widened_ld(0, lora.map_or(0, |l| l.2), bias.is_some());
    let extra_w = client.empty(n * ld * size);
    let tail_w = lora.map(|(_, b, r, _)| (b, r, 1.0));
    dense::widen::<R, F, F>(client, None, tail_w, bias_w, &extra_w, n, 0, ld)?;
    let extra_x = client.empty(m * ld * size);
    let tail_x = lora.map(|(t, _, r, s)| (t, r, s));
    dense::widen::<R, F, f32>(client, None, tail_x, bias_x, &extra_x, m, 0, ld)?;
    Ok(Some((extra_w, extra_x, ld)))
}

/// `Y[M, N] = X · Dᵀ (+ bias) (+ s·T·Bᵀ)` for a dense row-major `D [N, K]` in `F`, `Y` in `O`
/// (f32 allowed): the plain product, then, with bias or LoRA, a second GEMM over the extra
/// columns alone adds to `Y` (`D` is never copied). The caller has checked every buffer.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense_forward<R: Runtime, F: Float, O: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    d: &Handle,
    n: usize,
    k: usize,
    bias: Option<&Handle>,
    lora: Option<(&Handle, &Handle, usize, f32)>,
    y: &Handle,
) -> Result<(), KernelError> {
    let ty = data_type::<F>().ok_or_else(|| err("cuBLAS runs bf16 and f16 products only"))?;
    let out = output_type::<O>().ok_or_else(|| err("cuBLAS writes bf16, f16 or f32 only"))?;
    let mut gemms = vec![Gemm::new(BlasShape::forward(m, n, k), (d, x, y)).types(ty, out)];
    let extra = extra_operands::<R, F>(client, m, n, bias, lora)?;
    if let Some((ew, ex, ld)) = &extra {
        gemms.push(Gemm {
            beta: 1.0,
            ..Gemm::new(BlasShape::forward(m, n, *ld), (ew, ex, y)).types(ty, out)
        });
    }
    run(client, &gemms)
}

/// `dX[M, K] = dY[M, N] · deq(W)[N, K]` through a dense `W` and cuBLAS. The decode goes in
/// [`crate::blas::decode_pieces`] pieces of columns of `W`; ordered on the device, the GEMM of
/// one piece's columns of `dX` runs while the next piece decodes.
pub(crate) fn transposed<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    dy: &Handle,
    m: usize,
    weight: &DeviceWeight,
    dx: &Handle,
) -> Result<(), KernelError> {
    let ty = data_type::<F>().ok_or_else(|| err("cuBLAS runs bf16 and f16 products only"))?;
    let (n, k) = (weight.n, weight.k);
    let w = client.empty(n * k * std::mem::size_of::<F>());
    let cols = pieces(k, crate::blas::decode_pieces(m, k, n), PIECE_ALIGN);
    let gemms: Vec<Gemm<'_>> = cols
        .iter()
        .enumerate()
        .map(|(stage, c)| {
            let mut shape = BlasShape::transposed(m, n, c.len());
            (shape.lda, shape.ldc) = (k, k);
            Gemm {
                a_offset: c.start,
                c_offset: c.start,
                stage,
                ..Gemm::new(shape, (&w, dy, dx)).types(ty, ty)
            }
        })
        .collect();
    run_staged(client, &gemms, cols.len(), &mut |i| {
        dense::dequantize_block::<R, F>(client, weight, &w, k, 0..n, cols[i].clone())
    })
}
