//! [`HfCheckpoint`]: a Hugging Face model directory opened for reading.
//!
//! The directory holds `config.json` and either one `model.safetensors` or the shards named by
//! `model.safetensors.index.json` (`{"metadata": {"total_size": N}, "weight_map": {tensor:
//! file}}`). Opening parses every header and memory-maps every shard; tensor data is only read
//! (paged in) when asked for, one tensor at a time.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::error::{io, CheckpointError, Result};
use crate::SourceDtype;

/// The model configuration file.
pub const CONFIG_FILE: &str = "config.json";
/// The weights of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where one tensor lives and what it is.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Index into [`HfCheckpoint::shards`].
    pub shard: usize,
    /// Byte range of the data inside the shard file.
    start: usize,
    end: usize,
}

impl TensorInfo {
    /// Number of elements (1 for a 0-D tensor).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of data.
    pub fn nbytes(&self) -> usize {
        self.end - self.start
    }
}

/// A tensor's stored form, borrowed from the memory map.
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
    /// Little-endian bytes, exactly as stored.
    pub data: &'a [u8],
}

/// One safetensors file of the checkpoint.
#[derive(Debug)]
pub struct Shard {
    /// File name inside the directory, e.g. `model-00001-of-00002.safetensors`.
    pub file_name: String,
    pub path: PathBuf,
    /// Tensor names in the order their data appears in the file.
    pub tensor_names: Vec<String>,
    /// The file's `__metadata__`, if any.
    pub metadata: Option<HashMap<String, String>>,
    map: Mmap,
}

impl Shard {
    fn open(dir: &Path, file_name: &str) -> Result<(Self, Vec<TensorInfo>)> {
        let path = dir.join(file_name);
        let file = File::open(&path).map_err(io("cannot open", &path))?;
        // SAFETY: the map is read-only and lives as long as the shard; as with every reader of
        // memory-mapped checkpoints, the file must not be truncated while it is open.
        let map = unsafe { Mmap::map(&file) }.map_err(io("cannot memory-map", &path))?;
        let (header_len, meta) =
            SafeTensors::read_metadata(&map).map_err(|source| CheckpointError::Header {
                path: path.clone(),
                source,
            })?;
        let base = 8 + header_len;
        let tensor_names = meta.offset_keys();
        let infos = tensor_names
            .iter()
            .map(|name| {
                let t = meta.info(name).expect("offset_keys lists known tensors");
                TensorInfo {
                    name: name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    shard: 0,
                    start: base + t.data_offsets.0,
                    end: base + t.data_offsets.1,
                }
            })
            .collect();
        let shard = Shard {
            file_name: file_name.to_string(),
            path,
            tensor_names,
            metadata: meta.metadata().clone(),
            map,
        };
        Ok((shard, infos))
    }

    /// Size of the file in bytes.
    pub fn file_size(&self) -> u64 {
        self.map.len() as u64
    }

    /// Pages the whole file in (one read per 4 KiB page, on every core), so that later reads
    /// of its tensors run at memory speed; returns the bytes touched.
    fn prefetch(&self) -> u64 {
        // Advice only: a kernel that ignores it still gets the pages touched below.
        #[cfg(unix)]
        let _ = self.map.advise(memmap2::Advice::WillNeed);
        const PAGE: usize = 4096;
        let data: &[u8] = &self.map;
        super::par::chunks(data.len().div_ceil(PAGE), |pages| {
            let mut sum = 0u8;
            for p in pages {
                sum ^= data[p * PAGE];
            }
            std::hint::black_box(sum);
        });
        self.map.len() as u64
    }
}

/// A Hugging Face model directory: config, shards and a name -> tensor table.
#[derive(Debug)]
pub struct HfCheckpoint {
    dir: PathBuf,
    config: Value,
    index: Option<Value>,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorInfo>,
}

