//! cuBLAS on cubecl's buffers: the vendor half of the "dequantize, then GEMM" strategy.
//!
//! cubecl 0.10 emits no `wgmma`, so on Hopper its tensor-core kernels reach a fraction of the
//! chip's bf16 rate; cuBLAS reaches most of it. For large M the decode of a 4-bit weight into a
//! dense buffer ([`crate::dense`]) is cheap next to the product, so decoding once and handing the
//! product to cuBLAS wins. libcublas is loaded at run time (cudarc's dynamic loading, the same
//! way cubecl-cuda loads the driver and NVRTC); without it this path reports itself unavailable.
//!
//! Where cubecl's CUDA stream can be found ([`crate::cubecl_stream`], through CUPTI), the GEMMs
//! are queued on it after the buffers' pointers are taken (`get_resource`, which flushes
//! cubecl's queue and, for a buffer last used on another cubecl stream, queues a wait for it),
//! and nobody waits. Otherwise (cubecl does not expose its stream) the two sides are ordered
//! through the host, in this order ([`run`]):
//! 1. take every buffer's device pointer (`get_resource`), which holds its memory and, for a
//!    buffer last used on another cubecl stream (another host thread's `StreamId`), queues a wait
//!    for that stream on the caller's;
//! 2. wait for the caller's cubecl stream, which now covers those waits too (a sync taken
//!    before step 1, as this module first did, left another thread's producer unwaited);
//! 3. run the GEMMs on our stream (same primary context, same device memory) under the
//!    device's lock (one cuBLAS handle and stream serve every thread) and wait for them, also
//!    when a launch fails, before any pointer is released to cubecl's pool.
//!
//! The handles keep cuBLAS's default workspace. A 32 MiB one of our own (NVIDIA's advice for
//! Hopper, what torch sets) changed no kernel choice on the update's shapes, and with it the
//! strategy stress test read non-finite f16 outputs at 264 rows on both paths (H200,
//! 2026-11-28: three of seven runs of its f16 test failed with it, none of three on cubecl's
//! stream without it).
//!
//! The autotuner times these syncs as part of the strategy, so it is picked only where it still
//! wins.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cudarc::cublas::{result as blas, sys, CudaBlas};
use cudarc::driver::{CudaContext, CudaStream};

use crate::cubecl_stream::StreamBlas;
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
pub(crate) fn output_type<O: 'static>() -> Option<sys::cudaDataType> {
    match TypeId::of::<O>() == TypeId::of::<f32>() {
        true => Some(sys::cudaDataType::CUDA_R_32F),
        false => data_type::<O>(),
    }
}

