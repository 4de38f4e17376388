//! Hugging Face checkpoints: read them, quantize their decoder linears, read the result back.
//!
//! * [`HfCheckpoint`]: a model directory (`config.json` + `model.safetensors` or shards with
//!   `model.safetensors.index.json`); lists tensors and reads one as f32 with its dtype.
//! * [`quantize_checkpoint`]: writes a quantized copy that compressed-tensors / vLLM
//!   (`nvfp4-pack-quantized`, `mxfp4-pack-quantized`) or transformers + bitsandbytes (NF4) load.
//!   q, k, v, o, gate, up and down projections are quantized (see [`names`]); every other tensor
//!   keeps its dtype and bytes. The output keeps the input's shard layout.
//! * [`QuantizedCheckpoint`]: loads the quantized modules back as [`QuantizedWeight`]s.
//!
//! The tensor layout of each format is documented in [`layout`].
//!
//! [`QuantizedWeight`]: crate::QuantizedWeight

pub mod config;
mod error;
pub mod layout;
pub mod names;
pub(crate) mod outdir;
pub mod par;
pub mod pyjson;
mod quantize;
mod quantized;
mod reader;

pub use error::{CheckpointError, Result};
pub use names::{classify, LinearKind, LinearName};
pub use quantize::{quantize_checkpoint, relative_error, LayerStat, ProgressEvent, QuantizeReport};
pub use quantized::{detect_format, QuantizedCheckpoint};
pub use reader::{
    bytes_to_f32, source_dtype, HfCheckpoint, RawTensor, Shard, TensorInfo, CONFIG_FILE,
    INDEX_FILE, SINGLE_FILE,
};
