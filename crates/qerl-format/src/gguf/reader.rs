//! Reading a GGUF file (versions 2 and 3): header, metadata, tensor infos, data section.
//!
//! Layout (little-endian): magic `GGUF`, `version: u32`, `tensor_count: u64`,
//! `metadata_kv_count: u64`; then each key-value (`key: string`, `type: u32`, value); then each
//! tensor info (`name: string`, `n_dims: u32`, `dims: [u64; n_dims]` innermost first,
//! `type: u32`, `offset: u64` from the start of the data section); then padding to the file's
//! alignment (`general.alignment`, default 32), then the data section. A string is `len: u64`
//! followed by that many UTF-8 bytes; an array is `type: u32`, `len: u64`, then the values.
//!
//! Every count and length is checked against the bytes that are left before anything is
//! allocated for it, so a lying header fails with [`GgufError::Malformed`] instead of asking
//! for terabytes; nested arrays are limited in depth; every tensor of a type qerl reads must
//! lie inside the file, at an aligned offset.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::dequant::GgmlType;
use super::error::{io, GgufError, Result};
use super::metadata::{MetaArray, MetaValue, Metadata};

/// `GGUF` as the first four bytes.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are refused (real files use none; it bounds recursion).
const MAX_ARRAY_DEPTH: usize = 3;

/// One tensor's entry in the header.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensor {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension, the reverse of PyTorch's.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
    /// Product of `dims`.
    pub n_elements: u64,
    /// Bytes of data; `None` for a type qerl does not read (its size is not checked).
    pub n_bytes: Option<u64>,
}

