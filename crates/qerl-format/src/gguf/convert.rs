//! GGUF file -> Hugging Face model directory: `config.json`, `generation_config.json`,
//! `model.safetensors` (every tensor dequantized to f32 or bf16, renamed, q/k rows of Llama
//! models un-permuted) and the tokenizer files.
//!
//! Everything is checked before the first byte is written (every tensor present, with the
//! shape the metadata implies and a type qerl reads; no tensor without a place in the model);
//! the output is staged in a hidden sibling directory and renamed into place only when
//! complete. Tensors are dequantized one at a time while `model.safetensors` is written, so
//! memory holds one tensor, not the model.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use half::bf16;
use safetensors::{Dtype, View};
use serde_json::{json, Value};

use super::error::{io, GgufError, Result};
use super::hf::{self, GgufArch, HfHyper};
use super::reader::{GgufFile, GgufTensor};
use super::tokenizer::tokenizer_files;
use crate::checkpoint::outdir::Staging;
use crate::checkpoint::pyjson;

/// The floating-point type of the written tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutDtype {
    /// Every dequantized value exactly (twice the size of bf16).
    #[default]
    F32,
    /// Rounded to nearest even, as Hugging Face checkpoints are usually shipped.
    Bf16,
}

impl OutDtype {
    fn safetensors(self) -> Dtype {
        match self {
            OutDtype::F32 => Dtype::F32,
            OutDtype::Bf16 => Dtype::BF16,
        }
    }

    /// The `torch_dtype` of `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            OutDtype::F32 => "float32",
            OutDtype::Bf16 => "bfloat16",
        }
    }
}

/// How to convert.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConvertOptions {
    pub dtype: OutDtype,
}

/// One tensor written (`done` of `total`), for a progress bar.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub done: usize,
    pub total: usize,
    pub tensor: &'a str,
}

/// What a conversion did.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvertReport {
    pub arch: GgufArch,
    pub gguf_version: u32,
    /// `general.name`, if the file has one.
    pub model_name: Option<String>,
    pub hyper: HfHyper,
    pub tensors: usize,
    pub parameters: u64,
    /// Tensor count per ggml type name.
    pub types: BTreeMap<String, usize>,
    /// q/k weights and biases whose RoPE row permutation was undone.
    pub unpermuted: usize,
    pub input_bytes: u64,
    pub output_bytes: u64,
    /// Files written, in order.
    pub files: Vec<String>,
    /// Token strings that occur twice in the vocabulary (the first id is kept).
    pub duplicate_tokens: usize,
}

/// A tensor dequantized when the safetensors writer asks for its bytes.
struct LazyTensor<'a> {
    file: &'a GgufFile,
    tensor: &'a GgufTensor,
    hf_name: &'a str,
    shape: Vec<usize>,
    dtype: OutDtype,
    rope_heads: Option<usize>,
    /// The first error met while writing (then the bytes written are zeros and the output is
    /// discarded).
    failure: &'a RefCell<Option<GgufError>>,
    done: &'a Cell<usize>,
    total: usize,
    progress: &'a dyn Fn(Progress),
}

impl LazyTensor<'_> {
    fn values(&self) -> Result<Vec<f32>> {
        let values = self.file.dequantize(self.tensor)?;
        Ok(match self.rope_heads {
            Some(heads) => {
                let cols = if self.shape.len() == 2 {
                    self.shape[1]
                } else {
                    1
                };
                hf::unpermute_rope_rows(&values, heads, cols)
            }
            None => values,
        })
    }
}

impl View for LazyTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype.safetensors()
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let bytes = match self.values() {
            Ok(values) => match self.dtype {
                OutDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                OutDtype::Bf16 => values
                    .iter()
                    .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                    .collect(),
            },
            Err(e) => {
                self.failure.borrow_mut().get_or_insert(e);
                vec![0u8; self.data_len()]
            }
        };
        self.done.set(self.done.get() + 1);
        (self.progress)(Progress {
            done: self.done.get(),
            total: self.total,
            tensor: self.hf_name,
        });
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * (self.dtype.safetensors().bitsize() / 8)
    }
}

/// Pairs every GGUF tensor with its Hugging Face name, checking names, shapes and types.
fn plan<'a>(file: &'a GgufFile, h: &HfHyper) -> Result<Vec<(String, &'a GgufTensor)>> {
    let expected: HashMap<String, Vec<usize>> = hf::expected_tensors(h).into_iter().collect();
    let mut planned = Vec::with_capacity(file.tensors.len());
    for t in &file.tensors {
        let terr = |why: String| GgufError::Tensor {
            path: file.path().to_path_buf(),
            tensor: t.name.clone(),
            why,
        };
        let name = hf::hf_name(&t.name)
            .filter(|n| expected.contains_key(n))
            .ok_or_else(|| terr(format!("has no place in this {} model", h.arch.hf_class())))?;
        let shape = t.torch_shape();
        if shape != expected[&name] {
            return Err(terr(format!(
                "has shape {shape:?} (as {name}), but the metadata implies {:?}",
                expected[&name]
            )));
        }
        if t.n_bytes.is_none() {
            return Err(GgufError::UnsupportedType {
                path: file.path().to_path_buf(),
                tensor: t.name.clone(),
                ggml_type: t.ggml_type.name(),
            });
        }
        planned.push((name, t));
    }
    if planned.len() < expected.len() {
        let mut missing: Vec<&String> = expected
            .keys()
            .filter(|n| !planned.iter().any(|(p, _)| p == *n))
            .collect();
        missing.sort();
        return Err(GgufError::Tensor {
            path: file.path().to_path_buf(),
            tensor: missing[0].clone(),
            why: format!(
                "is missing ({} Hugging Face tensors have no GGUF tensor)",
                missing.len()
            ),
        });
    }
    Ok(planned)
}

