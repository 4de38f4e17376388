//! On-device sampling against host references: greedy, top-k and top-p masks, the sampled
//! distribution, seeds, and the returned log-probabilities.

use burn::backend::NdArray;
use burn::tensor::{Tensor, TensorData};
use qerl_model::sampling::{
    inverse_cdf, sample, top_k_filter, top_p_filter, Rng, SamplingParams, CDF_BLOCK,
};

type B = NdArray<f32>;

fn tensor(values: &[f32], rows: usize) -> Tensor<B, 2> {
    let cols = values.len() / rows;
    Tensor::from_data(
        TensorData::new(values.to_vec(), [rows, cols]),
        &Default::default(),
    )
}

fn host2(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// Random logits with distinct values (no ties), `rows x cols`.
fn random_logits(rows: usize, cols: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..rows * cols)
        .map(|_| {
            // sum of uniforms ~ roughly normal
            let s: f32 = (0..4).map(|_| rng.next_open01()).sum::<f32>() - 2.0;
            s * scale
        })
        .collect()
}

fn log_softmax_row(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// transformers' TopPLogitsWarper on one row: sort ascending, drop tokens whose cumulative
/// probability is <= 1 - p, keep at least the best one.
fn hf_top_p_keep(row: &[f32], p: f32) -> Vec<bool> {
    let lp = log_softmax_row(row);
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[a].total_cmp(&row[b]));
    let mut keep = vec![true; row.len()];
    let mut cum = 0f64;
    for (rank, &i) in order.iter().enumerate() {
        cum += lp[i].exp();
        if cum <= 1.0 - p as f64 && rank + 1 < row.len() {
            keep[i] = false;
        }
    }
    keep
}

#[test]
fn greedy_is_argmax_with_its_log_softmax() {
    let (rows, cols) = (5, 300);
    let logits = random_logits(rows, cols, 1, 3.0);
    let s = sample::<B>(tensor(&logits, rows), &SamplingParams::greedy(), &[]);
    let ids: Vec<i64> = s.ids.into_data().iter::<i64>().collect();
    let lps: Vec<f32> = s.logprobs.into_data().iter::<f32>().collect();
    for r in 0..rows {
        let row = &logits[r * cols..(r + 1) * cols];
        let best = (0..cols)
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap();
        assert_eq!(ids[r] as usize, best);
        assert!((lps[r] as f64 - log_softmax_row(row)[best]).abs() < 1e-5);
    }
}

#[test]
fn top_k_keeps_exactly_the_k_largest() {
    let (rows, cols) = (4, 257);
    let logits = random_logits(rows, cols, 2, 2.0);
    for k in [1, 2, 7, 100, 256] {
        let got = host2(top_k_filter(tensor(&logits, rows), k));
        for r in 0..rows {
            let row = &logits[r * cols..(r + 1) * cols];
            let mut sorted = row.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let kth = sorted[k - 1];
            for c in 0..cols {
                let kept = got[r * cols + c] != f32::NEG_INFINITY;
                assert_eq!(kept, row[c] >= kth, "k {k} row {r} col {c}");
                if kept {
                    assert_eq!(got[r * cols + c], row[c]);
                }
            }
        }
    }
    // k = 0 and k >= vocab: unchanged
    assert_eq!(host2(top_k_filter(tensor(&logits, rows), 0)), logits);
    assert_eq!(host2(top_k_filter(tensor(&logits, rows), cols)), logits);
}

#[test]
fn top_p_matches_transformers_definition() {
    let (rows, cols) = (6, 500);
    for (seed, scale) in [(3u64, 1.0f32), (4, 4.0), (5, 12.0)] {
        let logits = random_logits(rows, cols, seed, scale);
        for p in [0.05f32, 0.3, 0.5, 0.9, 0.99] {
            let got = host2(top_p_filter(tensor(&logits, rows), p));
            for r in 0..rows {
                let row = &logits[r * cols..(r + 1) * cols];
                let expected = hf_top_p_keep(row, p);
                let kept: Vec<bool> = got[r * cols..(r + 1) * cols]
                    .iter()
                    .map(|&v| v != f32::NEG_INFINITY)
                    .collect();
                let n = expected.iter().filter(|&&k| k).count();
                assert_eq!(
                    kept, expected,
                    "seed {seed} p {p} row {r} ({n} kept by the reference)"
                );
            }
        }
    }
}

#[test]
fn sampled_frequencies_follow_the_truncated_distribution() {
    // Three rows, one distribution each; many draws per row through the uniform numbers.
    let logits = [2.0f32, 1.0, 0.5, -1.0, -3.0];
    let params = SamplingParams {
        temperature: 0.7,
        top_k: 4,
        top_p: 0.95,
    };
    let draws = 4000;
    let rows = 200;
    let mut rng = Rng::new(99);
    let mut counts = [0usize; 5];
    for _ in 0..draws / rows {
        let batch: Vec<f32> = logits.iter().copied().cycle().take(rows * 5).collect();
        let u: Vec<f32> = (0..rows).map(|_| rng.next_open01()).collect();
        let s = sample::<B>(tensor(&batch, rows), &params, &u);
        for id in s.ids.into_data().iter::<i64>() {
            counts[id as usize] += 1;
        }
    }
    // reference: softmax(l / T), top-4, then top-p 0.95 over the renormalised four
    let scaled: Vec<f32> = logits.iter().map(|l| l / 0.7).collect();
    let lp = log_softmax_row(&scaled[..4]);
    let probs: Vec<f64> = lp.iter().map(|l| l.exp()).collect();
    let keep = hf_top_p_keep(&scaled[..4], 0.95);
    let z: f64 = probs
        .iter()
        .zip(&keep)
        .filter(|(_, &k)| k)
        .map(|(p, _)| p)
        .sum();
    for i in 0..5 {
        let expected = if i < 4 && keep[i] { probs[i] / z } else { 0.0 };
        let freq = counts[i] as f64 / draws as f64;
        let sd = (expected * (1.0 - expected) / draws as f64).sqrt();
        assert!(
            (freq - expected).abs() <= 5.0 * sd + 1e-9,
            "token {i}: {freq} vs {expected}"
        );
    }
    assert_eq!(counts[4], 0, "top-k dropped the last token");
}

