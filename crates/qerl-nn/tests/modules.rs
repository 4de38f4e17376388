//! Module forwards and gradients against dense references built from ordinary Burn ops, on the
//! CPU reference backend (NdArray) and on the CubeCL kernels through wgpu (lavapipe in CI).
//!
//! Bounds (relative Frobenius error): the CPU path computes in f32 like the reference, 1e-5;
//! wgpu f32 kernels accumulate in another order, 1e-4.

use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
mod common;

use common::{normal, rel_err, seed, tensor};
use qerl_format::{QuantizedWeight, SourceDtype};
use qerl_nn::{LoraConfig, NoisyRmsNorm, Nvfp4Linear, Precision, QerlBackend};

/// Linear with LoRA: forward and the gradients of x, A, B against `x·Wᵀ + b + s·x·Aᵀ·Bᵀ` with the
/// dequantized W as a constant.
fn linear_grads<B>(device: &B::Device, tol: f64)
where
    B: AutodiffBackend + QerlBackend,
    B::InnerBackend: QerlBackend,
{
    linear_grads_shaped::<B>(device, tol, 3, 48);
}

/// [`linear_grads`] with x of shape [2, `t`, k] and `n` outputs.
fn linear_grads_shaped<B>(device: &B::Device, tol: f64, t: usize, n: usize)
where
    B: AutodiffBackend + QerlBackend,
    B::InnerBackend: QerlBackend,
{
    let s = seed();
    let (m, k, r) = (2 * t, 80, 8); // x is [2, t, k]: leading dims are flattened
    for precision in [
        Precision::Nvfp4,
        Precision::Mxfp4,
        Precision::Nf4,
        Precision::Bf16,
    ] {
        let k = if precision == Precision::Nf4 || precision == Precision::Mxfp4 {
            96
        } else {
            k
        };
        let w = normal(s, n * k, 0.05);
        let bias = normal(s + 1, n, 0.3);
        let lora = LoraConfig {
            rank: r,
            alpha: 16.0,
        };
        let mut layer = Nvfp4Linear::<B>::from_dense(
            "test.q_proj",
            &w,
            SourceDtype::F32,
            n,
            k,
            Some(&bias),
            precision,
            Some(lora),
            device,
        )
        .unwrap();
        // A non-zero B, so that dA is not trivially zero.
        let a = tensor::<B, 2>(normal(s + 2, r * k, 0.1), [r, k], device);
        let b = tensor::<B, 2>(normal(s + 3, n * r, 0.1), [n, r], device);
        layer.set_lora_weights(a.clone(), b.clone());
        let deq = match precision.format() {
            Some(f) => QuantizedWeight::quantize(f, "w", &w, &[n, k], SourceDtype::F32)
                .unwrap()
                .dequantize(),
            None => w.clone(),
        };
        let x_data = normal(s + 4, m * k, 1.0);
        let probe = tensor::<B, 3>(normal(s + 5, m * n, 1.0), [2, t, n], device);

        let x = tensor::<B, 3>(x_data.clone(), [2, t, k], device).require_grad();
        let y = layer.forward(x.clone());
        let grads = (y.clone() * probe.clone()).sum().backward();
        let (gx, ga, gb) = (
            x.grad(&grads).unwrap(),
            layer.lora().unwrap().a.grad(&grads).unwrap(),
            layer.lora().unwrap().b.grad(&grads).unwrap(),
        );
        if let Some(dense) = &layer.dense {
            assert!(
                dense.grad(&grads).is_none(),
                "the frozen weight got a gradient"
            );
        }

        let xr = tensor::<B, 3>(x_data, [2, t, k], device).require_grad();
        let (ar, br) = (a.require_grad(), b.require_grad());
        let wr = tensor::<B, 2>(deq, [n, k], device);
        let yr = xr.clone().matmul(wr.clone().transpose().unsqueeze())
            + tensor::<B, 1>(bias.clone(), [n], device).unsqueeze()
            + xr.clone()
                .matmul(ar.clone().transpose().unsqueeze())
                .matmul(br.clone().transpose().unsqueeze())
                .mul_scalar(lora.scale());
        let gr = (yr.clone() * probe).sum().backward();
        let what = format!("{precision} seed {s}");
        for (name, e) in [
            ("y", rel_err(y.inner(), yr.inner())),
            ("dx", rel_err(gx, xr.grad(&gr).unwrap())),
            ("dA", rel_err(ga, ar.grad(&gr).unwrap())),
            ("dB", rel_err(gb, br.grad(&gr).unwrap())),
        ] {
            assert!(
                e <= tol,
                "{what}: {name} relative error {e:.2e} > {tol:.0e}"
            );
        }

        // LoRA disabled is the base layer; the merged weight reproduces the full layer.
        let x = tensor::<B, 2>(normal(s + 6, 4 * k, 1.0), [4, k], device);
        let b_row = tensor::<B, 1>(bias, [n], device).unsqueeze::<2>();
        let base = layer.forward_without_lora(x.clone());
        let base_ref = x.clone().matmul(wr.transpose()) + b_row.clone();
        let e = rel_err(base.inner(), base_ref.inner());
        assert!(e <= tol, "{what}: LoRA disabled, relative error {e:.2e}");
        let merged = x.clone().matmul(layer.merged_weight().transpose()) + b_row;
        let e = rel_err(merged.inner(), layer.forward(x).inner());
        assert!(e <= tol, "{what}: merged weight, relative error {e:.2e}");
    }
}

