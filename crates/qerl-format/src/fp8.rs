//! 8-bit scale encodings: FP8 E4M3 (the NVFP4 block scale) and E8M0 (the MXFP4 block scale).
//!
//! E4M3 here is the "fn" variant used by PyTorch (`torch.float8_e4m3fn`) and by the
//! safetensors dtype `F8_E4M3`: bias 7, no infinities, 0x7f/0xff are NaN, largest finite 448,
//! smallest subnormal 2^-9.

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Encodes `x` as E4M3, rounding to nearest with ties to even.
///
/// Finite magnitudes above 448 saturate to 448 (PTX `cvt.rn.satfinite`); callers that follow
/// compressed-tensors clamp to ±448 first, where saturation and PyTorch's cast agree.
/// NaN and infinities encode as NaN (0x7f with the sign).
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() || a.is_infinite() {
        return sign | 0x7f;
    }
    // Quantum of the binade `a` falls in (2^-9 for subnormals), then round on that grid.
    // Dividing by a power of two is exact in f32, so the only rounding is `round_ties_even`.
    let quantum = if a >= f32::powi(2.0, -6) {
        let e = a.log2().floor() as i32;
        // log2 may be off by one right at a power of two: fix the binade exactly.
        let e = if f32::powi(2.0, e) > a {
            e - 1
        } else if f32::powi(2.0, e + 1) <= a {
            e + 1
        } else {
            e
        };
        f32::powi(2.0, e - 3)
    } else {
        f32::powi(2.0, -9)
    };
    let v = ((a / quantum).round_ties_even() * quantum).min(E4M3_MAX);
    sign | encode_exact_e4m3(v)
}

/// Bits of a non-negative value that E4M3 represents exactly.
fn encode_exact_e4m3(v: f32) -> u8 {
    if v < f32::powi(2.0, -6) {
        return (v / f32::powi(2.0, -9)) as u8;
    }
    let e = v.log2().floor() as i32;
    let e = if f32::powi(2.0, e) > v { e - 1 } else { e };
    let mantissa = (v / f32::powi(2.0, e - 3)) as u8 - 8;
    (((e + 7) as u8) << 3) | mantissa
}

/// Decodes E4M3 bits to f32 (exact).
pub fn e4m3_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((bits >> 3) & 0x0f) as i32;
    let m = (bits & 0x07) as f32;
    if e == 0x0f && bits & 0x07 == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m * f32::powi(2.0, -9)
    } else {
        sign * (8.0 + m) * f32::powi(2.0, e - 10)
    }
}

/// Table of all 256 E4M3 values, index = bits (used to build kernel lookup tables).
pub fn e4m3_table() -> [f32; 256] {
    std::array::from_fn(|b| e4m3_to_f32(b as u8))
}

/// Decodes an E8M0 scale (OCP MX): `2^(bits - 127)`, 0xff is NaN.
pub fn e8m0_to_f32(bits: u8) -> f32 {
    if bits == 0xff {
        f32::NAN
    } else {
        f32::powi(2.0, bits as i32 - 127)
    }
}

/// Encodes the power of two `2^exp` as E8M0, clamping `exp` to the representable -127..=127.
pub fn e8m0_from_exponent(exp: i32) -> u8 {
    (exp.clamp(-127, 127) + 127) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_hand_derived_bytes() {
        // 1.0 = 2^0 * (1 + 0/8): exponent field 7 -> 0x38.
        assert_eq!(e4m3_from_f32(1.0), 0x38);
        assert_eq!(e4m3_from_f32(-1.0), 0xb8);
        // 448 = 2^8 * 1.75: exponent 15, mantissa 6 -> 0x7e.
        assert_eq!(e4m3_from_f32(448.0), 0x7e);
        assert_eq!(e4m3_from_f32(1000.0), 0x7e, "saturates");
        // 0.125 = 2^-3: exponent field 4 -> 0x20.
        assert_eq!(e4m3_from_f32(0.125), 0x20);
        // smallest subnormal 2^-9 -> 0x01; half of it ties to even (0).
        assert_eq!(e4m3_from_f32(f32::powi(2.0, -9)), 0x01);
        assert_eq!(e4m3_from_f32(f32::powi(2.0, -10)), 0x00);
        assert_eq!(
            e4m3_from_f32(1.5 * f32::powi(2.0, -9)),
            0x02,
            "tie to even code 2"
        );
        // 1.0625 lies halfway between 1.0 (mantissa 0) and 1.125 (mantissa 1): even -> 1.0.
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        // 1.1875 halfway between 1.125 (m=1) and 1.25 (m=2): even -> 1.25.
        assert_eq!(e4m3_from_f32(1.1875), 0x3a);
        // Rounding that carries into the next binade: 15.5 -> 16.
        assert_eq!(e4m3_to_f32(e4m3_from_f32(15.5)), 16.0);
        assert!(e4m3_to_f32(e4m3_from_f32(f32::NAN)).is_nan());
    }

    #[test]
    fn e4m3_round_trip_and_nearest() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            // -0.0 encodes as 0x80, so every finite code round-trips.
            assert_eq!(e4m3_from_f32(v), b, "code {b:#04x} value {v}");
        }
        // Any value maps to a nearest representable value.
        let finite: Vec<f32> = (0u8..=0x7e).map(e4m3_to_f32).collect();
        let mut x = 0.0f32;
        while x < 448.0 {
            let got = e4m3_to_f32(e4m3_from_f32(x));
            let best = finite
                .iter()
                .map(|v| (v - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert!((got - x).abs() <= best, "x={x} got={got}");
            x = x * 1.0137 + 1e-4;
        }
    }

    #[test]
    fn e8m0_values() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(e8m0_from_exponent(-3)), 0.125);
        assert_eq!(e8m0_from_exponent(500), 254);
        assert!(e8m0_to_f32(255).is_nan());
    }
}
