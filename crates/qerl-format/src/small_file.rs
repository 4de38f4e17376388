//! Reading a configuration-like file whole (`config.json`, `tokenizer.json`, a shard index, a
//! run's TOML), after checking that it is a regular file of a sane size: a path that leads to
//! `/dev/zero`, a FIFO or a multi-gigabyte file is refused at once instead of being read until
//! memory runs out.

use std::io::{Error, ErrorKind, Read};
use std::path::Path;

/// Most bytes a configuration-like file may have (the largest tokenizer.json files are tens of
/// megabytes).
pub const SMALL_FILE_LIMIT: u64 = 256 << 20;

/// Checks that `path` (after following links) is a regular file of at most
/// [`SMALL_FILE_LIMIT`] bytes; returns its size. The error says which rule it broke (callers
/// name the path).
pub fn check_small_file(path: &Path) -> std::io::Result<u64> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        let what = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a device, FIFO or socket)"
        };
        return Err(Error::new(ErrorKind::InvalidInput, format!("it is {what}")));
    }
    if meta.len() > SMALL_FILE_LIMIT {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "it is {} bytes, more than the {} MiB a configuration file may have",
                meta.len(),
                SMALL_FILE_LIMIT >> 20
            ),
        ));
    }
    Ok(meta.len())
}

/// [`check_small_file`], then the file's bytes (never more than the limit, even if the file
/// grows while it is read).
pub fn read_small_file(path: &Path) -> std::io::Result<Vec<u8>> {
    let len = check_small_file(path)?;
    let mut bytes = Vec::with_capacity(len as usize);
    std::fs::File::open(path)?
        .take(SMALL_FILE_LIMIT + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > SMALL_FILE_LIMIT {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "it grew past the {} MiB a configuration file may have while it was read",
                SMALL_FILE_LIMIT >> 20
            ),
        ));
    }
    Ok(bytes)
}

/// [`read_small_file`] as UTF-8 text.
pub fn read_small_text(path: &Path) -> std::io::Result<String> {
    String::from_utf8(read_small_file(path)?)
        .map_err(|e| Error::new(ErrorKind::InvalidData, format!("it is not UTF-8 text: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_directories_and_huge_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let zero = dir.path().join("config.toml");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_small_file(&zero).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = read_small_file(dir.path()).unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        let huge = dir.path().join("huge.json");
        let f = std::fs::File::create(&huge).unwrap();
        f.set_len(SMALL_FILE_LIMIT + 1).unwrap(); // sparse: no disk used
        let e = read_small_file(&huge).unwrap_err();
        assert!(e.to_string().contains("MiB"), "{e}");
        let ok = dir.path().join("ok.json");
        std::fs::write(&ok, "{}").unwrap();
        assert_eq!(read_small_text(&ok).unwrap(), "{}");
    }
}
