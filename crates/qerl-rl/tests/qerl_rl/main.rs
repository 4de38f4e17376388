//! Tests of qerl-rl: one test binary, one module per area (links burn once).

mod advantage;
mod aqn;
mod config;
mod data;
mod eval;
mod logprob;
mod loss;
mod metrics;
mod optim;
mod reward_cases;
mod reward_data;
mod reward_fuzz;
mod rewards;

/// Asserts `|a - b| <= tol` with a readable message.
#[track_caller]
pub fn close(a: f64, b: f64, tol: f64) {
    assert!((a - b).abs() <= tol, "{a} != {b} (tolerance {tol})");
}

/// The repository root (for `configs/` and `data/`).
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}
