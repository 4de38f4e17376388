//! One module per `qerl` subcommand: each has `Args` (clap) and `run(Args) -> anyhow::Result<()>`.

pub mod quantize;