/// Noisy RMSNorm: forward and the gradients of x and w against ordinary ops.
fn norm_grads<B>(device: &B::Device, tol: f64)
where
    B: AutodiffBackend + QerlBackend,
    B::InnerBackend: QerlBackend,
{
    let s = seed();
    let (rows, d, eps) = (5, 208, 1e-6);
    let w: Vec<f32> = normal(s, d, 0.2).iter().map(|v| 1.0 + v).collect();
    let z = normal(s + 1, d, 0.05);
    let x_data = normal(s + 2, rows * d, 1.0);
    let probe = tensor::<B, 2>(normal(s + 3, rows * d, 1.0), [rows, d], device);
    for with_noise in [false, true] {
        let mut norm = NoisyRmsNorm::new(tensor::<B, 1>(w.clone(), [d], device), eps, true);
        norm.set_noise(with_noise.then(|| tensor::<B, 1>(z.clone(), [d], device)));
        let x = tensor::<B, 2>(x_data.clone(), [rows, d], device).require_grad();
        let y = norm.forward(x.clone());
        let g = (y.clone() * probe.clone()).sum().backward();

        let xr = tensor::<B, 2>(x_data.clone(), [rows, d], device).require_grad();
        let wr = tensor::<B, 1>(w.clone(), [d], device).require_grad();
        let gain = if with_noise {
            wr.clone() + tensor::<B, 1>(z.clone(), [d], device)
        } else {
            wr.clone()
        };
        let rstd = (xr.clone().powf_scalar(2.0).mean_dim(1) + eps)
            .sqrt()
            .recip();
        let yr = xr.clone() * rstd * gain.unsqueeze();
        let gr = (yr.clone() * probe.clone()).sum().backward();
        let what = format!("noise={with_noise} seed {s}");
        for (name, e) in [
            ("y", rel_err(y.inner(), yr.inner())),
            ("dx", rel_err(x.grad(&g).unwrap(), xr.grad(&gr).unwrap())),
            (
                "dw",
                rel_err(norm.weight.grad(&g).unwrap(), wr.grad(&gr).unwrap()),
            ),
        ] {
            assert!(
                e <= tol,
                "{what}: {name} relative error {e:.2e} > {tol:.0e}"
            );
        }
    }
    // A frozen norm's weight gets no gradient.
    let norm = NoisyRmsNorm::new(tensor::<B, 1>(w, [d], device), eps, false);
    let x = tensor::<B, 2>(x_data, [rows, d], device).require_grad();
    let g = norm.forward(x.clone()).sum().backward();
    assert!(norm.weight.grad(&g).is_none());
    assert!(x.grad(&g).is_some());
}

