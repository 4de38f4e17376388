//! Datasets: JSONL files of questions and reference answers.
//!
//! GSM8K and MATH-500 are vendored in the repository (`data/`, see `data/README.md`); any other
//! JSONL file works with configurable field names ([`FieldSpec`]). Each line is one JSON object;
//! blank lines are skipped. Errors name the file, the 1-based line and the field.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::reward::{extract_hash_answer, last_boxed};

/// A dataset loading error. Every variant names the file; line numbers are 1-based.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a JSON object: {source}")]
    Json {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}:{line}: line is JSON but not an object")]
    NotObject { path: PathBuf, line: usize },
    #[error("{path}:{line}: missing field `{field}` (fields present: {present})")]
    MissingField {
        path: PathBuf,
        line: usize,
        field: String,
        present: String,
    },
    #[error("{path}:{line}: field `{field}` must be a string or a number, found {found}")]
    FieldType {
        path: PathBuf,
        line: usize,
        field: String,
        found: &'static str,
    },
    #[error("{path}:{line}: field `{field}`: {reason}")]
    NoAnswer {
        path: PathBuf,
        line: usize,
        field: String,
        reason: &'static str,
    },
    #[error("{path}: no examples")]
    Empty { path: PathBuf },
    #[error("unknown dataset `{0}`: use gsm8k, math500 or a path to a .jsonl file")]
    UnknownDataset(String),
}

/// The datasets the repository ships, plus any JSONL file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetKind {
    /// GSM8K (`data/gsm8k/{train,test}.jsonl`): `question`, `answer` = solution ending `#### N`.
    Gsm8k,
    /// MATH-500 (`data/math500/test.jsonl`): `problem`, `answer` (final answer), `solution`.
    Math500,
    /// Any JSONL file, fields from the config.
    Jsonl,
}

/// A split of a built-in dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Test,
}

/// How the answer field holds the final answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerFormat {
    /// The field is the final answer.
    Plain,
    /// A GSM8K solution: the final answer follows the last `####`.
    Gsm8kSolution,
    /// A worked solution: the final answer is the last `\boxed{…}`.
    Boxed,
}

/// Which fields of a JSONL object hold the question and the answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldSpec {
    /// Field with the question / problem text.
    pub question: String,
    /// Field with the reference answer.
    pub answer: String,
    /// How to read the final answer out of the answer field.
    #[serde(default = "default_answer_format")]
    pub answer_format: AnswerFormat,
    /// Optional field with an identifier (string or number); the example's index where the
    /// field is absent or not given.
    #[serde(default)]
    pub id: Option<String>,
}

fn default_answer_format() -> AnswerFormat {
    AnswerFormat::Plain
}

impl FieldSpec {
    /// GSM8K: `question`, `answer` (solution ending in `#### N`), `idx`.
    pub fn gsm8k() -> Self {
        Self {
            question: "question".into(),
            answer: "answer".into(),
            answer_format: AnswerFormat::Gsm8kSolution,
            id: Some("idx".into()),
        }
    }

    /// MATH-500: `problem`, `answer`, `unique_id`.
    pub fn math500() -> Self {
        Self {
            question: "problem".into(),
            answer: "answer".into(),
            answer_format: AnswerFormat::Plain,
            id: Some("unique_id".into()),
        }
    }

    /// The fields of a built-in dataset; a generic `question` / `answer` spec for `Jsonl`.
    pub fn for_kind(kind: DatasetKind) -> Self {
        match kind {
            DatasetKind::Gsm8k => Self::gsm8k(),
            DatasetKind::Math500 => Self::math500(),
            DatasetKind::Jsonl => Self {
                question: "question".into(),
                answer: "answer".into(),
                answer_format: AnswerFormat::Plain,
                id: None,
            },
        }
    }
}

/// One question with its reference answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Example {
    /// The id field's value, or the 0-based index among the file's examples.
    pub id: String,
    /// The question text, as in the file.
    pub question: String,
    /// The final reference answer (`"18"`, `"\frac{1}{2}"`), what rewards compare against.
    pub answer: String,
    /// The raw answer field (a full solution for GSM8K).
    pub solution: String,
}

/// The repository's `data/` directory: `$QERL_DATA_DIR` when set, else the `data/` folder of
/// the source tree this crate was built from, else (a binary copied to another machine)
/// `data/` under the current directory.
pub fn data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("QERL_DATA_DIR") {
        return PathBuf::from(d);
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("data")
    }
}

/// Path of a built-in dataset split under [`data_dir`]. MATH-500 has only a test split, which
/// both splits return.
pub fn builtin_path(kind: DatasetKind, split: Split) -> Option<PathBuf> {
    let dir = data_dir();
    match (kind, split) {
        (DatasetKind::Gsm8k, Split::Train) => Some(dir.join("gsm8k/train.jsonl")),
        (DatasetKind::Gsm8k, Split::Test) => Some(dir.join("gsm8k/test.jsonl")),
        (DatasetKind::Math500, _) => Some(dir.join("math500/test.jsonl")),
        (DatasetKind::Jsonl, _) => None,
    }
}

