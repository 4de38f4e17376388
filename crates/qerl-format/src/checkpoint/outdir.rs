//! The output directory: staged in a hidden sibling and renamed into place only when complete,
//! so a failed run leaves nothing behind; and the copy of the input's non-weight files.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use super::error::{io, CheckpointError, Result};

/// A temporary sibling of the output directory, removed on drop unless committed.
#[derive(Debug)]
pub(crate) struct Staging {
    tmp: PathBuf,
    out: PathBuf,
    committed: bool,
}

fn path_err(path: &Path, why: &str) -> CheckpointError {
    CheckpointError::OutputPath {
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

impl Staging {
    /// Checks `out` (absent or an empty directory, not `input` nor inside it) and creates the
    /// staging directory next to it.
    pub(crate) fn new(input: &Path, out: &Path) -> Result<Self> {
        if out.exists() {
            if !out.is_dir() {
                return Err(path_err(out, "it exists and is not a directory"));
            }
            let mut entries = fs::read_dir(out).map_err(io("cannot list", out))?;
            if entries.next().is_some() {
                return Err(CheckpointError::OutputExists {
                    path: out.to_path_buf(),
                });
            }
        }
        let name = out
            .file_name()
            .ok_or_else(|| path_err(out, "it has no final directory name"))?
            .to_string_lossy()
            .into_owned();
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(io("cannot create", &parent))?;
        let input_abs = fs::canonicalize(input).map_err(io("cannot resolve", input))?;
        let parent_abs = fs::canonicalize(&parent).map_err(io("cannot resolve", &parent))?;
        if parent_abs.join(&name).starts_with(&input_abs) {
            return Err(path_err(out, "it is the input directory or inside it"));
        }
        remove_stale(&parent, &name)?;
        let tmp = parent.join(format!(".{name}.qerl-tmp-{}", std::process::id()));
        if tmp.exists() {
            // Left by an earlier run of this process id that was killed: ours to remove.
            fs::remove_dir_all(&tmp).map_err(io("cannot remove stale", &tmp))?;
        }
        fs::create_dir(&tmp).map_err(io("cannot create", &tmp))?;
        Ok(Staging {
            tmp,
            out: out.to_path_buf(),
            committed: false,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.tmp
    }

    /// Moves the staged directory into place.
    pub(crate) fn commit(mut self) -> Result<()> {
        if self.out.is_dir() {
            // An empty directory was there (checked in `new`); `remove_dir` fails if it no
            // longer is.
            fs::remove_dir(&self.out).map_err(io("cannot replace", &self.out))?;
        }
        fs::rename(&self.tmp, &self.out)
            .map_err(io("cannot rename staging directory to", &self.out))?;
        self.committed = true;
        Ok(())
    }
}

/// Removes the staging directories of earlier runs into `parent/name` that were killed
/// (`.NAME.qerl-tmp-PID` whose process is gone), so that a `kill -9` leaves no half-written
/// copy behind for longer than the next run. Where there is no `/proc` to ask, none is removed.
fn remove_stale(parent: &Path, name: &str) -> Result<()> {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return Ok(());
    }
    let prefix = format!(".{name}.qerl-tmp-");
    let entries = fs::read_dir(parent).map_err(io("cannot list", parent))?;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !proc.join(pid.to_string()).exists() {
            let path = entry.path();
            fs::remove_dir_all(&path).map_err(io("cannot remove stale", &path))?;
        }
    }
    Ok(())
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Whether a file name is model weights (never copied: the output has its own).
fn is_weight_file(name: &str) -> bool {
    const WEIGHT_EXTENSIONS: [&str; 9] = [
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".ckpt",
        ".gguf",
        ".h5",
        ".msgpack",
        ".onnx",
    ];
    WEIGHT_EXTENSIONS.iter().any(|e| name.ends_with(e)) || name.ends_with(".index.json")
}

/// Copies every file of `src` into `dst` (recursively), except hidden entries, weight files
/// and the top-level names in `skip`. Returns the copied relative paths.
///
/// A symbolic link to a regular file is copied as that file's content (a Hugging Face cache
/// snapshot is made of such links into its `blobs`); a link to a directory or to anything else
/// (a device, a FIFO, a dangling link) is refused, naming the link, before anything is copied
/// from it.
pub(crate) fn copy_other_files(
    src: &Path,
    dst: &Path,
    skip: &HashSet<&str>,
) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    copy_dir(src, dst, skip, "", &mut copied)?;
    Ok(copied)
}

fn copy_dir(
    src: &Path,
    dst: &Path,
    skip: &HashSet<&str>,
    prefix: &str,
    copied: &mut Vec<String>,
) -> Result<()> {
    let mut entries: Vec<_> = fs::read_dir(src)
        .map_err(io("cannot list", src))?
        .collect::<std::io::Result<_>>()
        .map_err(io("cannot list", src))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || (prefix.is_empty() && skip.contains(name.as_str())) {
            continue;
        }
        let from = entry.path();
        let to = dst.join(&name);
        let meta = fs::symlink_metadata(&from).map_err(io("cannot read", &from))?;
        let meta = if meta.file_type().is_symlink() {
            let why = |why: String| CheckpointError::Symlink {
                path: from.clone(),
                why,
            };
            let target = fs::read_link(&from).map_err(io("cannot read the link", &from))?;
            let shown = target.display();
            match fs::metadata(&from) {
                Ok(m) if m.is_file() => m,
                Ok(m) if m.is_dir() => return Err(why(format!("to the directory `{shown}`"))),
                Ok(_) => return Err(why(format!("to `{shown}`, which is not a regular file"))),
                Err(e) => return Err(why(format!("to `{shown}`, which cannot be read ({e})"))),
            }
        } else {
            meta
        };
        let rel = format!("{prefix}{name}");
        if meta.is_dir() {
            fs::create_dir(&to).map_err(io("cannot create", &to))?;
            copy_dir(&from, &to, skip, &format!("{rel}/"), copied)?;
        } else if meta.is_file() && !is_weight_file(&name) {
            fs::copy(&from, &to).map_err(io("cannot copy", &from))?;
            copied.push(rel);
        }
    }
    Ok(())
}
