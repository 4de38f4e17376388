//! Per-step training metrics: the record, a JSONL log, and a PNG of the run's curves.
//!
//! One [`StepMetrics`] per optimizer step is appended to `metrics.jsonl` (one JSON object per
//! line, flushed at once, so a crashed run keeps every finished step); [`plot_run`] draws reward,
//! accuracy, entropy, completion length and sigma when the run ends.

mod font;
mod plot;

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use plot::{plot_run, PLOT_HEIGHT, PLOT_WIDTH};

use crate::reward::BatchScores;

/// A metrics I/O error; names the file (and line when reading).
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a metrics record: {source}")]
    Json {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: cannot draw the plot: {message}")]
    Plot { path: PathBuf, message: String },
}

/// Mean and standard deviation of one reward over a step's samples.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MeanStd {
    #[serde(deserialize_with = "nan_f32")]
    pub mean: f32,
    #[serde(deserialize_with = "nan_f32")]
    pub std: f32,
}

/// Everything logged for one optimizer step. Rates are fractions in `[0, 1]`; lengths are in
/// tokens; times in seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepMetrics {
    /// 0-based optimizer step.
    pub step: usize,
    /// Weighted total reward over the step's completions.
    #[serde(deserialize_with = "nan_f32")]
    pub reward_mean: f32,
    #[serde(deserialize_with = "nan_f32")]
    pub reward_std: f32,
    /// Each reward's own (unweighted) score, by name.
    pub rewards: BTreeMap<String, MeanStd>,
    /// (reward, sample) pairs whose reward failed and scored 0.
    pub reward_failures: usize,
    /// Fraction of completions the accuracy reward judged correct.
    #[serde(deserialize_with = "nan_f32")]
    pub accuracy: f32,
    /// Mean per-token policy entropy (nats) over completion tokens.
    #[serde(deserialize_with = "nan_f32")]
    pub entropy: f32,
    /// Mean k3 KL to the reference policy.
    #[serde(deserialize_with = "nan_f32")]
    pub kl: f32,
    #[serde(deserialize_with = "nan_f32")]
    pub clip_frac_low: f32,
    #[serde(deserialize_with = "nan_f32")]
    pub clip_frac_high: f32,
    #[serde(deserialize_with = "nan_f32")]
    pub loss: f32,
    /// Global gradient norm before clipping.
    #[serde(deserialize_with = "nan_f32")]
    pub grad_norm: f32,
    #[serde(deserialize_with = "nan_f64")]
    pub lr: f64,
    #[serde(deserialize_with = "nan_f32")]
    pub completion_len_mean: f32,
    pub completion_len_max: usize,
    /// Fraction of completions cut at the length limit.
    #[serde(deserialize_with = "nan_f32")]
    pub truncated_frac: f32,
    /// Fraction of groups whose rewards were all equal (before dynamic sampling).
    #[serde(deserialize_with = "nan_f32")]
    pub zero_std_frac: f32,
    /// Groups dropped by dynamic sampling, and rollout rounds used.
    pub groups_dropped: usize,
    pub sampling_rounds: usize,
    /// AQN sigma used in this step's rollout.
    #[serde(deserialize_with = "nan_f32")]
    pub sigma: f32,
    /// Generated tokens per second of rollout time.
    #[serde(deserialize_with = "nan_f32")]
    pub rollout_tokens_per_s: f32,
    #[serde(deserialize_with = "nan_f32")]
    pub rollout_time_s: f32,
    #[serde(deserialize_with = "nan_f32")]
    pub step_time_s: f32,
    /// Memory high-water mark in bytes (of this rank under data parallelism): on a GPU the
    /// pool the allocator holds after the step (it keeps the pages the step's peak needed); on
    /// the CPU the process's peak resident set; `None` where neither is known.
    pub peak_memory_bytes: Option<u64>,
}

impl StepMetrics {
    /// Fills the reward fields (`reward_mean/std`, `rewards`, `reward_failures`, `accuracy`)
    /// from a batch's scores.
    pub fn set_rewards(&mut self, scores: &BatchScores) {
        let (m, s) = scores.total_mean_std();
        self.reward_mean = m;
        self.reward_std = s;
        self.rewards = scores
            .per_reward_mean_std()
            .into_iter()
            .map(|(n, mean, std)| (n, MeanStd { mean, std }))
            .collect();
        self.reward_failures = scores.failure_count();
        self.accuracy = scores.accuracy().unwrap_or(0.0);
    }

    /// Fills the completion-length fields from per-completion lengths and truncation flags.
    pub fn set_lengths(&mut self, lengths: &[usize], truncated: &[bool]) {
        let n = lengths.len().max(1) as f32;
        self.completion_len_mean = lengths.iter().sum::<usize>() as f32 / n;
        self.completion_len_max = lengths.iter().copied().max().unwrap_or(0);
        self.truncated_frac =
            truncated.iter().filter(|&&t| t).count() as f32 / truncated.len().max(1) as f32;
    }
}

/// JSON has no NaN: serde_json writes a non-finite float as `null`; read it back as NaN so a
/// diverged step does not make the whole log unreadable.
fn nan_f32<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(f32::NAN))
}

fn nan_f64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Appends [`StepMetrics`] to a JSONL file, one line per step, flushed per line.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    file: File,
}

impl MetricsWriter {
    /// Opens `path` for appending (creating it and its directory).
    pub fn append(path: &Path) -> Result<Self, MetricsError> {
        let io = |source| MetricsError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Writes one record as one line and flushes.
    pub fn write(&mut self, m: &StepMetrics) -> Result<(), MetricsError> {
        let mut line = serde_json::to_string(m).expect("metrics serialise");
        line.push('\n');
        let io = |source| MetricsError::Io {
            path: self.path.clone(),
            source,
        };
        self.file.write_all(line.as_bytes()).map_err(io)?;
        self.file.flush().map_err(io)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every record of a metrics JSONL file (blank lines skipped).
pub fn read_jsonl(path: &Path) -> Result<Vec<StepMetrics>, MetricsError> {
    let file = File::open(path).map_err(|source| MetricsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| MetricsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line).map_err(|source| MetricsError::Json {
                path: path.to_path_buf(),
                line: i + 1,
                source,
            })?,
        );
    }
    Ok(out)
}
