//! `qerl`: the command line of the qerl project.
//!
//! Each subcommand lives in its own module under [`cmd`] with a clap `Args` struct and a
//! `run(args) -> anyhow::Result<()>`; adding one (generate, score, train, eval) means adding a
//! module there and a variant to [`Command`].

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "qerl",
    version,
    about = "Quantization-enhanced RL for LLMs",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Without a subcommand: the demo (NVFP4 + LoRA + GRPO + AQN on the embedded tiny-math model).
    #[command(flatten)]
    demo: cmd::demo::Args,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Quantize a Hugging Face checkpoint's decoder linears to NVFP4, MXFP4 or NF4.
    Quantize(cmd::quantize::Args),
    /// Convert a llama.cpp GGUF file (Llama / Qwen2) into a Hugging Face model directory.
    Convert(cmd::convert::Args),
    /// Generate completions with a Qwen2 / Llama model (dense or NVFP4, optional LoRA adapter).
    Generate(cmd::generate::Args),
    /// Print, for every position of a text, the top-K next tokens and their log-probabilities.
    Score(cmd::score::Args),
    /// RL post-training (GRPO / DAPO / Dr. GRPO) with LoRA on a frozen NVFP4 or BF16 model, with AQN.
    Train(cmd::train::Args),
    /// pass@1 (mean over K samples) on GSM8K, MATH-500 or a JSONL file, strict and flexible.
    Eval(cmd::eval::Args),
    /// Re-score a JSONL file of completions with a dataset's rewards.
    Reward(cmd::reward::Args),
    /// Benchmarks: `qerl bench rollout` (the rollout engine on random weights of a preset shape).
    Bench(cmd::bench::Args),
    /// Compile the kernels a run will need once (a load, short generations, with --train one
    /// training step), and print where the kernel cache lives.
    Warmup(cmd::warmup::Args),
    /// Make a small math model from scratch: synthetic problems, a BPE tokenizer, supervised
    /// training of a Qwen2 model, a Hugging Face checkpoint and its held-out accuracy.
    Sft(cmd::sft::Args),
}

fn main() {
    let cli = Cli::parse();
    // A bad QERL_GEMM fails here, with its name, not inside the first GPU product.
    if let Err(err) = qerl_kernels::gemm::strategy() {
        eprintln!("error: {err}");
        std::process::exit(1);
    }
    let result = match cli.command {
        None => cmd::demo::run(cli.demo),
        Some(Command::Quantize(args)) => cmd::quantize::run(args),
        Some(Command::Convert(args)) => cmd::convert::run(args),
        Some(Command::Generate(args)) => cmd::generate::run(args),
        Some(Command::Score(args)) => cmd::score::run(args),
        Some(Command::Train(args)) => cmd::train::run(args),
        Some(Command::Eval(args)) => cmd::eval::run(args),
        Some(Command::Reward(args)) => cmd::reward::run(args),
        Some(Command::Sft(args)) => cmd::sft::run(args),
        Some(Command::Bench(args)) => cmd::bench::run(args),
        Some(Command::Warmup(args)) => cmd::warmup::run(args),
    };
    if let Err(err) = result {
        eprintln!("error: {}", error_chain(&err));
        std::process::exit(1);
    }
    // Stopped by Ctrl-C (SIGINT) or SIGTERM after saving what it had: 130, as shells expect of
    // an interrupted command, so that `qerl train ... && next` does not go on.
    if qerl_train::signal::requested() {
        std::process::exit(qerl_train::signal::INTERRUPTED_EXIT);
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
