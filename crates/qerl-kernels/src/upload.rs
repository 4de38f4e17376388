//! Bulk host-to-device copies of weights: the loader's upload phase.
//!
//! Inside an [`UploadSession`] (the loader opens one per load), with the `staged` path (the
//! default, `QERL_UPLOAD=staged`) on CUDA, [`create_bytes`] and [`create_tensor`] allocate the
//! destination through cubecl and fill it from pinned host buffers on a stream of their own
//! (the CUDA-only module `upload_cuda`): the host copies a chunk into one buffer on every core
//! while the copy engine uploads the other. The session waits for its copies when it ends.
//!
//! `QERL_UPLOAD=cubecl`, other runtimes (wgpu), buffers under [`UploadConfig::min_bytes`] and
//! calls outside a session take cubecl's own `create`, which is synchronous on the device
//! thread and goes through pageable copies (docs/cold-start.md, "Why the upload was slow").

use std::cell::RefCell;
use std::marker::PhantomData;

use cubecl::bytes::Bytes;
use cubecl::prelude::*;
use cubecl::server::{Handle, MemoryLayout};
use cubecl::zspace::Shape;
use thiserror::Error;

/// Which path large uploads take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UploadPath {
    /// Pinned double-buffered copies on a stream of their own (CUDA; elsewhere as `Cubecl`).
    #[default]
    Staged,
    /// cubecl's `create`, one tensor at a time.
    Cubecl,
}

impl UploadPath {
    pub fn name(self) -> &'static str {
        match self {
            UploadPath::Staged => "staged",
            UploadPath::Cubecl => "cubecl",
        }
    }
}

/// How an [`UploadSession`] uploads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UploadConfig {
    pub path: UploadPath,
    /// Bytes of each of the two pinned buffers (a pitched tensor needs a whole row in one).
    pub chunk_bytes: usize,
    /// Buffers smaller than this take cubecl's path (each staged tensor costs two round trips
    /// to cubecl's device thread).
    pub min_bytes: usize,
}

impl Default for UploadConfig {
    fn default() -> Self {
        UploadConfig {
            path: UploadPath::Staged,
            chunk_bytes: 64 << 20,
            min_bytes: 1 << 20,
        }
    }
}

impl UploadConfig {
    /// `staged` or `cubecl`; unset means `staged`.
    pub const PATH_VAR: &'static str = "QERL_UPLOAD";
    /// MiB of each pinned buffer (default 64).
    pub const CHUNK_VAR: &'static str = "QERL_UPLOAD_CHUNK_MIB";

    /// The default, changed by `QERL_UPLOAD` and `QERL_UPLOAD_CHUNK_MIB`.
    pub fn from_env() -> Result<Self, UploadError> {
        let mut config = UploadConfig::default();
        let var = |name| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        if let Some(v) = var(Self::PATH_VAR) {
            config.path = match v.trim() {
                "staged" => UploadPath::Staged,
                "cubecl" => UploadPath::Cubecl,
                _ => return Err(env_error(Self::PATH_VAR, v, "`staged` or `cubecl`")),
            };
        }
        if let Some(v) = var(Self::CHUNK_VAR) {
            match v.trim().parse::<usize>() {
                Ok(mib @ 1..=4096) => config.chunk_bytes = mib << 20,
                _ => return Err(env_error(Self::CHUNK_VAR, v, "a size in MiB, 1 to 4096")),
            }
        }
        Ok(config)
    }
}

fn env_error(var: &'static str, value: String, expected: &'static str) -> UploadError {
    UploadError::Env {
        var,
        value,
        expected,
    }
}

/// A failed upload, naming the tensor.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum UploadError {
    #[error("{var}=`{value}`: expected {expected}")]
    Env {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
    /// The driver or cubecl failed (allocation, pinned memory, copy, synchronisation).
    #[error("uploading `{tensor}`: {op} failed: {what}")]
    Device {
        tensor: String,
        op: &'static str,
        what: String,
    },
    /// The destination cubecl allocated is not what the data needs.
    #[error("uploading `{tensor}`: {what}")]
    Layout { tensor: String, what: String },
    /// A pitched row is copied in one piece, so it must fit in one pinned staging buffer.
    #[error(
        "uploading `{tensor}`: a row of {row_bytes} bytes does not fit in a staging buffer of \
         {chunk_bytes} bytes (raise {var})",
        var = UploadConfig::CHUNK_VAR
    )]
    RowTooLarge {
        tensor: String,
        row_bytes: usize,
        chunk_bytes: usize,
    },
}

/// Bytes of data per staged chunk when every chunk must hold whole units of `unit` bytes (a
/// pitched tensor's row; 1 for contiguous data): as many whole units as a staging buffer of
/// `chunk_bytes` holds. An error when not even one unit fits, instead of chunks of nothing.
pub(crate) fn staging_step(
    tensor: &str,
    unit: usize,
    chunk_bytes: usize,
) -> Result<usize, UploadError> {
    let unit = unit.max(1);
    match chunk_bytes / unit * unit {
        0 => Err(UploadError::RowTooLarge {
            tensor: tensor.to_string(),
            row_bytes: unit,
            chunk_bytes,
        }),
        step => Ok(step),
    }
}

/// What a session uploaded, by path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    pub staged_tensors: usize,
    pub staged_bytes: u64,
    pub cubecl_tensors: usize,
    pub cubecl_bytes: u64,
}

impl SessionStats {
    /// The path of the bulk of the bytes: `staged`, `cubecl`, or `host` when nothing went
    /// through these functions (the CPU backend).
    pub fn path(&self) -> &'static str {
        if self.staged_tensors > 0 {
            "staged"
        } else if self.cubecl_tensors > 0 {
            "cubecl"
        } else {
            "host"
        }
    }
}

