//! Policy losses against values computed by hand.
//!
//! The shared example: 2 sequences x 3 positions, eps_low 0.2, eps_high 0.28, no KL, and
//! `logp_old = -1` everywhere, `logp_new = -1 + ln r` so the ratios are exactly `r`:
//!
//! ```text
//! seq 0: A = +1.0, mask [1, 1, 0], r = [1.5, 0.9, 5.0]
//!   t0: r A = 1.5,  clip(1.5) = 1.28 -> min 1.28 -> loss -1.28   (high-clipped: r > 1.28, A > 0)
//!   t1: r A = 0.9,  clip(0.9) = 0.9  -> min 0.9  -> loss -0.9
//!   t2: masked
//! seq 1: A = -0.5, mask [1, 1, 1], r = [0.5, 1.1, 1.0]
//!   t0: r A = -0.25, clip(0.5) = 0.8 -> 0.8 A = -0.4 -> min -0.4 -> loss 0.4 (low-clipped: r < 0.8, A < 0)
//!   t1: r A = -0.55 (in range)                         -> loss 0.55
//!   t2: r A = -0.5                                     -> loss 0.5
//!
//! GRPO (sequence mean):   seq0 (-1.28 - 0.9) / 2 = -1.09;  seq1 (0.4 + 0.55 + 0.5) / 3 = 0.48333
//!                         loss = (-1.09 + 0.48333) / 2 = -0.303333
//! DAPO (token mean):      (-1.28 - 0.9 + 0.4 + 0.55 + 0.5) / 5 = -0.73 / 5 = -0.146
//! Dr. GRPO (max_len 4):   -0.73 / (2 * 4) = -0.09125
//! clip fractions: low 1/5, high 1/5
//! ```

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{backend::Backend, Tensor, TensorData};
use qerl_rl::loss::*;

use crate::close;

type B = NdArray<f32>;
type AB = Autodiff<B>;

fn t2<Bk: Backend>(rows: [[f32; 3]; 2], dev: &Bk::Device) -> Tensor<Bk, 2> {
    Tensor::from_data(TensorData::from(rows), dev)
}