#[test]
fn cpu_linear_gradients_match_dense_reference() {
    linear_grads::<Autodiff<qerl_nn::backends::Cpu>>(&Default::default(), 1e-5);
}

/// The CPU path works through the weight in tiles of 64 rows and through x in blocks of rows
/// per core: 150 outputs (a partial last tile) and 2 x 7 rows.
#[test]
fn cpu_linear_gradients_match_dense_reference_across_tiles() {
    linear_grads_shaped::<Autodiff<qerl_nn::backends::Cpu>>(&Default::default(), 1e-5, 7, 150);
}

#[test]
fn cpu_norm_gradients_match_reference() {
    norm_grads::<Autodiff<qerl_nn::backends::Cpu>>(&Default::default(), 1e-5);
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_linear_gradients_match_dense_reference() {
    linear_grads::<Autodiff<qerl_nn::backends::Wgpu>>(
        &qerl_nn::backends::wgpu_device_or_exit(),
        1e-4,
    );
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_norm_gradients_match_reference() {
    norm_grads::<Autodiff<qerl_nn::backends::Wgpu>>(
        &qerl_nn::backends::wgpu_device_or_exit(),
        1e-4,
    );
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features qerl-train/cuda -- --ignored cuda"]
fn cuda_linear_gradients_match_dense_reference() {
    // bf16 activations on both sides: a few units of bf16 rounding (2^-8).
    linear_grads::<Autodiff<qerl_nn::backends::Cuda>>(&Default::default(), 2e-2);
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features qerl-train/cuda -- --ignored cuda"]
fn cuda_norm_gradients_match_reference() {
    norm_grads::<Autodiff<qerl_nn::backends::Cuda>>(&Default::default(), 2e-2);
}

/// [`qerl_nn::rope_heads`]: forward and the gradient of `x` against the rotation written with
/// burn's ops (reshape, move the heads, rotate half) and its autodiff on the same backend.
fn rope_grads<B>(device: &B::Device, tol: f64)
where
    B: AutodiffBackend + QerlBackend,
{
    use burn::tensor::Tensor;
    let s = seed();
    for (b, t, heads, d) in [(2, 5, 3, 16), (1, 3, 2, 6)] {
        let n = b * t * heads * d;
        let xv = normal(s, n, 1.0);
        let cos = tensor::<B, 4>(normal(s + 1, b * t * d, 1.0), [b, 1, t, d], device);
        let sin = tensor::<B, 4>(normal(s + 2, b * t * d, 1.0), [b, 1, t, d], device);
        let probe = tensor::<B, 4>(normal(s + 3, n, 1.0), [b, heads, t, d], device);
        let x = tensor::<B, 3>(xv.clone(), [b, t, heads * d], device).require_grad();
        let y = qerl_nn::rope_heads(x.clone(), &cos, &sin, heads);
        let grads = (y.clone() * probe.clone()).sum().backward();
        let xr = tensor::<B, 3>(xv, [b, t, heads * d], device).require_grad();
        let x4 = xr.clone().reshape([b, t, heads, d]).swap_dims(1, 2);
        let x1 = x4.clone().slice([0..b, 0..heads, 0..t, 0..d / 2]);
        let x2 = x4.clone().slice([0..b, 0..heads, 0..t, d / 2..d]);
        let yr = x4 * cos.clone() + Tensor::cat(vec![x2.neg(), x1], 3) * sin.clone();
        let rgrads = (yr.clone() * probe).sum().backward();
        for (name, e) in [
            ("y", rel_err(y.inner(), yr.inner())),
            (
                "dx",
                rel_err(x.grad(&grads).unwrap(), xr.grad(&rgrads).unwrap()),
            ),
        ] {
            assert!(
                e <= tol,
                "rope [{b}, {t}, {heads}x{d}] {name}: relative error {e:.2e} > {tol:.0e}, seed {s}"
            );
        }
    }
}

#[test]
fn cpu_rope_gradients_match_burn() {
    rope_grads::<Autodiff<qerl_nn::backends::Cpu>>(&Default::default(), 1e-5);
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_rope_gradients_match_burn() {
    rope_grads::<Autodiff<qerl_nn::backends::Wgpu>>(
        &qerl_nn::backends::wgpu_device_or_exit(),
        1e-4,
    );
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features qerl-train/cuda -- --ignored cuda"]
fn cuda_rope_gradients_match_burn() {
    rope_grads::<Autodiff<qerl_nn::backends::Cuda>>(&Default::default(), 2e-2);
}

/// [`qerl_nn::silu_mul`]: forward and the gradients of both inputs against burn's
/// `silu(g) * u` and its autodiff on the same backend, on a 3-D input (leading dims flattened)
/// whose gate reaches σ's tails.
fn silu_mul_grads<B>(device: &B::Device, tol: f64)
where
    B: AutodiffBackend + QerlBackend,
{
    use burn::tensor::activation::silu;
    let s = seed();
    let dims = [2, 3, 40];
    let n = dims.iter().product();
    let (gv, uv) = (normal(s, n, 4.0), normal(s + 1, n, 1.0));
    let probe = tensor::<B, 3>(normal(s + 2, n, 1.0), dims, device);
    let g = tensor::<B, 3>(gv.clone(), dims, device).require_grad();
    let u = tensor::<B, 3>(uv.clone(), dims, device).require_grad();
    let h = qerl_nn::silu_mul(g.clone(), u.clone());
    let grads = (h.clone() * probe.clone()).sum().backward();
    let gr = tensor::<B, 3>(gv, dims, device).require_grad();
    let ur = tensor::<B, 3>(uv, dims, device).require_grad();
    let hr = silu(gr.clone()) * ur.clone();
    let rgrads = (hr.clone() * probe).sum().backward();
    for (name, e) in [
        ("h", rel_err(h.inner(), hr.inner())),
        (
            "dg",
            rel_err(g.grad(&grads).unwrap(), gr.grad(&rgrads).unwrap()),
        ),
        (
            "du",
            rel_err(u.grad(&grads).unwrap(), ur.grad(&rgrads).unwrap()),
        ),
    ] {
        assert!(
            e <= tol,
            "silu_mul {name}: relative error {e:.2e} > {tol:.0e}, seed {s}"
        );
    }
}

#[test]
fn cpu_silu_mul_gradients_match_burn() {
    silu_mul_grads::<Autodiff<qerl_nn::backends::Cpu>>(&Default::default(), 1e-5);
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_silu_mul_gradients_match_burn() {
    silu_mul_grads::<Autodiff<qerl_nn::backends::Wgpu>>(
        &qerl_nn::backends::wgpu_device_or_exit(),
        1e-4,
    );
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features qerl-train/cuda -- --ignored cuda"]
fn cuda_silu_mul_gradients_match_burn() {
    // one rounding to bf16 here, several in burn's chain
    silu_mul_grads::<Autodiff<qerl_nn::backends::Cuda>>(&Default::default(), 2e-2);
}

/// [`QerlBackend::dense_matmul`] under autodiff, every transpose combination with a scale: the
/// product and both gradients against burn's matmul and its autodiff on the CPU in f32 (a
/// reference that compiles nothing on the GPU).
fn dense_matmul_grads<B>(device: &B::Device, tol: f64)
where
    B: AutodiffBackend + QerlBackend,
{
    use burn::tensor::{Tensor, TensorPrimitive};
    type C = Autodiff<qerl_nn::backends::Cpu>;
    let cpu = Default::default();
    let (m, n, k, alpha) = (5, 7, 12, 0.5f32);
    let s = seed();
    for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
        let a_dims = if a_t { [k, m] } else { [m, k] };
        let b_dims = if b_t { [n, k] } else { [k, n] };
        let (av, bv, gv) = (
            normal(s, m * k, 1.0),
            normal(s + 1, k * n, 1.0),
            normal(s + 2, m * n, 1.0),
        );
        let a = tensor::<B, 2>(av.clone(), a_dims, device).require_grad();
        let b = tensor::<B, 2>(bv.clone(), b_dims, device).require_grad();
        let g = tensor::<B, 2>(gv.clone(), [m, n], device);
        let c = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::dense_matmul(
            a.clone().into_primitive().tensor(),
            a_t,
            b.clone().into_primitive().tensor(),
            b_t,
            alpha,
        )));
        let grads = (c.clone() * g).sum().backward();
        let ra = tensor::<C, 2>(av, a_dims, &cpu).require_grad();
        let rb = tensor::<C, 2>(bv, b_dims, &cpu).require_grad();
        let rg = tensor::<C, 2>(gv, [m, n], &cpu);
        let op = |t: Tensor<C, 2>, tr: bool| if tr { t.transpose() } else { t };
        let rc = op(ra.clone(), a_t)
            .matmul(op(rb.clone(), b_t))
            .mul_scalar(alpha);
        let rgrads = (rc.clone() * rg).sum().backward();
        let what = format!("dense_matmul a_t={a_t} b_t={b_t}, seed {s}");
        let host = |t: Vec<f32>, d: [usize; 2]| tensor::<C, 2>(t, d, &cpu);
        let inner = |t: Vec<f32>, d: [usize; 2]| tensor::<qerl_nn::backends::Cpu, 2>(t, d, &cpu);
        let back = |t: burn::tensor::TensorData| t.convert::<f32>().to_vec::<f32>().unwrap();
        assert!(
            rel_err(host(back(c.into_data()), [m, n]), rc) < tol,
            "{what}: C"
        );
        let ga = back(a.grad(&grads).unwrap().into_data());
        assert!(
            rel_err(inner(ga, a_dims), ra.grad(&rgrads).unwrap()) < tol,
            "{what}: dA"
        );
        let gb = back(b.grad(&grads).unwrap().into_data());
        assert!(
            rel_err(inner(gb, b_dims), rb.grad(&rgrads).unwrap()) < tol,
            "{what}: dB"
        );
    }
}

#[test]
fn cpu_dense_matmul_gradients_match_burn() {
    dense_matmul_grads::<Autodiff<qerl_nn::backends::Cpu>>(&Default::default(), 1e-5);
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_dense_matmul_gradients_match_burn() {
    dense_matmul_grads::<Autodiff<qerl_nn::backends::Wgpu>>(
        &qerl_nn::backends::wgpu_device_or_exit(),
        1e-4,
    );
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features qerl-train/cuda -- --ignored cuda"]
fn cuda_dense_matmul_gradients_match_burn() {
    // cuBLAS against burn's matmul, both bf16 in and out.
    dense_matmul_grads::<Autodiff<qerl_nn::backends::Cuda>>(&Default::default(), 2e-2);
}

#[test]
fn unknown_precision_and_bad_shapes_are_named() {
    let e = "int3".parse::<Precision>().unwrap_err().to_string();
    assert!(e.contains("int3"), "{e}");
    let device = Default::default();
    let e = Nvfp4Linear::<qerl_nn::backends::Cpu>::from_dense(
        "model.layers.0.mlp.down_proj",
        &[0.5; 24 * 4],
        SourceDtype::F32,
        4,
        24,
        None,
        Precision::Nvfp4,
        None,
        &device,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("model.layers.0.mlp.down_proj") && e.contains("[4, 24]"),
        "{e}"
    );
}
