//! Sizes are checked against a limit before anything is allocated from them, and the error
//! names the file and the field (a damaged or hostile config.json must not end in the
//! allocator, minutes of work, or an abort with no file named).

mod common;

use std::path::Path;

use common::small_config;
use qerl_model::config::SIZE_LIMITS;
use qerl_model::ModelConfig;
use serde_json::json;

#[test]
fn every_size_of_a_config_has_a_limit_named_in_the_error() {
    let path = Path::new("/models/x/config.json");
    assert!(ModelConfig::from_json(&small_config(json!({})), path).is_ok());
    for (key, limit) in SIZE_LIMITS {
        // a too-large value on its own (heads and kv heads stay divisible, head_dim even)
        let changes = match key {
            "num_attention_heads" => {
                json!({"num_attention_heads": 2 * limit, "num_key_value_heads": 2 * limit,
                       "head_dim": 16})
            }
            "head_dim" => json!({ "head_dim": 2 * limit }),
            _ => json!({ key: 2 * limit }),
        };
        let e = ModelConfig::from_json(&small_config(changes), path)
            .expect_err(key)
            .to_string();
        assert!(
            e.contains("/models/x/config.json")
                && e.contains(key)
                && e.contains(&limit.to_string()),
            "{key}: {e}"
        );
    }
    // the case
    let e = ModelConfig::from_json(
        &small_config(json!({"num_hidden_layers": 1_000_000_000u64})),
        path,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("num_hidden_layers") && e.contains("1000000000"),
        "{e}"
    );
}
