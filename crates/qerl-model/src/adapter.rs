//! PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`.
//!
//! Tensor names are PEFT's, `base_model.model.<module>.lora_A.weight` (`[r, d_input]`) and
//! `.lora_B.weight` (`[d_output, r]`), e.g. `base_model.model.model.layers.0.self_attn.q_proj`.
//! The update is `scale · B · A` with `scale = lora_alpha / r` (`lora_alpha / sqrt(r)` with
//! `use_rslora`). DoRA, per-module rank/alpha patterns, trained biases and `modules_to_save` are
//! rejected.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Tensor, TensorData};
use qerl_format::checkpoint::{bytes_to_f32, source_dtype};
use qerl_nn::{LoraConfig, QerlBackend};
use safetensors::SafeTensors;
use serde_json::Value;

use crate::config::Keys;
use crate::error::{config_err, read_json, ModelError, Result};
use crate::load::LoraSpec;
use crate::model::CausalLm;

/// The config file of a PEFT adapter directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The weights file of a PEFT adapter directory.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
const PREFIX: &str = "base_model.model.";

/// One module's LoRA matrices, row-major.
#[derive(Clone, Debug, PartialEq)]
struct Pair {
    a: Option<(Vec<f32>, Vec<usize>)>,
    b: Option<(Vec<f32>, Vec<usize>)>,
}

/// A PEFT LoRA adapter read into memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Adapter {
    pub dir: PathBuf,
    pub config: LoraConfig,
    /// `target_modules` of the config (e.g. `q_proj`).
    pub targets: Vec<String>,
    modules: BTreeMap<String, Pair>,
}

