//! [`LocalComm`]: a world of N ranks as threads of one process (CPU tests of data-parallel
//! training). Every collective is one *round*: each rank deposits its bytes, the last to
//! arrive publishes all of them, each rank takes its copy, and the round is cleared once every
//! rank has taken it. A rank that does not arrive within the timeout is named; a rank whose
//! communicator is dropped (its thread returned or panicked) is named at once.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{f32_bytes, sum_in_rank_order, CommError, Communicator};

/// One rank of an in-process world; create the whole world with [`local_world`].
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
    /// Collectives this rank has entered (for error messages).
    seq: std::cell::Cell<u64>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

struct Published {
    round: u64,
    parts: Arc<Vec<(String, Vec<u8>)>>,
    taken: Vec<bool>,
}

struct State {
    /// The round being filled.
    round: u64,
    /// `(operation, bytes)` of each rank in the round being filled.
    slots: Vec<Option<(String, Vec<u8>)>>,
    /// The completed round, until every rank has taken it.
    published: Option<Published>,
    gone: Vec<bool>,
}

/// `world` communicators sharing one state; collectives wait at most `timeout` for the others.
pub fn local_world(world: usize, timeout: Duration) -> Vec<LocalComm> {
    assert!(world > 0, "a world has at least one rank");
    let shared = Arc::new(Shared {
        world,
        timeout,
        state: Mutex::new(State {
            round: 0,
            slots: vec![None; world],
            published: None,
            gone: vec![false; world],
        }),
        changed: Condvar::new(),
    });
    (0..world)
        .map(|rank| LocalComm {
            rank,
            shared: shared.clone(),
            seq: std::cell::Cell::new(0),
        })
        .collect()
}

impl LocalComm {
    fn lock(&self) -> MutexGuard<'_, State> {
        // a rank that panicked while holding the lock left consistent data (no partial writes)
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the condition variable until `ready`, failing after the deadline with the
    /// ranks `missing` names, or at once when one of them is gone.
    fn wait_until<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        deadline: Instant,
        op: &str,
        ready: impl Fn(&State) -> bool,
        missing: impl Fn(&State) -> Vec<usize>,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        let seq = self.seq.get();
        while !ready(&st) {
            let miss = missing(&st);
            if let Some(&rank) = miss.iter().find(|&&r| st.gone[r]) {
                return Err(CommError::PeerGone {
                    rank,
                    op: op.into(),
                    seq,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    ranks: miss,
                    op: op.into(),
                    seq,
                    timeout: self.shared.timeout,
                });
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(st)
    }

    fn exchange(&self, op: &str, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        let deadline = Instant::now() + self.shared.timeout;
        let world = self.shared.world;
        let st = self.lock();
        // the previous round must be taken by everyone before its slots are reused
        let mut st = self.wait_until(
            st,
            deadline,
            op,
            |s| s.published.is_none(),
            |s| match &s.published {
                Some(p) => (0..world).filter(|&r| !p.taken[r]).collect(),
                None => Vec::new(),
            },
        )?;
        let round = st.round;
        st.slots[self.rank] = Some((op.to_string(), bytes));
        if st.slots.iter().all(Option::is_some) {
            let parts = st
                .slots
                .iter_mut()
                .map(|s| s.take().expect("every slot is filled"))
                .collect();
            st.published = Some(Published {
                round,
                parts: Arc::new(parts),
                taken: vec![false; world],
            });
            st.round += 1;
            self.shared.changed.notify_all();
        }
        let mut st = self.wait_until(
            st,
            deadline,
            op,
            |s| s.published.as_ref().is_some_and(|p| p.round == round),
            |s| (0..world).filter(|&r| s.slots[r].is_none()).collect(),
        )?;
        let p = st.published.as_mut().expect("the round is published");
        p.taken[self.rank] = true;
        let parts = p.parts.clone();
        if p.taken.iter().all(|&t| t) {
            st.published = None;
            self.shared.changed.notify_all();
        }
        drop(st);
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        // every rank checks: all of them report a caller that diverged
        if let Some((rank, (theirs, _))) = parts.iter().enumerate().find(|(_, (o, _))| o != op) {
            return Err(CommError::Mismatch {
                rank,
                seq,
                ours: op.into(),
                theirs: theirs.clone(),
            });
        }
        Ok(parts.iter().map(|(_, b)| b.clone()).collect())
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        let parts = self.exchange("all_reduce_sum", f32_bytes(data))?;
        sum_in_rank_order(&parts, data)
    }

    fn all_gather(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.exchange("all_gather", local.to_vec())
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut st = self.lock();
        st.gone[self.rank] = true;
        // do not hold the others back on a round this rank will never take
        if let Some(p) = st.published.as_mut() {
            p.taken[self.rank] = true;
            if p.taken.iter().all(|&t| t) {
                st.published = None;
            }
        }
        self.shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_and_gather_agree_on_every_rank() {
        let comms = local_world(3, Duration::from_secs(10));
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let r = c.rank() as f32;
                    let mut v = vec![r, 10.0 * r, 0.1];
                    for _ in 0..5 {
                        c.all_reduce_sum(&mut v).unwrap();
                    }
                    let g = c.all_gather(&[c.rank() as u8; 2][..c.rank()]).unwrap();
                    c.barrier().unwrap();
                    (v, g)
                })
            })
            .collect();
        let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // (0 + 1 + 2) * 3^4 after five sums of three equal vectors
        assert_eq!(out[0].0[0], 3.0 * 81.0);
        assert_eq!(out[0].0[1], 30.0 * 81.0);
        for o in &out {
            assert_eq!(o.0, out[0].0, "bitwise equal on every rank");
            assert_eq!(o.1, vec![vec![], vec![1], vec![2, 2]]);
        }
    }

    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let mut comms = local_world(3, Duration::from_millis(300));
        let _late = comms.pop().unwrap(); // rank 2 never arrives but stays alive
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| std::thread::spawn(move || c.barrier().unwrap_err().to_string()))
            .collect();
        for h in handles {
            let msg = h.join().unwrap();
            assert!(
                msg.starts_with("rank 2 did not reach collective #0"),
                "{msg}"
            );
        }
    }

    #[test]
    fn a_dropped_rank_is_named_at_once() {
        let mut comms = local_world(2, Duration::from_secs(60));
        drop(comms.pop());
        let start = Instant::now();
        let msg = comms[0].all_gather(b"x").unwrap_err().to_string();
        assert!(msg.starts_with("rank 1 left the run"), "{msg}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn different_collectives_are_a_mismatch() {
        let comms = local_world(2, Duration::from_secs(10));
        let mut it = comms.into_iter();
        let (a, b) = (it.next().unwrap(), it.next().unwrap());
        let t = std::thread::spawn(move || b.all_gather(b"1").map(drop));
        let ours = a.all_reduce_sum(&mut [1.0]).unwrap_err().to_string();
        let theirs = t.join().unwrap().unwrap_err().to_string();
        assert!(ours.contains("rank 1 called `all_gather`"), "{ours}");
        assert!(
            theirs.contains("rank 0 called `all_reduce_sum`"),
            "{theirs}"
        );
    }
}