/// Reads a `--dataset` argument: `gsm8k`, `math500` (built-in, the given split) or a path to a
/// `.jsonl` file (fields from `jsonl_fields`). Returns the kind, the file and its fields.
pub fn resolve_dataset(
    arg: &str,
    split: Split,
    jsonl_fields: &FieldSpec,
) -> Result<(DatasetKind, PathBuf, FieldSpec), DataError> {
    match arg {
        "gsm8k" => Ok((
            DatasetKind::Gsm8k,
            builtin_path(DatasetKind::Gsm8k, split).unwrap(),
            FieldSpec::gsm8k(),
        )),
        "math500" | "math-500" | "math" => Ok((
            DatasetKind::Math500,
            builtin_path(DatasetKind::Math500, split).unwrap(),
            FieldSpec::math500(),
        )),
        p if p.ends_with(".jsonl") || Path::new(p).is_file() => {
            Ok((DatasetKind::Jsonl, PathBuf::from(p), jsonl_fields.clone()))
        }
        other => Err(DataError::UnknownDataset(other.to_string())),
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Loads every example of a JSONL file.
pub fn load_jsonl(path: &Path, spec: &FieldSpec) -> Result<Vec<Example>, DataError> {
    let file = File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(&line).map_err(|source| DataError::Json {
            path: path.to_path_buf(),
            line: line_no,
            source,
        })?;
        let Value::Object(obj) = value else {
            return Err(DataError::NotObject {
                path: path.to_path_buf(),
                line: line_no,
            });
        };
        let field = |name: &str| -> Result<String, DataError> {
            match obj.get(name) {
                Some(Value::String(s)) => Ok(s.clone()),
                Some(Value::Number(n)) => Ok(n.to_string()),
                Some(other) => Err(DataError::FieldType {
                    path: path.to_path_buf(),
                    line: line_no,
                    field: name.to_string(),
                    found: json_kind(other),
                }),
                None => Err(DataError::MissingField {
                    path: path.to_path_buf(),
                    line: line_no,
                    field: name.to_string(),
                    present: obj
                        .keys()
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join(", "),
                }),
            }
        };
        let question = field(&spec.question)?;
        let solution = field(&spec.answer)?;
        let no_answer = |reason| DataError::NoAnswer {
            path: path.to_path_buf(),
            line: line_no,
            field: spec.answer.clone(),
            reason,
        };
        let answer = match spec.answer_format {
            AnswerFormat::Plain => solution.trim().to_string(),
            AnswerFormat::Gsm8kSolution => extract_hash_answer(&solution)
                .ok_or_else(|| no_answer("no `#### <answer>` line"))?
                .replace(',', ""),
            AnswerFormat::Boxed => last_boxed(&solution)
                .ok_or_else(|| no_answer("no `\\boxed{...}`"))?
                .to_string(),
        };
        if answer.is_empty() {
            return Err(no_answer("empty answer"));
        }
        // an identifier field the file does not have: the line's position, as with no field
        let id = match &spec.id {
            Some(f) if obj.get(f).is_some() => field(f)?,
            _ => out.len().to_string(),
        };
        out.push(Example {
            id,
            question,
            answer,
            solution,
        });
    }
    if out.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// Loads a built-in dataset split from [`data_dir`].
pub fn load_builtin(kind: DatasetKind, split: Split) -> Result<Vec<Example>, DataError> {
    let path =
        builtin_path(kind, split).ok_or_else(|| DataError::UnknownDataset("jsonl".into()))?;
    load_jsonl(&path, &FieldSpec::for_kind(kind))
}

/// Hands out batches of example indices epoch after epoch: every example once per epoch, in a
/// seeded shuffled order (or in file order without shuffling). A batch that reaches the end of an
/// epoch continues with the next epoch's order.
#[derive(Debug, Clone)]
pub struct PromptSampler {
    len: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
    order: Vec<usize>,
    pos: usize,
}

impl PromptSampler {
    /// A sampler over `len` examples.
    ///
    /// # Panics
    /// When `len` is 0.
    pub fn new(len: usize, shuffle: bool, seed: u64) -> Self {
        assert!(len > 0, "PromptSampler over an empty dataset");
        let mut s = Self {
            len,
            shuffle,
            seed,
            epoch: 0,
            order: Vec::new(),
            pos: 0,
        };
        s.order = s.epoch_order(0);
        s
    }

    fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        use rand::seq::SliceRandom;
        use rand::SeedableRng;
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let seed = self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        }
        order
    }

    /// The next `n` indices.
    pub fn next_batch(&mut self, n: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.pos == self.len {
                self.epoch += 1;
                self.order = self.epoch_order(self.epoch);
                self.pos = 0;
            }
            out.push(self.order[self.pos]);
            self.pos += 1;
        }
        out
    }

    /// Epochs started so far minus one (0 during the first pass).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}
