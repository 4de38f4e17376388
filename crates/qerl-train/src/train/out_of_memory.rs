//! Running out of device memory, reported as an error that says so and what to change.
//!
//! cubecl reports an allocation the device cannot satisfy by panicking deep inside a launch
//! or an autotune run (`called Result::unwrap() on an Err value: CallError`, with a screen of
//! autotune results). [`guard`] runs a phase of the run, catches such a panic, keeps the panic
//! hook from printing it, and returns [`OutOfMemory`] naming the phase and the settings that
//! lower the memory a step needs; the run then ends like any failed run, with its last
//! checkpoint intact (checkpoints are written atomically). Any other panic goes on unwinding.
//!
//! On CUDA the allocation fails on cubecl's device-server thread (`DSD-…`: `can't allocate
//! buffer of size: N`), which dies; the training thread then panics with whatever its next call
//! meets (`CallError`, `Communication channel with the server is down`, an autotune plan that
//! cannot run). So the panic hook records an out-of-memory panic of any thread, and [`guard`]
//! reports any panic of its phase that follows one as running out of memory (seen on an H100,
//! 2026-11-27: a 7B update of 64 x 1,280 tokens without checkpointing asked for 21.3 GB).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Mutex, Once};

use thiserror::Error;

/// A phase of the run ran out of device memory.
#[derive(Debug, Error)]
#[error(
    "out of device memory in {phase}{pool}: lower the memory a step needs (rollout.batch_prompts \
     or rollout.group_size for the rollout, a larger optim.grad_accum for smaller micro-batches \
     in the update, rollout.max_completion_tokens for both) and resume from the last checkpoint \
     with --resume. The device said: {reason}"
)]
pub struct OutOfMemory {
    pub phase: String,
    /// What the allocator held when it happened, when the caller knows (`, 12.3 GB in use ...`).
    pub pool: String,
    /// The first line of the runtime's own message.
    pub reason: String,
    /// The allocation failed on the runtime's own thread, which is gone: this process cannot
    /// use the device again (the caller ends instead of trying the next thing).
    pub runtime_lost: bool,
}

/// Whether a panic message is the runtime running out of memory: cubecl's `OutOfMemory` launch
/// error, CUDA's `CUDA_ERROR_OUT_OF_MEMORY`, wgpu's out-of-memory error.
pub fn is_out_of_memory(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    [
        "out-of-memory",
        "out of memory",
        "outofmemory",
        "out_of_memory",
        "can't allocate buffer",
    ]
    .iter()
    .any(|w| m.contains(w))
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
fn payload_text(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

/// The first out-of-memory panic message of any thread since the last [`guard`] began.
static RECORDED: Mutex<Option<String>> = Mutex::new(None);

fn recorded() -> std::sync::MutexGuard<'static, Option<String>> {
    RECORDED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Records out-of-memory panics of every thread and keeps the panic hook quiet for them, and for
/// the panics that follow one (the runtime's threads failing one after another once its server
/// is gone): they become one [`OutOfMemory`] error with one readable message. Every other panic
/// is printed as before.
fn quiet_out_of_memory_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let text = payload_text(info.payload());
            let mut seen = recorded();
            if let Some(text) = text.filter(|t| is_out_of_memory(t)) {
                seen.get_or_insert_with(|| reason_line(text));
            } else if seen.is_none() {
                drop(seen);
                previous(info);
            }
        }));
    });
}

/// The line of a panic message that says what ran out, with the size in GB where it gives one.
fn reason_line(text: &str) -> String {
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| is_out_of_memory(l))
        .unwrap_or(text);
    let bytes = line
        .rsplit(|c: char| !c.is_ascii_digit())
        .find(|w| w.len() >= 7)
        .and_then(|w| w.parse::<u64>().ok());
    match bytes {
        Some(b) => format!("{line} ({:.1} GB)", b as f64 / 1e9),
        None => line.to_string(),
    }
}

