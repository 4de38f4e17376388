//! Whole-module weights an adapter carries beside LoRA: PEFT's `modules_to_save`, restricted to
//! the RMSNorms (the only modules qerl trains besides LoRA, as QeRL does with `--ln True`).
//!
//! PEFT saves such a module's weight under the module's own name,
//! `base_model.model.model.layers.0.input_layernorm.weight` (the wrapper's
//! `modules_to_save.<adapter>.` part is dropped when saving); the longer
//! `...input_layernorm.modules_to_save.default.weight` is read too. Which modules an entry of
//! `modules_to_save` names follows PEFT: every module of the `PeftModel` whose dotted name ends
//! with the entry as a plain string (so `norm` names all the RMSNorms, `layernorm` the two of
//! every layer, `model.norm` the final one).
//!
//! Checkpoints qerl wrote before it used this format keep the norms in
//! [`LEGACY_NORMS_FILE`] beside the adapter, under checkpoint names
//! (`model.layers.0.input_layernorm.weight`); they are read and applied all the same.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::config::{Keys, ModelConfig};
use crate::error::{config_err, read_json, ModelError, Result};

/// The norms file of checkpoints written by earlier qerl versions.
pub const LEGACY_NORMS_FILE: &str = "norms.safetensors";
/// The trainer's state file, whose `trained_norms` says whether a checkpoint's norms were trained.
const TRAINER_STATE: &str = "trainer_state.json";
/// PEFT's prefix of every tensor name (the `PeftModel` wraps the model as `base_model.model`).
pub(crate) const PEFT_PREFIX: &str = "base_model.model.";

/// One saved module weight, with where it came from (for errors).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct SavedWeight {
    pub file: PathBuf,
    pub tensor: String,
    pub values: Vec<f32>,
    pub shape: Vec<usize>,
}

/// The `modules_to_save` of an adapter: the config's entries and the saved weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct SavedModules {
    /// `modules_to_save` of adapter_config.json, as written.
    pub entries: Vec<String>,
    /// Weights by module name (`model.layers.0.input_layernorm`), from the weights file.
    pub weights: BTreeMap<String, SavedWeight>,
    /// Norm weights by module name from [`LEGACY_NORMS_FILE`] (every norm listed there is
    /// applied, without `modules_to_save`).
    pub legacy: BTreeMap<String, SavedWeight>,
}

/// The module a non-LoRA tensor of an adapter weights file belongs to, if it is a whole-module
/// weight (`base_model.model.<module>.weight` or `...<module>.modules_to_save.default.weight`).
pub(crate) fn saved_module_of(tensor: &str) -> Option<&str> {
    let rest = tensor.strip_prefix(PEFT_PREFIX)?;
    rest.strip_suffix(".modules_to_save.default.weight")
        .or_else(|| rest.strip_suffix(".weight"))
}

/// `modules_to_save` of an adapter config: absent, `null` or a list of module names.
pub(crate) fn entries(keys: &Keys) -> Result<Vec<String>> {
    let path = keys.path;
    let Some(value) = keys.get("modules_to_save") else {
        return Ok(Vec::new());
    };
    let items = value.as_array().ok_or_else(|| {
        config_err(
            path,
            "modules_to_save",
            format!("is {value}, not a list of module names"),
        )
    })?;
    items
        .iter()
        .map(|v| {
            v.as_str().map(str::to_string).ok_or_else(|| {
                config_err(
                    path,
                    "modules_to_save",
                    format!("holds {v}, not a module name"),
                )
            })
        })
        .collect()
}

/// Reads [`LEGACY_NORMS_FILE`] of `dir` if there is one.
pub(crate) fn read_legacy(dir: &Path) -> Result<BTreeMap<String, SavedWeight>> {
    let path = dir.join(LEGACY_NORMS_FILE);
    if !path.exists() {
        return Ok(BTreeMap::new());
    }
    let mut out = BTreeMap::new();
    for w in crate::adapter::read_tensors(&path)? {
        let Some(module) = w.tensor.strip_suffix(".weight") else {
            return Err(ModelError::UnexpectedTensors {
                dir: path.clone(),
                arch: "qerl norms file",
                names: vec![w.tensor],
            });
        };
        out.insert(module.to_string(), w);
    }
    Ok(out)
}

/// Refuses a checkpoint whose trainer state says the norms were trained when the adapter holds
/// none (e.g. a deleted `norms.safetensors`): the LoRA weights alone are not the trained policy.
pub(crate) fn check_trained_norms_present(dir: &Path, saved: &SavedModules) -> Result<()> {
    let path = dir.join(TRAINER_STATE);
    if !path.is_file() || !saved.weights.is_empty() || !saved.legacy.is_empty() {
        return Ok(());
    }
    let state = read_json(&path)?;
    if state.get("trained_norms").and_then(|v| v.as_bool()) == Some(true) {
        return Err(config_err(
            &path,
            "trained_norms",
            format!(
                "is true, but neither {} (`modules_to_save`) nor {LEGACY_NORMS_FILE} holds the \
                 trained norms: the LoRA weights alone are not the trained policy",
                crate::ADAPTER_WEIGHTS
            ),
        ));
    }
    Ok(())
}