fn write_text(dir: &Path, name: &str, text: &str, files: &mut Vec<String>) -> Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, text).map_err(io("write", &path))?;
    files.push(name.to_string());
    Ok(())
}

/// Converts the GGUF file `gguf` into a Hugging Face model directory `out_dir`, which must not
/// exist or be empty.
pub fn convert_gguf(
    gguf: &Path,
    out_dir: &Path,
    options: &ConvertOptions,
    progress: &dyn Fn(Progress),
) -> Result<ConvertReport> {
    let file = GgufFile::open(gguf)?;
    let staging = Staging::new(gguf, out_dir)?;
    let h = hf::hyper(&file)?;
    let planned = plan(&file, &h)?;
    let tok = tokenizer_files(&file.metadata, h.max_position_embeddings)?;
    if tok.ids.bos.or(tok.ids.eos).is_none() {
        return Err(file.metadata.err(
            "tokenizer.ggml.eos_token_id",
            "is missing (and so is bos_token_id): generation would never stop",
        ));
    }

    let dir = staging.path();
    let mut files = Vec::new();
    let failure = RefCell::new(None);
    let done = Cell::new(0);
    let total = planned.len();
    let mut unpermuted = 0;
    let mut types: BTreeMap<String, usize> = BTreeMap::new();
    let mut parameters = 0u64;
    let views: Vec<(String, LazyTensor)> = planned
        .iter()
        .map(|(name, t)| {
            let rope_heads = hf::rope_heads(&h, name);
            unpermuted += rope_heads.is_some() as usize;
            *types.entry(t.ggml_type.name()).or_default() += 1;
            parameters += t.n_elements;
            let view = LazyTensor {
                file: &file,
                tensor: t,
                hf_name: name,
                shape: t.torch_shape(),
                dtype: options.dtype,
                rope_heads,
                failure: &failure,
                done: &done,
                total,
                progress,
            };
            (name.clone(), view)
        })
        .collect();
    let weights = dir.join("model.safetensors");
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    safetensors::serialize_to_file(views, metadata, &weights).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(source) => GgufError::Io {
            action: "write",
            path: weights.clone(),
            source,
        },
        other => GgufError::Io {
            action: "write",
            path: weights.clone(),
            source: std::io::Error::other(other.to_string()),
        },
    })?;
    if let Some(err) = failure.into_inner() {
        return Err(err);
    }
    files.push("model.safetensors".to_string());

    let config = hf::config_json(&h, &tok.ids, options.dtype.torch_name());
    write_text(
        dir,
        "config.json",
        &pyjson::dumps(&config, true),
        &mut files,
    )?;
    let mut eos: Vec<u32> = tok.ids.eos.into_iter().collect();
    eos.extend(&tok.ids.end_of_turn);
    let mut generation = json!({"_from_model_config": true});
    if let Some(bos) = tok.ids.bos {
        generation["bos_token_id"] = json!(bos);
    }
    generation["eos_token_id"] = match eos[..] {
        [one] => json!(one),
        _ => json!(eos),
    };
    if let Some(pad) = tok.ids.pad {
        generation["pad_token_id"] = json!(pad);
    }
    write_text(
        dir,
        "generation_config.json",
        &pyjson::dumps(&generation, true),
        &mut files,
    )?;
    let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON values serialize");
    write_text(dir, "tokenizer.json", &pretty(&tok.tokenizer), &mut files)?;
    write_text(
        dir,
        "tokenizer_config.json",
        &pretty(&tok.tokenizer_config),
        &mut files,
    )?;
    write_text(
        dir,
        "special_tokens_map.json",
        &pretty(&tok.special_tokens_map),
        &mut files,
    )?;

    let output_bytes = files
        .iter()
        .map(|f| std::fs::metadata(dir.join(f)).map(|m| m.len()).unwrap_or(0))
        .sum();
    staging.commit()?;
    Ok(ConvertReport {
        arch: h.arch,
        gguf_version: file.version,
        model_name: file
            .metadata
            .str_opt("general.name")
            .ok()
            .flatten()
            .map(str::to_string),
        hyper: h,
        tensors: total,
        parameters,
        types,
        unpermuted,
        input_bytes: file.len(),
        output_bytes,
        files,
        duplicate_tokens: tok.duplicate_tokens,
    })
}
