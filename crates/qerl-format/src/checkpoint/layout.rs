//! How a quantized linear is laid out as safetensors tensors, per format, in both directions.
//!
//! For a module `m` with a `[out, in]` weight:
//!
//! | format | tensor | dtype | shape |
//! | --- | --- | --- | --- |
//! | NVFP4 | `m.weight_packed` | U8 | `[out, in/2]` |
//! | | `m.weight_scale` | F8_E4M3 | `[out, in/16]` |
//! | | `m.weight_global_scale` | F32 | `[1]` |
//! | MXFP4 | `m.weight_packed` | U8 | `[out, in/2]` |
//! | | `m.weight_scale` | U8 (E8M0) | `[out, in/32]` |
//! | NF4 | `m.weight` | U8 | `[out*in/2, 1]` |
//! | | `m.weight.absmax` | F32 | `[out*in/64]` |
//! | | `m.weight.quant_map` | F32 | `[16]` |
//! | | `m.weight.quant_state.bitsandbytes__nf4` | U8 | `[len]`: JSON bytes |
//!
//! NVFP4/MXFP4 follow compressed-tensors' `nvfp4-pack-quantized` / `mxfp4-pack-quantized`
//! compressors; NF4 follows bitsandbytes' `Linear4bit._save_to_state_dict` with
//! `QuantState.as_dict(packed=True)` (blocksize 64, no double quantization), where the JSON is
//! Python's `json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape":
//! [out, in]})`.

use std::borrow::Cow;

use safetensors::{Dtype, View};

use crate::nf4::{self, NF4_TABLE};
use crate::{
    FormatError, Mxfp4Weight, Nf4Weight, Nvfp4Weight, QuantFormat, QuantizedWeight, SourceDtype,
};

/// Suffix of the NF4 quant-state tensor after `<module>.weight`.
pub const NF4_QUANT_STATE: &str = "quant_state.bitsandbytes__nf4";

/// A tensor to be written: dtype, shape and little-endian bytes (owned or borrowed).
#[derive(Clone, Debug, PartialEq)]
pub struct OutTensor<'a> {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

impl View for OutTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn owned(dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> OutTensor<'static> {
    OutTensor {
        dtype,
        shape,
        data: Cow::Owned(data),
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Quantizes a row-major `[rows, cols]` linear weight for a checkpoint.
///
/// NVFP4 uses `global` when given (the fused scale); NF4 blocks run over the flattened weight,
/// as bitsandbytes does, so only `rows * cols` must be a multiple of 64 (not `cols`).
pub fn quantize_linear(
    format: QuantFormat,
    name: &str,
    values: &[f32],
    shape: [usize; 2],
    dtype: SourceDtype,
    global: Option<f32>,
) -> Result<QuantizedWeight, FormatError> {
    Ok(match format {
        QuantFormat::Nvfp4 => {
            QuantizedWeight::Nvfp4(Nvfp4Weight::quantize(name, values, &shape, dtype, global)?)
        }
        QuantFormat::Mxfp4 => QuantizedWeight::Mxfp4(Mxfp4Weight::quantize(name, values, &shape)?),
        QuantFormat::Nf4 => QuantizedWeight::Nf4(Nf4Weight::quantize(name, values, &shape)?),
    })
}

/// The JSON bitsandbytes packs into `quant_state.bitsandbytes__nf4`, byte for byte.
pub fn nf4_quant_state_json(dtype: SourceDtype, rows: usize, cols: usize) -> String {
    let dtype = match dtype {
        SourceDtype::BF16 => "bfloat16",
        SourceDtype::F16 => "float16",
        SourceDtype::F32 => "float32",
    };
    format!(
        "{{\"quant_type\": \"nf4\", \"blocksize\": {}, \"dtype\": \"{dtype}\", \"shape\": [{rows}, {cols}]}}",
        nf4::BLOCK
    )
}

/// The tensors (name, tensor) that store quantized module `module`. `dtype` is the dtype the
/// original weight had (NF4 records it in its quant state).
pub fn module_tensors(
    module: &str,
    q: &QuantizedWeight,
    dtype: SourceDtype,
) -> Vec<(String, OutTensor<'static>)> {
    let [rows, cols] = q.shape();
    match q {
        QuantizedWeight::Nvfp4(w) => vec![
            (
                format!("{module}.weight_packed"),
                owned(Dtype::U8, vec![rows, cols / 2], w.packed.clone()),
            ),
            (
                format!("{module}.weight_scale"),
                owned(
                    Dtype::F8_E4M3,
                    vec![rows, cols / crate::nvfp4::BLOCK],
                    w.scales.clone(),
                ),
            ),
            (
                format!("{module}.weight_global_scale"),
                owned(Dtype::F32, vec![1], w.global_scale.to_le_bytes().to_vec()),
            ),
        ],
        QuantizedWeight::Mxfp4(w) => vec![
            (
                format!("{module}.weight_packed"),
                owned(Dtype::U8, vec![rows, cols / 2], w.packed.clone()),
            ),
            (
                format!("{module}.weight_scale"),
                owned(
                    Dtype::U8,
                    vec![rows, cols / crate::mxfp4::BLOCK],
                    w.scales.clone(),
                ),
            ),
        ],
        QuantizedWeight::Nf4(w) => {
            let state = nf4_quant_state_json(dtype, rows, cols).into_bytes();
            vec![
                (
                    format!("{module}.weight"),
                    owned(Dtype::U8, vec![rows * cols / 2, 1], w.packed.clone()),
                ),
                (
                    format!("{module}.weight.absmax"),
                    owned(Dtype::F32, vec![w.absmax.len()], f32_bytes(&w.absmax)),
                ),
                (
                    format!("{module}.weight.quant_map"),
                    owned(Dtype::F32, vec![16], f32_bytes(&NF4_TABLE)),
                ),
                (
                    format!("{module}.weight.{NF4_QUANT_STATE}"),
                    owned(Dtype::U8, vec![state.len()], state),
                ),
            ]
        }
    }
}

/// The module whose quantized form includes tensor `tensor`, if `tensor` is the one tensor per
/// module that marks it (`weight_packed` for NVFP4/MXFP4, the quant state for NF4).
pub fn marker_module(format: QuantFormat, tensor: &str) -> Option<&str> {
    match format {
        QuantFormat::Nvfp4 | QuantFormat::Mxfp4 => tensor.strip_suffix(".weight_packed"),
        QuantFormat::Nf4 => tensor.strip_suffix(&format!(".weight.{NF4_QUANT_STATE}")[..]),
    }
}
