//! NVFP4 as compressed-tensors' `nvfp4-pack-quantized` format (scheme NVFP4A16).
//!
//! A `[rows, cols]` weight becomes
//! * `packed`: u8 `[rows, cols / 2]`, two E2M1 codes a byte, element `2j` in the low nibble;
//! * `scales`: FP8-E4M3 bits `[rows, cols / 16]`, one per 16 consecutive inputs;
//! * `global_scale`: one f32, `g = 448 * 6 / amax(|W|)` (stored as is: the reciprocal convention).
//!
//! The value of element `(r, c)` is `q * (f32(s) / g)` with `s` the block scale of `c / 16`.
//! Arithmetic follows compressed-tensors step by step, including the places where it computes in
//! the weight's own dtype, so that quantizing the same BF16 weights gives the same bytes.

use crate::e2m1::{e2m1_from_f32, e2m1_to_f32, pack_nibbles, unpack_nibbles, E2M1_MAX};
use crate::fp8::{e4m3_from_f32, e4m3_to_f32, E4M3_MAX};
use crate::{check_finite, check_len, check_matrix, Result, SourceDtype};

/// Inputs per block scale.
pub const BLOCK: usize = 16;

/// Block scale that replaces a zero one, so that dequantization never divides by zero.
pub const ZERO_SCALE_REPLACEMENT: f32 = 0.125;

