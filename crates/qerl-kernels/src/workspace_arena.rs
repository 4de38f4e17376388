//! [`WorkspaceArena`]: the split-K workspaces of one pass, kept and handed out again, so that
//! a pass can be captured as a CUDA graph (`crate::graph`) on buffers that outlive it.

use cubecl::server::Handle;

/// The split-K workspaces one pass of a model allocates, kept so that the same pass can run
/// again on the same buffers: a CUDA graph captured from it (`qerl_engine`'s decode steps)
/// holds their addresses, and nothing may be allocated while a stream is captured.
/// [`WorkspaceArena::record`] keeps every workspace the thread allocates until
/// [`WorkspaceArena::finish`]; [`WorkspaceArena::replay`] hands the recorded ones out again in
/// order (a fresh one, and a failed replay, where the pass asks for another size or more).
#[derive(Debug, Default)]
pub struct WorkspaceArena {
    handles: Vec<(usize, Handle)>,
    next: usize,
    replaying: bool,
    failed: bool,
}

thread_local! {
    static ARENA: std::cell::RefCell<Option<WorkspaceArena>> = const { std::cell::RefCell::new(None) };
}

impl WorkspaceArena {
    /// Starts recording this thread's workspaces.
    pub fn record() {
        ARENA.with(|a| *a.borrow_mut() = Some(WorkspaceArena::default()));
    }

    /// Starts handing out `recorded`'s workspaces again, in order.
    pub fn replay(recorded: WorkspaceArena) {
        ARENA.with(|a| {
            *a.borrow_mut() = Some(WorkspaceArena {
                next: 0,
                replaying: true,
                failed: false,
                handles: recorded.handles,
            })
        });
    }

    /// Stops recording or replaying: the workspaces (kept alive by the returned arena), and
    /// whether a replay handed out exactly the recorded ones.
    pub fn finish() -> (WorkspaceArena, bool) {
        let arena = ARENA.with(|a| a.borrow_mut().take()).unwrap_or_default();
        let ok = !arena.failed && (!arena.replaying || arena.next == arena.handles.len());
        (arena, ok)
    }

    /// Workspaces held.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether none are held.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }
}

/// A workspace of `bytes` for this thread: the arena's next while replaying, else `fresh()`
/// (kept by the arena while recording).
pub(crate) fn workspace(bytes: usize, fresh: impl FnOnce() -> Handle) -> Handle {
    ARENA.with(|a| {
        let mut a = a.borrow_mut();
        let Some(arena) = a.as_mut() else {
            return fresh();
        };
        if arena.replaying {
            match arena.handles.get(arena.next) {
                Some((b, h)) if *b == bytes => {
                    arena.next += 1;
                    h.clone()
                }
                _ => {
                    arena.failed = true;
                    fresh()
                }
            }
        } else {
            let h = fresh();
            arena.handles.push((bytes, h.clone()));
            h
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(bytes: usize) -> Handle {
        Handle::new(cubecl::stream_id::StreamId::current(), bytes as u64)
    }

    #[test]
    fn a_replay_hands_out_the_recorded_workspaces_in_order() {
        WorkspaceArena::record();
        let a = workspace(64, || fresh(64));
        let b = workspace(128, || fresh(128));
        let (recorded, ok) = WorkspaceArena::finish();
        assert!(ok && recorded.len() == 2);
        WorkspaceArena::replay(recorded);
        let a2 = workspace(64, || panic!("replayed workspaces are not fresh"));
        let b2 = workspace(128, || panic!("replayed workspaces are not fresh"));
        let (_, ok) = WorkspaceArena::finish();
        assert!(ok);
        assert_eq!(format!("{:?}", a.memory), format!("{:?}", a2.memory));
        assert_eq!(format!("{:?}", b.memory), format!("{:?}", b2.memory));
        // Outside an arena every workspace is fresh.
        let mut made = false;
        let _ = workspace(64, || {
            made = true;
            fresh(64)
        });
        assert!(made);
    }

    #[test]
    fn a_replay_that_asks_for_other_sizes_fails() {
        WorkspaceArena::record();
        let _ = workspace(64, || fresh(64));
        let (recorded, _) = WorkspaceArena::finish();
        WorkspaceArena::replay(recorded);
        let _ = workspace(32, || fresh(32));
        assert!(!WorkspaceArena::finish().1);
        // Fewer than recorded fails too.
        WorkspaceArena::record();
        let _ = workspace(64, || fresh(64));
        let (recorded, _) = WorkspaceArena::finish();
        WorkspaceArena::replay(recorded);
        assert!(!WorkspaceArena::finish().1);
    }
}
