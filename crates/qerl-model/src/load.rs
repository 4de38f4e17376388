//! Building a [`CausalLm`] from a Hugging Face directory: a dense checkpoint (BF16/F16/F32,
//! single file or shards) or a quantized one as `qerl quantize` writes it (compressed-tensors
//! NVFP4/MXFP4, bitsandbytes NF4).
//!
//! Every tensor the configuration calls for must be present with the right shape; tensors the
//! architecture has no place for are an error too (they mean the config and the weights are of
//! different models), except `rotary_emb.inv_freq` buffers and an `lm_head.weight` of a tied
//! model.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::tensor::{Tensor, TensorData};
use qerl_format::checkpoint::{HfCheckpoint, QuantizedCheckpoint, CONFIG_FILE};
use qerl_format::{QuantFormat, QuantizedWeight, SourceDtype};
use qerl_nn::{LoraConfig, NoisyRmsNorm, Nvfp4Linear, Precision, QerlBackend};

use crate::adapter::Adapter;
use crate::attention::Attention;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::model::{CausalLm, DecoderLayer, Mlp};

/// LoRA adapters to put on the decoder linears.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    pub config: LoraConfig,
    /// Module names that get an adapter (`q_proj`, ..., `down_proj`); empty means all seven.
    pub targets: Vec<String>,
}

impl LoraSpec {
    fn applies_to(&self, module: &str) -> bool {
        let last = module.rsplit('.').next().unwrap_or(module);
        self.targets.is_empty() || self.targets.iter().any(|t| t == last || t == module)
    }
}

/// How to load a model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadOptions {
    /// How the decoder linears are stored. `None`: as the checkpoint has them (dense for a
    /// Hugging Face checkpoint, its format for a quantized one). A 4-bit precision on a dense
    /// checkpoint quantizes at load time (one NVFP4 global scale per tensor); [`Precision::Bf16`]
    /// on a quantized checkpoint gives its dequantized twin, each weight rounded to bf16 as
    /// compressed-tensors' decompression does.
    pub precision: Option<Precision>,
    /// Fresh (PEFT-initialised) LoRA adapters.
    pub lora: Option<LoraSpec>,
    /// Whether the RMSNorm weights are trainable.
    pub trainable_norms: bool,
}

/// The weights of a model directory, dense or quantized.
enum Source {
    Dense(HfCheckpoint),
    Quantized(QuantizedCheckpoint),
}

impl Source {
    fn ckpt(&self) -> &HfCheckpoint {
        match self {
            Source::Dense(c) => c,
            Source::Quantized(q) => q.checkpoint(),
        }
    }
}

/// Reads tensors by name, checking shapes and recording what was used.
struct Reader<'a> {
    source: &'a Source,
    quantized_modules: BTreeSet<String>,
    used: BTreeSet<String>,
}

impl Reader<'_> {
    fn dir(&self) -> PathBuf {
        self.source.ckpt().dir().to_path_buf()
    }

    fn read(
        &mut self,
        name: &str,
        shape: &[usize],
        needed_by: &str,
    ) -> Result<(Vec<f32>, SourceDtype)> {
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
        Ok(ckpt.read_f32(name)?)
    }

    /// A quantized module, with every stored part of it marked used.
    fn quantized(&mut self, module: &str, shape: [usize; 2]) -> Result<QuantizedWeight> {
        let Source::Quantized(q) = self.source else {
            unreachable!("only called for quantized modules")
        };
        let w = q.load(module)?;
        if w.shape() != shape {
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
            return Err(ModelError::TensorShape {
                file: file.unwrap_or_else(|| self.dir()),
                tensor: part,
                shape: w.shape().to_vec(),
                expected: shape.to_vec(),
            });
        }
        let prefix = format!("{module}.");
        let parts: Vec<String> = q
            .checkpoint()
            .tensors()
            .filter(|t| t.name.starts_with(&prefix) && t.name != format!("{module}.bias"))
            .map(|t| t.name.clone())
            .collect();
        self.used.extend(parts);
        Ok(w)
    }
}

