//! [`NcclComm`]: one process per GPU; the gradient all-reduce through NCCL (cudarc's bindings,
//! libnccl loaded at run time), everything else through the rank's [`TcpComm`], which also
//! carries NCCL's unique id from rank 0 to the others.
//!
//! NCCL itself waits forever for a rank that never calls a collective. So each all-reduce
//! first passes a TCP barrier, which names a rank that died or hangs (see [`TcpComm`]); the
//! NCCL operation is then awaited by polling an event until the timeout, after which the
//! communicator is aborted and the error says so. NCCL's all-reduce leaves bit-identical
//! results on every rank (the reduced chunks are broadcast), so the ranks' weights stay equal.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::tcp::TcpComm;
use super::{CommError, Communicator};

/// One rank of an NCCL group.
pub struct NcclComm {
    tcp: TcpComm,
    comm: Comm,
    stream: Arc<CudaStream>,
    timeout: Duration,
}

fn nccl(what: &str) -> impl FnOnce(cudarc::nccl::result::NcclError) -> CommError + '_ {
    move |e| CommError::Nccl(format!("{what}: {e:?}"))
}

fn cuda(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CommError + '_ {
    move |e| CommError::Nccl(format!("{what}: {e:?}"))
}

impl NcclComm {
    /// Joins the TCP group at `master`, then the NCCL group on GPU `local_rank`.
    pub fn connect(
        rank: usize,
        world: usize,
        local_rank: usize,
        master: &str,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let tcp = TcpComm::connect(rank, world, master, timeout)?;
        let mine: Vec<u8> = if rank == 0 {
            let id = Id::new().map_err(nccl("ncclGetUniqueId"))?;
            id.internal().iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        let ids = tcp.all_gather(&mine)?;
        let raw = &ids[0];
        if raw.len() != 128 {
            return Err(CommError::Remote(format!(
                "rank 0 sent an NCCL id of {} bytes",
                raw.len()
            )));
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, &s) in internal.iter_mut().zip(raw) {
            *d = s as std::ffi::c_char;
        }
        let ctx = CudaContext::new(local_rank).map_err(cuda("cannot open the GPU"))?;
        let stream = ctx.new_stream().map_err(cuda("cannot create a stream"))?;
        // every rank has the id: all of them call ncclCommInitRank now
        let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal))
            .map_err(nccl("ncclCommInitRank"))?;
        Ok(NcclComm {
            tcp,
            comm,
            stream,
            timeout,
        })
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }

    fn world_size(&self) -> usize {
        self.tcp.world_size()
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        if data.is_empty() {
            return self.tcp.barrier();
        }
        // every rank is here (or the barrier names the one that is not)
        self.tcp.barrier()?;
        let mut buf = self
            .stream
            .clone_htod(&*data)
            .map_err(cuda("copy to the GPU"))?;
        self.comm
            .all_reduce_in_place(&mut buf, &ReduceOp::Sum)
            .map_err(nccl("ncclAllReduce"))?;
        let done = self
            .stream
            .record_event(None)
            .map_err(cuda("record an event"))?;
        let deadline = Instant::now() + self.timeout;
        while !done.is_complete() {
            if Instant::now() >= deadline {
                return Err(CommError::Nccl(format!(
                    "an all-reduce of {} values did not complete within {:?}: a rank died or hangs inside NCCL",
                    data.len(),
                    self.timeout
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        self.stream
            .memcpy_dtoh(&buf, data)
            .map_err(cuda("copy from the GPU"))?;
        self.stream.synchronize().map_err(cuda("synchronize"))
    }

    fn all_gather(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.tcp.all_gather(local)
    }
}
