//! A decode step captured once as a CUDA graph and replayed, off cubecl's launch path.
//!
//! Why: at batch 1 a 7B step is ~290 launches, and cubecl spends several microseconds of host
//! time on each (its device thread: a kernel id, a context switch, stream bookkeeping), about
//! as long as the GPU spends on the step; the host, not the GPU, then sets the pace. A graph
//! replays all of a step's launches with one call: on an H200 (2026-11-29) the 7B step at batch
//! 1 went from 3.07 ms to 2.47 with every edge programmatic (2.60 with the products' only), the
//! 32B one from 10.24 to 8.71 (9.15), with the same sampled tokens
//! (docs/benchmarks/rollout.md, sessions 34 and 35).
//!
//! How ([`StepGraph::capture`]): cubecl's stream (`cubecl_stream`) is put in capture mode
//! (`CU_STREAM_CAPTURE_MODE_RELAXED`: cubecl's device thread, not this one, issues the
//! launches), the step is enqueued as usual, a blocking cubecl call makes the device thread
//! issue it all, and the capture ends. The graph is kept only where every node is a kernel
//! (no copy, no allocation: the split-K workspaces come from a [`WorkspaceArena`] recorded
//! on an earlier run of the same step). The edges into the kernels named in `programmatic`
//! become programmatic ([`programmatic_kernels`]): such a kernel's cubes start as soon as the
//! kernel before has let them (`griddepcontrol.launch_dependents`), send what reads do not
//! depend on the step (the products' first weight loads, LoRA's `A`) and wait
//! (`griddepcontrol.wait`) before they read what the kernels before wrote.
//!
//! What a graph bakes in: every launch's grid and scalars, and every buffer's address. The
//! caller keys graphs by whatever changes them (rows, the attention's split) and drops them when
//! the weights change; the arena keeps the workspaces' addresses alive.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cudarc::driver::sys as cu;
use cudarc::driver::CudaContext;

use crate::cubecl_stream::StreamBlas;
use crate::gemm::WorkspaceArena;

/// Whether decode steps run as captured graphs: `QERL_GRAPH` (1 by default; 0 turns it off).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::device::env_knob("QERL_GRAPH", &|v| v <= 1, 1) == 1)
}

/// The entry point of the 4-bit products (`gemv_mma.cu`), whose texts wait where
/// [`texts_wait`].
pub const PRODUCT_KERNEL: &str = "qerl_gemv_mma";

/// Which edges of a captured graph are programmatic, `QERL_GRAPH_PDL`: 0 none, 1 the edges
/// into the products, 2 (the default) also those into the caller's waiting kernels.
pub fn programmatic_level() -> usize {
    static LEVEL: OnceLock<usize> = OnceLock::new();
    *LEVEL.get_or_init(|| crate::device::env_knob("QERL_GRAPH_PDL", &|v| v <= 2, 2))
}

/// The kernels whose incoming edges a capture makes programmatic ([`programmatic_level`]):
/// none, the products, or the products and `waiting` (entry points of kernels that call
/// `griddepcontrol.wait` before they read what another kernel of the step wrote).
pub fn programmatic_kernels<'a>(waiting: &[&'a str]) -> Vec<&'a str> {
    match programmatic_level() {
        0 => Vec::new(),
        1 => vec![PRODUCT_KERNEL],
        _ => std::iter::once(PRODUCT_KERNEL)
            .chain(waiting.iter().copied())
            .collect(),
    }
}

/// Whether the products' texts wait (`griddepcontrol.wait`) after their first weight loads
/// rather than load `X` first, and let the kernel after them start early: where captured
/// steps launch them programmatically.
pub(crate) fn texts_wait() -> bool {
    enabled() && programmatic_level() >= 1
}

/// cubecl's stream on one device, for a launch of ours after everything cubecl has queued.
struct OrderedStream {
    stream: cu::CUstream,
}

/// Each device's context (sm_90 only; `None` where it is another), by ordinal.
fn contexts() -> &'static Mutex<HashMap<usize, Option<Arc<CudaContext>>>> {
    static ALL: OnceLock<Mutex<HashMap<usize, Option<Arc<CudaContext>>>>> = OnceLock::new();
    ALL.get_or_init(Default::default)
}

/// Asks for `handle`'s address: the blocking call that returns once cubecl's device thread has
/// issued everything queued before it (so a launch of ours goes in after it); makes the
/// device's context current on this thread; finds cubecl's stream (`cubecl_stream`). `None`
/// where any is missing, or the device is not sm_90 (what `griddepcontrol` needs).
fn ordered_stream(client: &ComputeClient<CudaRuntime>, handle: &Handle) -> Option<OrderedStream> {
    let first = client.get_resource(handle.clone()).ok()?;
    let ptr = first.resource().ptr;
    // `first` holds the allocation live.
    let ordinal = crate::cublas::device_ordinal(ptr).ok()?;
    let ctx = contexts()
        .lock()
        .ok()?
        .entry(ordinal)
        .or_insert_with(|| {
            CudaContext::new(ordinal)
                .ok()
                .filter(|c| c.compute_capability().is_ok_and(|(major, _)| major == 9))
        })
        .clone()?;
    ctx.bind_to_thread().ok()?;
    let stream = StreamBlas::find(client, ordinal).ok()??.stream();
    (!stream.is_null()).then_some(OrderedStream { stream })
}

