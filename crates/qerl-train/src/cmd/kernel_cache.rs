//! How many compiled kernels cubecl's PTX cache holds, for the "kernels compiled" lines of
//! `qerl warmup` and the benchmarks (issue 14: count what a run compiles).
//!
//! cubecl 0.10 appends one JSON line per compiled kernel to
//! `ROOT/cuda/<cubecl version>/ptx/toc.json.log` (`cubecl-common-0.10.0/src/cache.rs`), so the
//! lines of every such file under `ROOT/cuda` count the kernels in the cache, and the
//! difference across a run counts those it compiled (kernels already in the cache are loaded,
//! not compiled, and add no line).

use std::path::Path;

use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// Kernels in the PTX cache of this working directory's cubecl configuration; `None` where
/// the cache is off.
pub(super) fn cached_kernels() -> Option<usize> {
    let config = CubeClRuntimeConfig::get();
    let root = config.compilation.cache.as_ref()?.root();
    Some(count_under(&root.join("cuda")))
}

/// Non-empty lines of every `*/ptx/toc.json.log` under `cuda_dir` (0 when there is none).
fn count_under(cuda_dir: &Path) -> usize {
    let Ok(versions) = std::fs::read_dir(cuda_dir) else {
        return 0;
    };
    versions
        .flatten()
        .filter_map(|v| std::fs::read_to_string(v.path().join("ptx").join("toc.json.log")).ok())
        .map(|toc| toc.lines().filter(|l| !l.trim().is_empty()).count())
        .sum()
}

/// What a process added to the cache: printed as `kernels compiled by this process: N (M in
/// the cache)`.
pub(super) struct Compiled {
    pub compiled: usize,
    pub cached: usize,
}

impl std::fmt::Display for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "kernels compiled by this process: {} ({} in the cache)",
            self.compiled, self.cached
        )
    }
}

/// The kernels added since `before` (a [`cached_kernels`] count), or `None` without a cache.
pub(super) fn compiled_since(before: Option<usize>) -> Option<Compiled> {
    let (before, cached) = (before?, cached_kernels()?);
    Some(Compiled {
        compiled: cached.saturating_sub(before),
        cached,
    })
}

#[cfg(test)]
mod tests {
    use super::count_under;

    #[test]
    fn counts_the_lines_of_every_version_table() {
        let dir = std::env::temp_dir().join(format!("qerl-kernel-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(count_under(&dir), 0, "no cache yet");
        for (version, lines) in [("0.10.0", 3), ("0.9.0", 2)] {
            let ptx = dir.join(version).join("ptx");
            std::fs::create_dir_all(&ptx).unwrap();
            let toc: String = (0..lines)
                .map(|i| format!("{{\"key\":{i},\"value\":\"chunk0.cbor\"}}\n"))
                .collect();
            std::fs::write(ptx.join("toc.json.log"), toc + "\n").unwrap();
        }
        // a version directory without a table counts nothing
        std::fs::create_dir_all(dir.join("0.8.0")).unwrap();
        assert_eq!(count_under(&dir), 5);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
