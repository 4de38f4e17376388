//! Ctrl-C: the first SIGINT (or SIGTERM) sets a flag the training loop checks between steps
//! (it then saves a checkpoint and exits with [`INTERRUPTED_EXIT`]); a second one ends the
//! process at once, with the same status.

use std::sync::atomic::{AtomicBool, Ordering};

/// The exit status of an interrupted command: 128 + SIGINT, what shells report for Ctrl-C.
pub const INTERRUPTED_EXIT: i32 = 130;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    if STOP.swap(true, Ordering::SeqCst) {
        // second signal: leave now (async-signal-safe)
        unsafe { libc::_exit(INTERRUPTED_EXIT) };
    }
}

/// Installs the handler for SIGINT and SIGTERM.
pub fn install() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// Whether a stop was requested.
pub fn requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Requests a stop (as a signal would): for tests and callers that stop a run themselves.
pub fn request() {
    STOP.store(true, Ordering::SeqCst);
}

/// Clears a request.
pub fn reset() {
    STOP.store(false, Ordering::SeqCst);
}