#[test]
fn log_probs_are_log_softmax_at_temperature_before_truncation() {
    let (rows, cols) = (8, 64);
    let logits = random_logits(rows, cols, 6, 3.0);
    let params = SamplingParams {
        temperature: 1.3,
        top_k: 10,
        top_p: 0.8,
    };
    let mut rng = Rng::new(5);
    let u: Vec<f32> = (0..rows).map(|_| rng.next_open01()).collect();
    let s = sample::<B>(tensor(&logits, rows), &params, &u);
    let ids: Vec<i64> = s.ids.into_data().iter::<i64>().collect();
    let lps: Vec<f32> = s.logprobs.into_data().iter::<f32>().collect();
    for r in 0..rows {
        let row: Vec<f32> = logits[r * cols..(r + 1) * cols]
            .iter()
            .map(|l| l / 1.3)
            .collect();
        let expected = log_softmax_row(&row)[ids[r] as usize];
        assert!((lps[r] as f64 - expected).abs() < 1e-5, "row {r}");
        // and the token is inside the top-k
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!(row[ids[r] as usize] >= sorted[9]);
    }
}

#[test]
fn same_uniforms_same_tokens_and_seeded_streams() {
    let (rows, cols) = (16, 128);
    let logits = random_logits(rows, cols, 7, 1.0);
    let params = SamplingParams::default();
    let draw = |seed: u64| {
        let u: Vec<f32> = (0..rows)
            .map(|i| Rng::for_sequence(seed, i).next_open01())
            .collect();
        let s = sample::<B>(tensor(&logits, rows), &params, &u);
        s.ids.into_data().iter::<i64>().collect::<Vec<_>>()
    };
    assert_eq!(draw(11), draw(11));
    assert_ne!(draw(11), draw(12));
    // the generator's stream is fixed by this code
    let mut r = Rng::new(0);
    assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
    let u = Rng::new(1).next_open01();
    assert!(u > 0.0 && u < 1.0);
}

#[test]
fn invalid_parameters_are_rejected() {
    for (t, p) in [(-1.0f32, 1.0f32), (f32::NAN, 1.0), (1.0, 0.0), (1.0, 1.5)] {
        let params = SamplingParams {
            temperature: t,
            top_k: 0,
            top_p: p,
        };
        assert!(params.validate().is_err(), "{t} {p}");
    }
    assert!(SamplingParams::greedy().validate().is_ok());
}

/// The two-level inverse CDF over a vocabulary of several blocks (and a partial last one):
/// each token is drawn with its probability, zero-probability tokens never.
#[test]
fn inverse_cdf_across_blocks() {
    let vocab = 3 * CDF_BLOCK + 41;
    let mut weights = vec![0f32; vocab];
    // mass in the first, a middle and the partial last block, and on block edges
    for (i, w) in [
        (0usize, 1.0f32),
        (CDF_BLOCK - 1, 2.0),
        (CDF_BLOCK, 0.5),
        (CDF_BLOCK + 7, 3.0),
        (vocab - 1, 1.5),
    ] {
        weights[i] = w;
    }
    for (i, w) in weights
        .iter_mut()
        .enumerate()
        .skip(2 * CDF_BLOCK)
        .take(CDF_BLOCK)
    {
        *w = if i % 3 == 0 { 0.01 } else { 0.0 }; // many small ones
    }
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    let rows = 500;
    let rounds = 8;
    let mut rng = Rng::new(42);
    let mut counts = vec![0usize; vocab];
    for _ in 0..rounds {
        let batch: Vec<f32> = weights.iter().copied().cycle().take(rows * vocab).collect();
        let u: Vec<f32> = (0..rows).map(|_| rng.next_open01()).collect();
        let u = Tensor::<B, 2>::from_data(TensorData::new(u, [rows, 1]), &Default::default());
        let ids = inverse_cdf(tensor(&batch, rows), u);
        for id in ids.into_data().iter::<i64>() {
            counts[id as usize] += 1;
        }
    }
    let n = (rows * rounds) as f64;
    for (i, &w) in weights.iter().enumerate() {
        if w == 0.0 {
            assert_eq!(counts[i], 0, "token {i} has probability 0");
        } else if w >= 0.5 {
            let p = w as f64 / total;
            let freq = counts[i] as f64 / n;
            assert!(
                (freq - p).abs() < 5.0 * (p * (1.0 - p) / n).sqrt(),
                "token {i}: {freq} vs {p}"
            );
        }
    }
    // exact quantiles: u just below and above a token's cumulative boundary
    let cum_first = 1.0 / total as f32; // token 0 holds [0, 1/total)
    let u = Tensor::<B, 2>::from_data(
        TensorData::new(vec![cum_first * 0.999, cum_first * 1.001], [2, 1]),
        &Default::default(),
    );
    let two: Vec<f32> = weights.iter().copied().cycle().take(2 * vocab).collect();
    let ids: Vec<i64> = inverse_cdf(tensor(&two, 2), u)
        .into_data()
        .iter::<i64>()
        .collect();
    assert_eq!(ids, vec![0, CDF_BLOCK as i64 - 1]);
}
