//! MXFP4 (OCP Microscaling v1.0): E2M1 values with one E8M0 power-of-two scale per 32 inputs.
//!
//! A `[rows, cols]` weight becomes `packed` u8 `[rows, cols / 2]` (element `2j` in the low
//! nibble, as NVFP4) and `scales`, E8M0 bits `[rows, cols / 32]`. The shared exponent of a block
//! is `floor(log2(amax)) - 2` (2 = the largest E2M1 exponent), so the block's largest value lands
//! in [4, 8) and saturates to 6 when above: the OCP specification's conversion.

use crate::e2m1::{e2m1_from_f32, e2m1_to_f32, pack_nibbles, unpack_nibbles, E2M1_MAX};
use crate::fp8::{e8m0_from_exponent, e8m0_to_f32};
use crate::{check_finite, check_len, check_matrix, Result};

/// Inputs per scale.
pub const BLOCK: usize = 32;

/// Exponent of the largest normal E2M1 value (4 = 2^2).
const E2M1_EMAX: i32 = 2;

/// An MXFP4-quantized `[rows, cols]` matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Mxfp4Weight {
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols / 2]` packed E2M1 codes.
    pub packed: Vec<u8>,
    /// `[rows, cols / 32]` E8M0 bits.
    pub scales: Vec<u8>,
}

impl Mxfp4Weight {
    /// Quantizes a row-major `[rows, cols]` matrix.
    pub fn quantize(name: &str, values: &[f32], shape: &[usize]) -> Result<Self> {
        let (rows, cols) = check_matrix(name, values.len(), shape, BLOCK, "MXFP4")?;
        check_finite(name, values)?;
        let mut scales = Vec::with_capacity(rows * cols / BLOCK);
        let mut codes = Vec::with_capacity(rows * cols);
        for block in values.chunks_exact(BLOCK) {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // An all-zero block takes the smallest scale; its codes are all zero anyway.
            let exp = if amax == 0.0 {
                -127
            } else {
                exponent_of(amax) - E2M1_EMAX
            };
            let bits = e8m0_from_exponent(exp);
            let scale = e8m0_to_f32(bits);
            codes.extend(
                block
                    .iter()
                    .map(|&x| e2m1_from_f32((x / scale).clamp(-E2M1_MAX, E2M1_MAX))),
            );
            scales.push(bits);
        }
        Ok(Mxfp4Weight {
            rows,
            cols,
            packed: pack_nibbles(&codes),
            scales,
        })
    }

    /// Assembles a weight from stored parts, checking their lengths.
    pub fn from_parts(
        name: &str,
        rows: usize,
        cols: usize,
        packed: Vec<u8>,
        scales: Vec<u8>,
    ) -> Result<Self> {
        check_matrix(name, rows * cols, &[rows, cols], BLOCK, "MXFP4")?;
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
        Ok(Mxfp4Weight {
            rows,
            cols,
            packed,
            scales,
        })
    }

    /// 4-bit codes in element order.
    pub fn codes(&self) -> Vec<u8> {
        unpack_nibbles(&self.packed)
    }

    /// Dense row-major values: `q * 2^(e - 127)`.
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes()
            .chunks_exact(BLOCK)
            .zip(&self.scales)
            .flat_map(|(block, &s)| {
                let scale = e8m0_to_f32(s);
                block.iter().map(move |&c| e2m1_to_f32(c) * scale)
            })
            .collect()
    }
}

/// `floor(log2(x))` for a positive finite f32, exact (read from the bits).
fn exponent_of(x: f32) -> i32 {
    let bits = x.to_bits();
    let biased = ((bits >> 23) & 0xff) as i32;
    if biased == 0 {
        // Subnormal: the leading one sits in the mantissa.
        let mantissa = bits & 0x7f_ffff;
        -126 - (mantissa.leading_zeros() as i32 - 9) - 1
    } else {
        biased - 127
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponent_is_floor_log2() {
        for (x, e) in [
            (1.0f32, 0),
            (1.99, 0),
            (2.0, 1),
            (0.3, -2),
            (6.0, 2),
            (1e-40, -133),
        ] {
            assert_eq!(exponent_of(x), e, "x = {x}");
        }
    }

    #[test]
    fn hand_derived_small_case() {
        // amax = 12 -> floor(log2 12) = 3 -> shared exponent 1 -> scale 2 -> bits 128.
        let mut row = vec![0.0f32; 32];
        row[..4].copy_from_slice(&[12.0, -3.0, 1.0, 7.0]);
        let w = Mxfp4Weight::quantize("t", &row, &[1, 32]).unwrap();
        assert_eq!(w.scales, vec![128]);
        // 12/2 = 6 -> 7; -3/2 = -1.5 -> 0xb; 1/2 = 0.5 -> 1; 7/2 = 3.5 -> 4.0 -> 6.
        assert_eq!(&w.packed[..2], &[0xb7, 0x61]);
        assert_eq!(&w.dequantize()[..4], &[12.0, -3.0, 1.0, 8.0]);
    }

    #[test]
    fn saturates_block_maximum() {
        // amax = 7.5 -> exponent 2 - 2 = 0 -> scale 1: 7.5 does not fit and saturates to 6.
        let mut row = vec![0.0f32; 32];
        row[0] = 7.5;
        let w = Mxfp4Weight::quantize("t", &row, &[1, 32]).unwrap();
        assert_eq!(w.dequantize()[0], 6.0);
    }
}
