use burn::backend::NdArray;
use burn::tensor::{Int, Tensor, TensorData};
use qerl_rl::logprob::*;

use crate::close;

type B = NdArray<f32>;

#[test]
fn log_probs_and_entropy() {
    let dev = Default::default();
    // One sequence, two positions, vocab 3. Position 0 logits [0, ln 2, ln 3] -> p = [1, 2, 3] / 6;
    // position 1 uniform -> p = 1/3 each.
    let logits = Tensor::<B, 3>::from_data(
        TensorData::from([[[0.0f32, 2f32.ln(), 3f32.ln()], [5.0, 5.0, 5.0]]]),
        &dev,
    );
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::from([[2i64, 0]]), &dev);
    let lp: Vec<f32> = token_log_probs(logits.clone(), tokens, 1.0)
        .into_data()
        .iter::<f32>()
        .collect();
    close(lp[0] as f64, (0.5f64).ln(), 1e-5);
    close(lp[1] as f64, (1.0f64 / 3.0).ln(), 1e-5);

    let h: Vec<f32> = token_entropy(logits.clone(), 1.0)
        .into_data()
        .iter::<f32>()
        .collect();
    let p = [1.0f64 / 6.0, 2.0 / 6.0, 3.0 / 6.0];
    close(
        h[0] as f64,
        -p.iter().map(|x| x * x.ln()).sum::<f64>(),
        1e-5,
    );
    close(h[1] as f64, 3f64.ln(), 1e-5);

    // Temperature 2 halves the logits: position 0 becomes p ~ [1, sqrt 2, sqrt 3].
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::from([[0i64, 1]]), &dev);
    let lp: Vec<f32> = token_log_probs(logits.clone(), tokens, 2.0)
        .into_data()
        .iter::<f32>()
        .collect();
    close(lp[0] as f64, -(1.0 + 2f64.sqrt() + 3f64.sqrt()).ln(), 1e-5);

    let mask = Tensor::<B, 2>::from_data(TensorData::from([[1.0f32, 0.0]]), &dev);
    close(
        masked_mean(token_entropy(logits, 1.0), mask) as f64,
        h[0] as f64,
        1e-6,
    );
}
