//! [`quantize_checkpoint`]: a Hugging Face checkpoint in, a quantized one out, one shard at a
//! time.
//!
//! 1. Plan: classify every tensor (see [`names`](super::names)) and check each linear's dtype
//!    and shape from the headers alone, so a bad layer stops the run before any work.
//! 2. NVFP4 only: one streaming pass computes each linear's global scale; q/k/v of a layer and
//!    gate/up share the minimum of theirs.
//! 3. Per input shard: quantize its linears, keep every other tensor's bytes, write the output
//!    shard under the same file name (`__metadata__ = {"format": "pt"}`).
//! 4. Write `config.json` with `quantization_config`, the updated index, copy the other files,
//!    and rename the staging directory into place.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use serde_json::{json, Value};

use super::config::{config_text, quantized_config};
use super::error::{io, CheckpointError, Result};
use super::layout::{module_tensors, quantize_linear, OutTensor};
use super::names::{classify, LinearKind, LinearName};
use super::outdir::{copy_other_files, Staging};
use super::par;
use super::pyjson;
use super::reader::{source_dtype, HfCheckpoint, TensorInfo, CONFIG_FILE, INDEX_FILE};
use crate::nvfp4;
use crate::{QuantFormat, SourceDtype};

/// What [`quantize_checkpoint`] is doing, for a progress display.
#[derive(Clone, Debug, PartialEq)]
pub enum ProgressEvent {
    /// A pass over `total` tensors starts: `"scan"` (NVFP4 global scales) or `"quantize"`.
    Pass { name: &'static str, total: usize },
    /// One tensor of the current pass is done (`quantized`: it was quantized, not kept or
    /// only scanned).
    Tensor { name: String, quantized: bool },
    /// An output shard was written.
    ShardWritten { file: String, bytes: u64 },
}

/// One quantized linear in the report.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStat {
    /// Module name, e.g. `model.layers.0.self_attn.q_proj`.
    pub module: String,
    pub kind: LinearKind,
    /// `[out, in]`.
    pub shape: [usize; 2],
    /// `‖W − deq(Q(W))‖ / ‖W‖` (Frobenius norms, f64; 0 for an all-zero W).
    pub rel_error: f64,
    /// NVFP4 global scale used (the fused one for q/k/v and gate/up), `None` for other formats.
    pub global_scale: Option<f32>,
}

/// What a run did.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizeReport {
    pub format: QuantFormat,
    /// Bytes of the input safetensors files.
    pub input_bytes: u64,
    /// Bytes of the output safetensors files.
    pub output_bytes: u64,
    /// Every quantized linear, shard by shard in file order.
    pub layers: Vec<LayerStat>,
    /// Tensors written unchanged.
    pub kept: usize,
    /// Non-weight files copied (relative paths).
    pub copied: Vec<String>,
}

impl QuantizeReport {
    /// `input_bytes / output_bytes`.
    pub fn ratio(&self) -> f64 {
        self.input_bytes as f64 / self.output_bytes.max(1) as f64
    }

    /// Mean relative error per layer kind (kinds that occur, in q, k, v, o, gate, up, down
    /// order): (kind, count, mean).
    pub fn mean_error_by_kind(&self) -> Vec<(LinearKind, usize, f64)> {
        LinearKind::ALL
            .into_iter()
            .filter_map(|kind| {
                let errs: Vec<f64> = self
                    .layers
                    .iter()
                    .filter(|l| l.kind == kind)
                    .map(|l| l.rel_error)
                    .collect();
                (!errs.is_empty()).then(|| {
                    (
                        kind,
                        errs.len(),
                        errs.iter().sum::<f64>() / errs.len() as f64,
                    )
                })
            })
            .collect()
    }
}

/// A linear weight to quantize, validated from the header.
struct Linear<'a> {
    info: &'a TensorInfo,
    name: LinearName,
    shape: [usize; 2],
}