/// A captured step, ready to launch; it holds the workspaces its launches use.
pub struct StepGraph {
    graph: cu::CUgraph,
    exec: cu::CUgraphExec,
    /// Kernel nodes, and how many of them wait programmatically.
    pub kernels: usize,
    pub programmatic: usize,
    _workspaces: WorkspaceArena,
}

// SAFETY: the graph handles are used only through `&self`/`drop`, with the context current.
unsafe impl Send for StepGraph {}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // SAFETY: handles made by `capture`, destroyed once. A launched graph's work is
        // ordered on the stream; CUDA defers the destruction of an executing graph.
        unsafe {
            let _ = cu::cuGraphExecDestroy(self.exec);
            let _ = cu::cuGraphDestroy(self.graph);
        }
    }
}

/// Why a capture gave no graph.
#[derive(Debug)]
pub enum CaptureError {
    /// No CUDA stream of cubecl's could be found, or the device is not sm_90.
    NoStream,
    /// The step asked for other workspaces than the recording had.
    Workspaces,
    /// A node other than a kernel (a copy, an allocation), `what`.
    Node(String),
    /// A driver call failed.
    Driver(String),
}

fn check(r: cu::CUresult, what: &str) -> Result<(), CaptureError> {
    match r {
        cu::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(CaptureError::Driver(format!("{what}: {e:?}"))),
    }
}

impl StepGraph {
    /// Captures the launches `enqueue` makes on `client` (with `recorded`'s workspaces) into
    /// a graph, which has **not** run: launch it for this step. `sync` is any live buffer
    /// (asked for its address: the blocking call that drains cubecl's queue). On an error the
    /// step has not run either and its launches may have failed; the caller runs it again the
    /// usual way.
    pub fn capture<E>(
        client: &ComputeClient<CudaRuntime>,
        sync: &Handle,
        recorded: WorkspaceArena,
        programmatic: &[&str],
        enqueue: impl FnOnce() -> Result<(), E>,
    ) -> Result<Result<StepGraph, CaptureError>, E> {
        // Everything queued so far goes out before the capture starts.
        let Some(on) = ordered_stream(client, sync) else {
            return Ok(Err(CaptureError::NoStream));
        };
        let stream = on.stream;
        // SAFETY: cubecl's live stream of the current context.
        if let Err(e) = check(
            unsafe {
                cu::cuStreamBeginCapture_v2(
                    stream,
                    cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                )
            },
            "cuStreamBeginCapture",
        ) {
            return Ok(Err(e));
        }
        WorkspaceArena::replay(recorded);
        let enqueued = enqueue();
        // The device thread issues the step into the capture.
        let drained = client.get_resource(sync.clone()).is_ok();
        let (arena, same) = WorkspaceArena::finish();
        let mut graph: cu::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream whose capture began above.
        let ended = check(
            unsafe { cu::cuStreamEndCapture(stream, &mut graph) },
            "cuStreamEndCapture",
        );
        let made = (|| {
            ended?;
            if !drained {
                return Err(CaptureError::Driver("draining cubecl's queue".into()));
            }
            if !same {
                return Err(CaptureError::Workspaces);
            }
            // SAFETY: the graph the capture made.
            unsafe { finish(graph, arena, programmatic) }
        })();
        if made.is_err() && !graph.is_null() {
            // SAFETY: the capture's graph, not instantiated (a made one owns and drops it).
            unsafe {
                let _ = cu::cuGraphDestroy(graph);
            }
        }
        // A step that could not be enqueued is the caller's error, whatever was captured.
        enqueued.map(|()| made)
    }

    /// Launches the step after everything queued on `client` so far (`sync` as in
    /// [`StepGraph::capture`]). `false`: nothing launched.
    pub fn launch(&self, client: &ComputeClient<CudaRuntime>, sync: &Handle) -> bool {
        let Some(on) = ordered_stream(client, sync) else {
            return false;
        };
        // SAFETY: an instantiated graph and cubecl's live stream of the current context.
        unsafe { cu::cuGraphLaunch(self.exec, on.stream) == cu::CUresult::CUDA_SUCCESS }
    }
}

