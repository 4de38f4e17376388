//! Round trips and error bounds of the three formats on fresh random weights.

use qerl_format::e2m1::{pack_nibbles, unpack_nibbles};
use qerl_format::fp8::{e4m3_to_f32, e8m0_to_f32};
use qerl_format::nf4::{self, NF4_TABLE};
use qerl_format::nvfp4::{self, Nvfp4Weight};
use qerl_format::{Mxfp4Weight, Nf4Weight, QuantFormat, QuantizedWeight, SourceDtype};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

fn random_matrix(rows: usize, cols: usize) -> (Vec<f32>, u64) {
    let seed: u64 = rand::rng().random();
    let mut rng = StdRng::seed_from_u64(seed);
    let d = Normal::new(0.0f32, 0.05).unwrap();
    let mut w: Vec<f32> = (0..rows * cols).map(|_| d.sample(&mut rng)).collect();
    for _ in 0..rows {
        let i = rng.random_range(0..rows * cols);
        w[i] *= 30.0;
    }
    (w, seed)
}

#[test]
fn pack_unpack_round_trip() {
    let seed: u64 = rand::rng().random();
    let mut rng = StdRng::seed_from_u64(seed);
    let codes: Vec<u8> = (0..1000).map(|_| rng.random_range(0..16)).collect();
    assert_eq!(unpack_nibbles(&pack_nibbles(&codes)), codes, "seed {seed}");
    assert_eq!(nvfp4::unpack(&nvfp4::pack(&codes)), codes, "seed {seed}");
    assert_eq!(nf4::unpack(&nf4::pack(&codes)), codes, "seed {seed}");
    // The two nibble orders differ: NVFP4 low first, bitsandbytes high first.
    assert_eq!(nvfp4::pack(&[1, 2]), vec![0x21]);
    assert_eq!(nf4::pack(&[1, 2]), vec![0x12]);
}

#[test]
fn quantizing_a_dequantized_weight_gives_the_same_bytes() {
    let (rows, cols) = (24, 192);
    let (w, seed) = random_matrix(rows, cols);
    let q = Nvfp4Weight::quantize("w", &w, &[rows, cols], SourceDtype::F32, None).unwrap();
    let again = Nvfp4Weight::quantize(
        "w",
        &q.dequantize(),
        &[rows, cols],
        SourceDtype::F32,
        Some(q.global_scale),
    )
    .unwrap();
    // Equal up to the sign of zero: a small negative quantizes to code 0x8 (-0), which
    // dequantizes to -0.0, an exact zero, which quantizes to code 0.
    let no_neg_zero = |codes: Vec<u8>| -> Vec<u8> {
        codes
            .into_iter()
            .map(|c| if c == 8 { 0 } else { c })
            .collect()
    };
    assert!(q.scales == again.scales, "NVFP4 scales, seed {seed}");
    assert!(
        no_neg_zero(q.codes()) == again.codes(),
        "NVFP4 codes, seed {seed}"
    );
    assert!(
        q.dequantize() == again.dequantize(),
        "NVFP4 values, seed {seed}"
    );
    let q = Mxfp4Weight::quantize("w", &w, &[rows, cols]).unwrap();
    let again = Mxfp4Weight::quantize("w", &q.dequantize(), &[rows, cols]).unwrap();
    assert!(q.scales == again.scales, "MXFP4 scales, seed {seed}");
    assert!(
        no_neg_zero(q.codes()) == again.codes(),
        "MXFP4 codes, seed {seed}"
    );
    let q = Nf4Weight::quantize("w", &w, &[rows, cols]).unwrap();
    let again = Nf4Weight::quantize("w", &q.dequantize(), &[rows, cols]).unwrap();
    assert!(q == again, "NF4, seed {seed}");
}

