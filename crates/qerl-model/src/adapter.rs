//! PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`.
//!
//! Tensor names are PEFT's, `base_model.model.<module>.lora_A.weight` (`[r, d_input]`) and
//! `.lora_B.weight` (`[d_output, r]`), e.g. `base_model.model.model.layers.0.self_attn.q_proj`.
//! The update is `scale · B · A` with `scale = lora_alpha / r` (`lora_alpha / sqrt(r)` with
//! `use_rslora`); `rank_pattern` and `alpha_pattern` give some modules their own `r` and
//! `lora_alpha`, as in PEFT: the first key `k` (in file order) for which the module name
//! matches the regular expression `(.*\.)?(k)$`.
//!
//! Trained RMSNorm weights come as `modules_to_save` (see [`crate::adapter_norms`]).
//! Whatever else would make PEFT's model differ from what qerl runs is refused, naming the
//! key: other PEFT types, DoRA, `fan_in_fan_out`, trained biases, and the LoRA variants that
//! change the forward.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Tensor, TensorData};
use qerl_format::checkpoint::{bytes_to_f32, source_dtype};
use qerl_nn::{LoraConfig, QerlBackend};
use regex::Regex;
use safetensors::SafeTensors;
use serde_json::Value;

use crate::adapter_norms::{self, SavedModules, SavedWeight, PEFT_PREFIX};
use crate::config::{Keys, ModelConfig};
use crate::error::{config_err, read_json, ModelError, Result};
use crate::model::CausalLm;

/// The config file of a PEFT adapter directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The weights file of a PEFT adapter directory.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// Config keys that change PEFT's forward in ways qerl does not implement (DoRA and PEFT's
/// other LoRA variants, transposed weights, trained biases, layer replication, trainable
/// tokens, LoRA on parameters), refused when set to anything but their neutral value
/// (`false`, `null`, an empty list or object).
const UNSUPPORTED: [&str; 13] = [
    "use_dora",
    "fan_in_fan_out",
    "lora_bias",
    "use_qalora",
    "layer_replication",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "target_parameters",
    "velora_config",
    "monteclora_config",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
];

/// One module's LoRA matrices, row-major.
#[derive(Clone, Debug, PartialEq)]
struct Pair {
    a: Option<(Vec<f32>, Vec<usize>)>,
    b: Option<(Vec<f32>, Vec<usize>)>,
}

/// A `rank_pattern` / `alpha_pattern` entry: PEFT's key and value, and the key as a regex
/// anchored as PEFT anchors it.
#[derive(Clone, Debug)]
struct Pattern {
    key: String,
    regex: Regex,
    value: f64,
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key && self.value == other.value
    }
}

/// The value of the first pattern matching `module`.
fn first_match(patterns: &[Pattern], module: &str) -> Option<f64> {
    patterns
        .iter()
        .find(|p| p.regex.is_match(module))
        .map(|p| p.value)
}

/// A PEFT LoRA adapter read into memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Adapter {
    pub dir: PathBuf,
    /// `r` and `lora_alpha` of the modules no pattern names (`use_rslora` folded into alpha).
    pub config: LoraConfig,
    /// `target_modules` of the config (e.g. `q_proj`).
    pub targets: Vec<String>,
    modules: BTreeMap<String, Pair>,
    rank_pattern: Vec<Pattern>,
    alpha_pattern: Vec<Pattern>,
    lora_alpha: f64,
    use_rslora: bool,
    saved: SavedModules,
}

