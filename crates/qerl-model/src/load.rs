//! Building a [`CausalLm`] from a Hugging Face directory: a dense checkpoint (BF16/F16/F32,
//! single file or shards) or a quantized one as `qerl quantize` writes it (compressed-tensors
//! NVFP4/MXFP4, bitsandbytes NF4).
//!
//! Every tensor the configuration calls for must be present with the right shape; tensors the
//! architecture has no place for are an error too (they mean the config and the weights are of
//! different models), except `rotary_emb.inv_freq` buffers and an `lm_head.weight` of a tied
//! model.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use qerl_format::checkpoint::{par, HfCheckpoint, QuantizedCheckpoint, CONFIG_FILE};
use qerl_format::QuantFormat;
use qerl_nn::upload::{UploadConfig, UploadSession};
use qerl_nn::{
    KernelError, LoraConfig, NnError, NoisyRmsNorm, Nvfp4Linear, Precision, QerlBackend,
};

use crate::adapter::Adapter;
use crate::attention::Attention;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::load_host::{Host, Job, Planner, Source};
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

/// Where the time of a load went. The read pages the files in (from the disk or the page
/// cache); conversion (on every core) and upload overlap, so `convert + upload` may exceed the
/// time after the read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadStats {
    /// Bytes of the safetensors files.
    pub bytes: u64,
    pub total: Duration,
    pub read: Duration,
    pub convert: Duration,
    pub upload: Duration,
    /// The path the bulk of the weights took: `staged`, `cubecl` or `host` (the CPU backend).
    pub upload_path: &'static str,
}

impl std::fmt::Display for LoadStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.total.as_secs_f64();
        let gb = self.bytes as f64 / 1e9;
        let size = if gb >= 1.0 {
            format!("{gb:.2} GB")
        } else {
            format!("{:.1} MB", gb * 1e3)
        };
        write!(
            f,
            "{size} in {secs:.2} s ({:.2} GB/s): read {:.2} s, convert {:.2} s, upload {:.2} s ({})",
            gb / secs.max(1e-9),
            self.read.as_secs_f64(),
            self.convert.as_secs_f64(),
            self.upload.as_secs_f64(),
            if self.upload_path.is_empty() { "-" } else { self.upload_path }
        )
    }
}

/// What the planning thread hands the uploading one, in model order.
enum Stage {
    Embed(Host),
    Layer(Vec<Host>),
    FinalNorm(Host),
    LmHead(Option<Host>),
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
    load_with_stats(dir, options, adapter, device).map(|(model, _)| model)
}

/// [`load_with_adapter`], with where the time went.
///
/// The files are paged in first (all cores); then one thread plans and converts the stages
/// (embeddings, each decoder layer, the final norm, the lm_head) with the tensors of a stage
/// converted on every core, while the calling thread uploads the previous stage: at most three
/// stages are on the host at once. Every error is the one a sequential read would meet first.
pub fn load_with_stats<B: QerlBackend>(
    dir: &Path,
    options: &LoadOptions,
    adapter: Option<&Adapter>,
    device: &B::Device,
) -> Result<(CausalLm<B>, LoadStats)> {
    load_with_upload(dir, options, adapter, None, device)
}

