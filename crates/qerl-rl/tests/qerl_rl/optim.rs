use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::{backend::Backend, Tensor, TensorData};
use qerl_rl::optim_schedule::*;

use crate::close;

type AB = Autodiff<NdArray<f32>>;

#[test]
fn warmup_then_cosine() {
    let s = LrSchedule {
        peak_lr: 1e-5,
        warmup_steps: 10,
        total_steps: 100,
        decay: LrDecay::Cosine,
        min_lr_ratio: 0.0,
    };
    close(s.lr(0), 0.0, 0.0);
    close(s.lr(5), 5e-6, 1e-15);
    close(s.lr(10), 1e-5, 1e-15);
    // Halfway through the decay (p = 45 / 90): cos factor 0.5.
    close(s.lr(55), 5e-6, 1e-15);
    close(s.lr(100), 0.0, 1e-15);
    close(s.lr(150), 0.0, 1e-15);
    let lin = LrSchedule {
        decay: LrDecay::Linear,
        ..s
    };
    close(lin.lr(55), 5e-6, 1e-15);
    close(lin.lr(82), 1e-5 * (1.0 - 72.0 / 90.0), 1e-15);
    let floor = LrSchedule {
        min_lr_ratio: 0.1,
        ..s
    };
    close(floor.lr(100), 1e-6, 1e-15);
    let flat = LrSchedule {
        decay: LrDecay::Constant,
        ..s
    };
    close(flat.lr(99), 1e-5, 0.0);
}

#[test]
fn warmup_ratio_rounds_up() {
    // QeRL: warmup-ratio 0.1 over one GSM8K epoch of 7473 steps.
    let s = LrSchedule::with_warmup_ratio(1e-5, 0.1, 7473, LrDecay::Cosine);
    assert_eq!(s.warmup_steps, 748);
    let none = LrSchedule::with_warmup_ratio(1e-5, 0.0, 10, LrDecay::Cosine);
    close(none.lr(0), 1e-5, 0.0);
}

#[derive(Module, Debug)]
struct Two<B: Backend> {
    a: Param<Tensor<B, 1>>,
    b: Param<Tensor<B, 2>>,
}

fn two_with_grads(dev: &burn::backend::ndarray::NdArrayDevice) -> (Two<AB>, GradientsParams) {
    let m = Two::<AB> {
        a: Param::from_tensor(Tensor::from_data(TensorData::from([1.0f32]), dev)),
        b: Param::from_tensor(Tensor::from_data(TensorData::from([[1.0f32, 1.0]]), dev)),
    };
    // loss = 3 a + 2 b0 + 2 sqrt(3) b1: gradients [3], [[2, 2 sqrt 3]]: global norm sqrt(9 + 4 + 12) = 5.
    let w = Tensor::<AB, 2>::from_data(TensorData::from([[2.0f32, 2.0 * 3f32.sqrt()]]), dev);
    let loss = m.a.val().mul_scalar(3.0).sum() + (m.b.val() * w).sum();
    let grads = GradientsParams::from_grads(loss.backward(), &m);
    (m, grads)
}

#[test]
fn global_grad_norm_clipping() {
    let dev = Default::default();
    let (m, mut grads) = two_with_grads(&dev);
    close(grad_norm::<AB, _>(&m, &grads) as f64, 5.0, 1e-5);
    let before = clip_grad_norm::<AB, _>(&m, &mut grads, 1.0);
    close(before as f64, 5.0, 1e-5);
    close(grad_norm::<AB, _>(&m, &grads) as f64, 1.0, 1e-5);
    let ga: Vec<f32> = grads
        .get::<NdArray<f32>, 1>(m.a.id)
        .unwrap()
        .into_data()
        .iter::<f32>()
        .collect();
    close(ga[0] as f64, 0.6, 1e-5);
    let gb: Vec<f32> = grads
        .get::<NdArray<f32>, 2>(m.b.id)
        .unwrap()
        .into_data()
        .iter::<f32>()
        .collect();
    close(gb[0] as f64, 0.4, 1e-5);

    // Below the limit: untouched.
    let (m, mut grads) = two_with_grads(&dev);
    close(
        clip_grad_norm::<AB, _>(&m, &mut grads, 10.0) as f64,
        5.0,
        1e-5,
    );
    close(grad_norm::<AB, _>(&m, &grads) as f64, 5.0, 1e-5);
}
