//! Writing a model as a Hugging Face checkpoint (`config.json` + `model.safetensors`), and
//! making the dense weights of a model trainable: what supervised training (`qerl sft`) and a
//! merged export need.
//!
//! Tensor names follow transformers' `Qwen2ForCausalLM` / `LlamaForCausalLM`
//! (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`, ...,
//! `model.norm.weight`, `lm_head.weight` when untied), so the files load back into qerl and into
//! transformers alike.

use std::path::{Path, PathBuf};

use burn::tensor::Tensor;
use half::bf16;
use qerl_nn::{Nvfp4Linear, QerlBackend};
use safetensors::Dtype;

use crate::error::{ModelError, Result};
use crate::model::CausalLm;

/// A named host tensor: `(name, shape, row-major values)`.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// The element type a checkpoint is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    Bf16,
    F32,
}

impl ExportDtype {
    /// The `torch_dtype` of config.json.
    pub fn torch_name(self) -> &'static str {
        match self {
            ExportDtype::Bf16 => "bfloat16",
            ExportDtype::F32 => "float32",
        }
    }
}

fn host<B: QerlBackend, const D: usize>(t: Tensor<B, D>) -> (Vec<usize>, Vec<f32>) {
    let shape = t.dims().to_vec();
    (shape, t.into_data().iter::<f32>().collect())
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl<B: QerlBackend> CausalLm<B> {
    /// The decoder linear named like its checkpoint module (see
    /// [`linear_mut`](Self::linear_mut)).
    pub fn linear(&self, module: &str) -> Option<&Nvfp4Linear<B>> {
        let (i, suffix) = module.strip_prefix("model.layers.")?.split_once('.')?;
        let layer = self.layers.get(i.parse::<usize>().ok()?)?;
        Some(match suffix {
            "self_attn.q_proj" => &layer.self_attn.q_proj,
            "self_attn.k_proj" => &layer.self_attn.k_proj,
            "self_attn.v_proj" => &layer.self_attn.v_proj,
            "self_attn.o_proj" => &layer.self_attn.o_proj,
            "mlp.gate_proj" => &layer.mlp.gate_proj,
            "mlp.up_proj" => &layer.mlp.up_proj,
            "mlp.down_proj" => &layer.mlp.down_proj,
            _ => return None,
        })
    }

    /// Every weight under its transformers name. Decoder linears are written as
    /// [`Nvfp4Linear::merged_weight`]: a 4-bit weight dequantized, a LoRA adapter merged in.
    pub fn export_tensors(&self) -> Vec<NamedTensor> {
        let mut out = Vec::new();
        let mut push =
            |name: String, (shape, values): (Vec<usize>, Vec<f32>)| out.push((name, shape, values));
        push(
            "model.embed_tokens.weight".into(),
            host(self.embed_tokens.val()),
        );
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            push(
                format!("{p}.input_layernorm.weight"),
                host(layer.input_layernorm.weight.val()),
            );
            push(
                format!("{p}.post_attention_layernorm.weight"),
                host(layer.post_attention_layernorm.weight.val()),
            );
            for (name, ..) in self.config.linears() {
                let lin = self
                    .linear(&format!("{p}.{name}"))
                    .expect("every configured linear exists");
                push(format!("{p}.{name}.weight"), host(lin.merged_weight()));
                if let Some(b) = &lin.bias {
                    push(format!("{p}.{name}.bias"), host(b.val()));
                }
            }
        }
        push("model.norm.weight".into(), host(self.norm.weight.val()));
        if let Some(w) = &self.lm_head {
            push("lm_head.weight".into(), host(w.val()));
        }
        out
    }

    /// Marks every weight trainable (embeddings, lm_head, dense linears and their biases,
    /// norms) for full-parameter training. The decoder linears must be dense
    /// ([`crate::Precision::Bf16`]): a 4-bit weight has no gradient. Intended for f32 backends
    /// (the parameters keep the backend's float type).
    pub fn set_base_trainable(&mut self) -> Result<()> {
        self.embed_tokens = self.embed_tokens.clone().set_require_grad(true);
        self.lm_head = self.lm_head.take().map(|p| p.set_require_grad(true));
        let names: Vec<String> = (0..self.layers.len())
            .flat_map(|i| {
                self.config
                    .linears()
                    .map(|(n, ..)| format!("model.layers.{i}.{n}"))
            })
            .collect();
        for name in names {
            let lin = self
                .linear_mut(&name)
                .expect("every configured linear exists");
            let Some(w) = lin.dense.take() else {
                return Err(ModelError::Precision {
                    path: self.config.path.clone(),
                    why: format!("`{name}` is quantized: only a dense model can be fully trained"),
                });
            };
            lin.dense = Some(w.set_require_grad(true));
            lin.bias = lin.bias.take().map(|b| b.set_require_grad(true));
        }
        for norm in self.norms_mut() {
            norm.weight = norm.weight.clone().set_require_grad(true);
        }
        Ok(())
    }
}

/// Writes `tensors` as one safetensors file in `dtype`, through a temporary file renamed into
/// place (a crash never leaves a half-written checkpoint).
pub fn write_safetensors(path: &Path, tensors: &[NamedTensor], dtype: ExportDtype) -> Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| match dtype {
            ExportDtype::Bf16 => v
                .iter()
                .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                .collect(),
            ExportDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        })
        .collect();
    let st_dtype = match dtype {
        ExportDtype::Bf16 => Dtype::BF16,
        ExportDtype::F32 => Dtype::F32,
    };
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            safetensors::tensor::TensorView::new(st_dtype, shape.clone(), b)
                .map(|v| (name.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| ModelError::Input(format!("cannot write `{}`: {e}", path.display())))?;
    let tmp = tmp_path(path);
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &tmp)
        .map_err(|e| ModelError::Input(format!("cannot write `{}`: {e}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Writes `text` to `path` through a temporary file renamed into place.
pub fn write_atomic(path: &Path, text: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Saves `model` into `dir` as a Hugging Face checkpoint: `model.safetensors` in `dtype` (4-bit
/// linears dequantized, adapters merged) and the `config.json` the model was loaded from, with
/// `torch_dtype` set to `dtype`. The tokenizer is not written (copy it alongside).
pub fn save_pretrained<B: QerlBackend>(
    model: &CausalLm<B>,
    dir: &Path,
    dtype: ExportDtype,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let src = &model.config().path;
    let text = std::fs::read_to_string(src).map_err(io(src))?;
    let mut config: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: src.clone(),
            source,
        })?;
    if let Some(obj) = config.as_object_mut() {
        obj.insert("torch_dtype".into(), dtype.torch_name().into());
        // a quantized source's quantization_config does not describe the dense export
        obj.remove("quantization_config");
    }
    write_safetensors(
        &dir.join("model.safetensors"),
        &model.export_tensors(),
        dtype,
    )?;
    let json = serde_json::to_string_pretty(&config).expect("a JSON value serializes");
    write_atomic(&dir.join("config.json"), json.as_bytes())
}
