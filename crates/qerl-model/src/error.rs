//! Errors of the model layer. Every one names the file and the key (JSON field or tensor name)
//! at fault, where there is one.

use std::path::PathBuf;

use qerl_format::checkpoint::CheckpointError;
use thiserror::Error;

/// Why a model could not be configured, loaded, run or asked to generate.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A configuration file (`config.json`, `generation_config.json`, `adapter_config.json`)
    /// has a missing, mistyped or unsupported key.
    #[error("`{}`: key `{key}` {why}", path.display())]
    Config {
        path: PathBuf,
        key: String,
        why: String,
    },
    /// A JSON file that is not valid JSON.
    #[error("`{}` is not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A file could not be read.
    #[error("cannot read `{}`: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint reader failed (its message names the file and tensor).
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The model needs a tensor the checkpoint does not have.
    #[error("`{}` has no tensor `{tensor}` (needed by {needed_by})", dir.display())]
    MissingTensor {
        dir: PathBuf,
        tensor: String,
        needed_by: String,
    },
    /// A tensor whose shape does not match the configuration.
    #[error(
        "tensor `{tensor}` in `{}` has shape {shape:?}, expected {expected:?} from config.json",
        file.display()
    )]
    TensorShape {
        file: PathBuf,
        tensor: String,
        shape: Vec<usize>,
        expected: Vec<usize>,
    },
    /// A weight holding NaN or an infinity (a corrupt or diverged checkpoint): refused at load,
    /// since it would only give NaN log-probabilities and token 0.
    #[error(
        "tensor `{tensor}` in `{}` holds {value} at index {index}: the checkpoint is corrupt or its training diverged",
        file.display()
    )]
    NonFinite {
        file: PathBuf,
        tensor: String,
        index: usize,
        value: f32,
    },
    /// Tensors the architecture has no place for (a sign of a different architecture).
    #[error("`{}` has tensors the {arch} architecture does not use: {}", dir.display(), names.join(", "))]
    UnexpectedTensors {
        dir: PathBuf,
        arch: &'static str,
        names: Vec<String>,
    },
    /// The requested precision cannot hold the model (e.g. a dimension that is not a multiple
    /// of the 4-bit block size), or does not fit the checkpoint.
    #[error("`{}`: {why}", path.display())]
    Precision { path: PathBuf, why: String },
    /// Copying the weights to the device failed, or `QERL_UPLOAD` is not a path (the message
    /// names the tensor or the variable).
    #[error(transparent)]
    Upload(#[from] qerl_nn::upload::UploadError),
    /// The tokenizer file cannot be loaded or used.
    #[error("tokenizer `{}`: {why}", path.display())]
    Tokenizer { path: PathBuf, why: String },
    /// A model directory without `tokenizer.json` and no tokenizer file given.
    #[error("`{}` has no tokenizer.json: pass a tokenizer file (--tokenizer FILE)", dir.display())]
    NoTokenizer { dir: PathBuf },
    /// Bad generation or scoring input (token id out of range, empty prompt, bad parameter).
    #[error("{0}")]
    Input(String),
    /// A qerl-nn module rejected its weights.
    #[error("{0}")]
    Nn(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// A [`ModelError::Config`] for `key` in `path`.
pub(crate) fn config_err(
    path: impl Into<PathBuf>,
    key: impl Into<String>,
    why: impl Into<String>,
) -> ModelError {
    ModelError::Config {
        path: path.into(),
        key: key.into(),
        why: why.into(),
    }
}

/// Reads and parses a JSON file.
pub(crate) fn read_json(path: &std::path::Path) -> Result<serde_json::Value> {
    let text = qerl_format::small_file::read_small_file(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_slice(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })
}
