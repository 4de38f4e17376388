//! One module per `qerl` subcommand: each has `Args` (clap) and `run(Args) -> anyhow::Result<()>`.

pub mod eval;
pub mod generate;
pub mod quantize;
pub mod reward;
pub mod score;
pub mod train;
