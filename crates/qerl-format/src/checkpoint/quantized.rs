//! [`QuantizedCheckpoint`]: reads back what [`quantize_checkpoint`](super::quantize_checkpoint)
//! writes (compressed-tensors NVFP4/MXFP4, bitsandbytes NF4), module by module.

use std::path::Path;

use safetensors::Dtype;
use serde_json::Value;

use super::error::{CheckpointError, Result};
use super::layout::{marker_module, NF4_QUANT_STATE};
use super::reader::{HfCheckpoint, RawTensor, CONFIG_FILE};
use crate::nf4::{self, NF4_TABLE};
use crate::{Mxfp4Weight, Nf4Weight, Nvfp4Weight, QuantFormat, QuantizedWeight};

/// A quantized checkpoint directory: an [`HfCheckpoint`] plus its format.
#[derive(Debug)]
pub struct QuantizedCheckpoint {
    ckpt: HfCheckpoint,
    format: QuantFormat,
}

/// The format a `config.json`'s `quantization_config` declares, if it is one qerl writes.
pub fn detect_format(config: &Value, config_path: &Path) -> Result<QuantFormat> {
    let unsupported = |why: String| CheckpointError::UnsupportedQuantization {
        path: config_path.to_path_buf(),
        why,
    };
    let q = config
        .get("quantization_config")
        .ok_or_else(|| unsupported("there is no quantization_config".into()))?;
    let get = |k: &str| q.get(k).and_then(Value::as_str).unwrap_or("");
    match get("quant_method") {
        "compressed-tensors" => match get("format") {
            "nvfp4-pack-quantized" => Ok(QuantFormat::Nvfp4),
            "mxfp4-pack-quantized" => Ok(QuantFormat::Mxfp4),
            other => Err(unsupported(format!("compressed-tensors format `{other}`"))),
        },
        "bitsandbytes" if get("bnb_4bit_quant_type") == "nf4" => Ok(QuantFormat::Nf4),
        "bitsandbytes" => Err(unsupported(format!(
            "bitsandbytes quant type `{}`",
            get("bnb_4bit_quant_type")
        ))),
        other => Err(unsupported(format!("quant_method `{other}`"))),
    }
}

impl QuantizedCheckpoint {
    /// Opens a quantized checkpoint and detects its format from `quantization_config`.
    pub fn open(dir: &Path) -> Result<Self> {
        let ckpt = HfCheckpoint::open(dir)?;
        let format = detect_format(ckpt.config(), &dir.join(CONFIG_FILE))?;
        Ok(QuantizedCheckpoint { ckpt, format })
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// The underlying checkpoint (for the tensors kept unquantized).
    pub fn checkpoint(&self) -> &HfCheckpoint {
        &self.ckpt
    }

    /// Names of the quantized modules, sorted (e.g. `model.layers.0.mlp.down_proj`).
    pub fn modules(&self) -> Vec<String> {
        self.ckpt
            .tensors()
            .filter_map(|t| marker_module(self.format, &t.name).map(str::to_string))
            .collect()
    }

    fn part(&self, module: &str, suffix: &str, dtype: Dtype) -> Result<RawTensor<'_>> {
        let tensor = format!("{module}.{suffix}");
        let info = self
            .ckpt
            .tensor_info(&tensor)
            .ok_or_else(|| CheckpointError::MissingPart {
                dir: self.ckpt.dir().to_path_buf(),
                module: module.to_string(),
                tensor: tensor.clone(),
            })?;
        if info.dtype != dtype {
            return Err(CheckpointError::Dtype {
                file: self.ckpt.file_of(info).to_path_buf(),
                tensor,
                dtype: format!("{:?}", info.dtype),
                expected: dtype_name(dtype),
            });
        }
        Ok(self.ckpt.raw_of(info))
    }

    fn bad(&self, module: &str, suffix: &str, why: String) -> CheckpointError {
        let file = self
            .ckpt
            .tensor_info(&format!("{module}.{suffix}"))
            .map(|i| self.ckpt.file_of(i).to_path_buf())
            .unwrap_or_else(|| self.ckpt.dir().to_path_buf());
        CheckpointError::BadParts {
            file,
            module: module.to_string(),
            why,
        }
    }

    /// Loads quantized module `module` (e.g. `model.layers.0.self_attn.q_proj`).
    pub fn load(&self, module: &str) -> Result<QuantizedWeight> {
        match self.format {
            QuantFormat::Nvfp4 | QuantFormat::Mxfp4 => self.load_packed(module),
            QuantFormat::Nf4 => self.load_nf4(module),
        }
    }

