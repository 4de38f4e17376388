//! AQN noise reaches the logits: through the norms of the rollout (inner) model and of the
//! autodiff training model; sigma = 0 leaves them bit-identical.

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use qerl_model::{load, CausalLm, LoadOptions, QerlBackend, TokenBatch};
use qerl_train::noise::{set_noise, step_noise};

type Cpu = qerl_nn::backends::Cpu;

fn logits<B: QerlBackend>(m: &CausalLm<B>) -> Vec<f32> {
    let b = TokenBatch::single(&[5, 17, 300, 44, 9, 120]).unwrap();
    m.forward(&b).unwrap().into_data().iter::<f32>().collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn noise_reaches_the_logits() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/compressed-tensors/qwen2_tied/nvfp4");
    let mut m = load::<Autodiff<Cpu>>(&dir, &LoadOptions::default(), &Default::default()).unwrap();
    let (layers, hidden) = (m.config().num_hidden_layers, m.config().hidden_size);
    let clean = logits(&m.valid());

    // sigma = 0: no noise at all, same logits bit for bit
    assert!(step_noise(7, 3, 2 * layers + 1, hidden, 0.0).is_none());
    set_noise(&mut m, None);
    assert_eq!(logits(&m.valid()), clean);

    let noise = step_noise(7, 3, 2 * layers + 1, hidden, 0.05).unwrap();
    assert_eq!(noise.len(), 2 * layers + 1);
    // on the rollout model (the inner view), as the trainer sets it
    let mut inner = m.valid();
    set_noise(&mut inner, Some(&noise));
    let d = max_diff(&logits(&inner), &clean);
    println!("max |logit change| with sigma 0.05 on the rollout model: {d:e}");
    assert!(d > 1e-4, "noise reached the logits: {d}");
    // on the training model (aqn.rollouts_only = false)
    set_noise(&mut m, Some(&noise));
    let d_train = max_diff(&logits(&m), &clean);
    assert!(d_train > 1e-4);
    assert!(
        max_diff(&logits(&m), &logits(&inner)) < 1e-5,
        "same noise, same logits"
    );
    // only the final norm noisy still changes the logits; a fresh step gives fresh noise
    let other = step_noise(7, 4, 2 * layers + 1, hidden, 0.05).unwrap();
    assert_ne!(other, noise);
    set_noise(&mut m, None);
    assert_eq!(logits(&m.valid()), clean, "cleared");
}
