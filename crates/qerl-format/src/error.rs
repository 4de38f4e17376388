//! Errors of the host-side formats.

use thiserror::Error;

/// Why a tensor could not be quantized, packed or read.
#[derive(Debug, Error, PartialEq)]
pub enum FormatError {
    /// The tensor is not 2-D or its input dimension is not a multiple of the format's block.
    #[error("tensor `{name}` has shape {shape:?}, which {format} cannot quantize: {why}")]
    Shape {
        name: String,
        shape: Vec<usize>,
        format: &'static str,
        why: String,
    },
    /// A buffer's length does not match the shape it is said to have.
    #[error("tensor `{name}`: {what} holds {got} elements but shape {shape:?} needs {expected}")]
    Length {
        name: String,
        what: &'static str,
        shape: Vec<usize>,
        expected: usize,
        got: usize,
    },
    /// A value that cannot be quantized (NaN or infinity) in the weights.
    #[error("tensor `{name}` holds a non-finite value ({value}) at flat index {index}")]
    NonFinite {
        name: String,
        index: usize,
        value: f32,
    },
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;
