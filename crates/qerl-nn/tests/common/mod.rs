//! Helpers shared by the module test binaries.
#![allow(dead_code)]

use burn::tensor::{Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution as _, Normal};

pub fn seed() -> u64 {
    rand::rng().random()
}

pub fn normal(seed: u64, len: usize, std: f32) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let d = Normal::new(0.0f32, std).unwrap();
    (0..len).map(|_| d.sample(&mut rng)).collect()
}

pub fn tensor<B: burn::tensor::backend::Backend, const D: usize>(
    v: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(v, shape), device)
}

pub fn rel_err<B: burn::tensor::backend::Backend, const D: usize>(
    got: Tensor<B, D>,
    want: Tensor<B, D>,
) -> f64 {
    let g = got.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    let w = want.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    assert!(g.iter().all(|v| v.is_finite()), "non-finite output");
    let num: f64 = g
        .iter()
        .zip(&w)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = w.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}