/// The modules of the `PeftModel` that wraps a model of `config` (names as its
/// `named_modules()` gives them), each with whether it is an RMSNorm; `lora` says which
/// decoder linears carry a LoRA layer (whose own submodules are listed too).
fn peft_modules(config: &ModelConfig, lora: &dyn Fn(&str) -> bool) -> Vec<(String, bool)> {
    let mut names: Vec<(String, bool)> = ["", "base_model", "base_model.model"]
        .iter()
        .map(|n| (n.to_string(), false))
        .collect();
    let mut add = |name: String, norm: bool| names.push((format!("{PEFT_PREFIX}{name}"), norm));
    for m in ["model", "model.embed_tokens", "model.layers"] {
        add(m.into(), false);
    }
    for i in 0..config.num_hidden_layers {
        let p = format!("model.layers.{i}");
        for m in ["", ".self_attn", ".mlp", ".mlp.act_fn"] {
            add(format!("{p}{m}"), false);
        }
        for (linear, ..) in config.linears() {
            let module = format!("{p}.{linear}");
            if lora(&module) {
                for sub in [
                    "base_layer",
                    "lora_dropout",
                    "lora_dropout.default",
                    "lora_A",
                    "lora_A.default",
                    "lora_B",
                    "lora_B.default",
                    "lora_embedding_A",
                    "lora_embedding_B",
                    "lora_magnitude_vector",
                ] {
                    add(format!("{module}.{sub}"), false);
                }
            }
            add(module, false);
        }
        add(format!("{p}.input_layernorm"), true);
        add(format!("{p}.post_attention_layernorm"), true);
    }
    add("model.norm".into(), true);
    add("model.rotary_emb".into(), false);
    add("lm_head".into(), false);
    names
}

impl SavedModules {
    /// Checks the saved modules against a model of `config` and returns the norm weights to
    /// use by checkpoint tensor name (`model.layers.0.input_layernorm.weight`).
    ///
    /// Refused, naming the key: an entry of `modules_to_save` that matches no module, or one
    /// that is not an RMSNorm; a module named there without its weight; a saved weight that
    /// no entry names (PEFT would drop it silently: here it is an error, not a different
    /// model); a weight of the wrong shape.
    pub fn norm_weights(
        &self,
        config: &ModelConfig,
        config_path: &Path,
        lora: &dyn Fn(&str) -> bool,
    ) -> Result<BTreeMap<String, Vec<f32>>> {
        let modules = peft_modules(config, lora);
        let mut wrapped: BTreeMap<String, &str> = BTreeMap::new();
        for entry in &self.entries {
            let matched: Vec<&(String, bool)> = modules
                .iter()
                .filter(|(n, _)| n.ends_with(entry.as_str()))
                .collect();
            if matched.is_empty() {
                return Err(config_err(
                    config_path,
                    "modules_to_save",
                    format!(
                        "names `{entry}`, which matches no module of {}",
                        config.arch.name()
                    ),
                ));
            }
            if let Some((other, _)) = matched.iter().find(|(_, norm)| !norm) {
                let other = other.strip_prefix(PEFT_PREFIX).unwrap_or(other);
                return Err(config_err(
                    config_path,
                    "modules_to_save",
                    format!(
                        "names `{entry}`, which matches `{other}`; qerl holds only RMSNorm \
                         weights beside LoRA"
                    ),
                ));
            }
            for (name, _) in matched {
                let module = name.strip_prefix(PEFT_PREFIX).unwrap_or(name);
                wrapped.entry(module.to_string()).or_insert(entry);
            }
        }
        let mut out = BTreeMap::new();
        let h = config.hidden_size;
        let mut take = |module: &str, w: &SavedWeight| -> Result<()> {
            if w.shape != [h] {
                return Err(ModelError::TensorShape {
                    file: w.file.clone(),
                    tensor: w.tensor.clone(),
                    shape: w.shape.clone(),
                    expected: vec![h],
                });
            }
            out.insert(format!("{module}.weight"), w.values.clone());
            Ok(())
        };
        for (module, entry) in &wrapped {
            let w = self
                .weights
                .get(module)
                .ok_or_else(|| ModelError::MissingTensor {
                    dir: self.weights_file(config_path),
                    tensor: format!("{PEFT_PREFIX}{module}.weight"),
                    needed_by: format!(
                        "`modules_to_save` entry `{entry}` of {}",
                        config_path.display()
                    ),
                })?;
            take(module, w)?;
        }
        if let Some((module, w)) = self.weights.iter().find(|(m, _)| !wrapped.contains_key(*m)) {
            return Err(config_err(
                &w.file,
                &w.tensor,
                format!(
                    "is a whole-module weight, but `modules_to_save` in {} does not name \
                     `{module}`",
                    config_path.display()
                ),
            ));
        }
        let norms: BTreeSet<&str> = modules
            .iter()
            .filter(|(_, norm)| *norm)
            .map(|(n, _)| n.strip_prefix(PEFT_PREFIX).unwrap_or(n))
            .collect();
        for (module, w) in &self.legacy {
            if !norms.contains(module.as_str()) {
                return Err(ModelError::UnexpectedTensors {
                    dir: w.file.clone(),
                    arch: config.arch.name(),
                    names: vec![w.tensor.clone()],
                });
            }
            take(module, w)?;
        }
        Ok(out)
    }

    fn weights_file(&self, config_path: &Path) -> PathBuf {
        config_path.with_file_name(crate::ADAPTER_WEIGHTS)
    }
}
