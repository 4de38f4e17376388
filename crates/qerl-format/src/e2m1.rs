//! FP4 E2M1 values and the nibble packing shared by NVFP4 and MXFP4.
//!
//! A code is 4 bits: bit 3 the sign, bits 0..3 the magnitude index into
//! [`E2M1_MAGNITUDES`] = {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Two codes share a byte, element `2j` in
//! the low nibble and `2j + 1` in the high nibble (compressed-tensors' `pack_fp4_to_uint8`).

/// The eight magnitudes of E2M1, index = code & 7.
pub const E2M1_MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// The 16 code values, index = code (used to build kernel lookup tables).
pub fn e2m1_table() -> [f32; 16] {
    std::array::from_fn(|c| e2m1_to_f32(c as u8))
}

/// Rounds `x` to the nearest E2M1 code, ties to the even code, saturating at ±6.
///
/// The midpoints and their direction (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4)
/// are those of compressed-tensors' FP4 cast. The sign bit is `x < 0` before rounding, as in that
/// library: a small negative value that rounds to zero gets code 0x8 (negative zero), while
/// exact zeros of either sign get 0x0. NaN encodes as 0.
pub fn e2m1_from_f32(x: f32) -> u8 {
    let a = x.abs();
    let magnitude: u8 = if a <= 0.25 || a.is_nan() {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if x < 0.0 {
        magnitude | 0x8
    } else {
        magnitude
    }
}

/// Value of a 4-bit code (only the low 4 bits of `code` are read).
pub fn e2m1_to_f32(code: u8) -> f32 {
    let m = E2M1_MAGNITUDES[(code & 7) as usize];
    if code & 0x8 != 0 {
        -m
    } else {
        m
    }
}

/// Packs 4-bit codes two per byte, element `2j` in the low nibble. `codes.len()` must be even.
pub fn pack_nibbles(codes: &[u8]) -> Vec<u8> {
    assert!(
        codes.len().is_multiple_of(2),
        "pack_nibbles needs an even number of codes"
    );
    codes
        .chunks_exact(2)
        .map(|p| (p[0] & 0x0f) | ((p[1] & 0x0f) << 4))
        .collect()
}

/// Inverse of [`pack_nibbles`]: two codes per byte, low nibble first.
pub fn unpack_nibbles(packed: &[u8]) -> Vec<u8> {
    packed.iter().flat_map(|b| [b & 0x0f, b >> 4]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_follow_compressed_tensors() {
        let cases = [
            (0.25, 0.0),
            (0.26, 0.5),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (5.01, 6.0),
            (100.0, 6.0),
            (-0.75, -1.0),
            (-3.5, -4.0),
        ];
        for (x, want) in cases {
            assert_eq!(e2m1_to_f32(e2m1_from_f32(x)), want, "x = {x}");
        }
        assert_eq!(
            e2m1_from_f32(-0.1),
            0x8,
            "small negatives keep their sign bit"
        );
        assert_eq!(e2m1_from_f32(-0.0), 0, "exact -0.0 is code 0");
        assert_eq!(e2m1_from_f32(-6.0), 0xf);
    }

    #[test]
    fn every_code_round_trips() {
        for c in 0u8..16 {
            if c == 8 {
                assert_eq!(e2m1_from_f32(e2m1_to_f32(c)), 0, "-0 encodes as +0");
                continue;
            }
            assert_eq!(e2m1_from_f32(e2m1_to_f32(c)), c);
        }
    }

    #[test]
    fn nibble_order_hand_derived() {
        // 1.0 is code 2, -6 is code 0xf: low nibble first -> 0xf2.
        assert_eq!(pack_nibbles(&[2, 0xf, 0x9, 0x0]), vec![0xf2, 0x09]);
        assert_eq!(unpack_nibbles(&[0xf2, 0x09]), vec![2, 0xf, 0x9, 0x0]);
    }
}
