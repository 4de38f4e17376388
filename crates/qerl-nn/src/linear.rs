//! [`Nvfp4Linear`]: a linear layer with a frozen (usually 4-bit) weight and a LoRA adapter.

use std::any::Any;
use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::{DType, Distribution, Tensor, TensorData, TensorPrimitive};
use qerl_format::{QuantizedWeight, SourceDtype};

use crate::backend::{LoraPrims, QerlBackend, QuantWeight};
use crate::{NnError, Precision};

/// Rank and scaling of a LoRA adapter (PEFT's `r` and `lora_alpha`; the update is scaled by
/// `alpha / rank`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f32,
}

impl LoraConfig {
    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }
}

/// A LoRA adapter: `ΔW = scale · B · A`, `A [rank, d_input]`, `B [d_output, rank]`
/// (PEFT's `lora_A.weight` and `lora_B.weight`).
///
/// `A` and `B` are f32 on every backend (master weights): the forward casts them to the
/// activations' type (bf16 on CUDA), and their gradients and the optimizer's moments stay f32.
/// In bf16 an AdamW step smaller than 2⁻⁸ of a weight would round away, and in f16 the second
/// moment of small gradients underflows to zero.
#[derive(Module, Debug)]
pub struct Lora<B: QerlBackend> {
    pub a: Param<Tensor<B, 2>>,
    pub b: Param<Tensor<B, 2>>,
    #[module(skip)]
    pub scale: f32,
}

impl<B: QerlBackend> Lora<B> {
    /// PEFT's initialisation: `A` Kaiming-uniform (bound `1 / sqrt(d_input)`), `B` zero, so the
    /// adapter starts as the identity change.
    pub fn init(config: LoraConfig, d_input: usize, d_output: usize, device: &B::Device) -> Self {
        let bound = 1.0 / (d_input as f64).sqrt();
        let a = Tensor::random(
            [config.rank, d_input],
            Distribution::Uniform(-bound, bound),
            (device, DType::F32),
        );
        Lora {
            a: Param::from_tensor(a),
            b: Param::from_tensor(Tensor::zeros([d_output, config.rank], (device, DType::F32))),
            scale: config.scale(),
        }
    }

    pub fn rank(&self) -> usize {
        self.a.dims()[0]
    }
}

/// The backend's weight, type-erased so that the module (and `Autodiff<B>`'s view of it, which
/// holds the same inner type) can carry it as a plain field.
#[derive(Clone)]
pub struct QuantHandle {
    weight: Arc<dyn Any + Send + Sync>,
    dims: [usize; 2],
}

impl std::fmt::Debug for QuantHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantHandle({:?})", self.dims)
    }
}

impl QuantHandle {
    fn new<W: QuantWeight>(w: W) -> Self {
        QuantHandle {
            dims: w.dims(),
            weight: Arc::new(w),
        }
    }

    fn get<B: QerlBackend>(&self) -> &B::QWeight {
        self.weight
            .downcast_ref::<B::QWeight>()
            .expect("the weight was uploaded for another backend")
    }
}

/// A linear layer `y = x · Wᵀ (+ b) (+ scale · x · Aᵀ · Bᵀ)` whose frozen weight `W
/// [d_output, d_input]` is stored as [`Precision`] says (NVFP4 by default), with an optional
/// LoRA adapter. The weight and bias never receive gradients; only the adapter trains.
///
/// Under `Autodiff<B>` the backward pass computes `dX` with the transposed 4-bit kernel: no
/// dense copy of `W` is made, in the forward or the backward pass. The 4-bit weight lives on the
/// device it was built on and is not part of the module's record (it is saved and loaded as a
/// checkpoint: see `qerl_format::checkpoint`); the adapter is.
#[derive(Module, Debug)]
pub struct Nvfp4Linear<B: QerlBackend> {
    /// The frozen dense weight `[d_output, d_input]` when the precision is [`Precision::Bf16`].
    pub dense: Option<Param<Tensor<B, 2>>>,
    /// The frozen bias `[d_output]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    pub lora: Option<Lora<B>>,
    #[module(skip)]
    quant: Option<QuantHandle>,
    #[module(skip)]
    precision: Precision,
    #[module(skip)]
    d_input: usize,
    #[module(skip)]
    d_output: usize,
}

fn frozen<B: QerlBackend, const D: usize>(t: Tensor<B, D>) -> Param<Tensor<B, D>> {
    Param::from_tensor(t).set_require_grad(false)
}

