//! Reading a config: TOML text, `--set key=value` overrides, then typed deserialisation.

use std::path::Path;

use toml::{Table, Value};

use super::{ConfigError, TrainConfig};

/// Splits `key=value` and parses the value as a TOML value (`0.3`, `true`, `"x"`, `[1, 2]`,
/// `{ name = "gsm8k" }`); a value that is not valid TOML is taken as a bare string, so
/// `--set model.dir=/models/q7b` needs no quotes.
pub fn parse_override(arg: &str) -> Result<(Vec<String>, Value), ConfigError> {
    let err = |message: &str| ConfigError::Override {
        arg: arg.to_string(),
        message: message.to_string(),
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| err("expected key=value"))?;
    let key = key.trim();
    if key.is_empty() {
        return Err(err("empty key"));
    }
    let parts: Vec<String> = key.split('.').map(|p| p.trim().to_string()).collect();
    if parts.iter().any(String::is_empty) {
        return Err(err("empty component in dotted key"));
    }
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<Table>() {
        Ok(mut t) => t.remove("v").expect("parsed the key we wrote"),
        Err(_) => Value::String(raw.to_string()),
    };
    Ok((parts, value))
}

/// Sets `path` (a dotted key split into parts) to `value` in `table`, creating tables on the
/// way; fails when a prefix of the key is a non-table value.
pub fn apply_override(table: &mut Table, path: &[String], value: Value) -> Result<(), ConfigError> {
    let mut cur = table;
    for (i, part) in path.iter().enumerate() {
        if i + 1 == path.len() {
            cur.insert(part.clone(), value);
            return Ok(());
        }
        let entry = cur
            .entry(part.clone())
            .or_insert_with(|| Value::Table(Table::new()));
        cur = match entry {
            Value::Table(t) => t,
            other => {
                return Err(ConfigError::Invalid {
                    key: path[..=i].join("."),
                    message: format!(
                        "is a {}, not a table, so `{}` cannot be set",
                        other.type_str(),
                        path.join(".")
                    ),
                })
            }
        };
    }
    Ok(())
}

impl TrainConfig {
    /// Parses TOML text; `origin` names it in errors (a file path, `--config`, ...).
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::from_toml_with_overrides(text, origin, &[])
    }

    /// Parses TOML text, applies `--set` overrides (in order), deserialises and validates.
    pub fn from_toml_with_overrides(
        text: &str,
        origin: &str,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let mut table: Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                origin: origin.to_string(),
                message: e.to_string().trim_end().to_string(),
            })?;
        for arg in overrides {
            let (path, value) = parse_override(arg)?;
            apply_override(&mut table, &path, value).map_err(|e| ConfigError::Override {
                arg: arg.clone(),
                message: e.to_string(),
            })?;
        }
        let config: TrainConfig = if overrides.is_empty() {
            // Parse the text itself so errors carry line and column.
            toml::from_str(text)
        } else {
            Value::Table(table).try_into()
        }
        .map_err(|e: toml::de::Error| ConfigError::Parse {
            origin: if overrides.is_empty() {
                origin.to_string()
            } else {
                format!("{origin} (with --set overrides)")
            },
            message: e.to_string().trim_end().to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, overrides, deserialises and validates a config file.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        let text =
            qerl_format::small_file::read_small_text(path).map_err(|source| ConfigError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Self::from_toml_with_overrides(&text, &path.display().to_string(), overrides)
    }
}
