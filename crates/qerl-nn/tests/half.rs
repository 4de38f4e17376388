//! Half-precision modules on wgpu (f16, as bf16 on CUDA), in a process of their own: burn's
//! matmul autotune shares its cache between f16 and f32 backends on one device, and an f16-tuned
//! choice served to the f32 tests of `modules.rs` costs them precision when both run together.

use burn::backend::Autodiff;
mod common;

use common::{normal, rel_err, seed, tensor};
use qerl_format::SourceDtype;
use qerl_nn::{LoraConfig, NoisyRmsNorm, Nvfp4Linear, Precision};

/// On a half-precision backend (f16 on wgpu, as bf16 on CUDA) the trainable parameters (LoRA,
/// a trainable norm) are f32 master weights while the outputs carry the backend's float type,
/// and the autodiff and plain forwards agree.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_f16_autodiff_and_plain_forwards_agree() {
    use burn::module::AutodiffModule;
    use burn::tensor::DType;
    type H = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, half::f16, i32, u32>;
    type A = Autodiff<H>;
    let device = qerl_nn::backends::wgpu_device_or_exit();
    let s = seed();
    let (n, k) = (48, 80);
    let w = normal(s, n * k, 0.05);
    let layer = Nvfp4Linear::<A>::from_dense(
        "t",
        &w,
        SourceDtype::F32,
        n,
        k,
        Some(&normal(s + 1, n, 0.3)),
        Precision::Nvfp4,
        Some(LoraConfig {
            rank: 8,
            alpha: 16.0,
        }),
        &device,
    )
    .unwrap();
    let lora = layer.lora().unwrap();
    for (name, dtype) in [("A", lora.a.val().dtype()), ("B", lora.b.val().dtype())] {
        assert_eq!(dtype, burn::tensor::DType::F32, "LoRA {name} dtype");
    }
    let x = tensor::<A, 2>(normal(s + 2, 5 * k, 1.0), [5, k], &device);
    let plain = layer.valid().forward(x.clone().inner());
    let tracked = layer.forward(x.clone()).inner();
    let e = rel_err(tracked, plain.clone());
    assert!(
        e < 1e-3,
        "autodiff vs plain forward, relative error {e:.2e}"
    );
    assert_eq!(plain.dtype(), burn::tensor::DType::F16, "output dtype");
    let w = tensor::<A, 1>(vec![1.0; k], [k], &device);
    for (trainable, dtype) in [(true, DType::F32), (false, DType::F16)] {
        let norm = NoisyRmsNorm::<A>::new(w.clone(), 1e-6, trainable);
        assert_eq!(
            norm.weight.val().dtype(),
            dtype,
            "norm weight, trainable {trainable}"
        );
        let y = norm.forward(x.clone());
        assert_eq!(y.dtype(), DType::F16, "norm output, trainable {trainable}");
    }
}