/// Checks that every linear's input width suits the block size of a 4-bit format.
fn check_blocks(config: &ModelConfig, precision: Precision) -> Result<()> {
    let Some(format) = precision.format() else {
        return Ok(());
    };
    let block = format.block_size();
    let widths = [
        (
            "hidden_size",
            config.hidden_size,
            "q_proj, k_proj, v_proj, gate_proj and up_proj",
        ),
        ("intermediate_size", config.intermediate_size, "down_proj"),
        ("num_attention_heads * head_dim", config.q_dim(), "o_proj"),
    ];
    for (key, width, users) in widths {
        let ok = match format {
            QuantFormat::Nf4 => {
                width % 2 == 0 && config.linears().iter().all(|l| (l.1 * l.2) % block == 0)
            }
            _ => width % block == 0,
        };
        if !ok {
            return Err(ModelError::Precision {
                path: config.path.clone(),
                why: format!(
                    "{key} is {width}, not a multiple of {block}, the {} block size ({users} take it as their input width); run this model in bf16",
                    format.name().to_uppercase()
                ),
            });
        }
    }
    Ok(())
}

fn precision_of(format: QuantFormat) -> Precision {
    match format {
        QuantFormat::Nvfp4 => Precision::Nvfp4,
        QuantFormat::Mxfp4 => Precision::Mxfp4,
        QuantFormat::Nf4 => Precision::Nf4,
    }
}

/// Loads the model in `dir` onto `device`.
pub fn load<B: QerlBackend>(
    dir: &Path,
    options: &LoadOptions,
    device: &B::Device,
) -> Result<CausalLm<B>> {
    load_with_adapter(dir, options, None, device)
}

/// [`load`], then the LoRA weights of a PEFT adapter (which decides the rank, alpha and target
/// modules; `options.lora` is ignored) and the norm weights it carries (`modules_to_save`, or
/// the norms file of an older qerl checkpoint) in place of the model's.
pub fn load_with_adapter<B: QerlBackend>(
    dir: &Path,
    options: &LoadOptions,
    adapter: Option<&Adapter>,
    device: &B::Device,
) -> Result<CausalLm<B>> {
    let config = ModelConfig::from_dir(dir)?;
    let raw_config = crate::error::read_json(&dir.join(CONFIG_FILE))?;
    let source = if raw_config.get("quantization_config").is_some() {
        Source::Quantized(QuantizedCheckpoint::open(dir)?)
    } else {
        Source::Dense(HfCheckpoint::open(dir)?)
    };
    let native = match &source {
        Source::Dense(_) => Precision::Bf16,
        Source::Quantized(q) => precision_of(q.format()),
    };
    let precision = options.precision.unwrap_or(native);
    if native != Precision::Bf16 && precision != Precision::Bf16 && precision != native {
        return Err(ModelError::Precision {
            path: config.path.clone(),
            why: format!("the checkpoint is {native}; it runs as {native} or as its dequantized bf16 twin, not as {precision}"),
        });
    }
    check_blocks(&config, precision)?;
    if let Some(a) = adapter {
        crate::adapter_check::check(a, &config)?;
    }
    // An adapter decides the rank and alpha of each module it has weights for, and may
    // replace norm weights (`modules_to_save`).
    let lora_of = |module: &str| match adapter {
        Some(a) => a.lora_config(module),
        None => options
            .lora
            .as_ref()
            .filter(|s| s.applies_to(module))
            .map(|s| s.config),
    };
    let adapter_norms = adapter
        .map(|a| a.norm_weights(&config))
        .transpose()?
        .unwrap_or_default();

    let quantized_modules = match &source {
        Source::Quantized(q) => q.modules().into_iter().collect(),
        Source::Dense(_) => BTreeSet::new(),
    };
    let mut r = Reader {
        source: &source,
        quantized_modules,
        used: BTreeSet::new(),
    };
    let (v, h) = (config.vocab_size, config.hidden_size);
    let tensor2 = |data: Vec<f32>, shape: [usize; 2]| {
        Tensor::<B, 2>::from_data(TensorData::new(data, shape), device)
    };
    let norm = |r: &mut Reader, name: &str| -> Result<NoisyRmsNorm<B>> {
        let (w, _) = r.read(name, &[h], "an RMSNorm")?;
        let w = adapter_norms.get(name).cloned().unwrap_or(w);
        let w = Tensor::<B, 1>::from_data(TensorData::new(w, [h]), device);
        Ok(NoisyRmsNorm::new(
            w,
            config.rms_norm_eps,
            options.trainable_norms,
        ))
    };

    let (embed, _) = r.read("model.embed_tokens.weight", &[v, h], "the embeddings")?;
    let embed = tensor2(embed, [v, h]);
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mut lin = |suffix: &str| -> Result<Nvfp4Linear<B>> {
            let (_, d_out, d_in, has_bias) = *config
                .linears()
                .iter()
                .find(|l| l.0 == suffix)
                .expect("known linear");
            let module = format!("{p}.{suffix}");
            let lora_cfg = lora_of(&module);
            linear(
                &mut r, &module, d_out, d_in, has_bias, precision, lora_cfg, device,
            )
        };
        let self_attn = Attention {
            q_proj: lin("self_attn.q_proj")?,
            k_proj: lin("self_attn.k_proj")?,
            v_proj: lin("self_attn.v_proj")?,
            o_proj: lin("self_attn.o_proj")?,
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        };
        let mlp = Mlp {
            gate_proj: lin("mlp.gate_proj")?,
            up_proj: lin("mlp.up_proj")?,
            down_proj: lin("mlp.down_proj")?,
        };
        layers.push(DecoderLayer {
            input_layernorm: norm(&mut r, &format!("{p}.input_layernorm.weight"))?,
            self_attn,
            post_attention_layernorm: norm(
                &mut r,
                &format!("{p}.post_attention_layernorm.weight"),
            )?,
            mlp,
        });
    }
    let final_norm = norm(&mut r, "model.norm.weight")?;
    let lm_head = if config.tie_word_embeddings {
        r.used.insert("lm_head.weight".into());
        None
    } else {
        let (w, _) = r.read(
            "lm_head.weight",
            &[v, h],
            "the untied lm_head (tie_word_embeddings is false)",
        )?;
        Some(tensor2(w, [v, h]))
    };
    let unused: Vec<String> = source
        .ckpt()
        .tensors()
        .map(|t| t.name.clone())
        .filter(|n| !r.used.contains(n) && !n.ends_with("rotary_emb.inv_freq"))
        .collect();
    if !unused.is_empty() {
        return Err(ModelError::UnexpectedTensors {
            dir: dir.to_path_buf(),
            arch: config.arch.name(),
            names: unused,
        });
    }
    let mut model = CausalLm::from_parts(embed, layers, final_norm, lm_head, config);
    if let Some(a) = adapter {
        a.apply(&mut model)?;
    }
    Ok(model)
}

