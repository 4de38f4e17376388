//! The Hugging Face tokenizer files of a GGUF model: `tokenizer.json` (the `tokenizers` format:
//! a byte-level BPE model with vocab and merges, its pre-tokenizer, the special tokens as added
//! tokens), `tokenizer_config.json` (special tokens, `add_bos_token`, the chat template) and
//! `special_tokens_map.json`.
//!
//! Read keys: `tokenizer.ggml.model` (must be `gpt2`, byte-level BPE; SentencePiece `llama`
//! vocabularies are refused), `tokenizer.ggml.pre` (which pre-tokenizer regex: `default`,
//! `gpt2`, `smollm`, `qwen2`, `llama-bpe`), `tokenizer.ggml.tokens`, `tokenizer.ggml.token_type`
//! (3 = control and 4 = user-defined become added tokens, special and not), `tokenizer.ggml.merges`
//! (`"a b"` strings), `tokenizer.ggml.{bos,eos,eot,unknown,padding}_token_id`,
//! `tokenizer.ggml.add_{bos,eos}_token`, `tokenizer.chat_template`.

use serde_json::{json, Map, Value};

use super::error::Result;
use super::metadata::Metadata;

const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The ids of the special tokens, as `config.json` and `generation_config.json` name them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Extra end-of-turn tokens (`eot`, `eom`) that should also stop generation.
    pub end_of_turn: Vec<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
}

/// The four files, as JSON values.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerFiles {
    pub tokenizer: Value,
    pub tokenizer_config: Value,
    pub special_tokens_map: Value,
    pub ids: SpecialIds,
    /// Token strings that appear more than once in the vocabulary (the first id is kept).
    pub duplicate_tokens: usize,
}

/// The regex that splits text before BPE, for `tokenizer.ggml.pre` values whose
/// Hugging Face pre-tokenizer is a `Split` followed by a regex-less `ByteLevel`.
fn split_regex(pre: &str) -> Option<String> {
    const WORDS: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|";
    const REST: &str = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    match pre {
        // Qwen2: every digit alone; Llama 3: runs of up to three digits.
        "qwen2" => Some(format!(r"{WORDS}\p{{N}}{REST}")),
        "llama-bpe" | "llama3" => Some(format!(r"{WORDS}\p{{N}}{{1,3}}{REST}")),
        _ => None,
    }
}

fn byte_level(use_regex: bool, add_prefix_space: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": use_regex})
}

/// The `pre_tokenizer` of `tokenizer.json` for a `tokenizer.ggml.pre` value.
fn pre_tokenizer(meta: &Metadata, pre: &str, add_prefix_space: bool) -> Result<Value> {
    if let Some(regex) = split_regex(pre) {
        return Ok(json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false, add_prefix_space),
        ]}));
    }
    match pre {
        "default" | "gpt2" | "gpt-2" => Ok(byte_level(true, add_prefix_space)),
        // SmolLM / StarCoder: every digit alone, then GPT-2's regex.
        "smollm" | "starcoder" => Ok(json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true, add_prefix_space),
        ]})),
        other => Err(meta.err(
            "tokenizer.ggml.pre",
            format!("is `{other}`; supported: default, gpt2, smollm, starcoder, qwen2, llama-bpe"),
        )),
    }
}

