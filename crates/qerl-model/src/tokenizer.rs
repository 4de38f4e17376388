//! `tokenizer.json` through the `tokenizers` crate (pure-Rust regex backend), and the ChatML
//! chat template of Qwen and SmolLM.
//!
//! ChatML renders each message as `<|im_start|>{role}\n{content}<|im_end|>\n` and, to ask for
//! a reply, appends `<|im_start|>assistant\n`. When the conversation has no system message and
//! the model directory's `tokenizer_config.json` has a ChatML `chat_template` that inserts a
//! default one (Qwen2.5: "You are Qwen, created by Alibaba Cloud. You are a helpful
//! assistant."; SmolLM2 has its own), that text is used, as `apply_chat_template` would.
//! Templates that are not ChatML are refused rather than rendered wrongly.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{read_json, ModelError, Result};
use crate::generate::Decode;

/// A Hugging Face fast tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({})", self.path.display())
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        if let Err(e) = qerl_format::small_file::check_small_file(path) {
            let why = match e.kind() {
                std::io::ErrorKind::NotFound => "no such file".to_string(),
                _ => e.to_string(),
            };
            return Err(ModelError::Tokenizer {
                path: path.to_path_buf(),
                why,
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::Tokenizer {
            path: path.to_path_buf(),
            why: e.to_string(),
        })?;
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// `file` if given, else `model_dir/tokenizer.json`.
    pub fn for_model(model_dir: &Path, file: Option<&Path>) -> Result<Self> {
        match file {
            Some(f) => Self::from_file(f),
            None => {
                let path = model_dir.join("tokenizer.json");
                if !path.is_file() {
                    return Err(ModelError::NoTokenizer {
                        dir: model_dir.to_path_buf(),
                    });
                }
                Self::from_file(&path)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, e: impl std::fmt::Display) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            why: e.to_string(),
        }
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. Llama's BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included unless `skip_special_tokens`.
    pub fn decode_ids(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.err(e))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

impl Decode for Tokenizer {
    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_ids(ids, false)
    }
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// The ChatML template, with the default system message of the model's template if any.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatTemplate {
    pub default_system: Option<String>,
}

impl ChatTemplate {
    /// Reads `dir/tokenizer_config.json` if there is one: its `chat_template` must be ChatML.
    /// Without the file, plain ChatML with no default system message.
    pub fn for_model(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer_config.json");
        if !path.is_file() {
            return Ok(Self::default());
        }
        let value = read_json(&path)?;
        let template = match value.get("chat_template") {
            None | Some(Value::Null) => return Ok(Self::default()),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string))
                .unwrap_or_default(),
            Some(other) => {
                return Err(crate::error::config_err(
                    &path,
                    "chat_template",
                    format!("is {other}, not a string"),
                ))
            }
        };
        Self::from_template(&template, &path)
    }

    /// Recognises a ChatML Jinja template and extracts its literal default system message.
    pub fn from_template(template: &str, path: &Path) -> Result<Self> {
        if !(template.contains(IM_START) && template.contains(IM_END)) {
            return Err(crate::error::config_err(
                path,
                "chat_template",
                "is not a ChatML template (no <|im_start|> / <|im_end|>); only ChatML is supported",
            ));
        }
        // In the Jinja source the default reads `'<|im_start|>system\n<TEXT><|im_end|>\n'`,
        // with a literal backslash-n.
        let marker = format!("{IM_START}system\\n");
        let default_system = template.match_indices(&marker).find_map(|(i, _)| {
            let rest = &template[i + marker.len()..];
            let text = &rest[..rest.find(IM_END)?];
            let literal = !text.is_empty() && !text.contains(['{', '}', '\'', '"', '\\']);
            literal.then(|| text.to_string())
        });
        Ok(ChatTemplate { default_system })
    }

    /// The prompt text for `messages`, ending with the assistant header when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> String {
        let mut out = String::new();
        let has_system = messages.first().is_some_and(|m| m.role == "system");
        if let (false, Some(system)) = (has_system, &self.default_system) {
            out += &format!("{IM_START}system\n{system}{IM_END}\n");
        }
        for m in messages {
            out += &format!("{IM_START}{}\n{}{IM_END}\n", m.role, m.content);
        }
        if add_generation_prompt {
            out += &format!("{IM_START}assistant\n");
        }
        out
    }

    /// Renders and tokenizes (no post-processor specials: the template carries the markers).
    /// Fails if the tokenizer does not have `<|im_start|>` and `<|im_end|>` as single tokens.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        for marker in [IM_START, IM_END] {
            if tokenizer.token_to_id(marker).is_none() {
                return Err(
                    tokenizer.err(format!("has no `{marker}` token: not a ChatML tokenizer"))
                );
            }
        }
        tokenizer.encode(&self.render(messages, add_generation_prompt), false)
    }
}