/// Runs `f` (the phase `phase` of the run); a panic of the runtime running out of memory
/// becomes [`OutOfMemory`] (`pool` adds what the allocator held, when known), other panics
/// continue.
pub fn guard<T>(
    phase: &str,
    pool: impl FnOnce() -> Option<String>,
    f: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    quiet_out_of_memory_panics();
    recorded().take();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let text = payload_text(payload.as_ref()).filter(|t| is_out_of_memory(t));
            // an allocation that failed on another thread (the runtime's server) first
            let elsewhere = recorded().clone();
            let reason = match (text, elsewhere) {
                (Some(text), _) => reason_line(text),
                (None, Some(reason)) => reason,
                (None, None) => resume_unwind(payload),
            };
            Err(OutOfMemory {
                phase: phase.to_string(),
                // the runtime may be unusable now: asking it must not panic again, and once
                // its server thread is gone it is not asked at all
                pool: if text.is_some() {
                    catch_unwind(AssertUnwindSafe(pool))
                        .ok()
                        .flatten()
                        .map(|p| format!(" ({p})"))
                        .unwrap_or_default()
                } else {
                    String::new()
                },
                reason,
                runtime_lost: text.is_none(),
            }
            .into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record is one per process: the tests take turns.
    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        static TURN: Mutex<()> = Mutex::new(());
        TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[test]
    fn an_out_of_memory_panic_becomes_an_error_that_says_what_to_change() {
        let _turn = one_at_a_time();
        let e = guard(
            "training step 3",
            || Some("9.8 GB in use, 10.0 GB reserved".into()),
            || -> anyhow::Result<()> {
                panic!(
                    "called `Result::unwrap()` on an `Err` value: An out-of-memory error happened \
                     during launch\nCaused by:\n  requested 4294967296 bytes\nBacktrace\n..."
                )
            },
        )
        .unwrap_err();
        let m = e.to_string();
        assert!(e.downcast_ref::<OutOfMemory>().is_some());
        for w in [
            "out of device memory in training step 3",
            "9.8 GB in use",
            "optim.grad_accum",
            "--resume",
            "An out-of-memory error happened during launch",
        ] {
            assert!(m.contains(w), "`{w}` not in: {m}");
        }
        assert!(!m.contains("Backtrace"), "{m}");
    }

    #[test]
    fn an_allocation_that_failed_on_another_thread_names_the_size() {
        let _turn = one_at_a_time();
        let e = guard(
            "training step 0",
            || panic!("the runtime is not asked once its server is gone"),
            || -> anyhow::Result<()> {
                // cubecl-cuda's server thread dies on the allocation ...
                let server = std::thread::spawn(|| {
                    panic!(
                        "called `Result::unwrap()` on an `Err` value: can't allocate buffer of \
                         size: 21254373376"
                    )
                });
                assert!(server.join().is_err());
                // ... and the caller meets a dead channel
                panic!("Can't execute the autotune plan for key: ... CallError")
            },
        )
        .unwrap_err();
        let m = e.to_string();
        for w in [
            "out of device memory in training step 0",
            "can't allocate buffer of size: 21254373376 (21.3 GB)",
            "optim.grad_accum",
        ] {
            assert!(m.contains(w), "`{w}` not in: {m}");
        }
        assert!(!m.contains("autotune"), "{m}");
        assert!(e.downcast_ref::<OutOfMemory>().unwrap().runtime_lost);
    }

    #[test]
    fn other_panics_and_errors_pass_through() {
        let _turn = one_at_a_time();
        let r = catch_unwind(|| {
            guard(
                "x",
                || None,
                || -> anyhow::Result<()> { panic!("index out of bounds") },
            )
        });
        assert!(
            r.is_err(),
            "a panic that is not about memory keeps unwinding"
        );
        let e = guard(
            "x",
            || None,
            || -> anyhow::Result<()> { anyhow::bail!("plain") },
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "plain");
        assert_eq!(guard("x", || None, || Ok(7)).unwrap(), 7);
    }
}