#[allow(clippy::too_many_arguments)]
fn linear<B: QerlBackend>(
    r: &mut Reader,
    module: &str,
    d_out: usize,
    d_in: usize,
    has_bias: bool,
    precision: Precision,
    lora: Option<LoraConfig>,
    device: &B::Device,
) -> Result<Nvfp4Linear<B>> {
    let bias = if has_bias {
        Some(r.read(&format!("{module}.bias"), &[d_out], module)?.0)
    } else {
        None
    };
    let nn = |e: qerl_nn::NnError| ModelError::Nn(format!("{module}: {e}"));
    if r.quantized_modules.contains(module) {
        let w = r.quantized(module, [d_out, d_in])?;
        if precision == Precision::Bf16 {
            let dense: Vec<f32> = w
                .dequantize()
                .into_iter()
                .map(|x| SourceDtype::BF16.round(x))
                .collect();
            return Nvfp4Linear::from_dense(
                module,
                &dense,
                SourceDtype::BF16,
                d_out,
                d_in,
                bias.as_deref(),
                precision,
                lora,
                device,
            )
            .map_err(nn);
        }
        return Nvfp4Linear::from_quantized(module, w, bias.as_deref(), lora, device).map_err(nn);
    }
    let (w, dtype) = r.read(&format!("{module}.weight"), &[d_out, d_in], module)?;
    Nvfp4Linear::from_dense(
        module,
        &w,
        dtype,
        d_out,
        d_in,
        bias.as_deref(),
        precision,
        lora,
        device,
    )
    .map_err(nn)
}
