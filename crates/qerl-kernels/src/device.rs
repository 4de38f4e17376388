//! Weights on the device, launch geometry, shape checks.

use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_format::{e2m1::e2m1_table, fp8, nf4, QuantFormat, QuantizedWeight};
use thiserror::Error;

use crate::upload;

/// A bad launch: shapes that do not agree, or a weight the kernel cannot read.
#[derive(Debug, Error, PartialEq)]
pub enum KernelError {
    #[error("{kernel}: {what}")]
    Shape { kernel: &'static str, what: String },
    /// The vendor library (cuBLAS) failed or could not be reached.
    #[error("cuBLAS: {what}")]
    Vendor { what: String },
    /// The device reported a failure of work queued before this call (a launch or an
    /// allocation that did not happen, so its output was never written).
    #[error("{kernel}: earlier work on the device failed: {what}")]
    Device { kernel: &'static str, what: String },
    /// A host-to-device copy failed ([`crate::upload`]).
    #[error(transparent)]
    Upload(#[from] crate::upload::UploadError),
}

/// Fails unless `h` holds at least `bytes` bytes.
pub(crate) fn check_buffer(
    kernel: &'static str,
    what: &str,
    h: &Handle,
    bytes: usize,
) -> Result<(), KernelError> {
    if (h.size() as usize) < bytes {
        return Err(shape_err(
            kernel,
            format!("{what} holds {} bytes but needs {bytes}", h.size()),
        ));
    }
    Ok(())
}

pub(crate) fn shape_err(kernel: &'static str, what: String) -> KernelError {
    KernelError::Shape { kernel, what }
}

/// A frozen 4-bit `[n, k]` weight on the device.
///
/// * `codes`: `n * k / 8` u32 words, element `(r, c)` in word `(r*k + c) / 8` at bits
///   `4 * (c % 8)` (low nibble first for every format; NF4 is re-ordered on upload);
/// * `scale_bytes`: for NVFP4/MXFP4 the 8-bit block scales, four per u32 word, little end
///   first, block `(r*k + c) / block`; unused (one zero word) for NF4;
/// * `scale_table`: NVFP4: the 256 E4M3 values divided by the global scale; MXFP4: the 256 E8M0
///   values; NF4: the f32 absmax of every block (indexed by block, not by byte);
/// * `code_table`: the 16 values of the 4-bit codes (E2M1 or NF4).
///
/// The element's value is `code_table[code] * scale_table[scale]`, the same f32 product as
/// [`QuantizedWeight::dequantize`], so device and host agree bit for bit.
#[derive(Clone, Debug)]
pub struct DeviceWeight {
    pub format: QuantFormat,
    pub n: usize,
    pub k: usize,
    pub codes: Handle,
    pub scale_bytes: Handle,
    pub scale_table: Handle,
    pub code_table: Handle,
}

impl DeviceWeight {
    /// Uploads a host weight. The kernels read whole 16-element stages of a row, so the input
    /// dimension must be a multiple of 16 (every NVFP4 and MXFP4 weight is; NF4 may not be).
    pub fn upload<R: Runtime>(
        client: &ComputeClient<R>,
        weight: &QuantizedWeight,
    ) -> Result<Self, KernelError> {
        let [n, k] = weight.shape();
        if !k.is_multiple_of(16) {
            return Err(shape_err(
                "upload",
                format!("a [{n}, {k}] weight: the input dimension must be a multiple of 16"),
            ));
        }
        // NVFP4/MXFP4 bytes already hold two codes each, low nibble first: read as
        // little-endian u32 words they are the device layout, uploaded without a host copy
        // (k is a multiple of 16, so the byte count is a multiple of 4). NF4 is re-ordered.
        // Codes and scales are the bulk of a checkpoint: staged inside an upload session.
        let codes = match weight {
            QuantizedWeight::Nvfp4(w) => upload::create_bytes(client, "codes", &w.packed)?,
            QuantizedWeight::Mxfp4(w) => upload::create_bytes(client, "codes", &w.packed)?,
            QuantizedWeight::Nf4(_) => {
                upload::create_bytes(client, "codes", u32::as_bytes(&pack_words(&weight.codes())))?
            }
        };
        let byte_scales = |scales: &[u8]| {
            if scales.len().is_multiple_of(4) {
                upload::create_bytes(client, "scales", scales)
            } else {
                upload::create_bytes(client, "scales", u32::as_bytes(&pack_bytes(scales)))
            }
        };
        let (scale_bytes, scale_table, code_table): (Handle, Vec<f32>, Vec<f32>) = match weight {
            QuantizedWeight::Nvfp4(w) => {
                let table = fp8::e4m3_table().map(|s| s / w.global_scale);
                (
                    byte_scales(&w.scales)?,
                    table.to_vec(),
                    e2m1_table().to_vec(),
                )
            }
            QuantizedWeight::Mxfp4(w) => {
                let table: Vec<f32> = (0..=255u8).map(fp8::e8m0_to_f32).collect();
                (byte_scales(&w.scales)?, table, e2m1_table().to_vec())
            }
            QuantizedWeight::Nf4(w) => (
                client.create_from_slice(u32::as_bytes(&[0u32])),
                w.absmax.clone(),
                nf4::NF4_TABLE.to_vec(),
            ),
        };
        Ok(DeviceWeight {
            format: weight.format(),
            n,
            k,
            codes,
            scale_bytes,
            scale_table: client.create_from_slice(f32::as_bytes(&scale_table)),
            code_table: client.create_from_slice(f32::as_bytes(&code_table)),
        })
    }

    pub fn block(&self) -> usize {
        self.format.block_size()
    }

    /// Whether scales are read through `scale_bytes` (NVFP4, MXFP4) or directly (NF4).
    pub fn byte_scales(&self) -> bool {
        self.format != QuantFormat::Nf4
    }

    pub(crate) fn words(&self) -> usize {
        self.n * self.k / 8
    }

    pub(crate) fn scale_words(&self) -> usize {
        if self.byte_scales() {
            (self.n * self.k / self.block()).div_ceil(4)
        } else {
            1
        }
    }

    pub(crate) fn scale_table_len(&self) -> usize {
        if self.byte_scales() {
            256
        } else {
            self.n * self.k / self.block()
        }
    }
}

/// Packs 4-bit codes (one per byte, element order) eight to a u32, element 0 in bits 0..4.
pub fn pack_words(codes: &[u8]) -> Vec<u32> {
    codes
        .chunks(8)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (i, &v)| w | (((v & 0xf) as u32) << (4 * i)))
        })
        .collect()
}