/// The ordinal of the device that holds `ptr`, a live device allocation (cubecl's).
pub(crate) fn device_ordinal(ptr: u64) -> Result<usize, cudarc::driver::DriverError> {
    let mut ordinal: i32 = 0;
    // SAFETY: the caller's live device pointer; the attribute is an int.
    unsafe {
        cudarc::driver::sys::cuPointerGetAttribute(
            &mut ordinal as *mut i32 as *mut std::ffi::c_void,
            cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
        .result()?;
    }
    Ok(ordinal as usize)
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
    /// Several products of one shape at fixed strides (`None`: one product at offset 0).
    pub batched: Option<Batched>,
}

/// `count` products, the `i`-th on `A`, `B`, `C` at `offsets + i·strides` elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Batched {
    pub count: usize,
    pub offsets: [usize; 3],
    pub strides: [usize; 3],
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
/// the buffers they touch); returns when they are done. See the module doc for the order.
pub(crate) fn run<R: Runtime>(
    client: &ComputeClient<R>,
    gemms: &[Gemm<'_>],
) -> Result<(), KernelError> {
    let client = cuda_client(client).ok_or_else(|| err("cuBLAS needs the CUDA runtime"))?;
    // 1. Pointers, each with the guard that keeps its memory out of the pool until we are done.
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
        let bt = g.batched.unwrap_or(Batched {
            count: 1,
            offsets: [0; 3],
            strides: [0; 3],
        });
        // the last product's start plus its extent
        let end = |e: usize, i: usize| bt.offsets[i] + (bt.count - 1) * bt.strides[i] + e;
        let a = ptr(g.a, end(ea, 0) * ab, "A")? + (bt.offsets[0] * ab) as u64;
        let b = ptr(g.b, end(eb, 1) * ab, "B")? + (bt.offsets[1] * ab) as u64;
        let c = ptr(g.c, end(ec, 2) * cb, "C")? + (bt.offsets[2] * cb) as u64;
        launches.push((a, b, c));
    }
    let Some(&(first, _, _)) = launches.first() else {
        return Ok(());
    };
    // `first` is a live device allocation of cubecl's (held above).
    let ordinal = device_ordinal(first).map_err(|e| err(format!("device of a buffer: {e:?}")))?;
    let dev = device_blas(ordinal)?;
    dev.ctx
        .bind_to_thread()
        .map_err(|e| err(format!("CUDA context: {e:?}")))?;
    let on_stream = match HOST_ORDERED.load(Ordering::Acquire) {
        0 => StreamBlas::find(client, ordinal)?,
        _ => None,
    };
    if let Some(on_stream) = on_stream {
        let bytes = held.iter().map(|r| r.resource().size).sum();
        let held = held
            .into_iter()
            .map(|r| Box::new(r) as Box<dyn Send>)
            .collect();
        return on_stream.enqueue(held, bytes, |h| launch_all(h, gemms, &launches));
    }
    // 2. Everything that writes or last read these buffers has finished on the device.
    cubecl::future::block_on(client.sync()).map_err(|e| err(format!("cubecl sync: {e:?}")))?;
    // 3. No cubecl call from here on: the device thread may need this lock (a tuning pass runs
    // the cuBLAS candidate there).
    let blas = dev.blas.lock().map_err(|_| err("cuBLAS handle poisoned"))?;
    let launched = launch_all(*blas.handle(), gemms, &launches);
    let waited = dev
        .stream
        .synchronize()
        .map_err(|e| err(format!("cuBLAS stream: {e:?}")));
    drop(blas);
    // Only now may the pool hand these buffers to the next reservation.
    drop(held);
    launched.and(waited)
}

/// Callers inside [`host_ordered`]: while any runs, every crossing takes the host-ordered path.
static HOST_ORDERED: AtomicUsize = AtomicUsize::new(0);

/// Runs `f` with cuBLAS ordered through the host (for every thread while it runs). The
/// autotuner's products (`QERL_GEMM=tuned`) run this way: they were verified on that path, and
/// the one failure seen under them with cuBLAS on cubecl's stream (H200, 2026-11-28, f16,
/// M = 264) came with a 32 MiB cuBLAS workspace that was later found to corrupt f16 products
/// on the host-ordered path too (the workspace is gone; see the module doc). Tuning is opt-in
/// and rare, so it keeps the path it was verified on until it is run again on a GPU.
pub(crate) fn host_ordered<T>(f: impl FnOnce() -> T) -> T {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            HOST_ORDERED.fetch_sub(1, Ordering::AcqRel);
        }
    }
    HOST_ORDERED.fetch_add(1, Ordering::AcqRel);
    let _leave = Leave;
    f()
}