/// Quantizes every decoder linear of the checkpoint at `input` into `format` and writes the
/// result to `output` (which must be absent or an empty directory). See the module docs.
pub fn quantize_checkpoint(
    input: &Path,
    output: &Path,
    format: QuantFormat,
    progress: &mut dyn FnMut(ProgressEvent),
) -> Result<QuantizeReport> {
    let ckpt = HfCheckpoint::open(input)?;
    let staging = Staging::new(input, output)?;
    let linears = plan(&ckpt, format)?;
    let globals = match format {
        QuantFormat::Nvfp4 => nvfp4_global_scales(&ckpt, &linears, progress)?,
        _ => HashMap::new(),
    };
    progress(ProgressEvent::Pass {
        name: "quantize",
        total: ckpt.tensors().count(),
    });
    let mut run = ShardWriter {
        ckpt: &ckpt,
        dir: staging.path(),
        format,
        linears: linears.iter().map(|l| (l.info.name.as_str(), l)).collect(),
        globals,
        report: QuantizeReport {
            format,
            input_bytes: ckpt.shards().iter().map(|s| s.file_size()).sum(),
            output_bytes: 0,
            layers: Vec::with_capacity(linears.len()),
            kept: 0,
            copied: Vec::new(),
        },
        weight_map: BTreeMap::new(),
        total_size: 0,
    };
    for s in 0..ckpt.shards().len() {
        run.write_shard(s, progress)?;
    }
    let ShardWriter {
        mut report,
        weight_map,
        total_size,
        ..
    } = run;

    let dtype = linears
        .first()
        .and_then(|l| source_dtype(l.info.dtype))
        .unwrap_or(SourceDtype::BF16);
    let config = ckpt.config().as_object().expect("checked when opened");
    let config = quantized_config(config, format, dtype);
    write_text(
        &staging.path().join(CONFIG_FILE),
        &config_text(&config, format),
    )?;
    if let Some(index) = ckpt.index() {
        let mut index = index.clone();
        let meta = index
            .as_object_mut()
            .expect("index has a weight_map, so it is an object")
            .entry("metadata")
            .or_insert_with(|| json!({}));
        if let Some(meta) = meta.as_object_mut() {
            meta.insert("total_size".into(), json!(total_size));
        }
        index["weight_map"] = Value::Object(weight_map.into_iter().collect());
        write_text(
            &staging.path().join(INDEX_FILE),
            &(pyjson::dumps(&index, true) + "\n"),
        )?;
    }
    let mut skip: HashSet<&str> = ckpt.shards().iter().map(|s| s.file_name.as_str()).collect();
    skip.extend([CONFIG_FILE, INDEX_FILE]);
    report.copied = copy_other_files(input, staging.path(), &skip)?;
    staging.commit()?;
    Ok(report)
}

/// Writes output shards and accumulates the report and the index.
struct ShardWriter<'a> {
    ckpt: &'a HfCheckpoint,
    dir: &'a Path,
    format: QuantFormat,
    linears: HashMap<&'a str, &'a Linear<'a>>,
    globals: HashMap<String, f32>,
    report: QuantizeReport,
    weight_map: BTreeMap<String, Value>,
    total_size: u64,
}

impl ShardWriter<'_> {
    /// Quantizes the linears of shard `s` (in parallel), keeps the rest, writes the file.
    fn write_shard(&mut self, s: usize, progress: &mut dyn FnMut(ProgressEvent)) -> Result<()> {
        let ckpt = self.ckpt;
        let shard = &ckpt.shards()[s];
        let (todo, kept): (Vec<&TensorInfo>, Vec<&TensorInfo>) = ckpt
            .shard_tensors(s)
            .partition(|i| self.linears.contains_key(i.name.as_str()));
        let mut out: Vec<(String, OutTensor)> = Vec::new();
        for info in kept {
            let raw = ckpt.raw_of(info);
            let (dtype, shape) = (raw.dtype, raw.shape.to_vec());
            let data = Cow::Borrowed(raw.data);
            out.push((info.name.clone(), OutTensor { dtype, shape, data }));
            self.report.kept += 1;
            progress(ProgressEvent::Tensor {
                name: info.name.clone(),
                quantized: false,
            });
        }
        let done = par::map(
            todo.len(),
            |i| {
                let linear = self.linears[todo[i].name.as_str()];
                let global = self.globals.get(&linear.name.module).copied();
                quantize_one(ckpt, linear, self.format, global)
            },
            |i, _| {
                progress(ProgressEvent::Tensor {
                    name: todo[i].name.clone(),
                    quantized: true,
                })
            },
        )?;
        for (tensors, stat) in done {
            out.extend(tensors);
            self.report.layers.push(stat);
        }
        for (name, t) in &out {
            self.total_size += t.data.len() as u64;
            let file = Value::String(shard.file_name.clone());
            self.weight_map.insert(name.clone(), file);
        }
        let path = self.dir.join(&shard.file_name);
        let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
        safetensors::serialize_to_file(out, metadata, &path).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(source) => CheckpointError::Io {
                action: "cannot write",
                path: path.clone(),
                source,
            },
            source => CheckpointError::Header {
                path: path.clone(),
                source,
            },
        })?;
        let bytes = std::fs::metadata(&path)
            .map_err(io("cannot stat", &path))?
            .len();
        self.report.output_bytes += bytes;
        progress(ProgressEvent::ShardWritten {
            file: shard.file_name.clone(),
            bytes,
        });
        Ok(())
    }
}

fn write_text(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(io("cannot write", path))
}