/// An NVFP4-quantized `[rows, cols]` matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Weight {
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols / 2]` packed E2M1 codes.
    pub packed: Vec<u8>,
    /// `[rows, cols / 16]` FP8-E4M3 bits.
    pub scales: Vec<u8>,
    /// `448 * 6 / amax`, f32.
    pub global_scale: f32,
}

/// Global scale of a tensor as compressed-tensors computes it: `448 * 6 / amax(|W|)`.
///
/// The weight is given as f32 values that hold `dtype` numbers. PyTorch evaluates
/// `2688 / amax` as `reciprocal(amax) * 2688`, each step rounded to the weight's dtype, so
/// `g = dtype(dtype(1 / amax) * 2688)`, with `amax` at least the dtype's smallest normal number
/// and a non-finite result replaced by 1 (see tools/compressed_tensors_nvfp4.md, section 2).
pub fn global_scale(values: &[f32], dtype: SourceDtype) -> f32 {
    let amax = values
        .iter()
        .fold(0.0f32, |m, v| m.max(v.abs()))
        .max(dtype.min_positive_normal());
    let g = dtype.round(dtype.round(1.0 / amax) * (E4M3_MAX * E2M1_MAX));
    if g.is_finite() {
        g
    } else {
        1.0
    }
}

/// The global scale shared by tensors fused at inference (q/k/v, gate/up): the minimum of theirs.
pub fn fused_global_scale(scales: &[f32]) -> f32 {
    scales.iter().copied().fold(f32::INFINITY, f32::min)
}

impl Nvfp4Weight {
    /// Quantizes a row-major `[rows, cols]` matrix.
    ///
    /// `global_scale = None` uses the tensor's own [`global_scale`]; pass the fused one for q/k/v
    /// and gate/up. `dtype` is the dtype the values were stored in (see [`SourceDtype`]).
    pub fn quantize(
        name: &str,
        values: &[f32],
        shape: &[usize],
        dtype: SourceDtype,
        global: Option<f32>,
    ) -> Result<Self> {
        let (rows, cols) = check_matrix(name, values.len(), shape, BLOCK, "NVFP4")?;
        check_finite(name, values)?;
        let g = global.unwrap_or_else(|| global_scale(values, dtype));
        let mut scales = Vec::with_capacity(rows * cols / BLOCK);
        let mut codes = Vec::with_capacity(rows * cols);
        for block in values.chunks_exact(BLOCK) {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // amax / 6 happens in the weight's dtype, the product with g in f32.
            let s = (g * dtype.round(amax / E2M1_MAX)).clamp(-E4M3_MAX, E4M3_MAX);
            let mut s_bits = e4m3_from_f32(s);
            if e4m3_to_f32(s_bits) == 0.0 {
                s_bits = e4m3_from_f32(ZERO_SCALE_REPLACEMENT);
            }
            let scale = e4m3_to_f32(s_bits) / g;
            codes.extend(
                block
                    .iter()
                    .map(|&x| e2m1_from_f32((x / scale).clamp(-E2M1_MAX, E2M1_MAX))),
            );
            scales.push(s_bits);
        }
        Ok(Nvfp4Weight {
            rows,
            cols,
            packed: pack(&codes),
            scales,
            global_scale: g,
        })
    }

    /// Assembles a weight from stored parts, checking their lengths.
    pub fn from_parts(
        name: &str,
        rows: usize,
        cols: usize,
        packed: Vec<u8>,
        scales: Vec<u8>,
        global_scale: f32,
    ) -> Result<Self> {
        check_matrix(name, rows * cols, &[rows, cols], BLOCK, "NVFP4")?;
        check_len(
            name,
            "weight_packed",
            [rows, cols],
            rows * cols / 2,
            packed.len(),
        )?;
        check_len(
            name,
            "weight_scale",
            [rows, cols],
            rows * cols / BLOCK,
            scales.len(),
        )?;
        Ok(Nvfp4Weight {
            rows,
            cols,
            packed,
            scales,
            global_scale,
        })
    }

    /// 4-bit codes in element order.
    pub fn codes(&self) -> Vec<u8> {
        unpack(&self.packed)
    }

    /// Dense row-major values: `q * (f32(s) / g)`.
    pub fn dequantize(&self) -> Vec<f32> {
        let codes = self.codes();
        codes
            .chunks_exact(BLOCK)
            .zip(&self.scales)
            .flat_map(|(block, &s)| {
                let scale = e4m3_to_f32(s) / self.global_scale;
                block.iter().map(move |&c| e2m1_to_f32(c) * scale)
            })
            .collect()
    }
}

/// Packs E2M1 codes two a byte, low nibble first.
pub fn pack(codes: &[u8]) -> Vec<u8> {
    pack_nibbles(codes)
}

/// Unpacks bytes into E2M1 codes, low nibble first.
pub fn unpack(packed: &[u8]) -> Vec<u8> {
    unpack_nibbles(packed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FormatError;

    #[test]
    fn hand_derived_small_case() {
        // One row, one block. amax = 6 -> g = 448. Block scale = 448 * 6/6 = 448 -> 0x7e.
        // Effective scale f32(448)/448 = 1, so values quantize straight onto the E2M1 grid.
        let mut row = vec![0.0f32; 16];
        row[..8].copy_from_slice(&[6.0, -6.0, 1.0, -0.5, 0.75, 2.5, 3.5, -5.0]);
        let w = Nvfp4Weight::quantize("t", &row, &[1, 16], SourceDtype::F32, None).unwrap();
        assert_eq!(w.global_scale, 448.0);
        assert_eq!(w.scales, vec![0x7e]);
        // codes: 6->7, -6->0xf, 1->2, -0.5->0x9, 0.75->2, 2.5->4, 3.5->6, -5->0xe
        assert_eq!(&w.packed[..4], &[0xf7, 0x92, 0x42, 0xe6]);
        assert_eq!(&w.packed[4..], &[0, 0, 0, 0]);
        let d = w.dequantize();
        assert_eq!(&d[..8], &[6.0, -6.0, 1.0, -0.5, 1.0, 2.0, 4.0, -4.0]);
    }

    #[test]
    fn zero_block_gets_replacement_scale() {
        let mut row = vec![0.0f32; 32];
        row[16] = 3.0;
        let w = Nvfp4Weight::quantize("t", &row, &[1, 32], SourceDtype::F32, None).unwrap();
        assert_eq!(e4m3_to_f32(w.scales[0]), ZERO_SCALE_REPLACEMENT);
        assert!(w.dequantize()[..16].iter().all(|&v| v == 0.0));
        assert_eq!(w.dequantize()[16], 3.0);
    }

    #[test]
    fn shapes_that_cannot_be_quantized() {
        let e = Nvfp4Weight::quantize("m.w", &[0.0; 24], &[2, 12], SourceDtype::F32, None);
        assert!(matches!(e, Err(FormatError::Shape { ref name, .. }) if name == "m.w"));
        let msg = e.unwrap_err().to_string();
        assert!(msg.contains("m.w") && msg.contains("[2, 12]"), "{msg}");
        let e = Nvfp4Weight::quantize("v", &[0.0; 32], &[32], SourceDtype::F32, None);
        assert!(e.unwrap_err().to_string().contains("1-D"));
    }

    #[test]
    fn fused_scale_is_the_minimum() {
        assert_eq!(fused_global_scale(&[3.0, 1.5, 2.0]), 1.5);
    }
}
