//! `qerl bench load`: how fast a checkpoint loads. Writes a Qwen2.5-shaped checkpoint with
//! random BF16 weights (and its NVFP4 twin through `qerl quantize`'s code) once into `--dir`,
//! then loads each precision `--repeat` times on the device and prints where the time went
//! (read, convert, upload). The second load of a file runs from the page cache.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use half::bf16;
use qerl_engine::ModelShape;
use qerl_format::checkpoint::{par, quantize_checkpoint};
use qerl_format::QuantFormat;
use qerl_model::{load_with_stats, LoadOptions};
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
    let bf16_dir = a.dir.join("bf16");
    if !bf16_dir.join("config.json").is_file() {
        let t = std::time::Instant::now();
        write_random(&shape, &bf16_dir)?;
        eprintln!(
            "wrote {} in {:.1} s",
            bf16_dir.display(),
            t.elapsed().as_secs_f64()
        );
    }
    let nvfp4_dir = a.dir.join("nvfp4");
    if a.precision.iter().any(|p| p == "nvfp4") && !nvfp4_dir.join("config.json").is_file() {
        let t = std::time::Instant::now();
        quantize_checkpoint(&bf16_dir, &nvfp4_dir, QuantFormat::Nvfp4, &mut |_| {})?;
        eprintln!(
            "quantized {} in {:.1} s",
            nvfp4_dir.display(),
            t.elapsed().as_secs_f64()
        );
    }
    with_backend!(a.device, B => {
        for p in &a.precision {
            let dir = a.dir.join(p);
            for i in 0..a.repeat {
                let (model, stats) = load_with_stats::<B>(&dir, &LoadOptions::default(), None, &Default::default())
                    .with_context(|| format!("cannot load `{}`", dir.display()))?;
                println!("{} {p} load {}: {stats}", a.shape, i + 1);
                drop(model);
            }
        }
        Ok::<(), anyhow::Error>(())
    })?;
    Ok(())
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
