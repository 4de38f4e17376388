//! ggml tensor types and their dequantization to f32, written from the block layouts of the
//! GGUF specification (all little-endian).
//!
//! A quantized tensor is a sequence of blocks along its innermost dimension (`ne[0]`, a row of
//! the Hugging Face matrix); every block holds `block_elems` values in `block_bytes` bytes:
//!
//! | type | elems | bytes | layout | value |
//! | --- | --- | --- | --- | --- |
//! | Q4_0 | 32 | 18 | `d: f16, qs: [u8; 16]` | `(q - 8) * d` |
//! | Q4_1 | 32 | 20 | `d: f16, m: f16, qs: [u8; 16]` | `q * d + m` |
//! | Q5_0 | 32 | 22 | `d: f16, qh: u32, qs: [u8; 16]` | `(q - 16) * d` |
//! | Q5_1 | 32 | 24 | `d: f16, m: f16, qh: u32, qs: [u8; 16]` | `q * d + m` |
//! | Q8_0 | 32 | 34 | `d: f16, qs: [i8; 32]` | `q * d` |
//! | Q4_K | 256 | 144 | `d, dmin: f16, scales: [u8; 12], qs: [u8; 128]` | `d*sc*q - dmin*m` |
//! | Q5_K | 256 | 176 | `d, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]` | `d*sc*q - dmin*m` |
//! | Q6_K | 256 | 210 | `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16` | `d*sc*(q - 32)` |
//!
//! In the 32-value formats element `j < 16` is the low nibble of `qs[j]` and element `j + 16`
//! its high nibble; Q5's fifth bit of element `j` is bit `j` of `qh`. The K formats split a
//! super-block of 256 into sub-blocks of 32 (Q4_K, Q5_K: 6-bit scale and min per sub-block,
//! packed in 12 bytes) or 16 (Q6_K: an i8 scale per sub-block).

use half::{bf16, f16};

/// A ggml tensor type code, as stored in a GGUF tensor info.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const BF16: GgmlType = GgmlType(30);

    /// Every type [`dequantize`] reads.
    pub const SUPPORTED: [GgmlType; 11] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
    ];

    /// The name ggml gives the type (`Q4_K`), or `type 99` for a code it does not know.
    pub fn name(self) -> String {
        const NAMES: [&str; 40] = [
            "F32",
            "F16",
            "Q4_0",
            "Q4_1",
            "Q4_2",
            "Q4_3",
            "Q5_0",
            "Q5_1",
            "Q8_0",
            "Q8_1",
            "Q2_K",
            "Q3_K",
            "Q4_K",
            "Q5_K",
            "Q6_K",
            "Q8_K",
            "IQ2_XXS",
            "IQ2_XS",
            "IQ3_XXS",
            "IQ1_S",
            "IQ4_NL",
            "IQ3_S",
            "IQ2_S",
            "IQ4_XS",
            "I8",
            "I16",
            "I32",
            "I64",
            "F64",
            "IQ1_M",
            "BF16",
            "Q4_0_4_4",
            "Q4_0_4_8",
            "Q4_0_8_8",
            "TQ1_0",
            "TQ2_0",
            "IQ4_NL_4_4",
            "IQ4_NL_4_8",
            "IQ4_NL_8_8",
            "MXFP4",
        ];
        match NAMES.get(self.0 as usize) {
            Some(name) => name.to_string(),
            None => format!("type {}", self.0),
        }
    }

    /// `(values per block, bytes per block)` of a type qerl reads; `None` for the others.
    pub fn block(self) -> Option<(usize, usize)> {
        Some(match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q4_K => (256, 144),
            Self::Q5_K => (256, 176),
            Self::Q6_K => (256, 210),
            _ => return None,
        })
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

fn half_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Dequantizes `bytes`, whole blocks of type `ty`, into `out` (`block_elems` values per block).
/// Returns `false`, writing nothing, when the type is not one qerl reads or the lengths do not
/// match; the caller has checked both, so this never panics on file contents.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> bool {
    let Some((elems, block_bytes)) = ty.block() else {
        return false;
    };
    if !bytes.len().is_multiple_of(block_bytes) || bytes.len() / block_bytes * elems != out.len() {
        return false;
    }
    let block_fn: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, o| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, o| o[0] = half_at(b, 0),
        GgmlType::BF16 => |b, o| o[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
        _ => return false,
    };
    for (block, values) in bytes
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(elems))
    {
        block_fn(block, values);
    }
    true
}

fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        out[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
        out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        out[j] = (qs[j] & 0x0f) as f32 * d + m;
        out[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The 5-bit codes of a Q5_0 / Q5_1 block: low nibbles from `qs`, fifth bits from `qh`.
fn q5_codes(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut codes = [0u8; 32];
    for j in 0..16 {
        let bit = |k: usize| (((high >> k) & 1) as u8) << 4;
        codes[j] = (qs[j] & 0x0f) | bit(j);
        codes[j + 16] = (qs[j] >> 4) | bit(j + 16);
    }
    codes
}

fn q5_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    for (o, q) in out.iter_mut().zip(q5_codes(&b[2..6], &b[6..22])) {
        *o = (q as i32 - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    for (o, q) in out.iter_mut().zip(q5_codes(&b[4..8], &b[8..24])) {
        *o = q as f32 * d + m;
    }
}

fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = (q as i8) as f32 * d;
    }
}

/// Scale and min (6 bits each) of sub-block `j` (0..8) from the 12 packed bytes of Q4_K and
/// Q5_K: sub-blocks 0..4 use the low 6 bits of bytes `j` and `j + 4`; 4..8 take their low 4
/// bits from a nibble of byte `j + 4` and their top 2 bits from the spare bits of 0..4.
fn k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        let scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        let min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        (scale, min)
    }
}

/// Q4_K and Q5_K: four groups of 64 values; a group's first 32 values take the low nibbles of
/// its 32 `qs` bytes (sub-block `2g`), the next 32 the high nibbles (sub-block `2g + 1`). Q5_K
/// adds bit `2g` (first half) or `2g + 1` (second half) of `qh[l]` as the fifth bit.
fn k_quant_4_5(b: &[u8], out: &mut [f32], qh: Option<&[u8]>, qs: &[u8]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let scales = &b[4..16];
    for g in 0..4 {
        let q = &qs[32 * g..32 * g + 32];
        for half in 0..2 {
            let (sc, m) = k_scale_min(scales, 2 * g + half);
            let (dl, ml) = (d * sc as f32, dmin * m as f32);
            for l in 0..32 {
                let mut code = if half == 0 { q[l] & 0x0f } else { q[l] >> 4 };
                if let Some(qh) = qh {
                    code |= ((qh[l] >> (2 * g + half)) & 1) << 4;
                }
                out[64 * g + 32 * half + l] = dl * code as f32 - ml;
            }
        }
    }
}

fn q4_k(b: &[u8], out: &mut [f32]) {
    k_quant_4_5(b, out, None, &b[16..144]);
}

fn q5_k(b: &[u8], out: &mut [f32]) {
    k_quant_4_5(b, out, Some(&b[16..48]), &b[48..176]);
}

/// Q6_K: two halves of 128 values; in half `n`, value `32k + l` (k = 0..4) has its low nibble
/// in `ql[64n + l + 32*(k & 1)]` (low nibble for k < 2, high for k >= 2) and its top 2 bits in
/// bits `2k..2k+2` of `qh[32n + l]`; its scale is `scales[8n + l/16 + 2k]`.
fn q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    for n in 0..2 {
        let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &scales[8 * n..]);
        for l in 0..32 {
            for k in 0..4 {
                let byte = ql[l + 32 * (k & 1)];
                let low = if k < 2 { byte & 0x0f } else { byte >> 4 };
                let code = (low | (((qh[l] >> (2 * k)) & 3) << 4)) as i32 - 32;
                let scale = sc[l / 16 + 2 * k] as i8;
                out[128 * n + 32 * k + l] = d * scale as f32 * code as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    #[test]
    fn q4_0_nibble_order_and_offset() {
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&f16_bytes(0.5));
        block[2] = 0xf0; // element 0 = 0 - 8, element 16 = 15 - 8
        let mut out = [0f32; 32];
        assert!(dequantize(GgmlType::Q4_0, &block, &mut out));
        assert_eq!(out[0], -4.0);
        assert_eq!(out[16], 3.5);
        assert_eq!(out[1], -4.0);
    }

    #[test]
    fn q5_0_takes_the_fifth_bit_from_qh() {
        let mut block = vec![0u8; 22];
        block[..2].copy_from_slice(&f16_bytes(1.0));
        block[2..6].copy_from_slice(&(1u32 | 1 << 17).to_le_bytes());
        let mut out = [0f32; 32];
        assert!(dequantize(GgmlType::Q5_0, &block, &mut out));
        assert_eq!(out[0], 0.0); // 16 - 16
        assert_eq!(out[1], -16.0);
        assert_eq!(out[17], 0.0);
    }

    #[test]
    fn wrong_lengths_and_types_are_refused() {
        let mut out = [0f32; 32];
        assert!(!dequantize(GgmlType::Q4_0, &[0u8; 17], &mut out));
        assert!(!dequantize(GgmlType::Q4_0, &[0u8; 18], &mut out[..31]));
        assert!(!dequantize(GgmlType(10), &[0u8; 84], &mut [0f32; 256]));
        assert_eq!(GgmlType(10).name(), "Q2_K");
        assert_eq!(GgmlType(999).name(), "type 999");
    }
}