    fn load_packed(&self, module: &str) -> Result<QuantizedWeight> {
        let packed = self.part(module, "weight_packed", Dtype::U8)?;
        let &[rows, half] = packed.shape else {
            let why = format!("weight_packed has shape {:?}, not 2-D", packed.shape);
            return Err(self.bad(module, "weight_packed", why));
        };
        let cols = 2 * half;
        let bad_parts = |e: crate::FormatError| self.bad(module, "weight_packed", e.to_string());
        let packed = packed.data.to_vec();
        match self.format {
            QuantFormat::Nvfp4 => {
                let scale = self.part(module, "weight_scale", Dtype::F8_E4M3)?;
                let global = self.part(module, "weight_global_scale", Dtype::F32)?;
                let Ok(bytes) = <[u8; 4]>::try_from(global.data) else {
                    let why = format!("weight_global_scale has shape {:?}, not [1]", global.shape);
                    return Err(self.bad(module, "weight_global_scale", why));
                };
                let global_scale = f32::from_le_bytes(bytes);
                if !global_scale.is_finite() || global_scale == 0.0 {
                    let why = format!(
                        "weight_global_scale is {global_scale}, not a finite non-zero number"
                    );
                    return Err(self.bad(module, "weight_global_scale", why));
                }
                // E4M3 has no infinities; 0x7f and 0xff are its NaNs.
                if let Some(i) = scale.data.iter().position(|&b| b & 0x7f == 0x7f) {
                    let why = format!(
                        "weight_scale holds NaN (E4M3 byte {:#04x}) at block {i}",
                        scale.data[i]
                    );
                    return Err(self.bad(module, "weight_scale", why));
                }
                let w = Nvfp4Weight::from_parts(
                    module,
                    rows,
                    cols,
                    packed,
                    scale.data.to_vec(),
                    global_scale,
                )
                .map_err(bad_parts)?;
                Ok(QuantizedWeight::Nvfp4(w))
            }
            _ => {
                let scale = self.part(module, "weight_scale", Dtype::U8)?;
                // E8M0's 0xff is NaN.
                if let Some(i) = scale.data.iter().position(|&b| b == 0xff) {
                    let why = format!("weight_scale holds NaN (E8M0 byte 0xff) at block {i}");
                    return Err(self.bad(module, "weight_scale", why));
                }
                let w = Mxfp4Weight::from_parts(module, rows, cols, packed, scale.data.to_vec())
                    .map_err(bad_parts)?;
                Ok(QuantizedWeight::Mxfp4(w))
            }
        }
    }

    fn load_nf4(&self, module: &str) -> Result<QuantizedWeight> {
        let state_suffix = format!("weight.{NF4_QUANT_STATE}");
        let state = self.part(module, &state_suffix, Dtype::U8)?;
        let state: Value = serde_json::from_slice(state.data).map_err(|e| {
            self.bad(
                module,
                &state_suffix,
                format!("quant state is not JSON: {e}"),
            )
        })?;
        let quant_type = state.get("quant_type").and_then(Value::as_str);
        let blocksize = state.get("blocksize").and_then(Value::as_u64);
        if quant_type != Some("nf4") || blocksize != Some(nf4::BLOCK as u64) {
            let why = format!("quant state {state} is not nf4 with blocksize 64");
            return Err(self.bad(module, &state_suffix, why));
        }
        let shape: Option<Vec<usize>> = state.get("shape").and_then(Value::as_array).map(|a| {
            a.iter()
                .filter_map(|d| d.as_u64().map(|d| d as usize))
                .collect()
        });
        let Some(&[rows, cols]) = shape.as_deref() else {
            let why = format!("quant state {state} has no 2-D shape");
            return Err(self.bad(module, &state_suffix, why));
        };
        let packed = self.part(module, "weight", Dtype::U8)?;
        let absmax = self.part(module, "weight.absmax", Dtype::F32)?;
        let quant_map = self.part(module, "weight.quant_map", Dtype::F32)?;
        let n = rows * cols;
        if n == 0
            || n % nf4::BLOCK != 0
            || packed.data.len() != n / 2
            || absmax.data.len() != 4 * (n / nf4::BLOCK)
        {
            let why = format!(
                "shape [{rows}, {cols}] does not fit weight ({} bytes) and absmax ({} bytes)",
                packed.data.len(),
                absmax.data.len()
            );
            return Err(self.bad(module, "weight", why));
        }
        let table: Vec<f32> = f32s(quant_map.data);
        if table != NF4_TABLE {
            return Err(self.bad(
                module,
                "weight.quant_map",
                "quant_map is not the NF4 table".into(),
            ));
        }
        let absmax = f32s(absmax.data);
        if let Some(i) = absmax.iter().position(|v| !v.is_finite()) {
            let why = format!("weight.absmax holds {} at block {i}", absmax[i]);
            return Err(self.bad(module, "weight.absmax", why));
        }
        let w = Nf4Weight::from_parts(module, rows, cols, packed.data.to_vec(), absmax)
            .map_err(|e| self.bad(module, "weight", e.to_string()))?;
        Ok(QuantizedWeight::Nf4(w))
    }
}

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::U8 => "U8",
        Dtype::F8_E4M3 => "F8_E4M3",
        Dtype::F32 => "F32",
        _ => "another dtype",
    }
}
