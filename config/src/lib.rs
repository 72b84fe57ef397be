//! headroom-config: reading typed TOML files and reporting what is wrong with them by field path,
//! value and reason, so an operator can fix a config without reading code.

pub mod reference;
pub mod serve;

use std::fmt;
use std::path::{Path, PathBuf};

/// One problem with one field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted path of the field, e.g. `replicas[2].num_gpu_blocks`.
    pub field: String,
    /// The offending value as written (or a description of it).
    pub value: String,
    /// Why it is wrong, and what would be right.
    pub reason: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {}: {}", self.field, self.value, self.reason)
    }
}

/// Why a config could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {error}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error (in the message, not a separate source: printed once in an error chain).
        error: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("invalid config {path}: {error}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The TOML error, with line and column.
        error: Box<toml::de::Error>,
    },
    /// The file parsed but some values are unusable; every problem is listed.
    #[error("invalid config {}:\n{}", path.display(), list(errors))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found.
        errors: Vec<FieldError>,
    },
}

fn list(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(|e| format!("  - {e}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A config type that can check its own values after parsing.
pub trait Validate {
    /// Pushes one [`FieldError`] per problem; `prefix` is the path of `self` (empty at the root).
    fn validate(&self, prefix: &str, errors: &mut Vec<FieldError>);
}

/// Joins a path prefix and a field name.
pub fn field_path(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_owned()
    } else {
        format!("{prefix}.{field}")
    }
}

/// Pushes an error for `field` under `prefix` when `ok` is false.
pub fn check(
    errors: &mut Vec<FieldError>,
    ok: bool,
    prefix: &str,
    field: &str,
    value: impl fmt::Display,
    reason: &str,
) {
    if !ok {
        errors.push(FieldError {
            field: field_path(prefix, field),
            value: value.to_string(),
            reason: reason.to_owned(),
        });
    }
}

/// Parses TOML text into `T` and validates it; `origin` names the source in errors.
pub fn parse_toml<T>(text: &str, origin: &Path) -> Result<T, ConfigError>
where
    T: serde::de::DeserializeOwned + Validate,
{
    let value: T = parse_only(text, origin)?;
    let mut errors = Vec::new();
    value.validate("", &mut errors);
    if errors.is_empty() {
        Ok(value)
    } else {
        Err(ConfigError::Invalid {
            path: origin.to_owned(),
            errors,
        })
    }
}

/// Reads, parses and validates a TOML file.
pub fn load_toml<T>(path: &Path) -> Result<T, ConfigError>
where
    T: serde::de::DeserializeOwned + Validate,
{
    parse_toml(&read(path)?, path)
}

/// Reads and parses a TOML file without validating it, for a caller that completes the values
/// first (from command-line flags) and validates the result itself.
pub fn load_toml_unvalidated<T>(path: &Path) -> Result<T, ConfigError>
where
    T: serde::de::DeserializeOwned,
{
    parse_only(&read(path)?, path)
}

fn parse_only<T: serde::de::DeserializeOwned>(text: &str, origin: &Path) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: origin.to_owned(),
        error: Box::new(e),
    })
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        path: path.to_owned(),
        error: e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        port: u16,
        #[serde(default)]
        replicas: Vec<Replica>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Replica {
        blocks: u64,
    }

    impl Validate for Sample {
        fn validate(&self, prefix: &str, errors: &mut Vec<FieldError>) {
            check(
                errors,
                self.port != 0,
                prefix,
                "port",
                self.port,
                "must be a fixed port, not 0",
            );
            for (i, r) in self.replicas.iter().enumerate() {
                let p = field_path(prefix, &format!("replicas[{i}]"));
                check(
                    errors,
                    r.blocks >= 2,
                    &p,
                    "blocks",
                    r.blocks,
                    "at least 2 blocks",
                );
            }
        }
    }

    #[test]
    fn every_invalid_field_is_named_with_value_and_reason() {
        let err = parse_toml::<Sample>(
            "port = 0\n[[replicas]]\nblocks = 9\n[[replicas]]\nblocks = 1\n",
            Path::new("x.toml"),
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("port = 0: must be a fixed port"), "{text}");
        assert!(
            text.contains("replicas[1].blocks = 1: at least 2 blocks"),
            "{text}"
        );
        assert!(!text.contains("replicas[0]"), "{text}");
    }

    #[test]
    fn unknown_fields_and_syntax_errors_are_parse_errors() {
        let err = parse_toml::<Sample>("port = 1\nbogus = 2\n", Path::new("x.toml")).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }));
        assert!(err.to_string().contains("bogus"), "{err}");
        assert!(parse_toml::<Sample>("port = 8000\n", Path::new("x.toml")).is_ok());
    }

    #[test]
    fn missing_file_is_a_read_error() {
        let err = load_toml::<Sample>(Path::new("/nonexistent/headroom.toml")).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }));
    }
}
