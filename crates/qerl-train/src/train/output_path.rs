//! An output file must not be one of the command's inputs: `File::create` on it would empty the
//! input before a single line of it is read (`qerl reward --completions X --output X`) or
//! replace a dataset with the results (`qerl eval --dataset X --output X`).

use std::path::{Path, PathBuf};

use anyhow::Result;

/// The file `path` names, symbolic links and `..` resolved: for a file that does not exist yet,
/// its (resolved) directory joined with its name.
fn resolved(path: &Path) -> Option<PathBuf> {
    if let Ok(p) = path.canonicalize() {
        return Some(p);
    }
    let name = path.file_name()?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Some(parent.canonicalize().ok()?.join(name))
}

/// Whether two existing paths are one file through a hard link.
#[cfg(unix)]
fn same_inode(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

#[cfg(not(unix))]
fn same_inode(_a: &Path, _b: &Path) -> bool {
    false
}

/// Fails when `output` (given as `output_flag`) is the same file as one of `inputs` (flag,
/// path), before anything is opened for writing.
pub fn ensure_not_an_input(
    output: &Path,
    output_flag: &str,
    inputs: &[(&str, &Path)],
) -> Result<()> {
    let out = resolved(output);
    for (flag, input) in inputs {
        let same = match (&out, resolved(input)) {
            (Some(o), Some(i)) => *o == i,
            _ => false,
        } || same_inode(output, input);
        anyhow::ensure!(
            !same,
            "{output_flag} `{}` is the file given as {flag} (`{}`): writing it would destroy the \
             input; choose another {output_flag}",
            output.display(),
            input.display()
        );
    }
    Ok(())
}
