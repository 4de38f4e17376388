//! `qerl bench load`: how fast a checkpoint loads. Writes a Qwen2.5-shaped checkpoint with
//! random BF16 weights (and its NVFP4 twin through `qerl quantize`'s code) once into `--dir`,
//! then loads each precision `--repeat` times on the device and prints where the time went
//! (read, convert, upload, and the upload path that ran). The second load of a file runs from
//! the page cache.
//!
//! `--upload cubecl,staged` times both upload paths (default: `QERL_UPLOAD`, else staged).
//! `--check` instead loads a small random model with odd widths (pitched rows on CUDA) through
//! cubecl's upload and through the staged one (small and default chunks), compares every
//! weight bit for bit and prints one PASS/FAIL line.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::tensor::{Tensor, TensorPrimitive};
use half::bf16;
use qerl_engine::reference::test_shape;
use qerl_engine::ModelShape;
use qerl_format::checkpoint::{par, quantize_checkpoint};
use qerl_format::QuantFormat;
use qerl_model::{load_with_upload, CausalLm, LoadOptions};
use qerl_nn::upload::{UploadConfig, UploadPath};
use qerl_nn::{Nvfp4Linear, QerlBackend};
use serde_json::{json, Map, Value};

use super::generate::{with_backend, DeviceArg};

#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// qwen2.5-0.5b, -1.5b, -7b, -14b or -32b.
    #[arg(long, default_value = "qwen2.5-0.5b")]
    pub shape: String,
    /// Where the checkpoints live (`DIR/bf16`, `DIR/nvfp4`); made when absent.
    #[arg(long)]
    pub dir: PathBuf,
    /// Checkpoints to load: bf16, nvfp4 (comma-separated).
    #[arg(long, default_value = "nvfp4,bf16", value_delimiter = ',')]
    pub precision: Vec<String>,
    /// Loads of each checkpoint (the first may read the disk, the next ones the page cache).
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Upload paths to time, each `--repeat` times: staged, cubecl (comma-separated; default:
    /// `QERL_UPLOAD`, else staged). The staged path needs CUDA; elsewhere it is cubecl's.
    #[arg(long, value_delimiter = ',')]
    pub upload: Vec<String>,
    /// Check that both upload paths load identical weights (a small model in `DIR/check`).
    #[arg(long)]
    pub check: bool,
}

pub fn run(a: LoadArgs) -> Result<()> {
    let shape = ModelShape::preset(&a.shape)?;
    if a.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    for p in &a.precision {
        if p != "bf16" && p != "nvfp4" {
            bail!("--precision: `{p}` is not bf16 or nvfp4");
        }
    }
    let mut uploads = Vec::new();
    for u in &a.upload {
        let mut c = UploadConfig::from_env()?;
        c.path = match u.as_str() {
            "staged" => UploadPath::Staged,
            "cubecl" => UploadPath::Cubecl,
            other => bail!("--upload: `{other}` is not staged or cubecl"),
        };
        uploads.push(Some(c));
    }
    if uploads.is_empty() {
        uploads.push(None);
    }
    if a.check {
        return check(&a);
    }
    write_pair(&shape, &a.dir, &a.precision)?;
    with_backend!(a.device, B => {
        for p in &a.precision {
            let dir = a.dir.join(p);
            for upload in &uploads {
                for i in 0..a.repeat {
                    let (model, stats) = load_with_upload::<B>(&dir, &LoadOptions::default(), None, *upload, &Default::default())
                        .with_context(|| format!("cannot load `{}`", dir.display()))?;
                    println!("{} {p} load {}: {stats}", a.shape, i + 1);
                    drop(model);
                }
            }
        }
        Ok::<(), anyhow::Error>(())
    })?;
    Ok(())
}