/// Checks the captured `graph` (kernels only), makes the edges into the products programmatic
/// where asked, and instantiates it.
///
/// # Safety
/// `graph` is a live graph of the current context.
unsafe fn finish(
    graph: cu::CUgraph,
    arena: WorkspaceArena,
    programmatic: &[&str],
) -> Result<StepGraph, CaptureError> {
    let mut count = 0usize;
    // SAFETY: the caller's graph; first the count, then the nodes.
    check(
        unsafe { cu::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) },
        "cuGraphGetNodes",
    )?;
    let mut nodes = vec![std::ptr::null_mut(); count];
    check(
        unsafe { cu::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) },
        "cuGraphGetNodes",
    )?;
    let mut waiting = 0usize;
    let skip = skipped_kernels();
    let skip: Vec<&str> = skip.iter().map(String::as_str).collect();
    let mut off = Vec::new();
    for &node in &nodes {
        let mut kind = cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        check(
            unsafe { cu::cuGraphNodeGetType(node, &mut kind) },
            "cuGraphNodeGetType",
        )?;
        if kind != cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            return Err(CaptureError::Node(format!("{kind:?}")));
        }
        let name = kernel_name(node)?;
        if named(&name, programmatic) {
            waiting += unsafe { programmatic_edges(graph, node) }?;
        }
        if named(&name, &skip) {
            off.push(node);
        }
    }
    let mut exec: cu::CUgraphExec = std::ptr::null_mut();
    check(
        unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
        "cuGraphInstantiate",
    )?;
    for node in off {
        // SAFETY: a kernel node of the graph `exec` was instantiated from.
        let disabled = check(
            unsafe { cu::cuGraphNodeSetEnabled(exec, node, 0) },
            "cuGraphNodeSetEnabled",
        );
        if let Err(e) = disabled {
            // SAFETY: the instantiation above; the caller destroys `graph`.
            unsafe {
                let _ = cu::cuGraphExecDestroy(exec);
            }
            return Err(e);
        }
    }
    Ok(StepGraph {
        graph,
        exec,
        kernels: count,
        programmatic: waiting,
        _workspaces: arena,
    })
}

/// Kernels left out of every replay, `QERL_GRAPH_SKIP` (entry points between `,` or `+`; none
/// by default): an experiment that measures what a kernel costs inside a replayed step, whose
/// outputs are then wrong.
fn skipped_kernels() -> &'static [String] {
    static SKIP: OnceLock<Vec<String>> = OnceLock::new();
    SKIP.get_or_init(|| {
        std::env::var("QERL_GRAPH_SKIP")
            .map(|v| {
                v.split([',', '+'])
                    .map(str::trim)
                    .filter(|k| !k.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Whether `name` is one of `kernels`' entry points (cubecl's carry type suffixes after an
/// underscore).
fn named(name: &[u8], kernels: &[&str]) -> bool {
    kernels.iter().any(|k| {
        name.strip_prefix(k.as_bytes())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(b"_"))
    })
}

/// The entry point a kernel node runs (empty where the driver names none).
fn kernel_name(node: cu::CUgraphNode) -> Result<Vec<u8>, CaptureError> {
    // SAFETY: a zeroed parameter block is valid for the driver to fill.
    let mut p: cu::CUDA_KERNEL_NODE_PARAMS_v2 = unsafe { std::mem::zeroed() };
    check(
        unsafe { cu::cuGraphKernelNodeGetParams_v2(node, &mut p) },
        "cuGraphKernelNodeGetParams",
    )?;
    if p.func.is_null() {
        return Ok(Vec::new());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    check(
        unsafe { cu::cuFuncGetName(&mut name, p.func) },
        "cuFuncGetName",
    )?;
    if name.is_null() {
        return Ok(Vec::new());
    }
    // SAFETY: the driver's NUL-terminated name of a live function.
    Ok(unsafe { std::ffi::CStr::from_ptr(name) }
        .to_bytes()
        .to_vec())
}

/// Replaces `node`'s incoming edges from kernel nodes by programmatic ones; returns how many.
///
/// # Safety
/// `node` is a node of `graph`, live.
unsafe fn programmatic_edges(
    graph: cu::CUgraph,
    node: cu::CUgraphNode,
) -> Result<usize, CaptureError> {
    let mut n = 0usize;
    check(
        unsafe {
            cu::cuGraphNodeGetDependencies_v2(
                node,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut n,
            )
        },
        "cuGraphNodeGetDependencies",
    )?;
    let mut from = vec![std::ptr::null_mut(); n];
    // SAFETY: zeroed edge data is the default edge.
    let mut data: Vec<cu::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; n];
    check(
        unsafe {
            cu::cuGraphNodeGetDependencies_v2(node, from.as_mut_ptr(), data.as_mut_ptr(), &mut n)
        },
        "cuGraphNodeGetDependencies",
    )?;
    let mut made = 0;
    for (&f, d) in from.iter().zip(&data) {
        let mut kind = cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        check(
            unsafe { cu::cuGraphNodeGetType(f, &mut kind) },
            "cuGraphNodeGetType",
        )?;
        if kind != cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL || d.type_ != 0 {
            continue;
        }
        check(
            unsafe { cu::cuGraphRemoveDependencies_v2(graph, &f, &node, d, 1) },
            "cuGraphRemoveDependencies",
        )?;
        let edge = cu::CUgraphEdgeData {
            from_port: cu::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
            to_port: 0,
            type_: cu::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
            reserved: [0; 5],
        };
        check(
            unsafe { cu::cuGraphAddDependencies_v2(graph, &f, &node, &edge, 1) },
            "cuGraphAddDependencies",
        )?;
        made += 1;
    }
    Ok(made)
}
