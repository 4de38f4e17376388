//! Host-side 4-bit weight formats for qerl: pure Rust, no GPU.
//!
//! * [`nvfp4`]: NVFP4 exactly as compressed-tensors' `nvfp4-pack-quantized` writes it
//!   (E2M1 values, one FP8-E4M3 scale per 16 inputs, one FP32 global scale per tensor).
//! * [`mxfp4`]: OCP MX FP4 (E2M1 values, one E8M0 power-of-two scale per 32 inputs).
//! * [`nf4`]: bitsandbytes NF4 (16-level NormalFloat table, one f32 absmax per 64 inputs).
//!
//! Every format quantizes a row-major `[out, in]` matrix along `in` and has `quantize`,
//! `dequantize`, `pack` and `unpack`. [`QuantizedWeight`] holds any of them.
//! [`checkpoint`] reads Hugging Face checkpoints and writes quantized ones; [`gguf`] converts
//! llama.cpp's GGUF files into Hugging Face checkpoints. [`small_file`] reads configuration
//! files whole, refusing devices and files past a size limit.

pub mod checkpoint;
pub mod e2m1;
mod error;
pub mod fp8;
pub mod gguf;
pub mod mxfp4;
pub mod nf4;
pub mod nvfp4;
pub mod small_file;

pub use error::{FormatError, Result};
pub use mxfp4::Mxfp4Weight;
pub use nf4::Nf4Weight;
pub use nvfp4::Nvfp4Weight;

use half::{bf16, f16};

/// The 4-bit formats qerl stores frozen weights in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    Nvfp4,
    Mxfp4,
    Nf4,
}

impl QuantFormat {
    pub const ALL: [QuantFormat; 3] = [QuantFormat::Nvfp4, QuantFormat::Mxfp4, QuantFormat::Nf4];

    /// Inputs that share one scale.
    pub fn block_size(self) -> usize {
        match self {
            QuantFormat::Nvfp4 => nvfp4::BLOCK,
            QuantFormat::Mxfp4 => mxfp4::BLOCK,
            QuantFormat::Nf4 => nf4::BLOCK,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Nvfp4 => "nvfp4",
            QuantFormat::Mxfp4 => "mxfp4",
            QuantFormat::Nf4 => "nf4",
        }
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for QuantFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "nvfp4" => Ok(QuantFormat::Nvfp4),
            "mxfp4" => Ok(QuantFormat::Mxfp4),
            "nf4" => Ok(QuantFormat::Nf4),
            other => Err(format!(
                "unknown format `{other}` (expected nvfp4, mxfp4 or nf4)"
            )),
        }
    }
}

/// The floating-point type a weight was stored in. compressed-tensors does part of its
/// arithmetic in the weight's own dtype; reproducing its bytes means rounding at the same places.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SourceDtype {
    F32,
    F16,
    BF16,
}

impl SourceDtype {
    /// Smallest positive normal number of this dtype (PyTorch's `finfo(dtype).tiny`).
    pub fn min_positive_normal(self) -> f32 {
        match self {
            SourceDtype::F32 | SourceDtype::BF16 => f32::MIN_POSITIVE,
            SourceDtype::F16 => f16::MIN_POSITIVE.to_f32(),
        }
    }

    /// Rounds an f32 to this dtype (round to nearest even) and back.
    pub fn round(self, x: f32) -> f32 {
        match self {
            SourceDtype::F32 => x,
            SourceDtype::F16 => f16::from_f32(x).to_f32(),
            SourceDtype::BF16 => bf16::from_f32(x).to_f32(),
        }
    }
}

/// A quantized `[rows, cols]` matrix in any of the formats.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantizedWeight {
    Nvfp4(Nvfp4Weight),
    Mxfp4(Mxfp4Weight),
    Nf4(Nf4Weight),
}

impl QuantizedWeight {
    /// Quantizes a row-major `shape = [rows, cols]` matrix (NVFP4 with its own global scale).
    pub fn quantize(
        format: QuantFormat,
        name: &str,
        values: &[f32],
        shape: &[usize],
        dtype: SourceDtype,
    ) -> Result<Self> {
        Ok(match format {
            QuantFormat::Nvfp4 => {
                QuantizedWeight::Nvfp4(Nvfp4Weight::quantize(name, values, shape, dtype, None)?)
            }
            QuantFormat::Mxfp4 => {
                QuantizedWeight::Mxfp4(Mxfp4Weight::quantize(name, values, shape)?)
            }
            QuantFormat::Nf4 => QuantizedWeight::Nf4(Nf4Weight::quantize(name, values, shape)?),
        })
    }

    pub fn format(&self) -> QuantFormat {
        match self {
            QuantizedWeight::Nvfp4(_) => QuantFormat::Nvfp4,
            QuantizedWeight::Mxfp4(_) => QuantFormat::Mxfp4,
            QuantizedWeight::Nf4(_) => QuantFormat::Nf4,
        }
    }

