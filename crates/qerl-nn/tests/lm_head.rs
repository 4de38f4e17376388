//! The chunked lm_head + log-softmax + gather + entropy ([`qerl_nn::lm_head_log_probs`])
//! against the unfused computation on the full `[M, V]` logits (the one
//! `qerl_rl::logprob::{token_log_probs, token_entropy}` does): values, and the gradients of
//! the hidden states (and of the weight, when it is trainable) under autodiff, for chunk sizes
//! that divide the token count and ones that do not, temperatures 1 and not 1, on the CPU
//! reference backend and on wgpu (lavapipe in CI).
//!
//! Bounds (relative Frobenius error): CPU 1e-5, wgpu 1e-4 (another summation order).

mod common;

use burn::backend::Autodiff;
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use common::{normal, rel_err, seed, tensor};
use qerl_nn::lm_head::{chunks, rows_for_budget, MAX_CHUNK_ROWS};
use qerl_nn::{lm_head_log_probs, Entropy, LogProbOptions, QerlBackend};
use rand::{Rng, SeedableRng};

/// `(log p [M], entropy [M])` from the full logits, as the unfused training path computes them.
fn reference<B: burn::tensor::backend::Backend>(
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    y: Tensor<B, 1, Int>,
    temperature: f32,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let [m, _] = h.dims();
    let logits = h.matmul(w.transpose()).cast(DType::F32);
    let logits = if temperature > 0.0 && temperature != 1.0 {
        logits.div_scalar(temperature)
    } else {
        logits
    };
    let logp = log_softmax(logits, 1);
    let picked = logp.clone().gather(1, y.unsqueeze_dim(1)).reshape([m]);
    let entropy = (logp.clone().exp() * logp).sum_dim(1).reshape([m]).neg();
    (picked, entropy)
}

struct Case {
    m: usize,
    k: usize,
    v: usize,
    temperature: f32,
}

/// Values and gradients of `Σ a·logp + Σ b·H` (and of `Σ a·logp` alone, entropy off) for one
/// shape at several chunk sizes.
fn check<B>(device: &B::Device, case: &Case, chunks: &[usize], train_weight: bool, tol: f64)
where
    B: AutodiffBackend + QerlBackend,
    B::InnerBackend: QerlBackend,
{
    let s = seed();
    let Case {
        m,
        k,
        v,
        temperature,
    } = *case;
    let hv = normal(s, m * k, 1.0);
    let wv = normal(s + 1, v * k, 0.5);
    let a = normal(s + 2, m, 1.0);
    let b = normal(s + 3, m, 1.0);
    let mut rng = rand::rngs::StdRng::seed_from_u64(s + 4);
    let yv: Vec<i64> = (0..m).map(|_| rng.random_range(0..v as i64)).collect();
    let y = || Tensor::<B, 1, Int>::from_data(TensorData::new(yv.clone(), [m]), device);
    let leaf = |v: &[f32], shape: [usize; 2], grad: bool| {
        let t = tensor::<B, 2>(v.to_vec(), shape, device);
        if grad {
            t.require_grad()
        } else {
            t
        }
    };
    let (av, bv) = (
        tensor::<B, 1>(a.clone(), [m], device),
        tensor::<B, 1>(b.clone(), [m], device),
    );

    // the reference, with and without the entropy term
    let (rh, rw) = (leaf(&hv, [m, k], true), leaf(&wv, [v, k], train_weight));
    let (rlp, rent) = reference(rh.clone(), rw.clone(), y(), temperature);
    let rg = ((rlp.clone() * av.clone()).sum() + (rent.clone() * bv.clone()).sum()).backward();
    let (rdh, rdw) = (rh.grad(&rg).unwrap(), rw.grad(&rg));
    assert_eq!(rdw.is_some(), train_weight);
    let (rh2, rw2) = (leaf(&hv, [m, k], true), leaf(&wv, [v, k], train_weight));
    let (rlp2, _) = reference(rh2.clone(), rw2.clone(), y(), temperature);
    let rg2 = (rlp2 * av.clone()).sum().backward();
    let (rdh2, rdw2) = (rh2.grad(&rg2).unwrap(), rw2.grad(&rg2));

    for &rows in chunks {
        let what = format!("M {m} V {v} T {temperature} rows {rows}");
        let opts = LogProbOptions {
            temperature,
            chunk_rows: rows,
            entropy: Entropy::Differentiable,
        };
        let (h, w) = (leaf(&hv, [m, k], true), leaf(&wv, [v, k], train_weight));
        let (lp, ent) = lm_head_log_probs(h.clone(), w.clone(), y(), &opts);
        assert_eq!(lp.dtype(), DType::F32);
        let e = rel_err(lp.clone(), rlp.clone());
        assert!(e < tol, "{what}: log p rel err {e}");
        let e = rel_err(ent.clone(), rent.clone());
        assert!(e < tol, "{what}: entropy rel err {e}");
        let g = ((lp * av.clone()).sum() + (ent * bv.clone()).sum()).backward();
        let e = rel_err(h.grad(&g).unwrap(), rdh.clone());
        assert!(e < tol, "{what}: dh rel err {e}");
        match (w.grad(&g), &rdw) {
            (Some(dw), Some(rdw)) => {
                let e = rel_err(dw, rdw.clone());
                assert!(e < tol, "{what}: dW rel err {e}");
            }
            (None, None) => {}
            (got, _) => panic!(
                "{what}: dW {} but the weight is trainable: {train_weight}",
                got.is_some()
            ),
        }

        // entropy off (zeros) or a metric (values, no gradient): the log-probabilities and
        // their gradient unchanged
        for entropy in [Entropy::Off, Entropy::Metric] {
            let opts = LogProbOptions { entropy, ..opts };
            let (h, w) = (leaf(&hv, [m, k], true), leaf(&wv, [v, k], train_weight));
            let (lp, ent) = lm_head_log_probs(h.clone(), w.clone(), y(), &opts);
            if entropy == Entropy::Off {
                assert!(ent.clone().into_data().iter::<f32>().all(|x| x == 0.0));
            } else {
                let e = rel_err(ent.clone(), rent.clone());
                assert!(e < tol, "{what}, {entropy:?}: entropy rel err {e}");
            }
            let e = rel_err(lp.clone(), rlp.clone());
            assert!(e < tol, "{what}, {entropy:?}: log p rel err {e}");
            // the entropy enters the loss but, detached, adds no gradient
            let g = ((lp * av.clone()).sum() + (ent * bv.clone()).sum()).backward();
            let e = rel_err(h.grad(&g).unwrap(), rdh2.clone());
            assert!(e < tol, "{what}, {entropy:?}: dh rel err {e}");
            if let (Some(dw), Some(rdw)) = (w.grad(&g), &rdw2) {
                let e = rel_err(dw, rdw.clone());
                assert!(e < tol, "{what}, {entropy:?}: dW rel err {e}");
            }
        }

        // without autodiff (the old / reference policy's pass): the same values
        let hi = tensor::<B::InnerBackend, 2>(hv.clone(), [m, k], device);
        let wi = tensor::<B::InnerBackend, 2>(wv.clone(), [v, k], device);
        let yi =
            Tensor::<B::InnerBackend, 1, Int>::from_data(TensorData::new(yv.clone(), [m]), device);
        let (lp, ent) = lm_head_log_probs(
            hi,
            wi,
            yi,
            &LogProbOptions {
                entropy: Entropy::Metric,
                ..opts
            },
        );
        let e = rel_err(lp, rlp.clone().inner());
        assert!(e < tol, "{what}, inner backend: log p rel err {e}");
        let e = rel_err(ent, rent.clone().inner());
        assert!(e < tol, "{what}, inner backend: entropy rel err {e}");
    }
}