/// Finds the linears and checks dtype and shape from the headers.
fn plan(ckpt: &HfCheckpoint, format: QuantFormat) -> Result<Vec<Linear<'_>>> {
    let block = format.block_size();
    let mut linears = Vec::new();
    for (s, _) in ckpt.shards().iter().enumerate() {
        for info in ckpt.shard_tensors(s) {
            let Some(name) = classify(&info.name) else {
                continue;
            };
            let file = ckpt.file_of(info).to_path_buf();
            if source_dtype(info.dtype).is_none() {
                return Err(CheckpointError::Dtype {
                    file,
                    tensor: info.name.clone(),
                    dtype: format!("{:?}", info.dtype),
                    expected: "BF16, F16 or F32 for a linear weight",
                });
            }
            let shape_err = |why: String| CheckpointError::Shape {
                file: file.clone(),
                tensor: info.name.clone(),
                shape: info.shape.clone(),
                why,
            };
            let &[rows, cols] = info.shape.as_slice() else {
                let why = format!(
                    "a linear weight must be 2-D, this is {}-D",
                    info.shape.len()
                );
                return Err(shape_err(why));
            };
            if rows == 0 || cols == 0 {
                return Err(shape_err("the weight is empty".into()));
            }
            let fits = match format {
                // bitsandbytes blocks run over the flattened weight.
                QuantFormat::Nf4 => (rows * cols) % block == 0,
                _ => cols % block == 0,
            };
            if !fits {
                let what = match format {
                    QuantFormat::Nf4 => format!("its element count {}", rows * cols),
                    _ => format!("in_features {cols}"),
                };
                return Err(shape_err(format!(
                    "{what} is not a multiple of the {} block size {block}",
                    format.name().to_uppercase()
                )));
            }
            linears.push(Linear {
                info,
                name,
                shape: [rows, cols],
            });
        }
    }
    Ok(linears)
}

/// NVFP4 global scale per module: its own, or its fused group's minimum.
fn nvfp4_global_scales(
    ckpt: &HfCheckpoint,
    linears: &[Linear],
    progress: &mut dyn FnMut(ProgressEvent),
) -> Result<HashMap<String, f32>> {
    progress(ProgressEvent::Pass {
        name: "scan",
        total: linears.len(),
    });
    let scales = par::map(
        linears.len(),
        |i| {
            let (values, dtype) = ckpt.read_f32_of(linears[i].info)?;
            Ok(nvfp4::global_scale(&values, dtype))
        },
        |i, _| {
            progress(ProgressEvent::Tensor {
                name: linears[i].info.name.clone(),
                quantized: false,
            })
        },
    )?;
    let mut own = HashMap::with_capacity(linears.len());
    let mut fused: HashMap<String, Vec<f32>> = HashMap::new();
    for (l, &g) in linears.iter().zip(&scales) {
        own.insert(l.name.module.clone(), g);
        if let Some(key) = l.name.fused_key() {
            fused.entry(key).or_default().push(g);
        }
    }
    Ok(linears
        .iter()
        .map(|l| {
            let g = match l.name.fused_key() {
                Some(key) => nvfp4::fused_global_scale(&fused[&key]),
                None => own[&l.name.module],
            };
            (l.name.module.clone(), g)
        })
        .collect())
}

/// Quantizes one linear: its output tensors and its report line.
fn quantize_one(
    ckpt: &HfCheckpoint,
    linear: &Linear,
    format: QuantFormat,
    global: Option<f32>,
) -> Result<(Vec<(String, OutTensor<'static>)>, LayerStat)> {
    let info = linear.info;
    let (values, dtype) = ckpt.read_f32_of(info)?;
    let q = quantize_linear(format, &info.name, &values, linear.shape, dtype, global).map_err(
        |source| CheckpointError::Quantize {
            file: ckpt.file_of(info).to_path_buf(),
            tensor: info.name.clone(),
            source: Box::new(source),
        },
    )?;
    let rel_error = relative_error(&values, &q.dequantize());
    let stat = LayerStat {
        module: linear.name.module.clone(),
        kind: linear.name.kind,
        shape: linear.shape,
        rel_error,
        global_scale: global,
    };
    Ok((module_tensors(&linear.name.module, &q, dtype), stat))
}

/// `‖w − d‖ / ‖w‖` in f64, 0 when `w` is all zeros.
pub fn relative_error(w: &[f32], d: &[f32]) -> f64 {
    let (num, den) = w.iter().zip(d).fold((0.0f64, 0.0f64), |(n, dn), (&a, &b)| {
        let diff = a as f64 - b as f64;
        (n + diff * diff, dn + (a as f64) * (a as f64))
    });
    if den == 0.0 {
        0.0
    } else {
        (num / den).sqrt()
    }
}
