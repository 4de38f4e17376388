//! Writing the trained parameters as a PEFT LoRA adapter (what `qerl_model::Adapter` and
//! Hugging Face PEFT read): the LoRA matrices and, when trained, the RMSNorm weights as PEFT's
//! `modules_to_save` (QeRL's `--ln True`), so `PeftModel.from_pretrained` runs the trained
//! policy from the checkpoint as it is; plus host copies of both for checkpoints and tests.
//! Checkpoints of earlier qerl versions kept the norms in `norms.safetensors`; they are still
//! read ([`read_trained`]).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use burn::module::{Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use qerl_model::{CausalLm, QerlBackend};
use qerl_nn::Nvfp4Linear;
use safetensors::{Dtype, View};
use serde_json::json;

/// PEFT's prefix of every tensor name.
pub const PEFT_PREFIX: &str = "base_model.model.";
/// `modules_to_save` of an adapter with trained norms. PEFT wraps every module whose name ends
/// with an entry: these three name exactly the model's RMSNorms (a bare `norm` would also
/// catch any other module named `*norm`).
pub const NORM_MODULES_TO_SAVE: [&str; 3] =
    ["input_layernorm", "post_attention_layernorm", "model.norm"];

/// The seven decoder linears of every layer, named like their checkpoint modules.
pub fn linears<B: QerlBackend>(model: &CausalLm<B>) -> Vec<(String, &Nvfp4Linear<B>)> {
    let mut out = Vec::with_capacity(7 * model.layers.len());
    for (i, l) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let a = &l.self_attn;
        for (n, lin) in [
            ("self_attn.q_proj", &a.q_proj),
            ("self_attn.k_proj", &a.k_proj),
            ("self_attn.v_proj", &a.v_proj),
            ("self_attn.o_proj", &a.o_proj),
            ("mlp.gate_proj", &l.mlp.gate_proj),
            ("mlp.up_proj", &l.mlp.up_proj),
            ("mlp.down_proj", &l.mlp.down_proj),
        ] {
            out.push((format!("{p}.{n}"), lin));
        }
    }
    out
}

/// Names of the norms in [`CausalLm::norms_mut`] order.
pub fn norm_names(layers: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(2 * layers + 1);
    for i in 0..layers {
        out.push(format!("model.layers.{i}.input_layernorm.weight"));
        out.push(format!("model.layers.{i}.post_attention_layernorm.weight"));
    }
    out.push("model.norm.weight".into());
    out
}

/// A host tensor: f32 values and shape.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl HostTensor {
    pub fn of<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Self {
        HostTensor {
            shape: t.dims().to_vec(),
            values: t
                .cast(burn::tensor::DType::F32)
                .into_data()
                .iter::<f32>()
                .collect(),
        }
    }
}

impl View for &HostTensor {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Owned(self.values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        self.values.len() * 4
    }
}

/// The LoRA matrices under PEFT's names (`base_model.model.<module>.lora_A.weight`, `lora_B`),
/// with their parameter ids.
pub fn lora_tensors<B: QerlBackend>(
    model: &CausalLm<B>,
) -> BTreeMap<String, (HostTensor, ParamId)> {
    let mut out = BTreeMap::new();
    for (name, lin) in linears(model) {
        if let Some(l) = lin.lora() {
            out.insert(
                format!("{PEFT_PREFIX}{name}.lora_A.weight"),
                (HostTensor::of(l.a.val()), l.a.id),
            );
            out.insert(
                format!("{PEFT_PREFIX}{name}.lora_B.weight"),
                (HostTensor::of(l.b.val()), l.b.id),
            );
        }
    }
    out
}

/// The RMSNorm weights by checkpoint name, with their parameter ids.
pub fn norm_tensors<B: QerlBackend>(
    model: &CausalLm<B>,
) -> BTreeMap<String, (HostTensor, ParamId)> {
    let names = norm_names(model.layers.len());
    let norms = model
        .layers
        .iter()
        .flat_map(|l| [&l.input_layernorm, &l.post_attention_layernorm])
        .chain([&model.norm]);
    norms
        .zip(names)
        .map(|(n, name)| (name, (HostTensor::of(n.weight.val()), n.weight.id)))
        .collect()
}

