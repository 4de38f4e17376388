//! The host half of loading: checkpoint bytes (memory-mapped) turned into what the device takes,
//! on every core, with every value checked to be finite.
//!
//! The loader plans each tensor on one thread (presence, shape, in the order a sequential read
//! would meet them, so the first error is the one it always was), then converts a stage's
//! tensors here: a dense tensor straight from its stored dtype to the backend's float type in
//! chunks over all cores (no f32 copy for a bf16 backend), a quantized module read as stored
//! (no unpacking), a dense linear quantized at load on a core of its own.

use std::collections::BTreeSet;
use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::{Element, TensorData};
use half::{bf16, f16};
use qerl_format::checkpoint::{
    par, CheckpointError, HfCheckpoint, QuantizedCheckpoint, TensorInfo,
};
use qerl_format::{QuantFormat, QuantizedWeight, SourceDtype};

use qerl_nn::Precision;

use crate::error::{ModelError, Result};

/// The weights of a model directory, dense or quantized.
pub(crate) enum Source {
    Dense(HfCheckpoint),
    Quantized(QuantizedCheckpoint),
}

impl Source {
    pub(crate) fn ckpt(&self) -> &HfCheckpoint {
        match self {
            Source::Dense(c) => c,
            Source::Quantized(q) => q.checkpoint(),
        }
    }
}

/// Plans the tensors of a stage: checks that each is present with its shape, in the order a
/// sequential read meets them, and records what was used.
pub(crate) struct Planner<'a> {
    pub(crate) source: &'a Source,
    pub(crate) quantized_modules: BTreeSet<String>,
    pub(crate) used: BTreeSet<String>,
}

impl Planner<'_> {
    fn dir(&self) -> PathBuf {
        self.source.ckpt().dir().to_path_buf()
    }

    /// The checked info of a dense tensor.
    pub(crate) fn check(
        &mut self,
        name: &str,
        shape: &[usize],
        needed_by: &str,
    ) -> Result<TensorInfo> {
        let ckpt = self.source.ckpt();
        let info = ckpt
            .tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor {
                dir: self.dir(),
                tensor: name.to_string(),
                needed_by: needed_by.to_string(),
            })?;
        if info.shape != shape {
            return Err(ModelError::TensorShape {
                file: ckpt.file_of(info).to_path_buf(),
                tensor: name.to_string(),
                shape: info.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        self.used.insert(name.to_string());
        Ok(info.clone())
    }

    /// The jobs of one decoder linear: its bias (if any), then its weight.
    pub(crate) fn linear(
        &mut self,
        module: &str,
        (d_out, d_in, has_bias): (usize, usize, bool),
        precision: Precision,
        jobs: &mut Vec<Job>,
    ) -> Result<()> {
        if has_bias {
            let info = self.check(&format!("{module}.bias"), &[d_out], module)?;
            jobs.push(Job::F32(info));
        }
        if self.quantized_modules.contains(module) {
            let Source::Quantized(q) = self.source else {
                unreachable!("quantized modules come from a quantized checkpoint")
            };
            let prefix = format!("{module}.");
            let parts = q
                .checkpoint()
                .tensors()
                .filter(|t| t.name.starts_with(&prefix) && t.name != format!("{module}.bias"))
                .map(|t| t.name.clone());
            self.used.extend(parts);
            jobs.push(Job::Quantized {
                module: module.to_string(),
                shape: [d_out, d_in],
                twin: precision == Precision::Bf16,
            });
            return Ok(());
        }
        let info = self.check(&format!("{module}.weight"), &[d_out, d_in], module)?;
        jobs.push(match precision.format() {
            Some(format) => Job::Quantize {
                info,
                format,
                module: module.to_string(),
            },
            None => Job::Float(info),
        });
        Ok(())
    }
}

/// One tensor to convert, as planned (present, with the expected shape).
pub(crate) enum Job {
    /// A small dense tensor widened to f32 (norm weights, biases).
    F32(TensorInfo),
    /// A dense tensor in the backend's float type (embeddings, lm_head, bf16 linears).
    Float(TensorInfo),
    /// A dense linear quantized at load.
    Quantize {
        info: TensorInfo,
        format: QuantFormat,
        module: String,
    },
    /// A quantized module as stored; with `twin`, dequantized to its bf16 twin in the
    /// backend's float type.
    Quantized {
        module: String,
        shape: [usize; 2],
        twin: bool,
    },
}

/// A converted tensor, ready to upload.
pub(crate) enum Host {
    F32(Vec<f32>),
    Float(TensorData),
    Quantized(QuantizedWeight),
}

impl Job {
    /// Converts the tensor. `E` is the backend's float type.
    pub(crate) fn run<E: Element>(&self, source: &Source) -> Result<Host> {
        let ckpt = source.ckpt();
        match self {
            Job::F32(info) => {
                let (values, _) = ckpt.read_f32(&info.name)?;
                check_finite(ckpt, info, &values)?;
                Ok(Host::F32(values))
            }
            Job::Float(info) => float_data::<E>(ckpt, info).map(Host::Float),
            Job::Quantize {
                info,
                format,
                module,
            } => {
                let (values, dtype) = ckpt.read_f32(&info.name)?;
                check_finite(ckpt, info, &values)?;
                QuantizedWeight::quantize(*format, module, &values, &info.shape, dtype)
                    .map(Host::Quantized)
                    .map_err(|e| ModelError::Nn(format!("{module}: {e}")))
            }
            Job::Quantized {
                module,
                shape,
                twin,
            } => {
                let Source::Quantized(q) = source else {
                    unreachable!("quantized modules come from a quantized checkpoint")
                };
                let w = q.load(module)?;
                if w.shape() != *shape {
                    return Err(quantized_shape_error(q, module, &w, *shape));
                }
                if !*twin {
                    return Ok(Host::Quantized(w));
                }
                // Rounded to bf16 as compressed-tensors' decompression does.
                let dense: Vec<E> = w
                    .dequantize()
                    .into_iter()
                    .map(|x| E::from_elem(SourceDtype::BF16.round(x)))
                    .collect();
                Ok(Host::Float(TensorData::new(dense, shape.to_vec())))
            }
        }
    }
}

fn quantized_shape_error(
    q: &QuantizedCheckpoint,
    module: &str,
    w: &QuantizedWeight,
    shape: [usize; 2],
) -> ModelError {
    let part = format!(
        "{module}.{}",
        if w.format() == QuantFormat::Nf4 {
            "weight"
        } else {
            "weight_packed"
        }
    );
    let file = q
        .checkpoint()
        .tensor_info(&part)
        .map(|i| q.checkpoint().file_of(i).to_path_buf());
    ModelError::TensorShape {
        file: file.unwrap_or_else(|| q.checkpoint().dir().to_path_buf()),
        tensor: part,
        shape: w.shape().to_vec(),
        expected: shape.to_vec(),
    }
}

/// The first NaN or infinity of `values` as an error naming the tensor and its file.
fn check_finite(ckpt: &HfCheckpoint, info: &TensorInfo, values: &[f32]) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(non_finite(ckpt, info, index, values[index])),
        None => Ok(()),
    }
}