/// Builds the tokenizer files from the `tokenizer.*` metadata; `model_max_length` is the
/// context length.
pub fn tokenizer_files(meta: &Metadata, model_max_length: usize) -> Result<TokenizerFiles> {
    match meta.str_opt("tokenizer.ggml.model")? {
        Some("gpt2") => {}
        Some(other) => {
            return Err(meta.err(
                "tokenizer.ggml.model",
                format!("is `{other}`; only `gpt2` (byte-level BPE) vocabularies are converted"),
            ))
        }
        None => return Err(meta.err("tokenizer.ggml.model", "is missing")),
    }
    let tokens = meta
        .strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| meta.err("tokenizer.ggml.tokens", "is missing"))?;
    if tokens.is_empty() || tokens.len() > u32::MAX as usize {
        return Err(meta.err(
            "tokenizer.ggml.tokens",
            format!("has {} tokens", tokens.len()),
        ));
    }
    let types = match meta.integers("tokenizer.ggml.token_type")? {
        Some(t) if t.len() != tokens.len() => {
            return Err(meta.err(
                "tokenizer.ggml.token_type",
                format!("has {} entries for {} tokens", t.len(), tokens.len()),
            ))
        }
        Some(t) => t,
        None => vec![1; tokens.len()],
    };
    let id = |key: &str| -> Result<Option<u32>> {
        match meta.token_id(key)? {
            Some(id) if id as usize >= tokens.len() => Err(meta.err(
                key,
                format!(
                    "is {id}, past the {} tokens of the vocabulary",
                    tokens.len()
                ),
            )),
            other => Ok(other),
        }
    };
    let mut ids = SpecialIds {
        bos: id("tokenizer.ggml.bos_token_id")?,
        eos: id("tokenizer.ggml.eos_token_id")?,
        end_of_turn: Vec::new(),
        unk: id("tokenizer.ggml.unknown_token_id")?,
        pad: id("tokenizer.ggml.padding_token_id")?,
    };
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(t) = id(key)? {
            if Some(t) != ids.eos && !ids.end_of_turn.contains(&t) {
                ids.end_of_turn.push(t);
            }
        }
    }
    let named: Vec<u32> = [ids.bos, ids.eos, ids.unk, ids.pad]
        .into_iter()
        .flatten()
        .chain(ids.end_of_turn.iter().copied())
        .collect();

    let mut vocab = Map::new();
    let mut duplicate_tokens = 0;
    let mut added = Vec::new();
    let mut added_decoder = Map::new();
    for (i, token) in tokens.iter().enumerate() {
        if vocab.contains_key(token) {
            duplicate_tokens += 1;
            continue;
        }
        vocab.insert(token.clone(), json!(i));
        let special = types[i] == CONTROL || named.contains(&(i as u32));
        if special || types[i] == USER_DEFINED {
            let entry = json!({"id": i, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": !special, "special": special});
            let mut decoder_entry = entry.clone();
            if let Value::Object(m) = &mut decoder_entry {
                m.remove("id");
            }
            added_decoder.insert(i.to_string(), decoder_entry);
            added.push(entry);
        }
    }
    let merges = merges(meta, &vocab)?;

    let pre = meta.str_opt("tokenizer.ggml.pre")?.unwrap_or("default");
    let add_prefix_space = meta
        .bool_opt("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(false);
    let llama3 = matches!(pre, "llama-bpe" | "llama3");
    let add_bos = meta
        .bool_opt("tokenizer.ggml.add_bos_token")?
        .unwrap_or(llama3);
    let add_eos = meta
        .bool_opt("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);
    let name = |id: Option<u32>| id.map(|i| tokens[i as usize].clone());
    let post_processor = if add_bos || add_eos {
        let bos = name(ids.bos).filter(|_| add_bos);
        let eos = name(ids.eos).filter(|_| add_eos);
        if add_bos && bos.is_none() {
            return Err(meta.err(
                "tokenizer.ggml.add_bos_token",
                "is true but there is no bos_token_id",
            ));
        }
        if add_eos && eos.is_none() {
            return Err(meta.err(
                "tokenizer.ggml.add_eos_token",
                "is true but there is no eos_token_id",
            ));
        }
        template_processing(bos.as_deref().zip(ids.bos), eos.as_deref().zip(ids.eos))
    } else {
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(meta, pre, add_prefix_space)?,
        "post_processor": post_processor,
        "decoder": byte_level(true, true),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": llama3,
            "vocab": vocab,
            "merges": merges,
        },
    });

    let mut special_map = Map::new();
    for (key, id) in [
        ("bos_token", ids.bos),
        ("eos_token", ids.eos),
        ("pad_token", ids.pad),
        ("unk_token", ids.unk),
    ] {
        if let Some(token) = name(id) {
            special_map.insert(key.into(), json!(token));
        }
    }
    let mut config = Map::new();
    config.insert("add_bos_token".into(), json!(add_bos));
    config.insert("add_eos_token".into(), json!(add_eos));
    config.insert("added_tokens_decoder".into(), Value::Object(added_decoder));
    for (k, v) in &special_map {
        config.insert(k.clone(), v.clone());
    }
    if let Some(template) = meta.str_opt("tokenizer.chat_template")? {
        config.insert("chat_template".into(), json!(template));
    }
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    config.insert("model_max_length".into(), json!(model_max_length));
    config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    Ok(TokenizerFiles {
        tokenizer,
        tokenizer_config: Value::Object(config),
        special_tokens_map: Value::Object(special_map),
        ids,
        duplicate_tokens,
    })
}

/// `tokenizer.ggml.merges` as `[left, right]` pairs, each side and their concatenation checked
/// against the vocabulary (the `tokenizers` crate refuses a merge whose parts it cannot find).
fn merges(meta: &Metadata, vocab: &Map<String, Value>) -> Result<Vec<Value>> {
    const KEY: &str = "tokenizer.ggml.merges";
    let Some(merges) = meta.strings(KEY)? else {
        return Err(meta.err(KEY, "is missing (a BPE vocabulary needs its merges)"));
    };
    merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let bad = |why: String| meta.err(&format!("{KEY}[{i}]"), format!("is {m:?}: {why}"));
            let (left, right) = m
                .split_once(' ')
                .filter(|(l, r)| !l.is_empty() && !r.is_empty() && !r.contains(' '))
                .ok_or_else(|| bad("not two tokens separated by one space".into()))?;
            for part in [
                left.to_string(),
                right.to_string(),
                format!("{left}{right}"),
            ] {
                if !vocab.contains_key(&part) {
                    return Err(bad(format!("`{part}` is not in the vocabulary")));
                }
            }
            Ok(json!([left, right]))
        })
        .collect()
}

/// A `TemplateProcessing` post-processor that puts BOS before and/or EOS after each sequence.
fn template_processing(bos: Option<(&str, u32)>, eos: Option<(&str, u32)>) -> Value {
    let special = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Map::new();
    for (s, type_id) in [("A", 0), ("B", 1)] {
        let mut part = Vec::new();
        if let Some((t, _)) = bos {
            part.push(special(t, type_id));
        }
        part.push(seq(s, type_id));
        if let Some((t, _)) = eos {
            part.push(special(t, type_id));
        }
        if s == "A" {
            single.extend(part.iter().cloned());
        }
        pair.extend(part);
    }
    for (t, id) in bos.into_iter().chain(eos) {
        specials.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}
