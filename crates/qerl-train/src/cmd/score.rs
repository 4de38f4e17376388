//! `qerl score --model DIR --text TEXT [--top-k K] [--json]`.
//!
//! Runs the text through the model once and prints, for every position, the token, its
//! log-probability given the tokens before it, and the K most likely next tokens with their
//! log-probabilities (log-softmax of the logits, temperature 1, LoRA adapter applied).

use anyhow::Result;
use qerl_model::{score, QerlBackend, Tokenizer};
use serde_json::{json, Value};

use super::generate::{load, with_backend, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to score (tokenized with the tokenizer's special tokens, e.g. a BOS).
    #[arg(long)]
    pub text: String,
    /// How many next-token candidates to list per position.
    #[arg(long, default_value_t = 5)]
    pub top_k: usize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<()> {
    with_backend!(args.model.device, B => run_on::<B>(&args, &Default::default()))
}

/// The text of one token (its bytes may be part of a character: then U+FFFD).
fn piece(tokenizer: &Tokenizer, id: u32) -> Result<String> {
    Ok(tokenizer.decode_ids(&[id], false)?)
}

fn run_on<B: QerlBackend>(args: &Args, device: &B::Device) -> Result<()> {
    let loaded = load::<B>(&args.model, device)?;
    let tok = &loaded.tokenizer;
    let ids = tok.encode(&args.text, true)?;
    if ids.is_empty() {
        anyhow::bail!("the text encodes to no tokens");
    }
    qerl_model::check_context(&loaded.model.config, std::slice::from_ref(&ids), 0)?;
    let scores = score(&loaded.model, &ids, args.top_k)?;
    if args.json {
        let positions = scores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let top = s
                    .top
                    .iter()
                    .map(|&(id, lp)| Ok(json!({"id": id, "token": piece(tok, id)?, "logprob": lp})))
                    .collect::<Result<Vec<Value>>>()?;
                Ok(json!({
                    "position": i,
                    "id": s.token,
                    "token": piece(tok, s.token)?,
                    "logprob": s.logprob,
                    "top": top,
                }))
            })
            .collect::<Result<Vec<Value>>>()?;
        let total: f32 = scores.iter().filter_map(|s| s.logprob).sum();
        let doc = json!({
            "model": args.model.model.display().to_string(),
            "text": args.text,
            "ids": ids,
            "total_logprob": total,
            "positions": positions,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!(
        "{:>4}  {:>7}  {:<16} {:>9}   top-{} next tokens",
        "pos", "id", "token", "logprob", args.top_k
    );
    for (i, s) in scores.iter().enumerate() {
        let lp = s
            .logprob
            .map_or_else(|| "-".to_string(), |l| format!("{l:.4}"));
        let top: Vec<String> = s
            .top
            .iter()
            .map(|&(id, l)| Ok(format!("{:?} {l:.3}", piece(tok, id)?)))
            .collect::<Result<_>>()?;
        println!(
            "{i:>4}  {:>7}  {:<16} {lp:>9}   {}",
            s.token,
            format!("{:?}", piece(tok, s.token)?),
            top.join(", ")
        );
    }
    Ok(())
}