fn non_finite(ckpt: &HfCheckpoint, info: &TensorInfo, index: usize, value: f32) -> ModelError {
    ModelError::NonFinite {
        file: PathBuf::from(ckpt.file_of(info)),
        tensor: info.name.clone(),
        index,
        value,
    }
}

/// A BF16/F16/F32 tensor converted to `E` on every core, checked finite on the way.
fn float_data<E: Element>(ckpt: &HfCheckpoint, info: &TensorInfo) -> Result<TensorData> {
    let raw = ckpt.raw(&info.name)?;
    let Some(dtype) = qerl_format::checkpoint::source_dtype(raw.dtype) else {
        return Err(CheckpointError::Dtype {
            file: ckpt.file_of(info).to_path_buf(),
            tensor: info.name.clone(),
            dtype: format!("{:?}", raw.dtype),
            expected: "BF16, F16 or F32",
        }
        .into());
    };
    let width = match dtype {
        SourceDtype::F32 => 4,
        _ => 2,
    };
    let n = raw.data.len() / width;
    let first_bad = AtomicUsize::new(usize::MAX);
    let mut out: Vec<E> = Vec::with_capacity(n);
    par::convert_into(
        raw.data,
        width,
        &mut out.spare_capacity_mut()[..n],
        |offset, bytes: &[u8], dst: &mut [MaybeUninit<E>]| {
            let mut bad = None;
            for (i, (d, b)) in dst.iter_mut().zip(bytes.chunks_exact(width)).enumerate() {
                let x = widen(b, dtype);
                if bad.is_none() && !x.is_finite() {
                    bad = Some(offset + i);
                }
                d.write(E::from_elem(x));
            }
            if let Some(i) = bad {
                first_bad.fetch_min(i, Ordering::Relaxed);
            }
        },
    );
    // SAFETY: `convert_into` wrote every one of the first `n` slots.
    unsafe { out.set_len(n) };
    let bad = first_bad.into_inner();
    if bad != usize::MAX {
        let value = widen(&raw.data[bad * width..(bad + 1) * width], dtype);
        return Err(non_finite(ckpt, info, bad, value));
    }
    Ok(TensorData::new(out, info.shape.clone()))
}

/// One little-endian value widened to f32 (exact).
fn widen(b: &[u8], dtype: SourceDtype) -> f32 {
    match dtype {
        SourceDtype::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        SourceDtype::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
        SourceDtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}
