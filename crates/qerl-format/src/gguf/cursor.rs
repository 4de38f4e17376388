//! The bounds-checked byte reader behind [`super::reader`]: primitive values, strings,
//! metadata values and arrays, tensor infos. Every read names its field in the error and checks
//! a length against the bytes left before allocating for it.

use std::path::Path;

use super::dequant::GgmlType;
use super::error::{GgufError, Result};
use super::metadata::{MetaArray, MetaValue};
use super::reader::{GgufTensor, MAX_DIMS};

/// Arrays of arrays deeper than this are refused (real files use none; it bounds recursion).
const MAX_ARRAY_DEPTH: usize = 3;

/// A bounds-checked reader over the header bytes.
pub(super) struct Cursor<'a> {
    pub data: &'a [u8],
    pub pos: usize,
    pub path: &'a Path,
}

impl<'a> Cursor<'a> {
    pub(super) fn malformed(&self, field: &str, why: impl Into<String>) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            offset: self.pos as u64,
            why: why.into(),
        }
    }

    fn remaining(&self) -> u64 {
        (self.data.len() - self.pos) as u64
    }

    /// Refuses a count of items of at least `min_size` bytes each that cannot fit in what is
    /// left of the file.
    pub(super) fn check_count(&self, field: &str, count: u64, min_size: u64) -> Result<()> {
        if count
            .checked_mul(min_size)
            .is_none_or(|n| n > self.remaining())
        {
            return Err(self.malformed(
                field,
                format!(
                    "is {count}, but {count} items of at least {min_size} bytes do not fit in the \
                     {} bytes left in the file (truncated, or a corrupt count)",
                    self.remaining()
                ),
            ));
        }
        Ok(())
    }

    fn take(&mut self, field: &str, n: u64) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.malformed(
                field,
                format!(
                    "needs {n} bytes but the file ends {} bytes later: truncated?",
                    self.remaining()
                ),
            ));
        }
        let bytes = &self.data[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(field, N as u64)?);
        Ok(out)
    }

    pub(super) fn u32(&mut self, field: &str) -> Result<u32> {
        self.array(field).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, field: &str) -> Result<u64> {
        self.array(field).map(u64::from_le_bytes)
    }

    pub(super) fn string(&mut self, field: &str) -> Result<String> {
        let len = self.u64(&format!("{field} length"))?;
        let start = self.pos;
        let bytes = self.take(field, len)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| GgufError::Malformed {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            offset: start as u64,
            why: format!("is not UTF-8: {e}"),
        })
    }

    /// A value of GGUF type code `ty`.
    pub(super) fn value(&mut self, field: &str, ty: u32, depth: usize) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(u8::from_le_bytes(self.array(field)?)),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(field)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(field)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(field)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(field)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(field)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(field)?)),
            7 => MetaValue::Bool(self.bool(field)?),
            8 => MetaValue::Str(self.string(field)?),
            9 => MetaValue::Array(self.meta_array(field, depth)?),
            10 => MetaValue::U64(u64::from_le_bytes(self.array(field)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(field)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(field)?)),
            other => {
                self.pos -= 4;
                return Err(self.malformed(
                    &format!("{field} type"),
                    format!("is {other}, not a GGUF value type (0..=12)"),
                ));
            }
        })
    }

    fn bool(&mut self, field: &str) -> Result<bool> {
        match self.array::<1>(field)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => {
                self.pos -= 1;
                Err(self.malformed(field, format!("is {b}, not a bool (0 or 1)")))
            }
        }
    }

    /// `count` fixed-size values decoded by `decode` from their little-endian bytes.
    fn fixed<T, const N: usize>(
        &mut self,
        field: &str,
        count: u64,
        decode: fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        self.check_count(&format!("{field} length"), count, N as u64)?;
        let bytes = self.take(field, count * N as u64)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| decode(c.try_into().expect("chunks of N")))
            .collect())
    }

    fn meta_array(&mut self, field: &str, depth: usize) -> Result<MetaArray> {
        let ty = self.u32(&format!("{field} array type"))?;
        let count = self.u64(&format!("{field} array length"))?;
        Ok(match ty {
            0 => MetaArray::U8(self.fixed(field, count, u8::from_le_bytes)?),
            1 => MetaArray::I8(self.fixed(field, count, i8::from_le_bytes)?),
            2 => MetaArray::U16(self.fixed(field, count, u16::from_le_bytes)?),
            3 => MetaArray::I16(self.fixed(field, count, i16::from_le_bytes)?),
            4 => MetaArray::U32(self.fixed(field, count, u32::from_le_bytes)?),
            5 => MetaArray::I32(self.fixed(field, count, i32::from_le_bytes)?),
            6 => MetaArray::F32(self.fixed(field, count, f32::from_le_bytes)?),
            7 => {
                self.check_count(&format!("{field} array length"), count, 1)?;
                let items = (0..count)
                    .map(|j| self.bool(&format!("{field}[{j}]")))
                    .collect::<Result<_>>()?;
                MetaArray::Bool(items)
            }
            8 => {
                self.check_count(&format!("{field} array length"), count, 8)?;
                let mut items = Vec::with_capacity(count as usize);
                for j in 0..count {
                    items.push(self.string(&format!("{field}[{j}]"))?);
                }
                MetaArray::Str(items)
            }
            9 => {
                if depth + 1 >= MAX_ARRAY_DEPTH {
                    return Err(self.malformed(
                        field,
                        format!("nests arrays more than {MAX_ARRAY_DEPTH} deep"),
                    ));
                }
                self.check_count(&format!("{field} array length"), count, 12)?;
                let mut items = Vec::with_capacity(count as usize);
                for j in 0..count {
                    let inner = format!("{field}[{j}]");
                    items.push(self.meta_array(&inner, depth + 1)?);
                }
                MetaArray::Array(items)
            }
            10 => MetaArray::U64(self.fixed(field, count, u64::from_le_bytes)?),
            11 => MetaArray::I64(self.fixed(field, count, i64::from_le_bytes)?),
            12 => MetaArray::F64(self.fixed(field, count, f64::from_le_bytes)?),
            other => {
                return Err(self.malformed(
                    &format!("{field} array type"),
                    format!("is {other}, not a GGUF value type (0..=12)"),
                ))
            }
        })
    }

    pub(super) fn tensor_info(&mut self, i: u64) -> Result<GgufTensor> {
        let name = self.string(&format!("tensor_info[{i}] name"))?;
        let field = |what: &str| format!("tensor `{name}` {what}");
        let n_dims = self.u32(&field("n_dims"))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            self.pos -= 4;
            return Err(
                self.malformed(&field("n_dims"), format!("is {n_dims}, not 1..={MAX_DIMS}"))
            );
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(self.u64(&field(&format!("dims[{d}]")))?);
        }
        let ggml_type = GgmlType(self.u32(&field("type"))?);
        let offset = self.u64(&field("offset"))?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n > 0 && n <= isize::MAX as u64 / 4)
            .ok_or_else(|| {
                self.malformed(&field("dims"), format!("{dims:?} is empty or too large"))
            })?;
        let n_bytes = match ggml_type.block() {
            None => None,
            Some((elems, bytes)) => {
                if dims[0] % elems as u64 != 0 {
                    return Err(self.malformed(
                        &field("dims"),
                        format!(
                            "{dims:?}: the innermost dimension is not a multiple of {elems}, the \
                             {ggml_type} block size"
                        ),
                    ));
                }
                Some(n_elements / elems as u64 * bytes as u64)
            }
        };
        Ok(GgufTensor {
            name,
            dims,
            ggml_type,
            offset,
            n_elements,
            n_bytes,
        })
    }
}
