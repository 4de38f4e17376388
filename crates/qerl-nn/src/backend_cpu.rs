//! The CPU reference path: [`QerlBackend`] for burn's NdArray backend.
//!
//! Host loops over the packed weight, one dequantized row at a time (never the whole dense
//! matrix), split over the machine's cores. Slow next to a GPU, but it makes every module and the
//! whole model run on a plain CPU, and it is the reference the GPU path is checked against.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use qerl_format::QuantizedWeight;

use crate::backend::{LoraPrims, QerlBackend, QuantWeight};
use crate::NnError;

type Cpu = NdArray<f32>;

/// A weight kept in its host (packed) form.
#[derive(Clone, Debug)]
pub struct HostWeight(pub Arc<QuantizedWeight>);

impl QuantWeight for HostWeight {
    fn dims(&self) -> [usize; 2] {
        self.0.shape()
    }
}

/// Values and shape of a float primitive.
fn host(t: FloatTensor<Cpu>) -> (Vec<f32>, Vec<usize>) {
    let t = Tensor::<Cpu, 1>::from_primitive(TensorPrimitive::Float(t));
    let data = t.into_data();
    let shape = data.shape.to_vec();
    (data.to_vec::<f32>().expect("f32 tensor"), shape)
}

fn device_tensor(values: Vec<f32>, shape: Vec<usize>) -> FloatTensor<Cpu> {
    <Cpu as FloatTensorOps<Cpu>>::float_from_data(
        TensorData::new(values, shape),
        &Default::default(),
    )
}

/// Runs `f(first, chunk)` over `out` cut into chunks of `chunk_len`, on all cores.
fn par_chunks(out: &mut [f32], chunk_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunks = out.len().div_ceil(chunk_len.max(1));
    let per_thread = chunks.div_ceil(threads).max(1) * chunk_len;
    std::thread::scope(|s| {
        for (i, part) in out.chunks_mut(per_thread).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (j, c) in part.chunks_mut(chunk_len).enumerate() {
                    f(i * per_thread / chunk_len + j, c);
                }
            });
        }
    });
}

impl QerlBackend for Cpu {
    type QWeight = HostWeight;

    fn qweight_upload(
        _name: &str,
        weight: &QuantizedWeight,
        _device: &Self::Device,
    ) -> Result<HostWeight, NnError> {
        Ok(HostWeight(Arc::new(weight.clone())))
    }

    fn qweight_dequantize(weight: &HostWeight, _device: &Self::Device) -> FloatTensor<Self> {
        device_tensor(weight.0.dequantize(), weight.dims().to_vec())
    }

    fn qlinear(
        x: FloatTensor<Self>,
        weight: &HostWeight,
        bias: Option<FloatTensor<Self>>,
        lora: Option<LoraPrims<Self>>,
    ) -> FloatTensor<Self> {
        let [n, k] = weight.dims();
        let (x, shape) = host(x);
        let m = shape[0];
        assert_eq!(shape[1], k, "qlinear: x is {shape:?}, weight is [{n}, {k}]");
        let bias = bias.map(|b| host(b).0);
        // LoRA: T = x·Aᵀ [m, r] once, then s·T·Bᵀ per output column.
        let lora = lora.map(|l| {
            let (a, a_shape) = host(l.a);
            let (b, _) = host(l.b);
            let r = a_shape[0];
            let t: Vec<f32> = (0..m * r)
                .map(|i| {
                    let (row, j) = (i / r, i % r);
                    dot(&x[row * k..(row + 1) * k], &a[j * k..(j + 1) * k])
                })
                .collect();
            (t, b, r, l.scale)
        });
        // Computed transposed, [n, m]: each task owns whole weight rows.
        let mut yt = vec![0.0f32; n * m];
        par_chunks(&mut yt, m, |col, out| {
            let mut row = vec![0.0f32; k];
            weight.0.dequantize_row(col, &mut row);
            for (i, o) in out.iter_mut().enumerate() {
                let mut v = dot(&x[i * k..(i + 1) * k], &row);
                if let Some(b) = &bias {
                    v += b[col];
                }
                if let Some((t, lb, r, s)) = &lora {
                    v += s * dot(&t[i * r..(i + 1) * r], &lb[col * r..(col + 1) * r]);
                }
                *o = v;
            }
        });
        let y: Vec<f32> = (0..m * n).map(|i| yt[(i % n) * m + i / n]).collect();
        device_tensor(y, vec![m, n])
    }

    fn qlinear_dx(dy: FloatTensor<Self>, weight: &HostWeight) -> FloatTensor<Self> {
        let [n, k] = weight.dims();
        let (dy, shape) = host(dy);
        let m = shape[0];
        assert_eq!(
            shape[1], n,
            "qlinear_dx: dy is {shape:?}, weight is [{n}, {k}]"
        );
        let mut dx = vec![0.0f32; m * k];
        // Each task owns rows of dx and streams over the weight rows.
        par_chunks(&mut dx, k, |i, out| {
            let mut row = vec![0.0f32; k];
            for col in 0..n {
                let g = dy[i * n + col];
                if g != 0.0 {
                    weight.0.dequantize_row(col, &mut row);
                    out.iter_mut().zip(&row).for_each(|(o, w)| *o += g * w);
                }
            }
        });
        device_tensor(dx, vec![m, k])
    }

    fn noisy_rms_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        z: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (x, shape) = host(x);
        let (rows, dim) = (shape[0], shape[1]);
        let gain = gain(host(w).0, z.map(|z| host(z).0));
        let mut y = vec![0.0f32; rows * dim];
        let mut rstd = vec![0.0f32; rows];
        for r in 0..rows {
            let row = &x[r * dim..(r + 1) * dim];
            let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            let inv = 1.0 / (ms + eps as f32).sqrt();
            rstd[r] = inv;
            for c in 0..dim {
                y[r * dim + c] = row[c] * inv * gain[c];
            }
        }
        (device_tensor(y, shape), device_tensor(rstd, vec![rows]))
    }

    fn noisy_rms_norm_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        z: Option<FloatTensor<Self>>,
        rstd: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dy, shape) = host(dy);
        let (x, _) = host(x);
        let (rstd, _) = host(rstd);
        let (rows, dim) = (shape[0], shape[1]);
        let gain = gain(host(w).0, z.map(|z| host(z).0));
        let mut dx = vec![0.0f32; rows * dim];
        let mut dw = vec![0.0f32; dim];
        for (r, &inv) in rstd.iter().enumerate().take(rows) {
            let base = r * dim;
            let mean_gx = (0..dim)
                .map(|c| dy[base + c] * gain[c] * x[base + c] * inv)
                .sum::<f32>()
                / dim as f32;
            for c in 0..dim {
                let xhat = x[base + c] * inv;
                dx[base + c] = inv * (dy[base + c] * gain[c] - xhat * mean_gx);
                dw[c] += dy[base + c] * xhat;
            }
        }
        (device_tensor(dx, shape), device_tensor(dw, vec![dim]))
    }
}

fn gain(w: Vec<f32>, z: Option<Vec<f32>>) -> Vec<f32> {
    match z {
        Some(z) => w.iter().zip(&z).map(|(a, b)| a + b).collect(),
        None => w,
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