/// [`load_with_stats`] with the upload path and buffers given; `None`: from `QERL_UPLOAD`
/// (staged on CUDA unless it says `cubecl`, see `qerl_nn::upload`).
pub fn load_with_upload<B: QerlBackend>(
    dir: &Path,
    options: &LoadOptions,
    adapter: Option<&Adapter>,
    upload: Option<UploadConfig>,
    device: &B::Device,
) -> Result<(CausalLm<B>, LoadStats)> {
    let start = Instant::now();
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
    let read_start = Instant::now();
    let bytes = source.ckpt().prefetch();
    let read = read_start.elapsed();
    let mut planner = Planner {
        source: &source,
        quantized_modules,
        used: BTreeSet::new(),
    };
    let (v, h) = (config.vocab_size, config.hidden_size);
    let upload_config = match upload {
        Some(c) => c,
        None => UploadConfig::from_env()?,
    };
    let mut upload = Duration::ZERO;
    // Uploads of this thread (`build`) may be staged until `finish` waits for them.
    let session = UploadSession::begin(upload_config);
    let (built, convert) = std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Stage>>(1);
        let planner = &mut planner;
        let config = &config;
        let source = &source;
        let producer = scope.spawn(move || {
            let mut convert = Duration::ZERO;
            let send = |stage: Result<Stage>| tx.send(stage).is_ok();
            let mut run = |jobs: Vec<Job>| -> Result<Vec<Host>> {
                let t = Instant::now();
                let hosts = par::map(
                    jobs.len(),
                    |i| jobs[i].run::<B::FloatElem>(source),
                    |_, _| {},
                );
                convert += t.elapsed();
                hosts
            };
            let stages = (|| -> Result<()> {
                let embed =
                    planner.check("model.embed_tokens.weight", &[v, h], "the embeddings")?;
                let embed = run(vec![Job::Float(embed)])?.pop().expect("one job");
                if !send(Ok(Stage::Embed(embed))) {
                    return Ok(());
                }
                for i in 0..config.num_hidden_layers {
                    let p = format!("model.layers.{i}");
                    let mut jobs = Vec::with_capacity(11);
                    for (suffix, d_out, d_in, has_bias) in config.linears() {
                        let module = format!("{p}.{suffix}");
                        planner.linear(&module, (d_out, d_in, has_bias), precision, &mut jobs)?;
                    }
                    for norm in ["input_layernorm", "post_attention_layernorm"] {
                        let name = format!("{p}.{norm}.weight");
                        jobs.push(Job::F32(planner.check(&name, &[h], "an RMSNorm")?));
                    }
                    if !send(Ok(Stage::Layer(run(jobs)?))) {
                        return Ok(());
                    }
                }
                let norm = planner.check("model.norm.weight", &[h], "an RMSNorm")?;
                let norm = run(vec![Job::F32(norm)])?.pop().expect("one job");
                if !send(Ok(Stage::FinalNorm(norm))) {
                    return Ok(());
                }
                let lm_head = if config.tie_word_embeddings {
                    planner.used.insert("lm_head.weight".into());
                    None
                } else {
                    let info = planner.check(
                        "lm_head.weight",
                        &[v, h],
                        "the untied lm_head (tie_word_embeddings is false)",
                    )?;
                    run(vec![Job::Float(info)])?.pop()
                };
                send(Ok(Stage::LmHead(lm_head)));
                Ok(())
            })();
            if let Err(e) = stages {
                send(Err(e));
            }
            convert
        });
        let built = build::<B>(
            rx,
            &mut upload,
            config,
            options,
            &lora_of,
            &adapter_norms,
            device,
        );
        let convert = producer.join().expect("the loading thread does not panic");
        (built, convert)
    });
    let (embed, layers, final_norm, lm_head) = built?;
    let unused: Vec<String> = source
        .ckpt()
        .tensors()
        .map(|t| t.name.clone())
        .filter(|n| !planner.used.contains(n) && !n.ends_with("rotary_emb.inv_freq"))
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
    let sync_start = Instant::now();
    let upload_stats = session.finish()?;
    B::sync(device).map_err(|e| {
        ModelError::Nn(format!(
            "the device failed while the weights were uploaded: {e:?}"
        ))
    })?;
    upload += sync_start.elapsed();
    let stats = LoadStats {
        bytes,
        total: start.elapsed(),
        read,
        convert,
        upload,
        upload_path: upload_stats.path(),
    };
    Ok((model, stats))
}

/// The model's parts as uploaded.
type Parts<B> = (
    Tensor<B, 2>,
    Vec<DecoderLayer<B>>,
    NoisyRmsNorm<B>,
    Option<Tensor<B, 2>>,
);