/// Packs bytes four to a u32, little end first, the last word zero-padded.
pub fn pack_bytes(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (i, &b)| w | ((b as u32) << (8 * i)))
        })
        .collect()
}

/// Whether the runtime multiplies `F x F -> f32` tiles of `m x n x k` on 32-wide planes: as a
/// `cmma` (warp-level WMMA) when `cmma`, else as a manual `mma`.
pub(crate) fn has_f32_mma<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    (m, n, k): (usize, usize, usize),
    cmma: bool,
) -> bool {
    let props = client.properties();
    let ty = F::as_type_native_unchecked().storage_type();
    let cfg = cubecl::features::MmaConfig {
        a_type: ty,
        b_type: ty,
        cd_type: f32::as_type_native_unchecked().storage_type(),
        m: m as u32,
        n: n as u32,
        k: k as u32,
    };
    let set = if cmma {
        &props.features.matmul.cmma
    } else {
        &props.features.matmul.mma
    };
    set.contains(&cfg) && props.hardware.plane_size_min == 32 && props.hardware.plane_size_max == 32
}

/// Most cubes along one grid dimension that every runtime accepts.
const MAX_GRID_DIM: u32 = 65_535;

/// A grid of `cubes` cubes laid out over x and y so that no dimension exceeds 65535; kernels
/// recover the linear index with [`linear_cube`](crate::device::linear_cube).
pub(crate) fn grid_1d(cubes: usize) -> CubeCount {
    let cubes = cubes.max(1) as u32;
    let x = cubes.min(MAX_GRID_DIM);
    CubeCount::Static(x, cubes.div_ceil(x), 1)
}

/// The widest vector (of 8, 4, 2, 1 elements, at most 16 bytes) that divides `len` and the
/// runtime allows.
pub(crate) fn vector_width<R: Runtime, F: Float>(client: &ComputeClient<R>, len: usize) -> usize {
    let max = client.properties().hardware.max_vector_size.max(1);
    let bytes = std::mem::size_of::<F>();
    [8usize, 4, 2, 1]
        .into_iter()
        .find(|&v| v * bytes <= 16 && v <= max && len.is_multiple_of(v))
        .unwrap_or(1)
}

/// Linear index of this cube in a [`grid_1d`] grid (may exceed the requested count on the last row).
#[cube]
pub(crate) fn linear_cube() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// Scale of block `b`: through the 8-bit code table, or read directly (NF4 absmax).
#[cube]
pub(crate) fn block_scale(
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    b: usize,
    #[comptime] byte_scales: bool,
) -> f32 {
    if byte_scales {
        let word = scale_bytes[b / 4];
        let byte = (word >> (((b % 4) * 8) as u32)) & 0xffu32;
        scale_table[byte as usize]
    } else {
        scale_table[b]
    }
}

/// Decodes word `w` of a weight (elements `8w .. 8w + 8`, one block) into `dst[offset ..]`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_word_to(
    codes: &Array<u32>,
    scale_bytes: &Array<u32>,
    scale_table: &Array<f32>,
    code_table: &Array<f32>,
    w: usize,
    dst: &mut SharedMemory<f32>,
    offset: usize,
    #[comptime] block: usize,
    #[comptime] byte_scales: bool,
) {
    let s = block_scale(scale_bytes, scale_table, w / (block / 8), byte_scales);
    let word = codes[w];
    #[unroll]
    for i in 0..8usize {
        let code = (word >> (4 * i) as u32) & 0xfu32;
        dst[offset + i] = code_table[code as usize] * s;
    }
}

/// The tuning knob `key` from the environment (experiments): its value where it parses and `ok`
/// accepts it, else `default`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn env_knob(key: &str, ok: &dyn Fn(usize) -> bool, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|v| ok(*v))
        .unwrap_or(default)
}

/// Whether the switch `key` is on: unset, or anything but `0` and `off`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn env_switch(key: &str) -> bool {
    std::env::var(key)
        .ok()
        .is_none_or(|v| v != "0" && v != "off")
}