fn example<Bk: Backend>(dev: &Bk::Device) -> PolicyLossInputs<Bk> {
    let r = [[1.5f32, 0.9, 5.0], [0.5, 1.1, 1.0]];
    let new = r.map(|row| row.map(|x| -1.0 + x.ln()));
    PolicyLossInputs {
        logp_new: t2(new, dev),
        logp_old: t2([[-1.0; 3]; 2], dev),
        logp_ref: None,
        advantages: Tensor::from_data(TensorData::from([1.0f32, -0.5]), dev),
        mask: t2([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dev),
        is_weights: None,
    }
}

fn cfg(aggregation: LossAggregation) -> PolicyLossConfig {
    PolicyLossConfig {
        eps_low: 0.2,
        eps_high: 0.28,
        beta: 0.0,
        aggregation,
    }
}

fn value<Bk: Backend>(t: Tensor<Bk, 1>) -> f64 {
    t.into_data().iter::<f32>().next().unwrap() as f64
}

#[test]
fn grpo_dapo_drgrpo_by_hand() {
    let dev = Default::default();
    let out = policy_loss::<B>(example(&dev), &cfg(LossAggregation::SequenceMean), None).unwrap();
    close(value(out.loss), (-1.09 + 1.45 / 3.0) / 2.0, 1e-5);
    close(out.stats.loss as f64, -0.303_333, 1e-5);
    close(out.stats.clip_frac_low as f64, 0.2, 1e-6);
    close(out.stats.clip_frac_high as f64, 0.2, 1e-6);
    close(out.stats.tokens as f64, 5.0, 0.0);
    close(
        out.stats.mean_ratio as f64,
        (1.5 + 0.9 + 0.5 + 1.1 + 1.0) / 5.0,
        1e-5,
    );
    close(out.stats.mean_kl as f64, 0.0, 0.0);
    close(out.stats.mean_is_weight as f64, 1.0, 0.0);

    let out = policy_loss::<B>(example(&dev), &cfg(LossAggregation::TokenMean), None).unwrap();
    close(value(out.loss), -0.146, 1e-5);

    let out = policy_loss::<B>(
        example(&dev),
        &cfg(LossAggregation::ConstantNormalizer { max_len: 4 }),
        None,
    )
    .unwrap();
    close(value(out.loss), -0.09125, 1e-5);
}

#[test]
fn symmetric_clip_changes_only_the_high_side() {
    // With eps_high 0.2, seq0 t0 clips at 1.2: token mean (-1.2 - 0.9 + 0.4 + 0.55 + 0.5) / 5 = -0.13.
    let dev = Default::default();
    let mut c = cfg(LossAggregation::TokenMean);
    c.eps_high = 0.2;
    let out = policy_loss::<B>(example(&dev), &c, None).unwrap();
    close(out.stats.loss as f64, -0.13, 1e-5);
    assert_eq!(PolicyLossConfig::dapo().eps_high, 0.28);
    assert_eq!(PolicyLossConfig::grpo().beta, 0.04);
    assert_eq!(
        PolicyLossConfig::dr_grpo(7).aggregation,
        LossAggregation::ConstantNormalizer { max_len: 7 }
    );
}

#[test]
fn gradient_flows_only_through_unclipped_tokens() {
    // d loss / d logp_new = -A r / (tokens of the sequence * sequences) where the unclipped branch
    // is taken, 0 where it is clipped or masked (GRPO aggregation):
    //   seq0: t0 clipped -> 0;  t1 -> -(1)(0.9)/(2*2) = -0.225;  t2 masked -> 0
    //   seq1: t0 clipped -> 0;  t1 -> 0.5*1.1/(3*2) = 0.091667;  t2 -> 0.5*1.0/6 = 0.083333
    let dev = Default::default();
    let mut inputs = example::<AB>(&dev);
    let logp_new = inputs.logp_new.clone().require_grad();
    inputs.logp_new = logp_new.clone();
    let out = policy_loss::<AB>(inputs, &cfg(LossAggregation::SequenceMean), None).unwrap();
    let grads = out.loss.backward();
    let g: Vec<f32> = logp_new
        .grad(&grads)
        .unwrap()
        .into_data()
        .iter::<f32>()
        .collect();
    let want = [0.0, -0.225, 0.0, 0.0, 0.55 / 6.0, 0.5 / 6.0];
    for (a, b) in g.iter().zip(want) {
        close(*a as f64, b, 1e-5);
    }
}

#[test]
fn k3_kl_term() {
    // Ratio 1 and A = 0, so only beta * KL remains. ref - new = [ln 2, 0]:
    // k3 = e^d - d - 1 = [2 - ln 2 - 1, 0] = [0.306853, 0]; mean 0.153426; loss 0.1 * mean.
    let dev = Default::default();
    let new = Tensor::<B, 2>::from_data(TensorData::from([[-1.0f32, -2.0]]), &dev);
    let inputs = PolicyLossInputs {
        logp_new: new.clone(),
        logp_old: new.clone(),
        logp_ref: Some(Tensor::from_data(
            TensorData::from([[-1.0f32 + 2f32.ln(), -2.0]]),
            &dev,
        )),
        advantages: Tensor::from_data(TensorData::from([0.0f32]), &dev),
        mask: Tensor::from_data(TensorData::from([[1.0f32, 1.0]]), &dev),
        is_weights: None,
    };
    let c = PolicyLossConfig {
        beta: 0.1,
        ..cfg(LossAggregation::TokenMean)
    };
    let out = policy_loss::<B>(inputs.clone(), &c, None).unwrap();
    let k3 = 2.0 - 2f64.ln() - 1.0;
    close(out.stats.mean_kl as f64, k3 / 2.0, 1e-6);
    close(out.stats.loss as f64, 0.1 * k3 / 2.0, 1e-6);
    // beta = 0: the KL is still reported but not in the loss.
    let out = policy_loss::<B>(inputs, &PolicyLossConfig { beta: 0.0, ..c }, None).unwrap();
    close(out.stats.mean_kl as f64, k3 / 2.0, 1e-6);
    close(out.stats.loss as f64, 0.0, 1e-7);
}

#[test]
fn truncated_importance_sampling() {
    let dev = Default::default();
    let train = Tensor::<B, 2>::from_data(TensorData::from([[3f32.ln(), 0.5f32.ln()]]), &dev);
    let rollout = Tensor::<B, 2>::zeros([1, 2], &dev);
    let w = truncated_is_weights(train, rollout, 2.0);
    let w: Vec<f32> = w.into_data().iter::<f32>().collect();
    close(w[0] as f64, 2.0, 1e-6);
    close(w[1] as f64, 0.5, 1e-6);

    // Weights scale the policy term per token: token mean with w = [2, 1, _, 0.5, 1, 1]:
    // (-1.28*2 - 0.9 + 0.4*0.5 + 0.55 + 0.5) / 5 = -2.21 / 5 = -0.442.
    let mut inputs = example::<B>(&dev);
    inputs.is_weights = Some(t2([[2.0, 1.0, 9.0], [0.5, 1.0, 1.0]], &dev));
    let out = policy_loss::<B>(inputs, &cfg(LossAggregation::TokenMean), None).unwrap();
    close(out.stats.loss as f64, -0.442, 1e-5);
    close(out.stats.mean_is_weight as f64, 5.5 / 5.0, 1e-6);
}

#[test]
fn micro_batches_sum_to_the_full_batch() {
    let dev = Default::default();
    let full = example::<B>(&dev);
    let split = |i: usize| PolicyLossInputs {
        logp_new: full.logp_new.clone().slice([i..i + 1, 0..3]),
        logp_old: full.logp_old.clone().slice([i..i + 1, 0..3]),
        logp_ref: None,
        advantages: full.advantages.clone().narrow(0, i, 1),
        mask: full.mask.clone().slice([i..i + 1, 0..3]),
        is_weights: None,
    };
    let global = Some(GlobalNormalizer {
        sequences: 2,
        tokens: 5.0,
    });
    for agg in [
        LossAggregation::SequenceMean,
        LossAggregation::TokenMean,
        LossAggregation::ConstantNormalizer { max_len: 4 },
    ] {
        let whole = policy_loss::<B>(full.clone(), &cfg(agg), None)
            .unwrap()
            .stats
            .loss as f64;
        let parts: f64 = (0..2)
            .map(|i| {
                policy_loss::<B>(split(i), &cfg(agg), global)
                    .unwrap()
                    .stats
                    .loss as f64
            })
            .sum();
        close(parts, whole, 1e-5);
    }
}

#[test]
fn mu_one_has_unit_ratio_and_no_clipping() {
    let dev = Default::default();
    let mut inputs = example::<B>(&dev);
    inputs.logp_old = inputs.logp_new.clone().detach();
    let out = policy_loss::<B>(inputs, &cfg(LossAggregation::TokenMean), None).unwrap();
    close(out.stats.mean_ratio as f64, 1.0, 1e-6);
    assert_eq!(out.stats.clip_frac_low + out.stats.clip_frac_high, 0.0);
    // loss = -(1 + 1 - 0.5 - 0.5 - 0.5) / 5 = -0.1
    close(out.stats.loss as f64, -0.1, 1e-6);
}

#[test]
fn shape_errors_name_the_input() {
    let dev = Default::default();
    let mut inputs = example::<B>(&dev);
    inputs.mask = Tensor::ones([2, 4], &dev);
    let e = policy_loss::<B>(inputs, &cfg(LossAggregation::TokenMean), None).unwrap_err();
    assert_eq!(e.input, "mask");
    assert!(e.to_string().contains("[2, 4]"), "{e}");
    let mut inputs = example::<B>(&dev);
    inputs.advantages = Tensor::ones([3], &dev);
    assert_eq!(
        policy_loss::<B>(inputs, &cfg(LossAggregation::TokenMean), None)
            .unwrap_err()
            .input,
        "advantages"
    );
}

#[test]
fn fully_masked_batch_is_finite() {
    let dev = Default::default();
    let mut inputs = example::<B>(&dev);
    inputs.mask = Tensor::zeros([2, 3], &dev);
    for agg in [LossAggregation::SequenceMean, LossAggregation::TokenMean] {
        let out = policy_loss::<B>(inputs.clone(), &cfg(agg), None).unwrap();
        assert_eq!(out.stats.loss, 0.0);
        assert_eq!(out.stats.tokens, 0.0);
    }
}
