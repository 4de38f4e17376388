//! Whether wgpu has an adapter to run on, asked before cubecl is.
//!
//! cubecl-wgpu panics inside its device thread when no adapter exists ("No possible adapter
//! available for backend"), and every later use of the device panics again with a `RecvError`:
//! a test binary then prints one unreadable panic per test. Asking first turns that into one
//! error that says what is missing and how to get it.

use std::io::Write;
use std::sync::{Mutex, OnceLock};

use cubecl::wgpu::{AutoGraphicsApi, GraphicsApi, WgpuDevice, WgpuRuntime};
use cubecl::Runtime;
use thiserror::Error;

/// The package that provides a Vulkan driver on the CPU (Mesa's lavapipe) on Debian/Ubuntu.
pub const LAVAPIPE_PACKAGE: &str = "mesa-vulkan-drivers";

/// wgpu found no adapter for its backend on this machine.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error(
    "no {backend} device found for wgpu: install a {backend} driver (on a machine without a GPU, \
     Mesa's lavapipe: `sudo apt-get install -y {LAVAPIPE_PACKAGE}`, or run tools/test.sh, which \
     installs it), or use another device (`--device cpu`)"
)]
pub struct NoWgpuAdapter {
    /// The graphics API wgpu would use here (Vulkan on Linux, Metal on macOS).
    pub backend: String,
}

/// The default wgpu device, once wgpu has been seen to have at least one adapter. The answer is
/// computed once per process (enumerating adapters loads the driver).
pub fn wgpu_device() -> Result<WgpuDevice, NoWgpuAdapter> {
    static PROBE: OnceLock<Result<(), NoWgpuAdapter>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let backend = AutoGraphicsApi::backend();
            if WgpuRuntime::enumerate_all_devices(&backend).is_empty() {
                Err(NoWgpuAdapter {
                    backend: format!("{backend:?}"),
                })
            } else {
                Ok(())
            }
        })
        .clone()
        .map(|()| WgpuDevice::default())
}

/// [`wgpu_device`] for test binaries: without an adapter the process prints the one line of
/// [`NoWgpuAdapter`] and exits with status 1, so a test binary fails once, with the cause, instead
/// of once per test. The line goes straight to stderr, past the test harness's output capture.
pub fn wgpu_device_or_exit() -> WgpuDevice {
    wgpu_device().unwrap_or_else(|e| {
        // Tests run on several threads: the first one prints and exits, holding the lock, so the
        // line appears once.
        static EXITING: Mutex<()> = Mutex::new(());
        let _held = EXITING.lock();
        let _ = writeln!(std::io::stderr(), "error: {e}");
        std::process::exit(1)
    })
}
