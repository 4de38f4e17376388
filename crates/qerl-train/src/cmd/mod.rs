//! One module per `qerl` subcommand: each has `Args` (clap) and `run(Args) -> anyhow::Result<()>`.

pub mod bench;
pub mod convert;
pub mod demo;
pub mod eval;
pub mod generate;
pub mod quantize;
pub mod reward;
pub mod score;
pub mod sft;
pub mod train;

/// Whether an NVIDIA GPU is visible (its device nodes exist).
pub fn gpu_present() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists() || std::path::Path::new("/dev/nvidia0").exists()
}
