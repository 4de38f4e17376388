//! `qerl quantize <hf_model_dir> <out_dir> [--format nvfp4|mxfp4|nf4]`.
//!
//! Quantizes every decoder linear (q, k, v, o, gate, up, down) of a Hugging Face checkpoint and
//! writes a checkpoint vLLM / transformers load (see `qerl_format::checkpoint`). Shows a progress
//! bar on a terminal, then prints the sizes before and after and the mean relative error
//! `‖W − deq(Q(W))‖ / ‖W‖` per layer kind.

use std::path::PathBuf;

use anyhow::Result;
use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use qerl_format::checkpoint::{quantize_checkpoint, ProgressEvent, QuantizeReport};
use qerl_format::QuantFormat;

/// The 4-bit format to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// compressed-tensors nvfp4-pack-quantized (E2M1, FP8 scale per 16, global scale).
    Nvfp4,
    /// compressed-tensors mxfp4-pack-quantized (E2M1, E8M0 scale per 32).
    Mxfp4,
    /// bitsandbytes NF4 (absmax per 64).
    Nf4,
}

impl From<FormatArg> for QuantFormat {
    fn from(f: FormatArg) -> Self {
        match f {
            FormatArg::Nvfp4 => QuantFormat::Nvfp4,
            FormatArg::Mxfp4 => QuantFormat::Mxfp4,
            FormatArg::Nf4 => QuantFormat::Nf4,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Hugging Face model directory (config.json + model.safetensors or sharded safetensors).
    pub hf_model_dir: PathBuf,
    /// Output directory; must not exist or be empty.
    pub out_dir: PathBuf,
    /// Quantization format.
    #[arg(long, value_enum, default_value_t = FormatArg::Nvfp4)]
    pub format: FormatArg,
}

pub fn run(args: Args) -> Result<()> {
    let format = QuantFormat::from(args.format);
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:40}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut on_event = |event: ProgressEvent| match event {
        ProgressEvent::Pass { name, total } => {
            bar.set_prefix(name);
            bar.set_length(total as u64);
            bar.set_position(0);
        }
        ProgressEvent::Tensor { name, .. } => {
            bar.set_message(name);
            bar.inc(1);
        }
        ProgressEvent::ShardWritten { file, .. } => bar.set_message(format!("wrote {file}")),
    };
    let result = quantize_checkpoint(&args.hf_model_dir, &args.out_dir, format, &mut on_event);
    bar.finish_and_clear();
    let report = result?;
    print!("{}", summary(&report));
    println!("wrote {}", args.out_dir.display());
    Ok(())
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// The end-of-run summary: counts, sizes and the error table.
pub fn summary(report: &QuantizeReport) -> String {
    let mut out = format!(
        "quantized {} linears to {}, kept {} tensors, copied {} files\n",
        report.layers.len(),
        report.format,
        report.kept,
        report.copied.len()
    );
    out += &format!(
        "size: {:.2} MB -> {:.2} MB ({:.2}x smaller)\n",
        mb(report.input_bytes),
        mb(report.output_bytes),
        report.ratio()
    );
    out += "layer  count  mean rel. error\n";
    for (kind, count, mean) in report.mean_error_by_kind() {
        out += &format!("{:<5}  {count:>5}  {mean:.5}\n", kind.label());
    }
    out
}
