//! Checkpoints, written atomically (a temporary directory renamed into place):
//!
//! | file | what |
//! | --- | --- |
//! | `adapter_model.safetensors`, `adapter_config.json` | the LoRA adapter in PEFT's format, with the RMSNorm weights (when trained) as `modules_to_save` |
//! | `optimizer.mpk` | burn's AdamW state (`NamedMpkFileRecorder`, full precision) |
//! | `trainer_state.json` | step, seed, prompts consumed, parameter ids |
//! | `config.toml` | the resolved run configuration |
//!
//! All randomness of a run derives from `(seed, step)` (AQN noise, sampling seeds) plus the
//! prompt order (seeded, replayed up to `prompts_consumed`), so resuming is exact.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// The state file of a checkpoint.
pub const STATE_FILE: &str = "trainer_state.json";
/// The saved configuration of a checkpoint.
pub const CONFIG_FILE: &str = "config.toml";
/// The optimizer state (without the extension the recorder adds).
pub const OPTIMIZER_FILE: &str = "optimizer";

/// `trainer_state.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    /// Optimizer steps (rollout batches) done.
    pub step: usize,
    pub seed: u64,
    /// Prompts handed out by the prompt sampler so far.
    pub prompts_consumed: usize,
    /// burn parameter id of each trained tensor (PEFT / checkpoint names).
    pub param_ids: BTreeMap<String, u64>,
    /// Whether the norms were trained (and so are in the adapter as `modules_to_save`; in
    /// checkpoints of earlier versions, in `norms.safetensors`).
    pub trained_norms: bool,
}

impl TrainerState {
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "`{}` is not a checkpoint: cannot read {STATE_FILE}",
                dir.display()
            )
        })?;
        serde_json::from_str(&text).with_context(|| format!("cannot parse `{}`", path.display()))
    }

    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(STATE_FILE);
        std::fs::write(&path, serde_json::to_string_pretty(self)? + "\n")
            .with_context(|| format!("cannot write `{}`", path.display()))
    }
}

/// Name of the checkpoint of step `step`.
pub fn checkpoint_name(step: usize) -> String {
    format!("checkpoint-{step:06}")
}

/// Writes a checkpoint as `parent/name`: `fill` writes the files into a temporary directory
/// next to it, which then replaces any previous `parent/name` in one rename.
pub fn write_atomically(
    parent: &Path,
    name: &str,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create `{}`", parent.display()))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let named = |what: &str, path: &Path| format!("cannot {what} `{}`", path.display());
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| named("remove", &tmp))?;
    }
    std::fs::create_dir(&tmp).with_context(|| format!("cannot create `{}`", tmp.display()))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let dest = parent.join(name);
    if dest.exists() {
        let old = parent.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(&dest, &old).with_context(|| named("move aside", &dest))?;
        std::fs::rename(&tmp, &dest).with_context(|| named("move the checkpoint to", &dest))?;
        std::fs::remove_dir_all(&old).with_context(|| named("remove", &old))?;
    } else {
        std::fs::rename(&tmp, &dest)
            .with_context(|| format!("cannot move the checkpoint to `{}`", dest.display()))?;
    }
    // `latest` names the newest checkpoint (for `--resume RUN_DIR`).
    let latest = parent.join("latest");
    let tmp_latest = parent.join(format!(".latest.tmp-{}", std::process::id()));
    std::fs::write(&tmp_latest, format!("{name}\n"))
        .with_context(|| named("write", &tmp_latest))?;
    std::fs::rename(&tmp_latest, &latest).with_context(|| named("replace", &latest))?;
    Ok(dest)
}

/// A checkpoint directory from `--resume`: the directory itself when it has a state file, else
/// the one its `latest` file names. A `latest` file names a directory inside the run directory
/// (one plain name: no `..`, no `/`, no absolute path, no symbolic link leading out), so a copied
/// or untrusted run directory cannot send qerl elsewhere.
pub fn resolve_checkpoint(dir: &Path) -> Result<PathBuf> {
    if dir.join(STATE_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    let latest = dir.join("latest");
    let name = std::fs::read_to_string(&latest).with_context(|| {
        format!(
            "`{}` is neither a checkpoint nor a run directory with a `latest` file",
            dir.display()
        )
    })?;
    let name = name.trim();
    let mut parts = Path::new(name).components();
    let plain = matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(_)), None)
    );
    anyhow::ensure!(
        plain,
        "`{}` names `{name}`, which is not a checkpoint inside `{}` (a `latest` file holds one \
         directory name, such as checkpoint-000003)",
        latest.display(),
        dir.display()
    );
    let ckpt = dir.join(name);
    anyhow::ensure!(
        ckpt.join(STATE_FILE).is_file(),
        "`{}` (from `{}`) is not a checkpoint",
        ckpt.display(),
        latest.display()
    );
    let inside = match (ckpt.canonicalize(), dir.canonicalize()) {
        (Ok(c), Ok(d)) => c.parent() == Some(d.as_path()),
        _ => false,
    };
    anyhow::ensure!(
        inside,
        "`{}` (from `{}`) leads outside `{}` (a symbolic link?): refusing to resume from it",
        ckpt.display(),
        latest.display(),
        dir.display()
    );
    Ok(ckpt)
}

/// The run directory that `--resume ARG` continues: `ARG` itself for a run directory, the
/// directory holding it for a checkpoint. New checkpoints and metrics go there, whatever
/// `train.output_dir` the checkpoint's `config.toml` names (a copied run directory would
/// otherwise write into the original).
pub fn resume_run_dir(arg: &Path) -> PathBuf {
    if !arg.join(STATE_FILE).is_file() {
        return arg.to_path_buf();
    }
    match arg.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