impl<B: QerlBackend> Nvfp4Linear<B> {
    /// Builds the layer from a dense row-major weight `[d_output, d_input]` (the Hugging Face
    /// layout), quantizing it unless `precision` is [`Precision::Bf16`]. `dtype` is the dtype
    /// the values were stored in (it decides NVFP4's rounding, see `qerl_format::nvfp4`).
    #[allow(clippy::too_many_arguments)]
    pub fn from_dense(
        name: &str,
        weight: &[f32],
        dtype: SourceDtype,
        d_output: usize,
        d_input: usize,
        bias: Option<&[f32]>,
        precision: Precision,
        lora: Option<LoraConfig>,
        device: &B::Device,
    ) -> Result<Self, NnError> {
        if weight.len() != d_output * d_input {
            return Err(NnError::Shape {
                name: name.to_string(),
                what: format!(
                    "{} values for a [{d_output}, {d_input}] weight",
                    weight.len()
                ),
            });
        }
        match precision.format() {
            Some(format) => {
                let q =
                    QuantizedWeight::quantize(format, name, weight, &[d_output, d_input], dtype)?;
                Self::from_quantized(name, q, bias, lora, device)
            }
            None => {
                let w = Tensor::from_data(
                    TensorData::new(weight.to_vec(), [d_output, d_input]),
                    device,
                );
                let mut layer = Self::empty(d_input, d_output, Precision::Bf16);
                layer.dense = Some(frozen(w));
                layer.with_bias_and_lora(name, bias, lora, device)
            }
        }
    }

    /// Builds a [`Precision::Bf16`] layer around a dense weight already on the device,
    /// `[d_output, d_input]` (the loader converts checkpoint bytes straight to the backend's
    /// float type, on every core, and uploads them without an f32 copy).
    pub fn from_dense_tensor(
        name: &str,
        weight: Tensor<B, 2>,
        bias: Option<&[f32]>,
        lora: Option<LoraConfig>,
        device: &B::Device,
    ) -> Result<Self, NnError> {
        let [d_output, d_input] = weight.dims();
        let mut layer = Self::empty(d_input, d_output, Precision::Bf16);
        layer.dense = Some(frozen(weight));
        layer.with_bias_and_lora(name, bias, lora, device)
    }

    /// Builds the layer from an already quantized weight (e.g. read from a compressed-tensors
    /// checkpoint with `qerl_format::checkpoint::QuantizedCheckpoint`).
    pub fn from_quantized(
        name: &str,
        weight: QuantizedWeight,
        bias: Option<&[f32]>,
        lora: Option<LoraConfig>,
        device: &B::Device,
    ) -> Result<Self, NnError> {
        let [d_output, d_input] = weight.shape();
        let precision = match weight.format() {
            qerl_format::QuantFormat::Nvfp4 => Precision::Nvfp4,
            qerl_format::QuantFormat::Mxfp4 => Precision::Mxfp4,
            qerl_format::QuantFormat::Nf4 => Precision::Nf4,
        };
        let mut layer = Self::empty(d_input, d_output, precision);
        layer.quant = Some(QuantHandle::new(B::qweight_upload(name, &weight, device)?));
        layer.with_bias_and_lora(name, bias, lora, device)
    }

    fn empty(d_input: usize, d_output: usize, precision: Precision) -> Self {
        Nvfp4Linear {
            dense: None,
            bias: None,
            lora: None,
            quant: None,
            precision,
            d_input,
            d_output,
        }
    }