/// Chunk sizes: one row, sizes that do not divide M = 37, one that does not fill a chunk, the
/// whole batch in one chunk, and the memory-budget default (0).
const CHUNKS: [usize; 7] = [1, 5, 16, 36, 37, 64, 0];

fn cases() -> [Case; 3] {
    [
        Case {
            m: 37,
            k: 24,
            v: 101,
            temperature: 0.7,
        },
        Case {
            m: 37,
            k: 32,
            v: 257,
            temperature: 1.0,
        },
        // peaked distributions (large logits): the shifted log-sum-exp must hold
        Case {
            m: 37,
            k: 16,
            v: 64,
            temperature: 0.05,
        },
    ]
}

#[test]
fn cpu_chunked_log_probs_match_unchunked() {
    for case in cases() {
        check::<Autodiff<qerl_nn::backends::Cpu>>(&Default::default(), &case, &CHUNKS, false, 1e-5);
    }
}

#[test]
fn cpu_chunked_log_probs_train_a_tied_weight() {
    for case in cases() {
        check::<Autodiff<qerl_nn::backends::Cpu>>(
            &Default::default(),
            &case,
            &[5, 37, 0],
            true,
            1e-5,
        );
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_chunked_log_probs_match_unchunked() {
    // fewer chunk sizes than on the CPU: every new shape is a kernel compilation on lavapipe
    let device = qerl_nn::backends::wgpu_device_or_exit();
    for case in cases() {
        check::<Autodiff<qerl_nn::backends::Wgpu>>(&device, &case, &[5, 16, 0], false, 1e-4);
    }
    check::<Autodiff<qerl_nn::backends::Wgpu>>(&device, &cases()[0], &[5, 0], true, 1e-4);
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features qerl-train/cuda -- --ignored cuda"]
fn cuda_chunked_log_probs_match_unchunked() {
    // bf16 products on both sides, the same rounding: a few units of bf16 (2^-8) at most
    let device = Default::default();
    for case in cases() {
        check::<Autodiff<qerl_nn::backends::Cuda>>(&device, &case, &CHUNKS, false, 2e-2);
    }
}

#[test]
fn chunk_rows_from_a_memory_budget() {
    // Qwen2.5's vocabulary in 2 GiB: 320 rows (a multiple of 64)
    assert_eq!(rows_for_budget(152_064, 2 << 30), 320);
    assert_eq!(LogProbOptions::default().rows(152_064), 320);
    assert_eq!(rows_for_budget(151_936, 1 << 30), 128);
    // small vocabularies are capped, tiny budgets floored
    assert_eq!(rows_for_budget(1_000, 2 << 30), MAX_CHUNK_ROWS);
    assert_eq!(rows_for_budget(152_064, 1 << 20), 16);
    let opts = LogProbOptions {
        chunk_rows: 1024,
        ..LogProbOptions::default()
    };
    assert_eq!(opts.rows(152_064), 1024);
    // chunks of one size, give or take a row, covering every row once
    assert_eq!(chunks(1100, 512), [0..366, 366..733, 733..1100]);
    assert_eq!(chunks(37, 37), vec![0..37]);
    assert_eq!(chunks(37, 64), vec![0..37]);
    assert_eq!(chunks(5, 1).len(), 5);
    assert!(chunks(0, 16).is_empty());
    for (m, rows) in [(37, 5), (37, 16), (5120, 320), (1000, 999)] {
        let c = chunks(m, rows);
        assert_eq!(c.len(), m.div_ceil(rows));
        assert_eq!((c[0].start, c[c.len() - 1].end), (0, m));
        assert!(c.windows(2).all(|w| w[0].end == w[1].start));
        let sizes: Vec<usize> = c.iter().map(|r| r.len()).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        assert!(*sizes.iter().max().unwrap() <= rows);
    }
}

#[test]
fn no_rows_give_empty_results() {
    type B = Autodiff<qerl_nn::backends::Cpu>;
    let d = Default::default();
    let h = Tensor::<B, 2>::zeros([0, 8], &d);
    let w = tensor::<B, 2>(normal(1, 40, 1.0), [5, 8], &d);
    let y = Tensor::<B, 1, Int>::zeros([0], &d);
    let (lp, ent) = lm_head_log_probs(h, w, y, &LogProbOptions::default());
    assert_eq!((lp.dims(), ent.dims()), ([0], [0]));
}

/// Device memory and time of the lm_head log-probabilities at Qwen2.5-7B's shape (hidden 3584,
/// vocabulary 152,064, bf16), forward + backward, one way per process (cubecl's pool keeps
/// what it reserved, so the reserved bytes are the run's high-water mark):
/// `QERL_LM_HEAD=unfused|chunked`, `QERL_LM_HEAD_TOKENS` rows (default 5120 = 16 x 320).
/// Prints one line; run with `--ignored --nocapture cuda_lm_head_memory`.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features qerl-train/cuda -- --ignored cuda"]
fn cuda_lm_head_memory() {
    type B = Autodiff<qerl_nn::backends::Cuda>;
    let way = std::env::var("QERL_LM_HEAD").unwrap_or_else(|_| "chunked".into());
    let m: usize = std::env::var("QERL_LM_HEAD_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5120);
    let (k, v, temperature) = (3584, 152_064, 0.9);
    let device = Default::default();
    let sync = || {
        let probe = Tensor::<B, 1>::zeros([1], &device);
        let _ = probe.into_data();
    };
    let h0 = Tensor::<B, 2>::random(
        [m, k],
        burn::tensor::Distribution::Normal(0.0, 1.0),
        &device,
    );
    let w = Tensor::<B, 2>::random(
        [v, k],
        burn::tensor::Distribution::Normal(0.0, 0.02),
        &device,
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let yv: Vec<i64> = (0..m).map(|_| rng.random_range(0..v as i64)).collect();
    let y = Tensor::<B, 1, Int>::from_data(TensorData::new(yv, [m]), &device);
    sync();
    let (used0, reserved0) = qerl_nn::backends::cuda_memory().unwrap();
    let mut times = Vec::new();
    for _ in 0..3 {
        let start = std::time::Instant::now();
        let h = h0.clone().detach().require_grad();
        let (lp, ent) = if way == "unfused" {
            let (lp, ent) = reference(h.clone(), w.clone(), y.clone(), temperature);
            (lp, ent.detach())
        } else {
            let opts = LogProbOptions {
                temperature,
                chunk_rows: std::env::var("QERL_LM_HEAD_ROWS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
                entropy: Entropy::Metric,
            };
            lm_head_log_probs(h.clone(), w.clone(), y.clone(), &opts)
        };
        let g = (lp.sum() + ent.sum()).backward();
        let dh = h.grad(&g).unwrap();
        let _ = dh.slice([0..1, 0..1]).into_data();
        times.push(start.elapsed().as_secs_f64());
    }
    let (used, reserved) = qerl_nn::backends::cuda_memory().unwrap();
    println!(
        "lm_head {way}: {m} tokens x {v} vocab, hidden {k}: reserved {:.2} GB over the inputs' \
         {:.2} GB (in use after: {:.2} GB), forward + backward {:.1} / {:.1} / {:.1} ms",
        (reserved - reserved0) as f64 / 1e9,
        used0 as f64 / 1e9,
        used as f64 / 1e9,
        times[0] * 1e3,
        times[1] * 1e3,
        times[2] * 1e3,
    );
}
