//! NF4 as bitsandbytes stores it (QLoRA's 4-bit NormalFloat).
//!
//! The weight is cut into blocks of 64 consecutive elements of the flattened (row-major) matrix,
//! as bitsandbytes does, so a block may straddle rows; each scaled by its absolute maximum into [-1, 1] and
//! rounded to the nearest of the 16 [`NF4_TABLE`] levels. `packed` is u8 `[rows * cols / 2]`
//! with the FIRST element of each pair in the HIGH nibble (bitsandbytes' order, the opposite of
//! NVFP4's), `absmax` f32 `[rows * cols / 64]`.

use crate::{check_finite, check_len, check_matrix, FormatError, Result};

/// A 2-D shape whose element count is a multiple of the block: bitsandbytes cuts blocks from
/// the flattened weight, so a block may straddle rows (e.g. `[64, 160]` is fine).
fn check_flat_blocks(name: &str, values_len: usize, shape: &[usize]) -> Result<(usize, usize)> {
    let (rows, cols) = check_matrix(name, values_len, shape, 1, "NF4")?;
    if (rows * cols) % BLOCK != 0 || cols % 2 != 0 {
        return Err(FormatError::Shape {
            name: name.to_string(),
            shape: shape.to_vec(),
            format: "NF4",
            why: format!(
                "its {} elements are not a whole number of {BLOCK}-element blocks with an even row length",
                rows * cols
            ),
        });
    }
    Ok((rows, cols))
}

/// Inputs per absmax block (bitsandbytes' default for NF4 weights).
pub const BLOCK: usize = 64;

/// The 16 NormalFloat levels (QLoRA, Dettmers et al. 2023, appendix E), index = code.
#[allow(clippy::excessive_precision)] // bitsandbytes' constants, as published
pub const NF4_TABLE: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// Code of the zero level.
pub const ZERO_CODE: u8 = 7;

/// An NF4-quantized `[rows, cols]` matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4Weight {
    pub rows: usize,
    pub cols: usize,
    /// `[rows * cols / 2]`, first element of a pair in the high nibble.
    pub packed: Vec<u8>,
    /// `[rows * cols / 64]` block absolute maxima.
    pub absmax: Vec<f32>,
}

/// Nearest NF4 level of a value in [-1, 1]; a value exactly between two levels takes the lower
/// one (bitsandbytes compares `x > midpoint`).
pub fn nf4_from_f32(x: f32) -> u8 {
    let mut code = 0u8;
    for i in 0..15 {
        let mid = 0.5 * (NF4_TABLE[i] + NF4_TABLE[i + 1]);
        if x > mid {
            code = i as u8 + 1;
        }
    }
    code
}

impl Nf4Weight {
    /// Quantizes a row-major `[rows, cols]` matrix.
    pub fn quantize(name: &str, values: &[f32], shape: &[usize]) -> Result<Self> {
        let (rows, cols) = check_flat_blocks(name, values.len(), shape)?;
        check_finite(name, values)?;
        let mut absmax = Vec::with_capacity(rows * cols / BLOCK);
        let mut codes = Vec::with_capacity(rows * cols);
        for block in values.chunks_exact(BLOCK) {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if amax == 0.0 {
                codes.extend(std::iter::repeat_n(ZERO_CODE, BLOCK));
            } else {
                // bitsandbytes multiplies by the reciprocal of the block maximum.
                let inv = 1.0 / amax;
                codes.extend(block.iter().map(|&x| nf4_from_f32(x * inv)));
            }
            absmax.push(amax);
        }
        Ok(Nf4Weight {
            rows,
            cols,
            packed: pack(&codes),
            absmax,
        })
    }

    /// Assembles a weight from stored parts, checking their lengths.
    pub fn from_parts(
        name: &str,
        rows: usize,
        cols: usize,
        packed: Vec<u8>,
        absmax: Vec<f32>,
    ) -> Result<Self> {
        check_flat_blocks(name, rows * cols, &[rows, cols])?;
        check_len(name, "weight", [rows, cols], rows * cols / 2, packed.len())?;
        check_len(
            name,
            "absmax",
            [rows, cols],
            rows * cols / BLOCK,
            absmax.len(),
        )?;
        Ok(Nf4Weight {
            rows,
            cols,
            packed,
            absmax,
        })
    }

    /// 4-bit codes in element order.
    pub fn codes(&self) -> Vec<u8> {
        unpack(&self.packed)
    }

    /// Dense row-major values: `table[code] * absmax`.
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes()
            .chunks_exact(BLOCK)
            .zip(&self.absmax)
            .flat_map(|(block, &a)| block.iter().map(move |&c| NF4_TABLE[c as usize] * a))
            .collect()
    }
}

/// Packs NF4 codes two a byte, the first of each pair in the high nibble.
pub fn pack(codes: &[u8]) -> Vec<u8> {
    assert!(
        codes.len().is_multiple_of(2),
        "NF4 pack needs an even number of codes"
    );
    codes
        .chunks_exact(2)
        .map(|p| ((p[0] & 0x0f) << 4) | (p[1] & 0x0f))
        .collect()
}

/// Unpacks bytes into NF4 codes, high nibble first.
pub fn unpack(packed: &[u8]) -> Vec<u8> {
    packed.iter().flat_map(|b| [b >> 4, b & 0x0f]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_map_to_themselves_and_midpoints_go_down() {
        for (c, &v) in NF4_TABLE.iter().enumerate() {
            assert_eq!(nf4_from_f32(v), c as u8);
        }
        let mid = 0.5 * (NF4_TABLE[7] + NF4_TABLE[8]);
        assert_eq!(nf4_from_f32(mid), 7);
        assert_eq!(nf4_from_f32(f32::from_bits(mid.to_bits() + 1)), 8);
    }

    #[test]
    fn hand_derived_small_case() {
        let mut row = vec![0.0f32; 64];
        row[0] = -2.0; // -1 -> code 0
        row[1] = 2.0; // 1 -> code 15
        row[2] = 0.33 * 2.0; // 0.33 -> nearest 0.3379 -> code 11
        let w = Nf4Weight::quantize("t", &row, &[1, 64]).unwrap();
        assert_eq!(w.absmax, vec![2.0]);
        assert_eq!(&w.packed[..2], &[0x0f, 0xb7]);
        let d = w.dequantize();
        assert_eq!(&d[..3], &[-2.0, 2.0, NF4_TABLE[11] * 2.0]);
    }
}
