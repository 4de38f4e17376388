//! Errors of the GGUF importer: every one names the file and the field, tensor or key at fault.

use std::path::PathBuf;

use thiserror::Error;

use crate::checkpoint::CheckpointError;

/// Why a GGUF file could not be read or converted.
#[derive(Debug, Error)]
pub enum GgufError {
    /// The file could not be opened or mapped, or an output file could not be written.
    #[error("cannot {action} `{}`: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the `GGUF` magic.
    #[error("`{}` is not a GGUF file: {why}", path.display())]
    NotGguf { path: PathBuf, why: String },
    /// A version other than 2 or 3 (version 1 used 32-bit counts and is long gone).
    #[error("`{}`: GGUF version {version} is not supported (versions 2 and 3 are)", path.display())]
    Version { path: PathBuf, version: u32 },
    /// The bytes of a header field are missing, or a count or length in it cannot be true
    /// (it runs past the end of the file, or an unknown type code).
    #[error("`{}`: {field} (at byte {offset}): {why}", path.display())]
    Malformed {
        path: PathBuf,
        field: String,
        offset: u64,
        why: String,
    },
    /// A metadata key is missing or its value has the wrong type or an impossible value.
    #[error("`{}`: metadata `{key}` {why}", path.display())]
    Metadata {
        path: PathBuf,
        key: String,
        why: String,
    },
    /// A tensor's shape, type, offset or name does not fit the file or the model.
    #[error("`{}`: tensor `{tensor}` {why}", path.display())]
    Tensor {
        path: PathBuf,
        tensor: String,
        why: String,
    },
    /// A tensor type qerl does not dequantize.
    #[error(
        "`{}`: tensor `{tensor}` is of type {ggml_type}, which qerl cannot dequantize \
         (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)",
        path.display()
    )]
    UnsupportedType {
        path: PathBuf,
        tensor: String,
        ggml_type: String,
    },
    /// The output directory cannot be used (exists and is not empty, ...).
    #[error(transparent)]
    Output(#[from] CheckpointError),
}

pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// Builds a [`GgufError::Io`] from an action ("open", "write", ...) and a path.
pub(crate) fn io(
    action: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> GgufError {
    let path = path.into();
    move |source| GgufError::Io {
        action,
        path,
        source,
    }
}
