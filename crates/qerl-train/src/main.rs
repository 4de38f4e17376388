//! `qerl`: the command line of the qerl project.
//!
//! Each subcommand lives in its own module under [`cmd`] with a clap `Args` struct and a
//! `run(args) -> anyhow::Result<()>`; adding one (generate, score, train, eval) means adding a
//! module there and a variant to [`Command`].

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "qerl", version, about = "Quantization-enhanced RL for LLMs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Quantize a Hugging Face checkpoint's decoder linears to NVFP4, MXFP4 or NF4.
    Quantize(cmd::quantize::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Quantize(args) => cmd::quantize::run(args),
    };
    if let Err(err) = result {
        eprintln!("error: {}", error_chain(&err));
        std::process::exit(1);
    }
}

/// The error and its causes, skipping causes whose text the message already contains (the
/// library's errors quote their source).
fn error_chain(err: &anyhow::Error) -> String {
    let mut msg = err.to_string();
    for cause in err.chain().skip(1) {
        let cause = cause.to_string();
        if !msg.contains(&cause) {
            msg.push_str(": ");
            msg.push_str(&cause);
        }
    }
    msg
}