/// Writes `DIR/bf16` (random weights of `shape`) and, when `precisions` has nvfp4, its NVFP4
/// twin `DIR/nvfp4`, unless they exist.
fn write_pair(shape: &ModelShape, dir: &Path, precisions: &[String]) -> Result<()> {
    let bf16_dir = dir.join("bf16");
    if !bf16_dir.join("config.json").is_file() {
        let t = std::time::Instant::now();
        write_random(shape, &bf16_dir)?;
        eprintln!(
            "wrote {} in {:.1} s",
            bf16_dir.display(),
            t.elapsed().as_secs_f64()
        );
    }
    let nvfp4_dir = dir.join("nvfp4");
    if precisions.iter().any(|p| p == "nvfp4") && !nvfp4_dir.join("config.json").is_file() {
        let t = std::time::Instant::now();
        quantize_checkpoint(&bf16_dir, &nvfp4_dir, QuantFormat::Nvfp4, &mut |_| {})?;
        eprintln!(
            "quantized {} in {:.1} s",
            nvfp4_dir.display(),
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The engine's test shape ([`test_shape`]: two layers, grouped queries, q/k/v biases, an
/// untied lm_head) at widths whose rows cubecl pads on CUDA (544 and 1440 bytes of bf16) and
/// that are multiples of the NVFP4 block.
fn check_shape() -> ModelShape {
    let base = test_shape();
    let hidden = 272;
    let head_dim = hidden / base.q_heads;
    ModelShape {
        name: "check".into(),
        vocab: 1000,
        hidden,
        intermediate: 720,
        head_dim,
        inv_freq: (0..head_dim / 2)
            .map(|i| 1e6f32.powf(-((2 * i) as f32) / head_dim as f32))
            .collect(),
        max_positions: 128,
        ..base
    }
}

/// Every weight of `model` as `(name, bytes)`: dense tensors as stored, 4-bit weights
/// dequantized on the device (a function of the codes, scales and tables).
fn weights<B: QerlBackend>(model: &CausalLm<B>, device: &B::Device) -> Vec<(String, Vec<u8>)> {
    fn bytes<B: QerlBackend, const D: usize>(t: Tensor<B, D>) -> Vec<u8> {
        t.into_data().as_bytes().to_vec()
    }
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        bytes(model.embed_tokens.val()),
    )];
    let linear = |out: &mut Vec<(String, Vec<u8>)>, name: String, l: &Nvfp4Linear<B>| {
        if let Some(w) = &l.dense {
            out.push((format!("{name}.weight"), bytes(w.val())));
        }
        if let Some(w) = l.quant_weight() {
            let deq = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(
                B::qweight_dequantize(w, device),
            ));
            out.push((format!("{name}.weight (dequantized)"), bytes(deq)));
        }
        if let Some(b) = &l.bias {
            out.push((format!("{name}.bias"), bytes(b.val())));
        }
    };
    for (i, layer) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let (attn, mlp) = (&layer.self_attn, &layer.mlp);
        for (m, l) in [
            ("self_attn.q_proj", &attn.q_proj),
            ("self_attn.k_proj", &attn.k_proj),
            ("self_attn.v_proj", &attn.v_proj),
            ("self_attn.o_proj", &attn.o_proj),
            ("mlp.gate_proj", &mlp.gate_proj),
            ("mlp.up_proj", &mlp.up_proj),
            ("mlp.down_proj", &mlp.down_proj),
        ] {
            linear(&mut out, format!("{p}.{m}"), l);
        }
        for (n, norm) in [
            ("input_layernorm", &layer.input_layernorm),
            ("post_attention_layernorm", &layer.post_attention_layernorm),
        ] {
            out.push((format!("{p}.{n}.weight"), bytes(norm.weight.val())));
        }
    }
    out.push(("model.norm.weight".into(), bytes(model.norm.weight.val())));
    if let Some(h) = &model.lm_head {
        out.push(("lm_head.weight".into(), bytes(h.val())));
    }
    out
}

/// `qerl bench load --check`: cubecl's upload against the staged one, bit for bit.
fn check(a: &LoadArgs) -> Result<()> {
    let dir = a.dir.join("check");
    write_pair(&check_shape(), &dir, &a.precision)?;
    let reference = UploadConfig {
        path: UploadPath::Cubecl,
        ..UploadConfig::default()
    };
    // Every buffer staged; 64 KiB chunks split each tensor (and its pitched rows) over many
    // chunks and both buffers, 64 MiB ones take each tensor whole.
    let staged = |chunk_bytes| UploadConfig {
        path: UploadPath::Staged,
        chunk_bytes,
        min_bytes: 0,
    };
    let candidates = [staged(64 << 10), staged(64 << 20)];
    let cuda = a.device == DeviceArg::Cuda;
    let mut failures = Vec::new();
    let (mut tensors, mut total) = (0usize, 0usize);
    let mut paths = Vec::new();
    with_backend!(a.device, B => {
        let device = Default::default();
        for p in &a.precision {
            let path = dir.join(p);
            let load = |upload: UploadConfig| {
                load_with_upload::<B>(&path, &LoadOptions::default(), None, Some(upload), &device)
                    .with_context(|| format!("cannot load `{}`", path.display()))
            };
            let (model, stats) = load(reference)?;
            paths.push(format!("{p}: {}", stats.upload_path));
            let want = weights(&model, &device);
            drop(model);
            for c in candidates {
                let (model, stats) = load(c)?;
                paths.push(format!("{p} ({} KiB chunks): {}", c.chunk_bytes >> 10, stats.upload_path));
                if cuda && stats.upload_path != "staged" {
                    failures.push(format!("{p}: the staged path did not run ({})", stats.upload_path));
                }
                let got = weights(&model, &device);
                if got.len() != want.len() {
                    failures.push(format!("{p}: {} tensors against {}", got.len(), want.len()));
                }
                for ((name, w), (_, g)) in want.iter().zip(&got) {
                    tensors += 1;
                    total += w.len();
                    if w != g {
                        let at = w.iter().zip(g).position(|(x, y)| x != y).unwrap_or(w.len().min(g.len()));
                        failures.push(format!(
                            "{p} ({} KiB chunks): `{name}` differs at byte {at} of {}",
                            c.chunk_bytes >> 10,
                            w.len()
                        ));
                    }
                }
            }
        }
        Ok::<(), anyhow::Error>(())
    })?;
    if failures.is_empty() {
        println!(
            "load check PASS: {tensors} tensors ({:.1} MB) bit-identical, cubecl vs staged uploads [{}]",
            total as f64 / 1e6,
            paths.join("; ")
        );
        Ok(())
    } else {
        println!(
            "load check FAIL: {} [{}]",
            failures.join("; "),
            paths.join("; ")
        );
        bail!("the upload paths loaded different weights")
    }
}