fn op(transposed: bool) -> sys::cublasOperation_t {
    if transposed {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// Queues the GEMMs on the handle's stream; stops at the first failure (the caller still waits
/// for the ones already queued).
fn launch_all(
    handle: sys::cublasHandle_t,
    gemms: &[Gemm<'_>],
    pointers: &[(u64, u64, u64)],
) -> Result<(), KernelError> {
    for (g, &(a, b, c)) in gemms.iter().zip(pointers) {
        let s = g.shape;
        let dims = [s.m, s.n, s.k, s.lda, s.ldb, s.ldc];
        if dims.iter().any(|&d| d == 0 || d > i32::MAX as usize) {
            return Err(err(format!("cuBLAS dimensions out of range: {dims:?}")));
        }
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let (alpha, beta) = (
            &g.alpha as *const f32 as *const _,
            &g.beta as *const f32 as *const _,
        );
        let what = |e| err(format!("cuBLAS GEMM {}x{}x{}: {e:?}", s.m, s.n, s.k));
        // SAFETY: the pointers are live cubecl allocations of the checked sizes (every product
        // of a batch included), held by the caller until the stream has been waited for; alpha
        // and beta are host f32 (the handle's default pointer mode) matching CUBLAS_COMPUTE_32F.
        unsafe {
            match g.batched {
                None => blas::gemm_ex(
                    handle,
                    op(s.trans_a),
                    op(s.trans_b),
                    s.m as i32,
                    s.n as i32,
                    s.k as i32,
                    alpha,
                    a as *const _,
                    g.ab_type,
                    s.lda as i32,
                    b as *const _,
                    g.ab_type,
                    s.ldb as i32,
                    beta,
                    c as *mut _,
                    g.c_type,
                    s.ldc as i32,
                    compute,
                    algo,
                )
                .map_err(what)?,
                Some(bt) => blas::gemm_strided_batched_ex(
                    handle,
                    op(s.trans_a),
                    op(s.trans_b),
                    s.m as i32,
                    s.n as i32,
                    s.k as i32,
                    alpha,
                    a as *const _,
                    g.ab_type,
                    s.lda as i32,
                    bt.strides[0] as i64,
                    b as *const _,
                    g.ab_type,
                    s.ldb as i32,
                    bt.strides[1] as i64,
                    beta,
                    c as *mut _,
                    g.c_type,
                    s.ldc as i32,
                    bt.strides[2] as i64,
                    bt.count as i32,
                    compute,
                    algo,
                )
                .map_err(what)?,
            }
        }
    }
    Ok(())
}

/// `Y[M, N] = X · deq(W)ᵀ (+ bias) (+ s·T·Bᵀ)`: `W` decoded into a dense buffer, bias and LoRA
/// folded in as extra columns ([`crate::dense`]). `lora` is `(T [M, r] f32, B [N, r] F, r, s)`;
/// the caller has checked every buffer's size.
///
/// Where `K <= N` (q/k/v, gate/up) the extra columns widen both operands and one GEMM runs over
/// `K + r + 1`: copying `X` costs less than a second pass over the wider `Y`. Where `K > N`
/// (o, down) the copy of `X` would cost more, and hold `M·K` more elements (3 GB for a 7B
/// down-projection at 80k rows), so the plain product runs first and a second GEMM over the
/// extra columns alone adds to `Y` (`beta = 1`).
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
    if (lora.is_none() && bias.is_none()) || k > n {
        // the plain product (then the extra columns' own GEMM) on the decoded weight
        let w = client.empty(n * k * size);
        dense::dequantize_rows::<R, F>(client, weight, &w, k)?;
        return dense_forward::<R, F, F>(client, x, m, &w, n, k, bias, lora, y);
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
    dense::dequantize_rows::<R, F>(client, weight, &w, ld)?;
    dense::widen::<R, F, F>(client, None, tail_w, bias_w, &w, n, k, ld)?;
    let xw = client.empty(m * ld * size);
    dense::widen::<R, F, f32>(client, Some(x), tail_x, bias_x, &xw, m, k, ld)?;
    let gemm = Gemm {
        shape: BlasShape::forward(m, n, ld),
        a: &w,
        b: &xw,
        c: y,
        ab_type: ty,
        c_type: ty,
        alpha: 1.0,
        beta: 0.0,
        batched: None,
    };
    run(client, &[gemm])
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
    let gemm = |ld: usize, a, b, beta| Gemm {
        shape: BlasShape::forward(m, n, ld),
        a,
        b,
        c: y,
        ab_type: ty,
        c_type: out,
        alpha: 1.0,
        beta,
        batched: None,
    };
    if lora.is_none() && bias.is_none() {
        return run(client, &[gemm(k, d, x, 0.0)]);
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
    run(
        client,
        &[gemm(k, d, x, 0.0), gemm(ld, &extra_w, &extra_x, 1.0)],
    )
}

/// `dX[M, K] = dY[M, N] · deq(W)[N, K]` through a dense `W` and cuBLAS.
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
    dense::dequantize_rows::<R, F>(client, weight, &w, k)?;
    let gemm = Gemm {
        shape: BlasShape::transposed(m, n, k),
        a: &w,
        b: dy,
        c: dx,
        ab_type: ty,
        c_type: ty,
        alpha: 1.0,
        beta: 0.0,
        batched: None,
    };
    run(client, &[gemm])
}
