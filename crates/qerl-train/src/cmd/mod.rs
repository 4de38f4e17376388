//! One module per `qerl` subcommand: each has `Args` (clap) and `run(Args) -> anyhow::Result<()>`.

pub mod bench;
pub mod bench_attention;
pub mod bench_load;
pub mod bench_train;
mod bench_train_report;
pub mod convert;
pub mod demo;
pub mod eval;
pub mod generate;
mod kernel_cache;
pub mod quantize;
pub mod reward;
pub mod score;
pub mod sft;
pub mod train;
pub mod warmup;

/// A count that must be at least 1 (`--samples`, `--batch`): clap refuses 0 with this message
/// instead of the command quietly running with 1.
pub fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("`{s}` is not a whole number: {e}")),
    }
}

/// Whether an NVIDIA GPU is visible (its device nodes exist).
pub fn gpu_present() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists() || std::path::Path::new("/dev/nvidia0").exists()
}
