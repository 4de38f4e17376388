//! Data-parallel training: the [`Communicator`] the trainer talks to, and its implementations.
//!
//! | implementation | where | what |
//! | --- | --- | --- |
//! | [`Single`] | one process | world size 1, every collective a no-op (the plain trainer) |
//! | [`local::LocalComm`] | threads of one process | CPU tests: world size N through shared memory |
//! | [`tcp::TcpComm`] | processes, one host or several | rendezvous at rank 0 (torchrun's `MASTER_ADDR` / `MASTER_PORT`), small gathers, CPU all-reduce |
//! | `nccl::NcclComm` (feature `cuda`) | one process per GPU | gradients all-reduced by NCCL, the rest over [`tcp::TcpComm`] |
//!
//! Every collective is called by every rank in the same order with the same operation; a rank
//! that does not arrive within the communicator's timeout, or whose process ends, makes every
//! other rank's collective fail with a [`CommError`] naming it.

pub mod launch;
pub mod local;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod tcp;

use std::time::Duration;

use serde::{de::DeserializeOwned, Serialize};

/// Why a collective failed.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Some ranks did not reach a collective in time: they died, hang, or run other code.
    #[error("{} did not reach collective #{seq} ({op}) within {timeout:?} (died, hung or diverged)", ranks_text(.ranks))]
    Timeout {
        ranks: Vec<usize>,
        op: String,
        seq: u64,
        timeout: Duration,
    },
    /// A rank's process or thread ended (its connection closed) before the collective.
    #[error("rank {rank} left the run before collective #{seq} ({op})")]
    PeerGone { rank: usize, op: String, seq: u64 },
    /// Ranks called different collectives at the same point: a bug in the caller.
    #[error("collective #{seq}: rank {rank} called `{theirs}` where this rank called `{ours}`")]
    Mismatch {
        rank: usize,
        seq: u64,
        ours: String,
        theirs: String,
    },
    /// Another rank reported the failure (the message names the rank at fault).
    #[error("{0}")]
    Remote(String),
    /// Setting up the group (addresses, ranks, world size).
    #[error("cannot set up the process group: {0}")]
    Setup(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("NCCL: {0}")]
    Nccl(String),
}

fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// The collectives data-parallel training needs. Results are identical on every rank (bit for
/// bit: reductions add the ranks' values in rank order), so every rank keeps the same weights.
pub trait Communicator {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum over ranks, in place. Every rank passes the same length.
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError>;
    /// Every rank's bytes (any length), in rank order.
    fn all_gather(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, CommError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError> {
        self.all_gather(&[]).map(drop)
    }
}

/// World size 1: the plain single-process trainer.
#[derive(Clone, Copy, Debug, Default)]
pub struct Single;

impl Communicator for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }
    fn all_gather(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        Ok(vec![local.to_vec()])
    }
}

/// Gathers a serializable value from every rank (JSON on the wire: these are small host
/// records such as per-sample rewards), in rank order.
pub fn gather_json<T: Serialize + DeserializeOwned>(
    comm: &dyn Communicator,
    value: &T,
) -> Result<Vec<T>, CommError> {
    let bytes = serde_json::to_vec(value).expect("host records serialize");
    comm.all_gather(&bytes)?
        .iter()
        .enumerate()
        .map(|(rank, b)| {
            serde_json::from_slice(b).map_err(|e| {
                CommError::Remote(format!("rank {rank} sent an unreadable record: {e}"))
            })
        })
        .collect()
}

/// Whether any rank passes `true` (e.g. a Ctrl-C seen by one rank stops all of them).
pub fn any(comm: &dyn Communicator, flag: bool) -> Result<bool, CommError> {
    if comm.world_size() == 1 {
        return Ok(flag);
    }
    Ok(comm.all_gather(&[flag as u8])?.iter().any(|b| b == &[1]))
}

/// The slice `[start, end)` of `n` items that `rank` of `world` owns: contiguous, in rank
/// order, sizes differing by at most one (the first `n % world` ranks take one more).
pub fn shard(n: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let (base, extra) = (n / world, n % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Sums `f32` vectors of equal length in rank order (what every implementation that reduces on
/// the host does, so that all ranks get the same bits).
pub(crate) fn sum_in_rank_order(parts: &[Vec<u8>], out: &mut [f32]) -> Result<(), CommError> {
    for (rank, p) in parts.iter().enumerate() {
        if p.len() != out.len() * 4 {
            return Err(CommError::Remote(format!(
                "rank {rank} reduced {} values where this rank has {}",
                p.len() / 4,
                out.len()
            )));
        }
    }
    for (i, o) in out.iter_mut().enumerate() {
        let mut s = 0f32;
        for p in parts {
            s += f32::from_le_bytes(p[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        }
        *o = s;
    }
    Ok(())
}

pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_in_order() {
        for n in 0..9 {
            for w in 1..5 {
                let parts: Vec<_> = (0..w).map(|r| shard(n, r, w)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[w - 1].end, n);
                for p in parts.windows(2) {
                    assert_eq!(p[0].end, p[1].start);
                    assert!(p[0].len() >= p[1].len() && p[0].len() <= p[1].len() + 1);
                }
            }
        }
    }

    #[test]
    fn timeout_names_the_ranks() {
        let e = CommError::Timeout {
            ranks: vec![1, 3],
            op: "all_gather".into(),
            seq: 7,
            timeout: Duration::from_secs(2),
        };
        assert!(e
            .to_string()
            .starts_with("ranks 1, 3 did not reach collective #7"));
    }
}
