//! The `qerl train` configuration: a TOML file, `--set key=value` overrides, validation.
//!
//! Every table rejects unknown keys (`deny_unknown_fields`), every field but `model.dir` has a
//! default, and [`TrainConfig::validate`] names the offending key (`loss.eps_high: ...`).
//! Loss parameters whose default depends on `loss.kind` are `Option`s; the accessors
//! ([`LossConfig::eps_high`], ...) and [`TrainConfig::resolved`] fill them in.
//!
//! ```toml
//! [model]
//! dir = "models/qwen2.5-7b-nvfp4"
//! [loss]
//! kind = "dapo"
//! ```

mod load;
mod sections;
mod validate;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use load::{apply_override, parse_override};
pub use sections::{
    AqnConfig, EvalConfig, LossConfig, OptimConfig, RewardSpec, RolloutConfig, RunConfig,
};

use crate::data::{AnswerFormat, DatasetKind, FieldSpec, Split};
use crate::optim_schedule::LrSchedule;
use crate::prompt::PromptTemplate;

/// A configuration error; each names the file or the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("--set {arg}: {message}")]
    Override { arg: String, message: String },
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

/// Base weights' storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    Nvfp4,
    Bf16,
    Mxfp4,
    Nf4,
}

/// Which policy-gradient recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    #[default]
    Grpo,
    Dapo,
    DrGrpo,
}

/// The whole `qerl train` config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub model: ModelConfig,
    #[serde(default)]
    pub lora: LoraConfig,
    #[serde(default)]
    pub data: DataConfig,
    #[serde(default)]
    pub rollout: RolloutConfig,
    #[serde(default)]
    pub loss: LossConfig,
    #[serde(default)]
    pub optim: OptimConfig,
    #[serde(default)]
    pub aqn: AqnConfig,
    /// Weighted rewards; empty means the dataset's default ([`TrainConfig::reward_specs`]).
    #[serde(default)]
    pub rewards: Vec<RewardSpec>,
    #[serde(default)]
    pub train: RunConfig,
    #[serde(default)]
    pub eval: EvalConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json).
    pub dir: PathBuf,
    #[serde(default)]
    pub precision: Precision,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f32,
    /// Also train the RMSNorm weights (QeRL `--ln True`; the AQN noise rides on them).
    pub train_norms: bool,
    /// Linear layers that get adapters.
    pub targets: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 16,
            alpha: 16.0,
            train_norms: true,
            targets: [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ]
            .map(String::from)
            .to_vec(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    pub dataset: DatasetKind,
    /// File for `dataset = "jsonl"`, or to override a built-in dataset's file.
    pub path: Option<PathBuf>,
    pub split: Split,
    /// Field names for `jsonl` (built-in datasets know theirs).
    pub question_field: String,
    pub answer_field: String,
    pub answer_format: AnswerFormat,
    pub max_prompt_tokens: usize,
    /// Shuffle the training questions each epoch (seeded by `train.seed`).
    pub shuffle: bool,
    pub prompt: PromptTemplate,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: DatasetKind::Gsm8k,
            path: None,
            split: Split::Train,
            question_field: "question".into(),
            answer_field: "answer".into(),
            answer_format: AnswerFormat::Plain,
            max_prompt_tokens: 256,
            shuffle: true,
            prompt: PromptTemplate::think_answer(),
        }
    }
}

impl DataConfig {
    /// The fields to read: the built-in dataset's, or the configured ones for `jsonl`.
    pub fn field_spec(&self) -> FieldSpec {
        match self.dataset {
            DatasetKind::Jsonl => FieldSpec {
                question: self.question_field.clone(),
                answer: self.answer_field.clone(),
                answer_format: self.answer_format,
                id: None,
            },
            k => FieldSpec::for_kind(k),
        }
    }

    /// The file to read: `path` if set, else the built-in dataset's split.
    pub fn file(&self) -> Option<PathBuf> {
        self.path
            .clone()
            .or_else(|| crate::data::builtin_path(self.dataset, self.split))
    }
}

impl TrainConfig {
    /// The rewards to use: `rewards` if set, else the dataset's default (GSM8K: format 0.2 +
    /// `gsm8k` 2.0 as QeRL; MATH-500 and JSONL: format 0.2 + `math` 1.0).
    pub fn reward_specs(&self) -> Vec<RewardSpec> {
        if !self.rewards.is_empty() {
            return self.rewards.clone();
        }
        let (correct, w) = match self.data.dataset {
            DatasetKind::Gsm8k => ("gsm8k", 2.0),
            _ => ("math", 1.0),
        };
        vec![
            RewardSpec {
                name: "format".into(),
                weight: 0.2,
                accuracy: false,
            },
            RewardSpec {
                name: correct.into(),
                weight: w,
                accuracy: true,
            },
        ]
    }

    /// The reward set of [`Self::reward_specs`].
    pub fn reward_set(&self) -> Result<crate::reward::RewardSet, crate::reward::RewardError> {
        let specs = self.reward_specs();
        let pairs: Vec<(String, f32)> = specs.iter().map(|s| (s.name.clone(), s.weight)).collect();
        let acc = specs.iter().find(|s| s.accuracy).map(|s| s.name.as_str());
        crate::reward::RewardSet::from_names(&pairs, acc)
    }

    /// The learning-rate schedule over `train.steps`.
    pub fn lr_schedule(&self) -> LrSchedule {
        let mut s = LrSchedule::with_warmup_ratio(
            self.optim.lr,
            self.optim.warmup_ratio,
            self.train.steps,
            self.optim.lr_decay,
        );
        s.min_lr_ratio = self.optim.min_lr_ratio;
        s
    }

    /// A copy with every kind-dependent default written out (for saving the effective config).
    pub fn resolved(&self) -> Self {
        let mut c = self.clone();
        let max = c.rollout.max_completion_tokens;
        c.loss.eps_high = Some(self.loss.eps_high());
        c.loss.beta = Some(self.loss.beta());
        c.loss.dynamic_sampling = Some(self.loss.dynamic_sampling());
        c.loss.mask_truncated = Some(self.loss.mask_truncated());
        c.loss.overlong_buffer = Some(self.loss.overlong_buffer(max));
        c.rewards = self.reward_specs();
        c
    }

    /// The config as TOML text.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("the config serialises")
    }
}