/// Uploads the stages the planning thread sends, in model order; adds its time to `upload`.
fn build<B: QerlBackend>(
    rx: std::sync::mpsc::Receiver<Result<Stage>>,
    upload: &mut Duration,
    config: &ModelConfig,
    options: &LoadOptions,
    lora_of: &dyn Fn(&str) -> Option<LoraConfig>,
    adapter_norms: &std::collections::BTreeMap<String, Vec<f32>>,
    device: &B::Device,
) -> Result<Parts<B>> {
    let h = config.hidden_size;
    let next = || -> Result<Stage> {
        rx.recv()
            .map_err(|_| ModelError::Input("the loading thread stopped early".into()))?
    };
    let norm = |name: &str, host: Host| -> NoisyRmsNorm<B> {
        let Host::F32(w) = host else {
            unreachable!("norm weights are f32")
        };
        let w = adapter_norms.get(name).cloned().unwrap_or(w);
        let w = Tensor::<B, 1>::from_data(TensorData::new(w, [h]), device);
        NoisyRmsNorm::new(w, config.rms_norm_eps, options.trainable_norms)
    };
    let float = |name: &str, host: Host| -> Result<Tensor<B, 2>> {
        let Host::Float(data) = host else {
            unreachable!("a dense tensor")
        };
        let t = B::float_upload(name, data, device).map_err(|e| match e {
            NnError::Kernel {
                source: KernelError::Upload(e),
                ..
            } => ModelError::Upload(e),
            e => ModelError::Nn(e.to_string()),
        })?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(t)))
    };
    let Stage::Embed(embed) = next()? else {
        unreachable!("the embeddings come first")
    };
    let t = Instant::now();
    let embed = float("model.embed_tokens.weight", embed)?;
    *upload += t.elapsed();
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let Stage::Layer(hosts) = next()? else {
            unreachable!("then the layers")
        };
        let t = Instant::now();
        let p = format!("model.layers.{i}");
        let mut hosts = hosts.into_iter();
        let mut lins = Vec::with_capacity(7);
        for (suffix, _, _, has_bias) in config.linears() {
            let module = format!("{p}.{suffix}");
            let bias = match has_bias.then(|| hosts.next()).flatten() {
                Some(Host::F32(b)) => Some(b),
                _ => None,
            };
            let nn = |e: qerl_nn::NnError| ModelError::Nn(format!("{module}: {e}"));
            let lora = lora_of(&module);
            let lin = match hosts.next().expect("a weight per linear") {
                Host::Quantized(w) => {
                    Nvfp4Linear::from_quantized(&module, w, bias.as_deref(), lora, device)
                }
                dense => Nvfp4Linear::from_dense_tensor(
                    &module,
                    float(&format!("{module}.weight"), dense)?,
                    bias.as_deref(),
                    lora,
                    device,
                ),
            }
            .map_err(nn)?;
            lins.push(lin);
        }
        let input_layernorm = norm(
            &format!("{p}.input_layernorm.weight"),
            hosts.next().expect("norm"),
        );
        let post_attention_layernorm = norm(
            &format!("{p}.post_attention_layernorm.weight"),
            hosts.next().expect("norm"),
        );
        let mut lins = lins.into_iter();
        let mut lin = || lins.next().expect("seven linears");
        let self_attn = Attention {
            q_proj: lin(),
            k_proj: lin(),
            v_proj: lin(),
            o_proj: lin(),
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        };
        let mlp = Mlp {
            gate_proj: lin(),
            up_proj: lin(),
            down_proj: lin(),
        };
        layers.push(DecoderLayer {
            input_layernorm,
            self_attn,
            post_attention_layernorm,
            mlp,
        });
        *upload += t.elapsed();
    }
    let Stage::FinalNorm(final_norm) = next()? else {
        unreachable!("then the final norm")
    };
    let final_norm = norm("model.norm.weight", final_norm);
    let Stage::LmHead(lm_head) = next()? else {
        unreachable!("then the lm_head")
    };
    let t = Instant::now();
    let lm_head = lm_head.map(|h| float("lm_head.weight", h)).transpose()?;
    *upload += t.elapsed();
    Ok((embed, layers, final_norm, lm_head))
}