    /// `[rows, cols]` = `[out_features, in_features]`.
    pub fn shape(&self) -> [usize; 2] {
        match self {
            QuantizedWeight::Nvfp4(w) => [w.rows, w.cols],
            QuantizedWeight::Mxfp4(w) => [w.rows, w.cols],
            QuantizedWeight::Nf4(w) => [w.rows, w.cols],
        }
    }

    /// The dense matrix, row-major, exactly as the format defines it (f32 arithmetic).
    pub fn dequantize(&self) -> Vec<f32> {
        match self {
            QuantizedWeight::Nvfp4(w) => w.dequantize(),
            QuantizedWeight::Mxfp4(w) => w.dequantize(),
            QuantizedWeight::Nf4(w) => w.dequantize(),
        }
    }

    /// Row `r` of the dense matrix, written into `out` (`cols` values): the same values as
    /// [`dequantize`](Self::dequantize) without materialising the whole matrix.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let [rows, cols] = self.shape();
        assert!(
            r < rows && out.len() == cols,
            "row {r} of a [{rows}, {cols}] weight"
        );
        let first = r * cols;
        // Code of flat element e: NVFP4/MXFP4 keep element 2j in the low nibble, NF4 in the high.
        let code = |packed: &[u8], e: usize, low_first: bool| -> u8 {
            let byte = packed[e / 2];
            if e.is_multiple_of(2) == low_first {
                byte & 0x0f
            } else {
                byte >> 4
            }
        };
        match self {
            QuantizedWeight::Nvfp4(w) => {
                for (c, o) in out.iter_mut().enumerate() {
                    let e = first + c;
                    let scale = fp8::e4m3_to_f32(w.scales[e / nvfp4::BLOCK]) / w.global_scale;
                    *o = e2m1::e2m1_to_f32(code(&w.packed, e, true)) * scale;
                }
            }
            QuantizedWeight::Mxfp4(w) => {
                for (c, o) in out.iter_mut().enumerate() {
                    let e = first + c;
                    let scale = fp8::e8m0_to_f32(w.scales[e / mxfp4::BLOCK]);
                    *o = e2m1::e2m1_to_f32(code(&w.packed, e, true)) * scale;
                }
            }
            QuantizedWeight::Nf4(w) => {
                for (c, o) in out.iter_mut().enumerate() {
                    let e = first + c;
                    *o = nf4::NF4_TABLE[code(&w.packed, e, false) as usize]
                        * w.absmax[e / nf4::BLOCK];
                }
            }
        }
    }

    /// 4-bit codes in element order (row-major), one per byte.
    pub fn codes(&self) -> Vec<u8> {
        match self {
            QuantizedWeight::Nvfp4(w) => w.codes(),
            QuantizedWeight::Mxfp4(w) => w.codes(),
            QuantizedWeight::Nf4(w) => w.codes(),
        }
    }

    /// Bytes the quantized form occupies (codes, scales, global scale).
    pub fn nbytes(&self) -> usize {
        match self {
            QuantizedWeight::Nvfp4(w) => w.packed.len() + w.scales.len() + 4,
            QuantizedWeight::Mxfp4(w) => w.packed.len() + w.scales.len(),
            QuantizedWeight::Nf4(w) => w.packed.len() + 4 * w.absmax.len(),
        }
    }
}

/// Checks that `values` is a `[rows, cols]` matrix with `cols` a multiple of `block`.
pub(crate) fn check_matrix(
    name: &str,
    values_len: usize,
    shape: &[usize],
    block: usize,
    format: &'static str,
) -> Result<(usize, usize)> {
    let shape_err = |why: String| FormatError::Shape {
        name: name.to_string(),
        shape: shape.to_vec(),
        format,
        why,
    };
    let &[rows, cols] = shape else {
        return Err(shape_err(format!("it is {}-D, not 2-D", shape.len())));
    };
    if rows == 0 || cols == 0 {
        return Err(shape_err("it is empty".into()));
    }
    if cols % block != 0 {
        return Err(shape_err(format!(
            "its input dimension {cols} is not a multiple of the block size {block}"
        )));
    }
    if values_len != rows * cols {
        return Err(FormatError::Length {
            name: name.to_string(),
            what: "values",
            shape: shape.to_vec(),
            expected: rows * cols,
            got: values_len,
        });
    }
    Ok((rows, cols))
}

/// Checks a stored buffer's length against what the shape needs.
pub(crate) fn check_len(
    name: &str,
    what: &'static str,
    shape: [usize; 2],
    expected: usize,
    got: usize,
) -> Result<()> {
    if expected != got {
        return Err(FormatError::Length {
            name: name.to_string(),
            what,
            shape: shape.to_vec(),
            expected,
            got,
        });
    }
    Ok(())
}

/// Errors on the first NaN or infinity.
pub(crate) fn check_finite(name: &str, values: &[f32]) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(FormatError::NonFinite {
            name: name.to_string(),
            index,
            value: values[index],
        }),
        None => Ok(()),
    }
}