/// `rank_pattern` / `alpha_pattern`: module regex -> number, in file order.
fn patterns(k: &Keys, key: &str, integer: bool) -> Result<Vec<Pattern>> {
    let Some(map) = k.object(key)? else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(pattern, v)| {
            let bad = |why: String| config_err(k.path, format!("{key}.{pattern}"), why);
            let value = match v.as_f64() {
                Some(x) if integer && (v.as_u64().is_none() || x < 1.0) => {
                    return Err(bad(format!("is {v}, not a positive integer rank")))
                }
                Some(x) => x,
                None => return Err(bad(format!("is {v}, not a number"))),
            };
            let regex = Regex::new(&format!(r"^(?:.*\.)?(?:{pattern})$"))
                .map_err(|e| bad(format!("is not a regular expression qerl can read: {e}")))?;
            Ok(Pattern {
                key: pattern.clone(),
                regex,
                value,
            })
        })
        .collect()
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
        let lora_alpha = k.f64_opt("lora_alpha")?.unwrap_or(8.0);
        for key in UNSUPPORTED {
            let neutral = match k.get(key) {
                None | Some(Value::Bool(false)) => true,
                Some(Value::Array(a)) => a.is_empty(),
                Some(Value::Object(o)) => o.is_empty(),
                Some(_) => false,
            };
            if !neutral {
                return Err(config_err(
                    &path,
                    key,
                    format!("is {}, which qerl does not support", k.get(key).unwrap()),
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
        let use_rslora = k.bool_opt("use_rslora")? == Some(true);
        let rank_pattern = patterns(&k, "rank_pattern", true)?;
        let alpha_pattern = patterns(&k, "alpha_pattern", false)?;
        let mut saved = SavedModules {
            entries: adapter_norms::entries(&k)?,
            ..SavedModules::default()
        };
        let weights_path = dir.join(ADAPTER_WEIGHTS);
        let pickle = dir.join("adapter_model.bin");
        if !weights_path.exists() && pickle.exists() {
            return Err(config_err(
                &pickle,
                "(file)",
                format!(
                    "is a PyTorch pickle; qerl reads only {ADAPTER_WEIGHTS} (save the adapter \
                     with safe_serialization=True, PEFT's default)"
                ),
            ));
        }
        let mut modules: BTreeMap<String, Pair> = BTreeMap::new();
        for w in read_tensors(&weights_path)? {
            let lora = w.tensor.strip_prefix(PEFT_PREFIX).and_then(|rest| {
                rest.strip_suffix(".lora_A.weight")
                    .map(|m| (m, true))
                    .or_else(|| rest.strip_suffix(".lora_B.weight").map(|m| (m, false)))
            });
            if let Some((module, is_a)) = lora {
                if w.shape.len() != 2 {
                    return Err(ModelError::TensorShape {
                        file: weights_path,
                        tensor: w.tensor.clone(),
                        shape: w.shape.clone(),
                        expected: vec![0, 0],
                    });
                }
                let entry = modules
                    .entry(module.to_string())
                    .or_insert(Pair { a: None, b: None });
                let values = Some((w.values, w.shape));
                if is_a {
                    entry.a = values;
                } else {
                    entry.b = values;
                }
            } else if let Some(module) = adapter_norms::saved_module_of(&w.tensor) {
                let module = module.to_string();
                if saved.weights.contains_key(&module) {
                    return Err(config_err(
                        &weights_path,
                        &w.tensor,
                        format!("holds the weight of `{module}` a second time"),
                    ));
                }
                saved.weights.insert(module, w);
            } else {
                return Err(ModelError::UnexpectedTensors {
                    dir: weights_path,
                    arch: "LoRA adapter",
                    names: vec![w.tensor],
                });
            }
        }
        saved.legacy = adapter_norms::read_legacy(dir)?;
        if let Some(w) = saved.legacy.values().next() {
            if !saved.weights.is_empty() || !saved.entries.is_empty() {
                return Err(config_err(
                    &w.file,
                    &w.tensor,
                    format!(
                        "is a norm weight, and {ADAPTER_WEIGHTS} has `modules_to_save` too: \
                         which norms apply is ambiguous; remove one of them"
                    ),
                ));
            }
        }
        adapter_norms::check_trained_norms_present(dir, &saved)?;
        Ok(Adapter {
            dir: dir.to_path_buf(),
            config: LoraConfig {
                rank,
                alpha: scaled_alpha(lora_alpha, rank, use_rslora) as f32,
            },
            targets,
            modules,
            rank_pattern,
            alpha_pattern,
            lora_alpha,
            use_rslora,
            saved,
        })
    }

    /// Module names the adapter has LoRA weights for.
    pub fn modules(&self) -> impl Iterator<Item = &str> {
        self.modules.keys().map(String::as_str)
    }

    /// Whether the adapter carries norm weights (`modules_to_save`, or the norms file of an
    /// older qerl checkpoint).
    pub fn has_norms(&self) -> bool {
        !self.saved.weights.is_empty() || !self.saved.legacy.is_empty()
    }

    /// The rank and alpha of `module`'s LoRA (`None` if the adapter has no weights for it):
    /// `r` / `lora_alpha`, or the first matching `rank_pattern` / `alpha_pattern` entry.
    pub fn lora_config(&self, module: &str) -> Option<LoraConfig> {
        if !self.modules.contains_key(module) {
            return None;
        }
        let rank = first_match(&self.rank_pattern, module).map_or(self.config.rank, |r| r as usize);
        let alpha = first_match(&self.alpha_pattern, module).unwrap_or(self.lora_alpha);
        Some(LoraConfig {
            rank,
            alpha: scaled_alpha(alpha, rank, self.use_rslora) as f32,
        })
    }

    /// The norm weights to load instead of the model's, by checkpoint tensor name, checked
    /// against a model of `config` (see [`SavedModules::norm_weights`]).
    pub(crate) fn norm_weights(&self, config: &ModelConfig) -> Result<BTreeMap<String, Vec<f32>>> {
        let has_lora = |m: &str| self.modules.contains_key(m);
        self.saved
            .norm_weights(config, &self.dir.join(ADAPTER_CONFIG), &has_lora)
    }

    /// Copies the LoRA matrices into the model's adapters (made with
    /// [`lora_config`](Self::lora_config)).
    pub(crate) fn apply<B: QerlBackend>(&self, model: &mut CausalLm<B>) -> Result<()> {
        let file = self.dir.join(ADAPTER_WEIGHTS);
        let device = model.device();
        let arch = model.config.arch.name();
        for (module, pair) in &self.modules {
            let tensor = |which: &str| format!("{PEFT_PREFIX}{module}.lora_{which}.weight");
            let (Some(a), Some(b)) = (&pair.a, &pair.b) else {
                let which = if pair.a.is_none() { "A" } else { "B" };
                return Err(ModelError::MissingTensor {
                    dir: self.dir.clone(),
                    tensor: tensor(which),
                    needed_by: format!("the adapter of {module}"),
                });
            };
            let r = self
                .lora_config(module)
                .expect("a module with weights")
                .rank;
            let layer = model
                .linear_mut(module)
                .ok_or_else(|| ModelError::UnexpectedTensors {
                    dir: self.dir.clone(),
                    arch,
                    names: vec![tensor("A")],
                })?;
            let [d_out, d_in] = layer.dims();
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

/// The alpha that gives `alpha / sqrt(r)` as `alpha' / r` under rsLoRA (`alpha' = alpha·sqrt(r)`).
fn scaled_alpha(alpha: f64, rank: usize, use_rslora: bool) -> f64 {
    if use_rslora {
        alpha * (rank as f64).sqrt()
    } else {
        alpha
    }
}

/// Every tensor of a safetensors file as f32 (BF16, F16 and F32 are read).
pub(crate) fn read_tensors(path: &Path) -> Result<Vec<SavedWeight>> {
    let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        key: "(header)".into(),
        why: format!("is not a valid safetensors file: {e}"),
    })?;
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = source_dtype(view.dtype()).ok_or_else(|| ModelError::Config {
                path: path.to_path_buf(),
                key: name.clone(),
                why: format!("has dtype {:?}, expected BF16, F16 or F32", view.dtype()),
            })?;
            Ok(SavedWeight {
                file: path.to_path_buf(),
                values: bytes_to_f32(view.data(), dtype),
                shape: view.shape().to_vec(),
                tensor: name,
            })
        })
        .collect()
}