impl Adapter {
    /// Reads an adapter directory.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(ADAPTER_CONFIG);
        let value = read_json(&path)?;
        let k = Keys::new(&path, &value)?;
        if let Some(t) = k.str_opt("peft_type")? {
            if t != "LORA" {
                return Err(config_err(
                    &path,
                    "peft_type",
                    format!("is `{t}`; only LORA adapters are supported"),
                ));
            }
        }
        let rank = k.positive("r")?;
        let alpha = k.f64_opt("lora_alpha")?.unwrap_or(8.0);
        for key in ["use_dora", "fan_in_fan_out"] {
            if k.bool_opt(key)? == Some(true) {
                return Err(config_err(
                    &path,
                    key,
                    "is true, which qerl does not support",
                ));
            }
        }
        for key in ["rank_pattern", "alpha_pattern"] {
            if k.object(key)?.is_some_and(|m| !m.is_empty()) {
                return Err(config_err(
                    &path,
                    key,
                    "is not empty; per-module ranks are not supported",
                ));
            }
        }
        if let Some(bias) = k.str_opt("bias")? {
            if bias != "none" {
                return Err(config_err(
                    &path,
                    "bias",
                    format!("is `{bias}`; only `none` is supported"),
                ));
            }
        }
        if k.get("modules_to_save")
            .is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(config_err(
                &path,
                "modules_to_save",
                "is set; only LoRA weights are supported",
            ));
        }
        let targets = match k.get("target_modules") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        config_err(
                            &path,
                            "target_modules",
                            format!("holds {v}, not a module name"),
                        )
                    })
                })
                .collect::<Result<_>>()?,
            Some(Value::String(s)) => vec![s.clone()],
            Some(v) => {
                return Err(config_err(
                    &path,
                    "target_modules",
                    format!("is {v}, not a list of names"),
                ))
            }
        };
        // rsLoRA scales by alpha / sqrt(r): the same as alpha' / r with alpha' = alpha * sqrt(r).
        let alpha = if k.bool_opt("use_rslora")? == Some(true) {
            alpha * (rank as f64).sqrt()
        } else {
            alpha
        };
        let modules = read_weights(&dir.join(ADAPTER_WEIGHTS))?;
        Ok(Adapter {
            dir: dir.to_path_buf(),
            config: LoraConfig {
                rank,
                alpha: alpha as f32,
            },
            targets,
            modules,
        })
    }

    /// The adapters to create before [`apply`](Self::apply) fills them: one on every module
    /// the weights file has.
    pub fn spec(&self) -> LoraSpec {
        LoraSpec {
            config: self.config,
            targets: self.modules.keys().cloned().collect(),
        }
    }

    /// Module names the adapter has weights for.
    pub fn modules(&self) -> impl Iterator<Item = &str> {
        self.modules.keys().map(String::as_str)
    }

    /// Copies the LoRA matrices into the model's adapters (made with [`spec`](Self::spec)).
    pub(crate) fn apply<B: QerlBackend>(&self, model: &mut CausalLm<B>) -> Result<()> {
        let file = self.dir.join(ADAPTER_WEIGHTS);
        let device = model.device();
        let arch = model.config.arch.name();
        for (module, pair) in &self.modules {
            let tensor = |which: &str| format!("{PREFIX}{module}.lora_{which}.weight");
            let (Some(a), Some(b)) = (&pair.a, &pair.b) else {
                let which = if pair.a.is_none() { "A" } else { "B" };
                return Err(ModelError::MissingTensor {
                    dir: self.dir.clone(),
                    tensor: tensor(which),
                    needed_by: format!("the adapter of {module}"),
                });
            };
            let layer = model
                .linear_mut(module)
                .ok_or_else(|| ModelError::UnexpectedTensors {
                    dir: self.dir.clone(),
                    arch,
                    names: vec![tensor("A")],
                })?;
            let [d_out, d_in] = layer.dims();
            let r = self.config.rank;
            for (which, (_, shape), expected) in [("A", a, [r, d_in]), ("B", b, [d_out, r])] {
                if shape[..] != expected {
                    return Err(ModelError::TensorShape {
                        file: file.clone(),
                        tensor: tensor(which),
                        shape: shape.clone(),
                        expected: expected.to_vec(),
                    });
                }
            }
            let a = Tensor::<B, 2>::from_data(TensorData::new(a.0.clone(), [r, d_in]), &device);
            let b = Tensor::<B, 2>::from_data(TensorData::new(b.0.clone(), [d_out, r]), &device);
            layer.set_lora_weights(a, b);
        }
        Ok(())
    }
}

fn read_weights(path: &Path) -> Result<BTreeMap<String, Pair>> {
    let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        key: "(header)".into(),
        why: format!("is not a valid safetensors file: {e}"),
    })?;
    let mut modules: BTreeMap<String, Pair> = BTreeMap::new();
    for (name, view) in st.tensors() {
        let parsed = name.strip_prefix(PREFIX).and_then(|rest| {
            rest.strip_suffix(".lora_A.weight")
                .map(|m| (m, true))
                .or_else(|| rest.strip_suffix(".lora_B.weight").map(|m| (m, false)))
        });
        let Some((module, is_a)) = parsed else {
            return Err(ModelError::UnexpectedTensors {
                dir: path.to_path_buf(),
                arch: "LoRA adapter",
                names: vec![name],
            });
        };
        let dtype = source_dtype(view.dtype()).ok_or_else(|| ModelError::Config {
            path: path.to_path_buf(),
            key: name.clone(),
            why: format!("has dtype {:?}, expected BF16, F16 or F32", view.dtype()),
        })?;
        if view.shape().len() != 2 {
            return Err(ModelError::TensorShape {
                file: path.to_path_buf(),
                tensor: name.clone(),
                shape: view.shape().to_vec(),
                expected: vec![0, 0],
            });
        }
        let values = (bytes_to_f32(view.data(), dtype), view.shape().to_vec());
        let entry = modules
            .entry(module.to_string())
            .or_insert(Pair { a: None, b: None });
        if is_a {
            entry.a = Some(values);
        } else {
            entry.b = Some(values);
        }
    }
    Ok(modules)
}
