//! Errors of the checkpoint layer: every one names the file and, where there is one, the tensor
//! or JSON field at fault.

use std::path::PathBuf;

use thiserror::Error;

use crate::FormatError;

/// Why a checkpoint could not be read, quantized or written.
#[derive(Debug, Error)]
pub enum CheckpointError {
    /// A file or directory could not be read, written, copied or renamed.
    #[error("{action} `{}`: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The input directory has no `config.json`.
    #[error("`{}` has no config.json: not a Hugging Face model directory", dir.display())]
    MissingConfig { dir: PathBuf },
    /// The input directory has neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error(
        "`{}` has neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    )]
    NoWeights { dir: PathBuf },
    /// A JSON file (config.json, the shard index) is not valid JSON.
    #[error("`{}` is not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A JSON file parses but a field is missing or has the wrong type.
    #[error("`{}`: field `{field}` {why}", path.display())]
    Field {
        path: PathBuf,
        field: String,
        why: String,
    },
    /// The shard index maps a tensor to a file that does not exist.
    #[error(
        "`{}` maps tensor `{tensor}` to `{shard}`, which does not exist",
        index.display()
    )]
    MissingShard {
        index: PathBuf,
        shard: String,
        tensor: String,
    },
    /// The shard index maps a tensor to a shard that does not hold it.
    #[error(
        "`{}` maps tensor `{tensor}` to `{shard}`, but that file has no such tensor",
        index.display()
    )]
    NotInShard {
        index: PathBuf,
        shard: String,
        tensor: String,
    },
    /// A safetensors file whose header cannot be parsed or does not fit the file.
    #[error("`{}` is not a valid safetensors file: {source}", path.display())]
    Header {
        path: PathBuf,
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// The same tensor name appears in two shards.
    #[error("tensor `{tensor}` appears in both `{first}` and `{second}`")]
    DuplicateTensor {
        tensor: String,
        first: String,
        second: String,
    },
    /// No tensor of that name in the checkpoint.
    #[error("no tensor `{tensor}` in `{}`", dir.display())]
    TensorNotFound { dir: PathBuf, tensor: String },
    /// A tensor whose dtype cannot be used where it is (e.g. an I64 linear weight).
    #[error("tensor `{tensor}` in `{}` has dtype {dtype}, expected {expected}", file.display())]
    Dtype {
        file: PathBuf,
        tensor: String,
        dtype: String,
        expected: &'static str,
    },
    /// A tensor whose shape does not fit what it is (e.g. a 1-D `q_proj.weight`).
    #[error("tensor `{tensor}` in `{}` has shape {shape:?}: {why}", file.display())]
    Shape {
        file: PathBuf,
        tensor: String,
        shape: Vec<usize>,
        why: String,
    },
    /// The format rejected a tensor (block size, NaN, stored lengths).
    #[error("cannot quantize `{tensor}` in `{}`: {source}", file.display())]
    Quantize {
        file: PathBuf,
        tensor: String,
        #[source]
        source: Box<FormatError>,
    },
    /// The stored parts of a quantized module do not fit together.
    #[error("quantized module `{module}` in `{}` is inconsistent: {why}", file.display())]
    BadParts {
        file: PathBuf,
        module: String,
        why: String,
    },
    /// A symbolic link in the input directory that is not copied: one to a directory (it may
    /// loop or lead out of the tree) or to anything but a regular file (a device such as
    /// `/dev/zero` never ends).
    #[error("`{}` is a symbolic link {why}; qerl quantize copies only links to regular files: remove it or copy what it points to into the directory", path.display())]
    Symlink { path: PathBuf, why: String },
    /// The output directory exists and is not empty.
    #[error("output directory `{}` exists and is not empty: refusing to overwrite it", path.display())]
    OutputExists { path: PathBuf },
    /// Input and output are the same directory, or the output path cannot hold a directory.
    #[error("invalid output path `{}`: {why}", path.display())]
    OutputPath { path: PathBuf, why: String },
    /// A quantized checkpoint lacks a tensor its format needs for a module.
    #[error("quantized module `{module}` in `{}` has no tensor `{tensor}`", dir.display())]
    MissingPart {
        dir: PathBuf,
        module: String,
        tensor: String,
    },
    /// The checkpoint's `quantization_config` is not one qerl writes.
    #[error("`{}`: unsupported quantization_config: {why}", path.display())]
    UnsupportedQuantization { path: PathBuf, why: String },
}

pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// Builds an [`CheckpointError::Io`] from a path and an action ("cannot read", ...).
pub(crate) fn io(
    action: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.into();
    move |source| CheckpointError::Io {
        action,
        path,
        source,
    }
}
