//! [`NoisyRmsNorm`]: RMSNorm with a per-channel noise vector (AQN).

use burn::module::{Module, Param};
use burn::tensor::{DType, Tensor, TensorPrimitive};

use crate::backend::QerlBackend;

/// `y = x / sqrt(mean(x²) + eps) ⊙ (w + z)` over the last dimension.
///
/// `w` is the norm's weight (trainable or frozen); `z` is the noise vector that adaptive
/// quantization noise (AQN) samples per rollout step and the caller sets with
/// [`set_noise`](Self::set_noise). Folding the noise into the weight is QeRL's trick: a Gaussian
/// change of the norm's scale acts like a channel-wise noise on the next linear layer's weight.
/// The noise is a constant for autodiff; the gradients are those of `x` and `w`.
#[derive(Module, Debug)]
pub struct NoisyRmsNorm<B: QerlBackend> {
    pub weight: Param<Tensor<B, 1>>,
    #[module(skip)]
    noise: Option<Tensor<B, 1>>,
    #[module(skip)]
    eps: f64,
}

impl<B: QerlBackend> NoisyRmsNorm<B> {
    /// A norm with the given weight `[d]`; `trainable = false` freezes it. A trainable weight
    /// is kept in f32 (a master weight, as LoRA's: see [`crate::Lora`]) and cast to the
    /// activations' type in the forward.
    pub fn new(weight: Tensor<B, 1>, eps: f64, trainable: bool) -> Self {
        let weight = if trainable {
            weight.cast(DType::F32)
        } else {
            weight
        };
        NoisyRmsNorm {
            weight: Param::from_tensor(weight).set_require_grad(trainable),
            noise: None,
            eps,
        }
    }

    /// Sets (or, with `None`, clears) the noise vector `[d]` used by the next forwards.
    pub fn set_noise(&mut self, noise: Option<Tensor<B, 1>>) {
        if let Some(z) = &noise {
            assert_eq!(z.dims(), self.weight.dims(), "noise and weight shapes");
        }
        self.noise = noise;
    }

    pub fn noise(&self) -> Option<&Tensor<B, 1>> {
        self.noise.as_ref()
    }

    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// `[.., d] -> [.., d]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let d = dims[D - 1];
        let rows = dims[..D - 1].iter().product::<usize>();
        let x2: Tensor<B, 2> = x.reshape([rows, d]);
        let dtype = x2.dtype();
        let (y, _rstd) = B::noisy_rms_norm(
            x2.into_primitive().tensor(),
            self.weight.val().cast(dtype).into_primitive().tensor(),
            self.noise
                .as_ref()
                .map(|z| z.clone().cast(dtype).into_primitive().tensor()),
            self.eps,
        );
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape(dims)
    }
}
