//! `qerl bench rollout`: the rollout engine on a Qwen2.5-shaped model with random weights built
//! in memory (no checkpoint), after a correctness check of the same engine against the host
//! reference on the same device.

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, Subcommand};
use cubecl::prelude::*;
use qerl_engine::bench::{rollout, RolloutRow, RolloutSpec};
use qerl_engine::reference::check_engine;
use qerl_engine::{ModelShape, RandomPrecision};

use super::generate::DeviceArg;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

#[derive(Subcommand, Debug)]
pub enum What {
    /// Generation throughput of the rollout engine (tokens/s, ms per step, weight bandwidth).
    Rollout(RolloutArgs),
    /// Checkpoint load throughput (read, convert, upload) on a random Qwen2.5-shaped model.
    Load(super::bench_load::LoadArgs),
    /// The fused attention against the decomposed one: a correctness check, then forward and
    /// backward time and held memory at a training shape (default Qwen2.5-7B, 16 x 320).
    Attention(super::bench_attention::AttentionArgs),
    /// GRPO steps on a random Qwen2.5-shaped model: rollout / reference / update time, peak
    /// memory, update TFLOP/s, NVFP4 against BF16 LoRA, and the longest context that fits.
    Train(super::bench_train::TrainArgs),
}

#[derive(ClapArgs, Debug)]
pub struct RolloutArgs {
    /// qwen2.5-0.5b, -1.5b, -7b, -14b or -32b.
    #[arg(long, default_value = "qwen2.5-7b")]
    pub shape: String,
    /// Frozen weights: nvfp4, bf16 (comma-separated to run both in one process).
    #[arg(long, default_value = "nvfp4,bf16", value_delimiter = ',')]
    pub precision: Vec<String>,
    /// Batch sizes (sequences decoded at once).
    #[arg(long, default_value = "1,16,64,256", value_delimiter = ',')]
    pub batch: Vec<usize>,
    #[arg(long, default_value_t = 256)]
    pub prompt: usize,
    #[arg(long, default_value_t = 512)]
    pub new_tokens: usize,
    /// LoRA rank on every linear (0: none).
    #[arg(long, default_value_t = 16)]
    pub lora_rank: usize,
    /// Most prompt tokens in one prefill pass.
    #[arg(long, default_value_t = 4096)]
    pub prefill_rows: usize,
    #[arg(long, value_enum, default_value = "cuda")]
    pub device: DeviceArg,
    /// Sample from the top-k tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sample from the nucleus of this probability (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Skip the correctness check against the host reference.
    #[arg(long)]
    pub no_check: bool,
    /// Also write the rows as JSON lines here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let before = super::kernel_cache::cached_kernels();
    let result = match args.what {
        What::Rollout(a) => run_rollout(a),
        What::Load(a) => super::bench_load::run(a),
        What::Train(a) => super::bench_train::run(a),
        What::Attention(a) => super::bench_attention::run(a),
    };
    // What a cold start pays for (issue 14): the CUDA kernels this run had to compile (only
    // CUDA's grow the cache, so a run elsewhere, or a warm one, prints nothing).
    if let Some(c) = super::kernel_cache::compiled_since(before).filter(|c| c.compiled > 0) {
        eprintln!("{c}");
    }
    result
}

fn run_rollout(a: RolloutArgs) -> Result<()> {
    let shape = ModelShape::preset(&a.shape)?;
    let precisions = a
        .precision
        .iter()
        .map(|p| match p.as_str() {
            "nvfp4" => Ok(RandomPrecision::Nvfp4),
            "bf16" => Ok(RandomPrecision::Bf16),
            other => bail!("--precision: `{other}` is not nvfp4 or bf16"),
        })
        .collect::<Result<Vec<_>>>()?;
    if a.batch.is_empty() || a.batch.contains(&0) || a.prompt == 0 || a.new_tokens == 0 {
        bail!("--batch, --prompt and --new-tokens must be positive");
    }
    if let Some(path) = &a.json {
        if path.exists() {
            bail!("--json: {} exists; not overwriting it", path.display());
        }
    }
    match a.device {
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda => {
            let client = cubecl::cuda::CudaRuntime::client(&Default::default());
            bench_on::<cubecl::cuda::CudaRuntime, half::bf16>(&client, &a, &shape, &precisions)
        }
        #[cfg(feature = "wgpu")]
        DeviceArg::Wgpu => {
            let device = qerl_kernels::runtime::wgpu_device()?;
            let client = cubecl::wgpu::WgpuRuntime::client(&device);
            bench_on::<cubecl::wgpu::WgpuRuntime, f32>(&client, &a, &shape, &precisions)
        }
        other => bail!("qerl bench rollout runs on a GPU backend; `{other:?}` is not one in this build (build with --features cuda)"),
    }
}

