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

use super::cursor::Cursor;
use super::dequant::GgmlType;
use super::error::{io, GgufError, Result};
use super::metadata::{MetaValue, Metadata};

/// `GGUF` as the first four bytes.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
pub const MAX_DIMS: usize = 4;

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
        if (2..=3).contains(&version.swap_bytes()) {
            return Err(GgufError::NotGguf {
                path: path.to_path_buf(),
                why: "it is a big-endian GGUF file; only little-endian files are read".into(),
            });
        }
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
