//! GGUF import: read a llama.cpp / Ollama model file and write a Hugging Face model directory.
//!
//! Written from the GGUF specification (format versions 2 and 3):
//! * [`reader`]: header, metadata, tensor infos and the aligned data section, every length
//!   checked against the file before anything is allocated for it.
//! * [`dequant`]: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K to f32.
//! * [`hf`]: llama / qwen2 metadata to `config.json`, tensor names, and the undoing of
//!   llama.cpp's RoPE row permutation of Llama q/k projections.
//! * [`tokenizer`]: `tokenizer.json` (byte-level BPE), `tokenizer_config.json` with the chat
//!   template, `special_tokens_map.json`.
//! * [`convert_gguf`]: all of it into a new directory.
//!
//! Every failure is a [`GgufError`] naming the file and the field, tensor or key.

mod convert;
mod cursor;
pub mod dequant;
mod error;
pub mod hf;
pub mod metadata;
pub mod reader;
pub mod tokenizer;

pub use convert::{convert_gguf, ConvertOptions, ConvertReport, OutDtype, Progress};
pub use dequant::GgmlType;
pub use error::{GgufError, Result};
pub use metadata::{MetaArray, MetaValue, Metadata};
pub use reader::{GgufFile, GgufTensor};