#[test]
fn every_element_lies_within_half_a_grid_step() {
    let (rows, cols) = (32, 320);
    let (w, seed) = random_matrix(rows, cols);
    // NVFP4: grid steps are at most 2 (between 4 and 6) in units of the block scale.
    let q = Nvfp4Weight::quantize("w", &w, &[rows, cols], SourceDtype::F32, None).unwrap();
    for (i, (a, b)) in w.iter().zip(q.dequantize()).enumerate() {
        let scale = e4m3_to_f32(q.scales[i / 16]) / q.global_scale;
        assert!(
            (a - b).abs() <= scale * 1.0001,
            "NVFP4 element {i}: {a} vs {b}, seed {seed}"
        );
    }
    // MXFP4: also saturation, the block max may sit up to 8 scale units: error <= 2 units.
    let q = Mxfp4Weight::quantize("w", &w, &[rows, cols]).unwrap();
    for (i, (a, b)) in w.iter().zip(q.dequantize()).enumerate() {
        let scale = e8m0_to_f32(q.scales[i / 32]);
        assert!(
            (a - b).abs() <= 2.0 * scale,
            "MXFP4 element {i}: {a} vs {b}, seed {seed}"
        );
    }
    // NF4: the largest gap in the table is between -1 and -0.696.
    let half_gap = (NF4_TABLE[1] - NF4_TABLE[0]) / 2.0;
    let q = Nf4Weight::quantize("w", &w, &[rows, cols]).unwrap();
    for (i, (a, b)) in w.iter().zip(q.dequantize()).enumerate() {
        let bound = q.absmax[i / 64] * half_gap * 1.0001;
        assert!(
            (a - b).abs() <= bound,
            "NF4 element {i}: {a} vs {b}, seed {seed}"
        );
    }
}

#[test]
fn relative_error_is_what_4_bits_give() {
    // Gaussian weights with 30x outliers: NVFP4 and NF4 land near 8-12% relative error, MXFP4 a
    // little worse. The outliers (each its block's maximum, so nearly exact) can carry most of
    // the energy: a draw with large ones gave 1.5% (seed 17925301164129089011), so the lower
    // bound only says the weights were really quantized.
    let (rows, cols) = (64, 512);
    let (w, seed) = random_matrix(rows, cols);
    for format in QuantFormat::ALL {
        let q =
            QuantizedWeight::quantize(format, "w", &w, &[rows, cols], SourceDtype::F32).unwrap();
        let d = q.dequantize();
        let num: f64 = w
            .iter()
            .zip(&d)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = w.iter().map(|a| (*a as f64).powi(2)).sum();
        let rel = (num / den).sqrt();
        assert!(
            rel > 0.002 && rel < 0.2,
            "{format}: relative error {rel}, seed {seed}"
        );
    }
}

#[test]
fn bf16_source_rounds_intermediates() {
    // amax = 1.1 (not a bf16 number on purpose: the caller passes bf16 values, 1.1 -> 1.1015625).
    let v = half::bf16::from_f32(1.1).to_f32();
    let mut w = vec![0.01f32; 16];
    w[3] = v;
    let g = nvfp4::global_scale(&w, SourceDtype::BF16);
    let bf = |x: f32| half::bf16::from_f32(x).to_f32();
    assert_eq!(
        g,
        bf(bf(1.0 / v) * 2688.0),
        "reciprocal first, both steps rounded to bf16"
    );
    assert_ne!(g, 2688.0 / v, "f32 and bf16 arithmetic differ here");
    // All-zero weights: amax is clamped to the smallest normal, 2688 / 2^-126 overflows -> 1.
    assert_eq!(nvfp4::global_scale(&[0.0; 16], SourceDtype::BF16), 1.0);
}

#[test]
fn nonfinite_values_are_rejected_by_name() {
    let mut w = vec![0.5f32; 32];
    w[7] = f32::NAN;
    let e = QuantizedWeight::quantize(
        QuantFormat::Nvfp4,
        "layers.3.q",
        &w,
        &[2, 16],
        SourceDtype::F32,
    );
    let msg = e.unwrap_err().to_string();
    assert!(
        msg.contains("layers.3.q") && msg.contains("index 7"),
        "{msg}"
    );
}

#[test]
fn dequantize_row_matches_the_whole_matrix() {
    // NF4 with 160 columns: blocks straddle rows.
    let (rows, cols) = (6, 160);
    let (w, seed) = random_matrix(rows, cols);
    for format in QuantFormat::ALL {
        let cols = if format == QuantFormat::Mxfp4 {
            128
        } else {
            cols
        };
        let q = QuantizedWeight::quantize(
            format,
            "w",
            &w[..rows * cols],
            &[rows, cols],
            SourceDtype::F32,
        )
        .unwrap();
        let all = q.dequantize();
        let mut row = vec![f32::NAN; cols];
        for r in 0..rows {
            q.dequantize_row(r, &mut row);
            assert!(
                row == all[r * cols..(r + 1) * cols],
                "{format} row {r}, seed {seed}"
            );
        }
    }
}
