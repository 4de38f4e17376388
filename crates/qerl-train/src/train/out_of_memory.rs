//! Running out of device memory, reported as an error that says so and what to change.
//!
//! cubecl reports an allocation the device cannot satisfy by panicking deep inside a launch
//! or an autotune run (`called Result::unwrap() on an Err value: CallError`, with a screen of
//! autotune results). [`guard`] runs a phase of the run, catches such a panic, keeps the panic
//! hook from printing it, and returns [`OutOfMemory`] naming the phase and the settings that
//! lower the memory a step needs; the run then ends like any failed run, with its last
//! checkpoint intact (checkpoints are written atomically). Any other panic goes on unwinding.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Once;

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

/// Keeps the panic hook quiet for out-of-memory panics (they become an [`OutOfMemory`] error
/// with one readable message); every other panic is printed as before.
fn quiet_out_of_memory_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !payload_text(info.payload()).is_some_and(is_out_of_memory) {
                previous(info);
            }
        }));
    });
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
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => match payload_text(payload.as_ref()) {
            Some(text) if is_out_of_memory(text) => {
                let reason = text
                    .lines()
                    .map(str::trim)
                    .find(|l| is_out_of_memory(l))
                    .unwrap_or(text)
                    .to_string();
                Err(OutOfMemory {
                    phase: phase.to_string(),
                    // the runtime may be unusable now: asking it must not panic again
                    pool: catch_unwind(AssertUnwindSafe(pool))
                        .ok()
                        .flatten()
                        .map(|p| format!(" ({p})"))
                        .unwrap_or_default(),
                    reason,
                }
                .into())
            }
            _ => resume_unwind(payload),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_memory_panic_becomes_an_error_that_says_what_to_change() {
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
    fn other_panics_and_errors_pass_through() {
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