/// Writes `config.json` and a `model.safetensors` of random BF16 weights (uniform, scaled like
/// a trained model's: `1/sqrt(fan_in)` for linears, norms near 1), streamed tensor by tensor.
pub fn write_random(shape: &ModelShape, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create `{}`", dir.display()))?;
    let config = json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.q_heads,
        "num_key_value_heads": shape.kv_heads,
        "rms_norm_eps": shape.rms_eps,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": shape.max_positions,
        "tie_word_embeddings": shape.tied_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1
    });
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&config)?)
        .with_context(|| format!("cannot write `{}`", path.display()))?;

    // (name, shape, scale, offset)
    let (h, v) = (shape.hidden, shape.vocab);
    let mut tensors: Vec<(String, Vec<usize>, f32, f32)> =
        vec![("model.embed_tokens.weight".into(), vec![v, h], 0.02, 0.0)];
    let linears = [
        ("self_attn.q_proj", shape.q_dim(), h, true),
        ("self_attn.k_proj", shape.kv_dim(), h, true),
        ("self_attn.v_proj", shape.kv_dim(), h, true),
        ("self_attn.o_proj", h, shape.q_dim(), false),
        ("mlp.gate_proj", shape.intermediate, h, false),
        ("mlp.up_proj", shape.intermediate, h, false),
        ("mlp.down_proj", h, shape.intermediate, false),
    ];
    for i in 0..shape.layers {
        let p = format!("model.layers.{i}");
        for (m, d_out, d_in, bias) in linears {
            let scale = 1.0 / (d_in as f32).sqrt();
            tensors.push((format!("{p}.{m}.weight"), vec![d_out, d_in], scale, 0.0));
            if bias {
                tensors.push((format!("{p}.{m}.bias"), vec![d_out], 0.02, 0.0));
            }
        }
        for n in ["input_layernorm", "post_attention_layernorm"] {
            tensors.push((format!("{p}.{n}.weight"), vec![h], 0.1, 1.0));
        }
    }
    tensors.push(("model.norm.weight".into(), vec![h], 0.1, 1.0));
    if !shape.tied_embeddings {
        tensors.push(("lm_head.weight".into(), vec![v, h], 0.02, 0.0));
    }

    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, dims, _, _) in &tensors {
        let bytes = 2 * dims.iter().product::<usize>();
        header.insert(
            name.clone(),
            json!({"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut header = serde_json::to_vec(&Value::Object(header))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let path = dir.join("model.safetensors");
    let mut out = BufWriter::with_capacity(
        1 << 24,
        File::create(&path).with_context(|| format!("cannot create `{}`", path.display()))?,
    );
    let write_err = || format!("cannot write `{}`", path.display());
    out.write_all(&(header.len() as u64).to_le_bytes())
        .with_context(write_err)?;
    out.write_all(&header).with_context(write_err)?;
    for (t, (_, dims, scale, shift)) in tensors.iter().enumerate() {
        let n: usize = dims.iter().product();
        let mut data = vec![[0u8; 2]; n];
        // One deterministic random value per element, filled on every core.
        par::convert_into(&vec![(); n], 1, &mut data, |start, _, chunk| {
            for (j, d) in chunk.iter_mut().enumerate() {
                let u = splitmix(((t as u64) << 40) ^ (start + j) as u64);
                let x = shift + scale * ((u >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0);
                *d = bf16::from_f32(x).to_le_bytes();
            }
        });
        out.write_all(data.as_flattened()).with_context(write_err)?;
    }
    out.flush().with_context(write_err)?;
    Ok(())
}

/// A 64-bit mix of `x` (splitmix64's finaliser): a deterministic random value per element.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
