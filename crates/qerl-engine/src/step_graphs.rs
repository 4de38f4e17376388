//! Decode steps replayed as CUDA graphs (CUDA sm_90, at most [`MAX_ROWS`] rows; `QERL_GRAPH=0`
//! turns it off; `qerl_kernels::graph` says why and how): the first step of a [`StepKey`] runs
//! as usual and records its split-K workspaces, the second is captured on those workspaces and
//! launched as a graph, the later ones replay it.
//! Anything else (another runtime, the switch off, a capture that failed) runs the step the
//! usual way.
//!
//! A graph holds the addresses of every buffer its step reads and writes, so those must live as
//! long as the graph: the engine's weights, workspaces, KV cache and its slots' tokens and
//! positions (`Engine::generate` resets those two in place; until session 35 it allocated them
//! per call, and a graph captured in one call read the previous call's freed buffers in the
//! next).

use std::collections::HashMap;

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::EngineError;

/// Most rows a captured step has: the batch-1 decode the graphs are for, whose launches are
/// cubecl kernels only. Past it the products may cross to cuBLAS on cubecl's stream, which
/// records and waits on events, not capturable (a batch-64 run hung, H200, 2026-11-29); and
/// there the GPU, not the host, sets the pace anyway.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const MAX_ROWS: usize = 8;

/// What a decode pass's launches depend on besides the device buffers: rows, logit rows, the
/// attention's splits and span (`crate::forward::pass_key`).
pub(crate) type StepKey = (usize, usize, usize, usize);

/// The graphs of one engine's decode steps, by key; dropped when its weights change.
#[derive(Default)]
pub(crate) struct StepGraphs {
    #[cfg(feature = "cuda")]
    recorded: HashMap<StepKey, qerl_kernels::gemm::WorkspaceArena>,
    #[cfg(feature = "cuda")]
    ready: HashMap<StepKey, qerl_kernels::graph::StepGraph>,
    #[cfg(not(feature = "cuda"))]
    ready: HashMap<StepKey, ()>,
    /// Why graphs were turned off for this engine, after a failure.
    pub off: Option<String>,
    /// Steps captured, and replayed.
    pub captured: usize,
    pub replayed: usize,
    /// The last captured graph's kernels and programmatic edges.
    pub last: Option<(usize, usize)>,
}

impl StepGraphs {
    /// Forgets every graph (the buffers they baked in may change).
    pub fn clear(&mut self) {
        #[cfg(feature = "cuda")]
        self.recorded.clear();
        self.ready.clear();
    }

    /// Runs one decode pass of key `key`, which `forward` enqueues: replayed, captured, or as
    /// usual. `sync` is any live buffer of the engine's.
    pub fn run<R: Runtime>(
        &mut self,
        client: &ComputeClient<R>,
        key: StepKey,
        sync: &Handle,
        mut forward: impl FnMut() -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        #[cfg(feature = "cuda")]
        {
            use qerl_kernels::gemm::WorkspaceArena;
            use qerl_kernels::graph::{programmatic_kernels, StepGraph};
            let cuda = (client as &dyn std::any::Any)
                .downcast_ref::<ComputeClient<qerl_kernels::runtime::CudaRuntime>>();
            let wanted = qerl_kernels::graph::enabled() && self.off.is_none() && key.0 <= MAX_ROWS;
            let Some(cuda) = cuda.filter(|_| wanted) else {
                return forward();
            };
            if let Some(g) = self.ready.get(&key) {
                if g.launch(cuda, sync) {
                    self.replayed += 1;
                    return Ok(());
                }
                self.off = Some("a graph launch failed".into());
                return forward();
            }
            if let Some(arena) = self.recorded.remove(&key) {
                let waiting = programmatic_kernels(&crate::kernels::WAITING_KERNELS);
                match StepGraph::capture(cuda, sync, arena, &waiting, &mut forward)? {
                    Ok(g) => {
                        if g.launch(cuda, sync) {
                            self.captured += 1;
                            self.last = Some((g.kernels, g.programmatic));
                            self.ready.insert(key, g);
                            return Ok(());
                        }
                        self.off = Some("a captured graph's first launch failed".into());
                    }
                    Err(e) => self.off = Some(format!("capture: {e:?}")),
                }
                return forward();
            }
            WorkspaceArena::record();
            let ran = forward();
            let (arena, _) = WorkspaceArena::finish();
            self.recorded.insert(key, arena);
            ran
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (client, key, sync);
            forward()
        }
    }
}