impl GgufTensor {
    /// The shape in PyTorch / safetensors order (outermost first).
    pub fn torch_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

/// An open GGUF file: parsed header, metadata and tensor infos over the mapped bytes.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<GgufTensor>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GgufFile({}, {} tensors)",
            self.path.display(),
            self.tensors.len()
        )
    }
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(io("open", path))?;
        // SAFETY: the map is read-only; like every reader of model files we assume nobody
        // truncates the file while it is open (a truncation would be a SIGBUS, not UB in Rust
        // terms we can guard against).
        let map = unsafe { Mmap::map(&file) }.map_err(io("map", path))?;
        Self::parse(path, Bytes::Mapped(map))
    }

    /// Parses a GGUF image held in memory; `path` only names it in errors.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(path, Bytes::Owned(bytes))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn all_bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }

    /// Size of the file in bytes.
    pub fn len(&self) -> u64 {
        self.all_bytes().len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The stored bytes of `tensor`; a [`GgufError::UnsupportedType`] for types qerl cannot
    /// size.
    pub fn tensor_bytes(&self, tensor: &GgufTensor) -> Result<&[u8]> {
        let Some(n) = tensor.n_bytes else {
            return Err(GgufError::UnsupportedType {
                path: self.path.clone(),
                tensor: tensor.name.clone(),
                ggml_type: tensor.ggml_type.name(),
            });
        };
        // In range: checked when the file was parsed.
        let start = (self.data_start + tensor.offset) as usize;
        Ok(&self.all_bytes()[start..start + n as usize])
    }

    /// The tensor as f32 values in ggml order (row-major over the torch shape).
    pub fn dequantize(&self, tensor: &GgufTensor) -> Result<Vec<f32>> {
        let bytes = self.tensor_bytes(tensor)?;
        let mut out = vec![0f32; tensor.n_elements as usize];
        if !super::dequant::dequantize(tensor.ggml_type, bytes, &mut out) {
            return Err(GgufError::UnsupportedType {
                path: self.path.clone(),
                tensor: tensor.name.clone(),
                ggml_type: tensor.ggml_type.name(),
            });
        }
        Ok(out)
    }

    fn parse(path: &Path, bytes: Bytes) -> Result<Self> {
        let mut file = GgufFile {
            path: path.to_path_buf(),
            bytes,
            version: 0,
            metadata: Metadata {
                entries: Vec::new(),
                path: path.to_path_buf(),
            },
            tensors: Vec::new(),
            alignment: DEFAULT_ALIGNMENT,
            data_start: 0,
        };
        let data = file.all_bytes();
        if data.len() < 4 || data[..4] != MAGIC {
            let head = &data[..data.len().min(4)];
            return Err(GgufError::NotGguf {
                path: path.to_path_buf(),
                why: format!("it starts with {head:02x?}, not the magic `GGUF`"),
            });
        }
        let mut c = Cursor { data, pos: 4, path };
        let version = c.u32("header version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version {
                path: path.to_path_buf(),
                version,
            });
        }
        let tensor_count = c.u64("header tensor_count")?;
        let kv_count = c.u64("header metadata_kv_count")?;
        // A key-value takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor info
        // 8 + 4 + 4 + 8.
        c.check_count("header metadata_kv_count", kv_count, 13)?;
        c.check_count("header tensor_count", tensor_count, 24)?;

        let mut entries: Vec<(String, MetaValue)> = Vec::new();
        for i in 0..kv_count {
            let key = c.string(&format!("metadata[{i}] key"))?;
            if entries.iter().any(|(k, _)| *k == key) {
                return Err(c.malformed(
                    &format!("metadata[{i}] key"),
                    format!("`{key}` appears twice"),
                ));
            }
            let field = format!("metadata `{key}`");
            let ty = c.u32(&format!("{field} type"))?;
            let value = c.value(&field, ty, 0)?;
            entries.push((key, value));
        }
        let metadata = Metadata {
            entries,
            path: path.to_path_buf(),
        };
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                _ => {
                    return Err(metadata.err(
                        "general.alignment",
                        format!("is {v:?}; it must be a power of two up to 2^20"),
                    ))
                }
            },
        };

        let mut tensors: Vec<GgufTensor> = Vec::new();
        for i in 0..tensor_count {
            let tensor = c.tensor_info(i)?;
            if tensors.iter().any(|t| t.name == tensor.name) {
                return Err(c.malformed(
                    &format!("tensor_info[{i}] name"),
                    format!("`{}` appears twice", tensor.name),
                ));
            }
            tensors.push(tensor);
        }
        let data_start = (c.pos as u64).next_multiple_of(alignment);
        let file_len = data.len() as u64;
        for t in &tensors {
            let terr = |why: String| GgufError::Tensor {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                why,
            };
            if t.offset % alignment != 0 {
                return Err(terr(format!(
                    "has offset {}, not a multiple of the alignment {alignment}",
                    t.offset
                )));
            }
            let Some(n_bytes) = t.n_bytes else { continue };
            let end = data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(n_bytes));
            if end.is_none_or(|e| e > file_len) {
                return Err(terr(format!(
                    "needs bytes {}..{} of the data section (which starts at byte {data_start}), \
                     past the end of the file ({file_len} bytes): truncated?",
                    t.offset,
                    t.offset.saturating_add(n_bytes)
                )));
            }
        }
        file.version = version;
        file.metadata = metadata;
        file.tensors = tensors;
        file.alignment = alignment;
        file.data_start = data_start;
        Ok(file)
    }
}

/// A bounds-checked reader over the header bytes.
struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn malformed(&self, field: &str, why: impl Into<String>) -> GgufError {
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
    fn check_count(&self, field: &str, count: u64, min_size: u64) -> Result<()> {
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

    fn u32(&mut self, field: &str) -> Result<u32> {
        self.array(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: &str) -> Result<u64> {
        self.array(field).map(u64::from_le_bytes)
    }

    fn string(&mut self, field: &str) -> Result<String> {
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
    fn value(&mut self, field: &str, ty: u32, depth: usize) -> Result<MetaValue> {
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

    fn tensor_info(&mut self, i: u64) -> Result<GgufTensor> {
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
