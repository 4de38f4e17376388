//! Whether a PEFT adapter fits the model it is loaded onto, checked before any of its LoRA
//! matrices is allocated: its `target_modules` name linears the model has, its
//! `layers_to_transform` layers the model has, its weights are exactly the modules those two
//! select, and every matrix has the shape its rank (`r`, `rank_pattern`) and the model's
//! dimensions give. Otherwise a misspelled target, or an adapter of another model, would be
//! applied by whatever tensors happen to be present, and a rank such as `r = 1e12` would be
//! allocated before any shape was compared.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

use serde_json::Value;

use crate::adapter::{Adapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use crate::config::ModelConfig;
use crate::error::{config_err, read_json, ModelError, Result};

/// The module names a LoRA target may use: the decoder linears of Qwen2 and Llama.
pub const LINEAR_NAMES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// PEFT's prefix of the module names in an adapter's weights.
const PREFIX: &str = "base_model.model.";

/// Whether `target` is a plain module name (PEFT reads a `target_modules` string as a regular
/// expression; those are matched as they are and not checked here).
fn is_plain(target: &str) -> bool {
    target
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
}

/// The last component of a module name (`model.layers.0.self_attn.q_proj` -> `q_proj`).
fn last(module: &str) -> &str {
    module.rsplit('.').next().unwrap_or(module)
}

/// Fails unless the adapter fits a model of `config` (see the module docs).
pub(crate) fn check(adapter: &Adapter, config: &ModelConfig) -> Result<()> {
    let config_path = adapter.dir.join(ADAPTER_CONFIG);
    let weights_path = adapter.dir.join(ADAPTER_WEIGHTS);
    for t in &adapter.targets {
        if is_plain(t) && !LINEAR_NAMES.contains(&last(t)) {
            return Err(config_err(
                &config_path,
                "target_modules",
                format!(
                    "names `{t}`, which is not a linear layer of a {} decoder (valid names: {})",
                    config.arch.name(),
                    LINEAR_NAMES.join(", ")
                ),
            ));
        }
    }
    let layers = layers_to_transform(&config_path, config.num_hidden_layers)?;
    let n = config.num_hidden_layers;
    // module -> (d_out, d_in), for every decoder linear of the model
    let mut linears = BTreeMap::new();
    for i in 0..n {
        for (suffix, d_out, d_in, _) in config.linears() {
            linears.insert(format!("model.layers.{i}.{suffix}"), (d_out, d_in));
        }
    }
    let plain_targets = adapter.targets.iter().all(|t| is_plain(t));
    let selected = |module: &str, layer: usize| {
        layers.as_ref().is_none_or(|l| l.contains(&layer))
            && (!plain_targets
                || adapter.targets.is_empty()
                || adapter
                    .targets
                    .iter()
                    .any(|t| t == last(module) || module.ends_with(&format!(".{t}"))))
    };
    let shapes = header_shapes(&weights_path)?;
    let with_weights: BTreeSet<&str> = adapter.modules().collect();
    for module in &with_weights {
        let Some(&(d_out, d_in)) = linears.get(*module) else {
            return Err(config_err(
                &weights_path,
                format!("{PREFIX}{module}"),
                format!(
                    "is LoRA weight of a module that a model of {n} layers does not have: this \
                     adapter was made for another model (`{}`)",
                    config.path.display()
                ),
            ));
        };
        let layer = layer_of(module);
        if !selected(module, layer) {
            return Err(config_err(
                &config_path,
                if layers.as_ref().is_some_and(|l| !l.contains(&layer)) {
                    "layers_to_transform"
                } else {
                    "target_modules"
                },
                format!("does not select `{module}`, which the adapter has weights for"),
            ));
        }
        let rank = adapter.lora_config(module).map_or(0, |c| c.rank);
        for (which, expected) in [("A", [rank, d_in]), ("B", [d_out, rank])] {
            let tensor = format!("{PREFIX}{module}.lora_{which}.weight");
            match shapes.get(&tensor) {
                Some(shape) if shape[..] == expected => {}
                Some(shape) => {
                    return Err(ModelError::TensorShape {
                        file: weights_path.clone(),
                        tensor,
                        shape: shape.clone(),
                        expected: expected.to_vec(),
                    })
                }
                None => {
                    return Err(ModelError::MissingTensor {
                        dir: adapter.dir.clone(),
                        tensor,
                        needed_by: format!("the adapter of {module} (rank {rank})"),
                    })
                }
            }
        }
    }
    if plain_targets && !adapter.targets.is_empty() {
        if let Some(missing) = linears
            .keys()
            .find(|m| selected(m, layer_of(m)) && !with_weights.contains(m.as_str()))
        {
            return Err(ModelError::MissingTensor {
                dir: adapter.dir.clone(),
                tensor: format!("{PREFIX}{missing}.lora_A.weight"),
                needed_by: format!(
                    "`{}` (target_modules {:?}{}) on a model of {n} layers: this adapter was made \
                     for another model",
                    config_path.display(),
                    adapter.targets,
                    if layers.is_some() {
                        " and layers_to_transform"
                    } else {
                        ""
                    }
                ),
            });
        }
    }
    Ok(())
}

/// The layer index of `model.layers.<i>.…`.
fn layer_of(module: &str) -> usize {
    module
        .strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|i| i.parse().ok())
        .unwrap_or(usize::MAX)
}

/// `layers_to_transform` (an integer or a list of them), each below `n`; `None` when absent.
fn layers_to_transform(path: &Path, n: usize) -> Result<Option<BTreeSet<usize>>> {
    let v = read_json(path)?;
    let key = "layers_to_transform";
    let items: Vec<&Value> = match v.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a.iter().collect(),
        Some(x) => vec![x],
    };
    let mut layers = BTreeSet::new();
    for item in items {
        match item.as_u64() {
            Some(i) if (i as usize) < n => {
                layers.insert(i as usize);
            }
            _ => {
                return Err(config_err(
                    path,
                    key,
                    format!("holds {item}, not a layer of a model of {n} layers"),
                ))
            }
        }
    }
    Ok(Some(layers))
}

/// The shape of every tensor of a safetensors file, from its header alone.
fn header_shapes(path: &Path) -> Result<BTreeMap<String, Vec<usize>>> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let bad = |why: String| config_err(path, "header", why);
    let mut f = std::fs::File::open(path).map_err(io)?;
    let size = f.metadata().map_err(io)?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(io)?;
    let len = u64::from_le_bytes(len);
    if len > size.saturating_sub(8) {
        return Err(bad(format!("claims {len} bytes, but the file has {size}")));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).map_err(io)?;
    let v: Value = serde_json::from_slice(&header).map_err(|e| bad(format!("is not JSON: {e}")))?;
    let mut shapes = BTreeMap::new();
    for (name, info) in v.as_object().into_iter().flatten() {
        if name == "__metadata__" {
            continue;
        }
        let shape = info
            .get("shape")
            .and_then(Value::as_array)
            .map(|dims| {
                dims.iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect()
            })
            .and_then(|s: Option<Vec<usize>>| s)
            .ok_or_else(|| bad(format!("gives `{name}` no shape")))?;
        shapes.insert(name.clone(), shape);
    }
    Ok(shapes)
}