impl HfCheckpoint {
    /// Opens `dir`: reads `config.json`, the shard index if there is one, and every header.
    pub fn open(dir: &Path) -> Result<Self> {
        let config_path = dir.join(CONFIG_FILE);
        if !config_path.is_file() {
            return Err(CheckpointError::MissingConfig {
                dir: dir.to_path_buf(),
            });
        }
        let config = read_json(&config_path)?;
        if !config.is_object() {
            return Err(field_err(&config_path, "(root)", "is not a JSON object"));
        }
        let index_path = dir.join(INDEX_FILE);
        let (index, files, claims) = if index_path.is_file() {
            let index = read_json(&index_path)?;
            let (files, claims) = shard_files(&index_path, &index, dir)?;
            (Some(index), files, claims)
        } else if dir.join(SINGLE_FILE).is_file() {
            (None, vec![SINGLE_FILE.to_string()], Vec::new())
        } else {
            return Err(CheckpointError::NoWeights {
                dir: dir.to_path_buf(),
            });
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut tensors: BTreeMap<String, TensorInfo> = BTreeMap::new();
        for (i, file_name) in files.iter().enumerate() {
            let (shard, infos) = Shard::open(dir, file_name)?;
            for mut info in infos {
                info.shard = i;
                if let Some(prev) = tensors.get(&info.name) {
                    return Err(CheckpointError::DuplicateTensor {
                        tensor: info.name,
                        first: files[prev.shard].clone(),
                        second: file_name.clone(),
                    });
                }
                tensors.insert(info.name.clone(), info);
            }
            shards.push(shard);
        }
        for (tensor, shard) in claims {
            let found = tensors.get(&tensor).map(|t| &files[t.shard]);
            if found != Some(&shard) {
                return Err(CheckpointError::NotInShard {
                    index: index_path,
                    shard,
                    tensor,
                });
            }
        }
        Ok(HfCheckpoint {
            dir: dir.to_path_buf(),
            config,
            index,
            shards,
            tensors,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `config.json` (a JSON object).
    pub fn config(&self) -> &Value {
        &self.config
    }

    /// The parsed `model.safetensors.index.json`, `None` for an unsharded checkpoint.
    pub fn index(&self) -> Option<&Value> {
        self.index.as_ref()
    }

    /// The safetensors files, in file-name order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Every tensor, sorted by name.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors.values()
    }

    /// The tensors of one shard, in the order their data appears in the file.
    pub fn shard_tensors(&self, shard: usize) -> impl Iterator<Item = &TensorInfo> {
        self.shards[shard]
            .tensor_names
            .iter()
            .map(|n| &self.tensors[n])
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Pages every shard in from the disk or the page cache, on every core (see
    /// [`Shard`]); returns the bytes read. Reading tensors afterwards touches no disk.
    pub fn prefetch(&self) -> u64 {
        self.shards.iter().map(Shard::prefetch).sum()
    }

    /// Path of the file holding `info`.
    pub fn file_of(&self, info: &TensorInfo) -> &Path {
        &self.shards[info.shard].path
    }

    fn info_or_err(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| CheckpointError::TensorNotFound {
                dir: self.dir.clone(),
                tensor: name.to_string(),
            })
    }

    /// A tensor's dtype, shape and stored bytes.
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>> {
        let info = self.info_or_err(name)?;
        Ok(self.raw_of(info))
    }

    pub(crate) fn raw_of<'a>(&'a self, info: &'a TensorInfo) -> RawTensor<'a> {
        RawTensor {
            dtype: info.dtype,
            shape: &info.shape,
            data: &self.shards[info.shard].map[info.start..info.end],
        }
    }

    /// A BF16, F16 or F32 tensor widened to f32 (exact), with its stored dtype. Shape is
    /// [`TensorInfo::shape`], row-major.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<f32>, SourceDtype)> {
        let info = self.info_or_err(name)?;
        self.read_f32_of(info)
    }

    pub(crate) fn read_f32_of(&self, info: &TensorInfo) -> Result<(Vec<f32>, SourceDtype)> {
        let dtype = source_dtype(info.dtype).ok_or_else(|| CheckpointError::Dtype {
            file: self.file_of(info).to_path_buf(),
            tensor: info.name.clone(),
            dtype: format!("{:?}", info.dtype),
            expected: "BF16, F16 or F32",
        })?;
        let data = self.raw_of(info).data;
        Ok((bytes_to_f32(data, dtype), dtype))
    }
}

/// The [`SourceDtype`] of a safetensors dtype, `None` for anything but BF16/F16/F32.
pub fn source_dtype(dtype: Dtype) -> Option<SourceDtype> {
    match dtype {
        Dtype::BF16 => Some(SourceDtype::BF16),
        Dtype::F16 => Some(SourceDtype::F16),
        Dtype::F32 => Some(SourceDtype::F32),
        _ => None,
    }
}

/// Widens little-endian BF16/F16/F32 bytes to f32.
pub fn bytes_to_f32(data: &[u8], dtype: SourceDtype) -> Vec<f32> {
    match dtype {
        SourceDtype::BF16 => data
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        SourceDtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        SourceDtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = crate::small_file::read_small_file(path).map_err(io("cannot read", path))?;
    serde_json::from_slice(&text).map_err(|source| CheckpointError::Json {
        path: path.to_path_buf(),
        source,
    })
}

pub(crate) fn field_err(path: &Path, field: &str, why: &str) -> CheckpointError {
    CheckpointError::Field {
        path: path.to_path_buf(),
        field: field.to_string(),
        why: why.to_string(),
    }
}

/// (tensor, shard file) pairs of an index's `weight_map`.
type Claims = Vec<(String, String)>;

/// The shard files an index names (sorted, deduplicated) and its (tensor, file) claims.
fn shard_files(index_path: &Path, index: &Value, dir: &Path) -> Result<(Vec<String>, Claims)> {
    let map = index
        .get("weight_map")
        .ok_or_else(|| field_err(index_path, "weight_map", "is missing"))?
        .as_object()
        .ok_or_else(|| field_err(index_path, "weight_map", "is not a JSON object"))?;
    let mut claims = Vec::with_capacity(map.len());
    for (tensor, file) in map {
        let field = format!("weight_map.{tensor}");
        let file = file
            .as_str()
            .ok_or_else(|| field_err(index_path, &field, "is not a string"))?;
        let plain = Path::new(file).components().count() == 1
            && matches!(
                Path::new(file).components().next(),
                Some(Component::Normal(_))
            );
        if !plain {
            return Err(field_err(
                index_path,
                &field,
                &format!("names `{file}`, which is not a file name inside the directory"),
            ));
        }
        claims.push((tensor.clone(), file.to_string()));
    }
    if claims.is_empty() {
        return Err(field_err(index_path, "weight_map", "is empty"));
    }
    let mut files: Vec<String> = claims.iter().map(|(_, f)| f.clone()).collect();
    files.sort();
    files.dedup();
    for file in &files {
        if !dir.join(file).is_file() {
            let tensor = claims
                .iter()
                .find(|(_, f)| f == file)
                .map(|(t, _)| t.clone());
            return Err(CheckpointError::MissingShard {
                index: index_path.to_path_buf(),
                shard: file.clone(),
                tensor: tensor.unwrap_or_default(),
            });
        }
    }
    Ok((files, claims))
}
