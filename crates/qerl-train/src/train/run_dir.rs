//! The run directory of `qerl train`: who may write into it, and what it may already hold.
//!
//! * While a run writes into a directory it holds a lock on [`LOCK_FILE`] there (`flock`, which
//!   the kernel drops when the process ends, even on `kill -9`), so two runs started into one
//!   directory cannot interleave their checkpoints and metrics: the second one is refused.
//! * A fresh run refuses a directory that already holds anything, since writing into it would
//!   replace checkpoint 1, truncate `metrics.jsonl` and leave the old run's later checkpoints
//!   mixed in. Told to overwrite, it first removes what a run writes (checkpoints, `latest`,
//!   metrics, plot, evaluations, config), and nothing else.
//! * Under the lock, temporary directories that a killed run left behind (`.NAME.tmp-PID`,
//!   `.NAME.old-PID`, see [`crate::checkpoint::write_atomically`]) are removed: no other process
//!   can be writing them.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The lock file of a run directory.
pub const LOCK_FILE: &str = ".qerl.lock";

/// Files and directories that a run writes at the top of its directory.
fn written_by_a_run(name: &str) -> bool {
    matches!(
        name,
        "latest" | "metrics.jsonl" | "metrics.png" | "eval.jsonl" | "config.toml"
    ) || name.starts_with("checkpoint-")
        || is_leftover(name)
}

/// A temporary file or directory of an atomic write that did not finish.
fn is_leftover(name: &str) -> bool {
    name.starts_with('.') && (name.contains(".tmp-") || name.contains(".old-"))
}

/// The exclusive right to write into a run directory, for as long as this value lives.
#[derive(Debug)]
pub struct RunDirLock {
    dir: PathBuf,
    _file: File,
}

impl RunDirLock {
    /// Creates `dir` if needed and locks it, or fails naming the directory when another
    /// process holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the run directory `{}`", dir.display()))?;
        let path = dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("cannot open the lock file `{}`", path.display()))?;
        if !try_lock(&file).with_context(|| format!("cannot lock `{}`", path.display()))? {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            anyhow::bail!(
                "the run directory `{}` is in use by another qerl run{} (it holds `{}`): wait \
                 for it to end, or choose another train.output_dir",
                dir.display(),
                if holder.is_empty() {
                    String::new()
                } else {
                    format!(", process {holder}")
                },
                path.display()
            );
        }
        // the holder's process id, for the message above (the lock itself is the flock)
        use std::io::{Seek, Write};
        file.set_len(0)?;
        file.seek(std::io::SeekFrom::Start(0))?;
        writeln!(file, "{}", std::process::id())?;
        let lock = RunDirLock {
            dir: dir.to_path_buf(),
            _file: file,
        };
        lock.remove_leftovers()?;
        Ok(lock)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn remove_leftovers(&self) -> Result<()> {
        for (name, path) in entries(&self.dir)? {
            if is_leftover(&name) {
                remove(&path)?;
            }
        }
        Ok(())
    }
}

/// Takes the lock without waiting: `Ok(false)` when another open file holds it.
#[cfg(unix)]
fn try_lock(file: &File) -> std::io::Result<bool> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock on a descriptor this function borrows; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

#[cfg(not(unix))]
fn try_lock(_file: &File) -> std::io::Result<bool> {
    Ok(true)
}

/// The entries of `dir` (name, path), the lock file left out.
fn entries(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("cannot list `{}`", dir.display()))? {
        let e = e.with_context(|| format!("cannot list `{}`", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name != LOCK_FILE {
            out.push((name, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

fn remove(path: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(path)
        .with_context(|| format!("cannot remove `{}`", path.display()))?;
    if meta.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
    .with_context(|| format!("cannot remove `{}`", path.display()))
}

/// Makes the locked directory ready for a fresh run: refuses when it holds anything, unless
/// `overwrite`; then removes what an earlier run wrote there (other files stay).
pub fn prepare_fresh(lock: &RunDirLock, overwrite: bool) -> Result<()> {
    let present = entries(lock.dir())?;
    if present.is_empty() {
        return Ok(());
    }
    if !overwrite {
        let mut names: Vec<&str> = present.iter().map(|(n, _)| n.as_str()).take(4).collect();
        if present.len() > names.len() {
            names.push("...");
        }
        anyhow::bail!(
            "the run directory `{}` is not empty ({}): continue that run with `--resume {}`, \
             replace it with `--overwrite`, or choose another train.output_dir",
            lock.dir().display(),
            names.join(", "),
            lock.dir().display()
        );
    }
    for (name, path) in &present {
        if written_by_a_run(name) {
            remove(path)?;
        }
    }
    Ok(())
}