fn write_safetensors(path: &Path, tensors: &BTreeMap<String, (HostTensor, ParamId)>) -> Result<()> {
    let views: Vec<(&str, &HostTensor)> =
        tensors.iter().map(|(k, (t, _))| (k.as_str(), t)).collect();
    safetensors::serialize_to_file(views, None, path)
        .with_context(|| format!("cannot write `{}`", path.display()))
}

/// Reads every tensor of an f32 safetensors file.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, HostTensor>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read `{}`", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("`{}` is not a safetensors file", path.display()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        anyhow::ensure!(
            view.dtype() == Dtype::F32,
            "`{}`: {name} is not F32",
            path.display()
        );
        let values = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.insert(
            name,
            HostTensor {
                shape: view.shape().to_vec(),
                values,
            },
        );
    }
    Ok(out)
}

/// What `adapter_config.json` says besides the weights.
#[derive(Clone, Debug)]
pub struct AdapterMeta {
    pub rank: usize,
    pub alpha: f32,
    pub targets: Vec<String>,
    pub base_model: String,
    /// Whether the norms were trained: then they are saved as `modules_to_save`.
    pub norms: bool,
}

/// Writes `adapter_model.safetensors` + `adapter_config.json` (PEFT's LoRA format) into `dir`:
/// the LoRA matrices and, with `meta.norms`, every RMSNorm weight under PEFT's name
/// (`base_model.model.model.layers.0.input_layernorm.weight`).
pub fn write_adapter<B: QerlBackend>(
    model: &CausalLm<B>,
    meta: &AdapterMeta,
    dir: &Path,
) -> Result<()> {
    let mut tensors = lora_tensors(model);
    if meta.norms {
        for (name, t) in norm_tensors(model) {
            tensors.insert(format!("{PEFT_PREFIX}{name}"), t);
        }
    }
    write_safetensors(&dir.join(qerl_model::ADAPTER_WEIGHTS), &tensors)?;
    let modules_to_save = meta.norms.then_some(NORM_MODULES_TO_SAVE);
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": meta.base_model,
        "r": meta.rank,
        "lora_alpha": meta.alpha,
        "lora_dropout": 0.0,
        "target_modules": meta.targets,
        "modules_to_save": modules_to_save,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "use_dora": false,
        "inference_mode": true,
        "init_lora_weights": true,
    });
    let path = dir.join(qerl_model::ADAPTER_CONFIG);
    std::fs::write(&path, serde_json::to_string_pretty(&config)? + "\n")
        .with_context(|| format!("cannot write `{}`", path.display()))
}

/// Host tensors by name.
pub type HostTensors = BTreeMap<String, HostTensor>;

/// The trained tensors of a checkpoint: the LoRA matrices by PEFT name and, when
/// `trained_norms`, the norm weights by checkpoint name (`model.norm.weight`), from
/// `modules_to_save` in the adapter or, in a checkpoint of an earlier qerl version, from
/// `norms.safetensors`.
pub fn read_trained(dir: &Path, trained_norms: bool) -> Result<(HostTensors, Option<HostTensors>)> {
    let path = dir.join(qerl_model::ADAPTER_WEIGHTS);
    let mut lora = read_safetensors(&path)?;
    let saved: Vec<String> = lora
        .keys()
        .filter(|k| !k.contains(".lora_A.") && !k.contains(".lora_B."))
        .cloned()
        .collect();
    let mut norms = BTreeMap::new();
    for key in saved {
        let t = lora.remove(&key).expect("listed");
        let name = key
            .strip_prefix(PEFT_PREFIX)
            .with_context(|| format!("`{}`: unexpected tensor `{key}`", path.display()))?;
        norms.insert(name.to_string(), t);
    }
    let legacy = dir.join(qerl_model::LEGACY_NORMS_FILE);
    if legacy.exists() {
        anyhow::ensure!(
            norms.is_empty(),
            "`{}` and `modules_to_save` in `{}` both hold norms: which apply is ambiguous",
            legacy.display(),
            path.display()
        );
        norms = read_safetensors(&legacy)?;
    }
    if !trained_norms {
        anyhow::ensure!(
            norms.is_empty(),
            "`{}` holds norm weights, but the checkpoint's {} says the norms were not trained",
            path.display(),
            crate::checkpoint::STATE_FILE
        );
        return Ok((lora, None));
    }
    anyhow::ensure!(
        !norms.is_empty(),
        "the checkpoint's {} says the norms were trained, but neither `{}` nor `{}` holds them",
        crate::checkpoint::STATE_FILE,
        path.display(),
        legacy.display()
    );
    Ok((lora, Some(norms)))
}

