//! GGUF metadata values and typed look-ups whose errors name the file and key.

use std::path::Path;

use super::error::{GgufError, Result};

/// One metadata value. Integers keep their stored width so a `u32` field can be told from an
/// `i32`; [`MetaValue::as_u64`] and friends read any integer width that fits.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(MetaArray),
}

/// A metadata array, stored by element type: a vocabulary's 150k token types take 4 bytes
/// each, not a [`MetaValue`] each (so memory stays within a small multiple of the file's size).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    Str(Vec<String>),
    Array(Vec<MetaArray>),
}

impl MetaArray {
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::F64(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::Str(v) => v.len(),
            MetaArray::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as i64 if they are integers that fit (token types, ids).
    pub fn to_i64(&self) -> Option<Vec<i64>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            MetaArray::U8(v) => conv(v, |x| Some(x.into())),
            MetaArray::I8(v) => conv(v, |x| Some(x.into())),
            MetaArray::U16(v) => conv(v, |x| Some(x.into())),
            MetaArray::I16(v) => conv(v, |x| Some(x.into())),
            MetaArray::U32(v) => conv(v, |x| Some(x.into())),
            MetaArray::I32(v) => conv(v, |x| Some(x.into())),
            MetaArray::U64(v) => conv(v, |x| i64::try_from(x).ok()),
            MetaArray::I64(v) => Some(v.clone()),
            _ => None,
        }
    }
}

impl MetaValue {
    /// The GGUF type name (`uint32`, `array`, ...) for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "uint8",
            MetaValue::I8(_) => "int8",
            MetaValue::U16(_) => "uint16",
            MetaValue::I16(_) => "int16",
            MetaValue::U32(_) => "uint32",
            MetaValue::I32(_) => "int32",
            MetaValue::U64(_) => "uint64",
            MetaValue::I64(_) => "int64",
            MetaValue::F32(_) => "float32",
            MetaValue::F64(_) => "float64",
            MetaValue::Bool(_) => "bool",
            MetaValue::Str(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// An integer of any width as i128 (every GGUF integer fits).
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// A float, or an integer read as one.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            // The shortest decimal that round-trips the f32 (1e-5, not 9.999999747378752e-06):
            // the value the model's author wrote in its config before it was stored as f32.
            MetaValue::F32(v) => v.to_string().parse().ok(),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// The metadata of one file, in file order, with look-ups that name the file in errors.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    pub(crate) entries: Vec<(String, MetaValue)>,
    pub(crate) path: std::path::PathBuf,
}

impl Metadata {
    /// `(key, value)` pairs in file order.
    pub fn entries(&self) -> &[(String, MetaValue)] {
        &self.entries
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn err(&self, key: &str, why: impl Into<String>) -> GgufError {
        GgufError::Metadata {
            path: self.path().to_path_buf(),
            key: key.to_string(),
            why: why.into(),
        }
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        want: &str,
        read: impl FnOnce(&'a MetaValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match read(v) {
                Some(t) => Ok(Some(t)),
                None => Err(self.err(
                    key,
                    format!("is a {} ({}), not {want}", v.type_name(), brief(v)),
                )),
            },
        }
    }

    /// A non-negative integer that fits in `usize`, if present.
    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        self.typed(key, "a non-negative integer", |v| {
            v.as_u64().and_then(|n| usize::try_from(n).ok())
        })
    }

    /// A required integer of at least 1.
    pub fn positive(&self, key: &str) -> Result<usize> {
        match self.usize_opt(key)? {
            None => Err(self.err(key, "is missing")),
            Some(0) => Err(self.err(key, "is 0")),
            Some(n) => Ok(n),
        }
    }

    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", MetaValue::as_f64)
    }

    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", MetaValue::as_bool)
    }

    pub fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", MetaValue::as_str)
    }

    /// A token id (an integer below 2^32), if present.
    pub fn token_id(&self, key: &str) -> Result<Option<u32>> {
        self.typed(key, "a token id", |v| {
            v.as_u64().and_then(|n| u32::try_from(n).ok())
        })
    }

    /// An array of strings, if present.
    pub fn strings(&self, key: &str) -> Result<Option<&[String]>> {
        self.typed(key, "an array of strings", |v| match v.as_array()? {
            MetaArray::Str(items) => Some(items.as_slice()),
            _ => None,
        })
    }

    /// An array of integers, if present.
    pub fn integers(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.typed(key, "an array of integers", |v| v.as_array()?.to_i64())
    }
}

/// A short rendering of a value for error messages (arrays by length, long strings cut).
fn brief(v: &MetaValue) -> String {
    match v {
        MetaValue::Array(items) => format!("{} items", items.len()),
        MetaValue::Str(s) if s.chars().count() > 40 => {
            format!("{:?}...", s.chars().take(40).collect::<String>())
        }
        MetaValue::Str(s) => format!("{s:?}"),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_lookups_name_the_key() {
        let meta = Metadata {
            entries: vec![
                ("a".into(), MetaValue::U32(7)),
                ("eps".into(), MetaValue::F32(1e-5)),
                ("s".into(), MetaValue::Str("é".repeat(30))),
            ],
            path: "m.gguf".into(),
        };
        assert_eq!(meta.positive("a").unwrap(), 7);
        assert_eq!(meta.f64_opt("eps").unwrap(), Some(1e-5));
        let err = meta.positive("s").unwrap_err().to_string();
        assert!(err.contains("`m.gguf`") && err.contains("`s`"), "{err}");
        assert!(meta
            .positive("missing")
            .unwrap_err()
            .to_string()
            .contains("is missing"));
    }
}