pub(crate) struct State {
    pub(crate) config: UploadConfig,
    stats: SessionStats,
    #[cfg(feature = "cuda")]
    pub(crate) stager: Option<crate::upload_cuda::Stager>,
}

thread_local! {
    static SESSION: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// Uploads of this thread between `begin` and `finish` (or drop, which also waits for the
/// copies) may be staged. A nested session is inert: the outer one stays in charge.
pub struct UploadSession {
    owner: bool,
    /// Thread-bound: the session lives in a thread-local.
    _thread: PhantomData<*const ()>,
}

impl UploadSession {
    pub fn begin(config: UploadConfig) -> Self {
        let owner = SESSION.with(|s| {
            let mut s = s.borrow_mut();
            if s.is_some() {
                return false;
            }
            *s = Some(State {
                config,
                stats: SessionStats::default(),
                #[cfg(feature = "cuda")]
                stager: None,
            });
            true
        });
        UploadSession {
            owner,
            _thread: PhantomData,
        }
    }

    /// Waits for every staged copy; after this the uploaded buffers may be read by kernels.
    pub fn finish(mut self) -> Result<SessionStats, UploadError> {
        self.end()
    }

    fn end(&mut self) -> Result<SessionStats, UploadError> {
        if !std::mem::take(&mut self.owner) {
            return Ok(SessionStats::default());
        }
        let Some(state) = SESSION.with(|s| s.borrow_mut().take()) else {
            return Ok(SessionStats::default());
        };
        #[cfg(feature = "cuda")]
        if let Some(mut stager) = state.stager {
            stager.finish()?;
        }
        Ok(state.stats)
    }
}

impl Drop for UploadSession {
    fn drop(&mut self) {
        // An error here has no one to go to; the copies are waited for either way.
        let _ = self.end();
    }
}

/// A buffer holding `data` (contiguous bytes), like `client.create_from_slice`.
pub fn create_bytes<R: Runtime>(
    client: &ComputeClient<R>,
    tensor: &str,
    data: &[u8],
) -> Result<Handle, UploadError> {
    if let Some(layout) = staged(client, tensor, data, None)? {
        return Ok(layout.memory);
    }
    Ok(client.create_from_slice(data))
}

/// A tensor of `shape` holding `data` (row-major, `elem_size` bytes an element) in cubecl's
/// layout for the runtime (rows may be pitched: read the strides), like `client.create_tensor`.
pub fn create_tensor<R: Runtime>(
    client: &ComputeClient<R>,
    tensor: &str,
    data: Bytes,
    shape: Shape,
    elem_size: usize,
) -> Result<MemoryLayout, UploadError> {
    if let Some(layout) = staged(client, tensor, &data, Some((&shape, elem_size)))? {
        return Ok(layout);
    }
    Ok(client.create_tensor(data, shape, elem_size))
}

/// The staged upload when the session, the path, the size and the runtime allow it; `None`
/// (counted as a cubecl upload when in a session) otherwise.
#[allow(unused_variables)]
fn staged<R: Runtime>(
    client: &ComputeClient<R>,
    tensor: &str,
    data: &[u8],
    layout: Option<(&Shape, usize)>,
) -> Result<Option<MemoryLayout>, UploadError> {
    SESSION.with(|s| {
        let mut s = s.borrow_mut();
        let Some(state) = s.as_mut() else {
            return Ok(None);
        };
        let bytes = data.len() as u64;
        let config = state.config;
        // A pitched row must fit in one pinned buffer (rows of a weight are a few KiB); a
        // tensor whose rows do not takes cubecl's path.
        let row_fits = layout.is_none_or(|(shape, elem)| {
            let row_bytes = shape.last().copied().unwrap_or(1) * elem;
            shape.len() < 2 || staging_step(tensor, row_bytes, config.chunk_bytes).is_ok()
        });
        if config.path == UploadPath::Staged && data.len() >= config.min_bytes.max(1) && row_fits {
            #[cfg(feature = "cuda")]
            if let Some(cuda) = crate::upload_cuda::as_cuda(client) {
                let out = crate::upload_cuda::upload(state, cuda, tensor, data, layout)?;
                state.stats.staged_tensors += 1;
                state.stats.staged_bytes += bytes;
                return Ok(Some(out));
            }
        }
        state.stats.cubecl_tensors += 1;
        state.stats.cubecl_bytes += bytes;
        Ok(None)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_steps_are_whole_rows_of_at_most_a_buffer() {
        // contiguous data: the whole buffer
        assert_eq!(staging_step("w", 1, 4096), Ok(4096));
        // pitched rows of 1000 bytes: four of them
        assert_eq!(staging_step("w", 1000, 4096), Ok(4000));
        assert_eq!(staging_step("w", 4096, 4096), Ok(4096));
        // empty rows count as one byte: no step of zero
        assert_eq!(staging_step("w", 0, 4096), Ok(4096));
    }

    #[test]
    fn a_row_larger_than_the_buffer_is_an_error_naming_both_sizes() {
        let err = staging_step("model.embed_tokens.weight", 5000, 4096).unwrap_err();
        assert_eq!(
            err,
            UploadError::RowTooLarge {
                tensor: "model.embed_tokens.weight".into(),
                row_bytes: 5000,
                chunk_bytes: 4096,
            }
        );
        let text = err.to_string();
        for part in ["5000 bytes", "4096 bytes", UploadConfig::CHUNK_VAR] {
            assert!(text.contains(part), "{text}");
        }
        // a buffer of nothing holds no data at all
        assert!(staging_step("w", 1, 0).is_err());
    }
}