/// Parameter ids of the trained tensors by name (LoRA and norms), for the optimizer state.
pub fn param_ids<B: QerlBackend>(model: &CausalLm<B>) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = lora_tensors(model)
        .into_iter()
        .map(|(k, (_, id))| (k, id.val()))
        .collect();
    out.extend(
        norm_tensors(model)
            .into_iter()
            .map(|(k, (_, id))| (k, id.val())),
    );
    out
}

/// Trainable parameters are f32 master weights whatever the backend's float type (see
/// `qerl_nn::Lora`); frozen ones take the backend's type.
fn tensor<B: QerlBackend, const D: usize>(
    t: &HostTensor,
    trainable: bool,
    device: &B::Device,
) -> Tensor<B, D> {
    let shape: [usize; D] = t.shape.clone().try_into().expect("tensor rank");
    let data = TensorData::new(t.values.clone(), shape);
    if trainable {
        Tensor::from_data(data, (device, burn::tensor::DType::F32))
    } else {
        Tensor::from_data(data, device)
    }
}

fn param<B: QerlBackend, const D: usize>(
    t: &HostTensor,
    id: Option<u64>,
    trainable: bool,
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    let id = id.map_or_else(ParamId::new, ParamId::from);
    Param::initialized(
        id,
        tensor::<B, D>(t, trainable, device).set_require_grad(trainable),
    )
}

/// Sets LoRA matrices (by PEFT name) and norm weights (by checkpoint name) from host tensors,
/// giving the parameters the ids in `ids` where present (so that a saved optimizer state
/// finds them). Every LoRA of the model must be in `lora`.
pub fn load_trained<B: QerlBackend>(
    model: &mut CausalLm<B>,
    lora: &BTreeMap<String, HostTensor>,
    norms: Option<&BTreeMap<String, HostTensor>>,
    ids: &BTreeMap<String, u64>,
) -> Result<()> {
    let device = model.device();
    let names: Vec<String> = linears(model).into_iter().map(|(n, _)| n).collect();
    for name in names {
        let lin = model.linear_mut(&name).expect("a known module");
        let Some(l) = lin.lora.as_mut() else { continue };
        for (which, slot) in [("A", &mut l.a), ("B", &mut l.b)] {
            let key = format!("{PEFT_PREFIX}{name}.lora_{which}.weight");
            let t = lora
                .get(&key)
                .with_context(|| format!("the adapter has no `{key}`"))?;
            anyhow::ensure!(
                t.shape == slot.dims().to_vec(),
                "`{key}` has shape {:?}, expected {:?}",
                t.shape,
                slot.dims()
            );
            *slot = param::<B, 2>(t, ids.get(&key).copied(), true, &device);
        }
    }
    if let Some(norms) = norms {
        let names = norm_names(model.layers.len());
        for (n, name) in model.norms_mut().into_iter().zip(names) {
            let t = norms
                .get(&name)
                .with_context(|| format!("the checkpoint has no norm `{name}`"))?;
            let trainable = n.weight.is_require_grad();
            n.weight = param::<B, 1>(t, ids.get(&name).copied(), trainable, &device);
        }
    }
    Ok(())
}