fn bench_on<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &RolloutArgs,
    shape: &ModelShape,
    precisions: &[RandomPrecision],
) -> Result<()> {
    if !a.no_check {
        // The same kernels in f32 (exact to ~1e-5) and in the benchmark's type.
        for quant in [false, true] {
            let exact = check_engine::<R, f32>(client, 3, quant)?;
            let typed = check_engine::<R, F>(client, 3, quant)?;
            let name = if quant { "nvfp4" } else { "dense" };
            println!(
                "check {name}: f32 tokens {}/{} max |dlogprob| {:.1e}; {} first tokens {}/{}, tokens {}/{}, max |dlogprob| before a mismatch {:.3}",
                exact.tokens_equal,
                exact.tokens,
                exact.max_logprob_diff,
                std::any::type_name::<F>(),
                typed.first_tokens_equal,
                typed.requests,
                typed.tokens_equal,
                typed.tokens,
                typed.max_logprob_diff
            );
            if typed.graph_steps != (0, 0) || exact.graph_steps != (0, 0) {
                println!(
                    "check {name} graphs (captured, replayed): f32 {:?}, typed {:?}",
                    exact.graph_steps, typed.graph_steps
                );
            }
            println!(
                "check {name} repeated by a second call on the same engine: f32 {}/{}, typed {}/{}",
                exact.repeated, exact.requests, typed.repeated, typed.requests
            );
            if exact.repeated != exact.requests || typed.repeated != typed.requests {
                bail!("a second generate on the same engine gave other tokens: f32 {exact:?}, typed {typed:?}");
            }
            if exact.tokens_equal != exact.tokens || exact.max_logprob_diff > 2e-3 {
                bail!("the engine does not match the host reference in f32: {exact:?}");
            }
            if typed.max_logprob_diff > 0.1 {
                bail!(
                    "the engine is too far from the host reference in {}: {typed:?}",
                    std::any::type_name::<F>()
                );
            }
        }
    }
    let mut all = Vec::new();
    for &precision in precisions {
        let spec = RolloutSpec {
            shape: shape.clone(),
            precision,
            lora_rank: (a.lora_rank > 0).then_some(a.lora_rank),
            batches: a.batch.clone(),
            prompt_tokens: a.prompt,
            new_tokens: a.new_tokens,
            prefill_rows: a.prefill_rows,
            truncation: qerl_engine::Truncation {
                top_k: a.top_k,
                top_p: a.top_p,
            },
        };
        let rows = rollout::<R, F>(client, &spec, |r| println!("{}", line(r)))
            .with_context(|| format!("{} {precision:?}", shape.name))?;
        all.extend(rows);
        client.memory_cleanup();
    }
    println!();
    println!("| shape | weights | batch | prefill ms | decode ms/step | tokens/s | decode tokens/s | weight TB/s | reserved GB |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &all {
        println!(
            "| {} | {:?} | {} | {:.1} | {:.2} | {:.0} | {:.0} | {:.2} | {:.1} |",
            r.shape,
            r.precision,
            r.batch,
            r.prefill_ms,
            r.decode_ms_per_step,
            r.tokens_per_s,
            r.decode_tokens_per_s,
            r.weight_tb_per_s,
            r.reserved_mb / 1e3
        );
    }
    if let Some(path) = &a.json {
        let text: String = all.iter().map(|r| json(r).to_string() + "\n").collect();
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn line(r: &RolloutRow) -> String {
    let graphs = match (r.graph_steps, &r.graph_off) {
        ((0, 0), None) => String::new(),
        ((c, p), off) => format!(
            "; graphs: {c} captured, {p} replayed{}{}",
            r.graph_edges.map_or(String::new(), |(k, e)| format!(
                " ({k} kernels, {e} programmatic edges)"
            )),
            off.as_ref()
                .map_or(String::new(), |o| format!(", off: {o}"))
        ),
    };
    let text = format!(
        "{} {:?} batch {}: tokens {:016x}, prefill {:.1} ms, decode {:.2} ms/step, {:.0} tokens/s ({:.0} decoding), {:.2} TB/s of weights, {:.1} GB reserved",
        r.shape,
        r.precision,
        r.batch,
        r.token_digest,
        r.prefill_ms,
        r.decode_ms_per_step,
        r.tokens_per_s,
        r.decode_tokens_per_s,
        r.weight_tb_per_s,
        r.reserved_mb / 1e3
    );
    text + &graphs
}

fn json(r: &RolloutRow) -> serde_json::Value {
    serde_json::json!({
        "shape": r.shape,
        "weights": format!("{:?}", r.precision).to_lowercase(),
        "batch": r.batch,
        "prompt_tokens": r.prompt_tokens,
        "new_tokens": r.new_tokens,
        "prefill_ms": r.prefill_ms,
        "decode_ms_per_step": r.decode_ms_per_step,
        "total_s": r.total_s,
        "tokens_per_s": r.tokens_per_s,
        "decode_tokens_per_s": r.decode_tokens_per_s,
        "weight_tb_per_s": r.weight_tb_per_s,
        "reserved_mb": r.reserved_mb,
        "in_use_mb": r.in_use_mb,
    })
}
