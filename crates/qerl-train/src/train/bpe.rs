//! Training a small byte-level BPE tokenizer with the ChatML special tokens, for a model the
//! project makes itself (`qerl sft`).
//!
//! The layout follows Qwen2.5's tokenizer.json so that everything reading that one (qerl's
//! [`qerl_model::Tokenizer`] and [`qerl_model::ChatTemplate`], transformers' `AutoTokenizer`)
//! reads this one: byte-level pre-tokenizer and decoder, no normalizer, no post-processor,
//! `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` as added special tokens. Digits are split
//! one per token, as Qwen's pre-tokenizer does: a small model then learns arithmetic digit by
//! digit instead of memorising a table of whole numbers.

use std::path::Path;

use anyhow::{Context, Result};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, TokenizerBuilder,
};

/// The special tokens, in id order (ids 0, 1, 2).
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Trains a BPE of at most `vocab_size` tokens (the 256 byte symbols and the special tokens
/// included) on `texts` and writes it to `path` as tokenizer.json.
pub fn train_bpe(texts: &[String], vocab_size: usize, path: &Path) -> Result<()> {
    anyhow::ensure!(
        vocab_size > 256 + SPECIAL_TOKENS.len(),
        "a byte-level BPE needs a vocabulary larger than its 256 byte symbols and {} special tokens (got {vocab_size})",
        SPECIAL_TOKENS.len()
    );
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let pre = PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ]));
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(pre))
    .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())))
    .build()
    .map_err(|e| anyhow::anyhow!("cannot build the tokenizer: {e}"))?;
    tokenizer
        .train(&mut trainer, texts.iter())
        .map_err(|e| anyhow::anyhow!("BPE training failed: {e}"))?;
    tokenizer.add_special_tokens(&specials);
    tokenizer
        .save(path, true)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("cannot write `{}`", path.display()))?;
    Ok(())
}

/// A ChatML `tokenizer_config.json` without a default system message, so that transformers'
/// `apply_chat_template` renders prompts exactly as [`qerl_model::ChatTemplate`] does.
pub fn chatml_tokenizer_config() -> serde_json::Value {
    let template = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}\
{{ '<|im_start|>assistant\\n' }}{% endif %}";
    serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": null,
        "model_max_length": 2048,
        "chat_template": template,
    })
}