    fn with_bias_and_lora(
        mut self,
        name: &str,
        bias: Option<&[f32]>,
        lora: Option<LoraConfig>,
        device: &B::Device,
    ) -> Result<Self, NnError> {
        if let Some(b) = bias {
            if b.len() != self.d_output {
                return Err(NnError::Shape {
                    name: name.to_string(),
                    what: format!("bias has {} values, d_output is {}", b.len(), self.d_output),
                });
            }
            self.bias = Some(frozen(Tensor::from_data(
                TensorData::new(b.to_vec(), [b.len()]),
                device,
            )));
        }
        self.lora = lora.map(|c| Lora::init(c, self.d_input, self.d_output, device));
        Ok(self)
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// `[d_output, d_input]`.
    pub fn dims(&self) -> [usize; 2] {
        [self.d_output, self.d_input]
    }

    pub fn lora(&self) -> Option<&Lora<B>> {
        self.lora.as_ref()
    }

    /// The frozen 4-bit weight as the backend holds it (`None` for a dense layer): an
    /// inference engine reads the same device buffers instead of a second copy.
    pub fn quant_weight(&self) -> Option<&B::QWeight> {
        self.quant.as_ref().map(QuantHandle::get::<B>)
    }

    /// Replaces the adapter's weights (`a [rank, d_input]`, `b [d_output, rank]`), e.g. when
    /// loading a PEFT adapter (kept as f32, see [`Lora`]). Panics on mismatched shapes or a
    /// layer without LoRA.
    pub fn set_lora_weights(&mut self, a: Tensor<B, 2>, b: Tensor<B, 2>) {
        let lora = self.lora.as_mut().expect("this layer has no LoRA adapter");
        assert_eq!(a.dims(), lora.a.dims(), "LoRA A shape");
        assert_eq!(b.dims(), lora.b.dims(), "LoRA B shape");
        lora.a = Param::from_tensor(a.cast(DType::F32));
        lora.b = Param::from_tensor(b.cast(DType::F32));
    }

    /// `[.., d_input] -> [.., d_output]`, adapter included.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.run(x, true)
    }

    /// The base layer alone (the KL reference policy: the same weights, LoRA disabled).
    pub fn forward_without_lora<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.run(x, false)
    }

    fn run<const D: usize>(&self, x: Tensor<B, D>, with_lora: bool) -> Tensor<B, D> {
        let mut dims = x.dims();
        assert_eq!(
            dims[D - 1],
            self.d_input,
            "input's last dimension vs d_input"
        );
        let m = dims[..D - 1].iter().product::<usize>();
        let x2: Tensor<B, 2> = x.reshape([m, self.d_input]);
        let dtype = x2.dtype();
        // the f32 master weights in the activations' type
        let lora = self
            .lora
            .as_ref()
            .filter(|_| with_lora)
            .map(|l| (l.a.val().cast(dtype), l.b.val().cast(dtype), l.scale));
        let y = match &self.quant {
            Some(q) => {
                let lora = lora.map(|(a, b, scale)| LoraPrims {
                    a: a.into_primitive().tensor(),
                    b: b.into_primitive().tensor(),
                    scale,
                });
                let bias = self
                    .bias
                    .as_ref()
                    .map(|b| b.val().into_primitive().tensor());
                let y = B::qlinear(x2.into_primitive().tensor(), q.get::<B>(), bias, lora);
                Tensor::from_primitive(TensorPrimitive::Float(y))
            }
            None => {
                let w = self
                    .dense
                    .as_ref()
                    .expect("dense or quantized weight")
                    .val();
                // Dense products through the backend (cuBLAS on CUDA: burn's matmul would tune
                // a dozen candidate kernels for every new shape).
                let mm = |x: Tensor<B, 2>, w: Tensor<B, 2>, alpha: f32| -> Tensor<B, 2> {
                    let (x, w) = (x.into_primitive().tensor(), w.into_primitive().tensor());
                    Tensor::from_primitive(TensorPrimitive::Float(B::dense_matmul(
                        x, false, w, true, alpha,
                    )))
                };
                let mut y = mm(x2.clone(), w, 1.0);
                if let Some(b) = &self.bias {
                    y = y + b.val().unsqueeze_dim(0);
                }
                if let Some((a, b, scale)) = lora {
                    y = y + mm(mm(x2, a, 1.0), b, scale);
                }
                y
            }
        };
        dims[D - 1] = self.d_output;
        y.reshape(dims)
    }

    /// The frozen weight as a dense `[d_output, d_input]` tensor, with the adapter merged in
    /// (`W + scale · B · A`) when it has one: the BF16 copy exported after training.
    pub fn merged_weight(&self) -> Tensor<B, 2> {
        let w = match (&self.quant, &self.dense) {
            (Some(q), _) => {
                let device = self
                    .bias
                    .as_ref()
                    .map(|b| b.device())
                    .or_else(|| self.lora.as_ref().map(|l| l.a.device()));
                let device = device.unwrap_or_default();
                Tensor::from_primitive(TensorPrimitive::Float(B::qweight_dequantize(
                    q.get::<B>(),
                    &device,
                )))
            }
            (None, Some(d)) => d.val(),
            (None, None) => unreachable!("a layer always has a weight"),
        };
        match &self.lora {
            Some(l) => {
                let delta = l.b.val().matmul(l.a.val()).mul_scalar(l.scale);
                let dtype = w.dtype();
                (w.cast(DType::F32) + delta).cast(dtype)
            }
            None => w,
        }
    }
}
