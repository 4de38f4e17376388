//! The CPU reference path: [`QerlBackend`] for burn's NdArray backend.
//!
//! Weights that fit a process-wide budget ([`DENSE_CACHE_BYTES`]) keep their dense rows after
//! first use and multiply through `matrixmultiply`'s blocked SGEMM in one call per block of
//! input rows (blocks split over the machine's cores). Larger ones are never held dense: they are
//! dequantized a tile of [`TILE_ROWS`] rows at a time, each tile through the same SGEMM. Slow next to a GPU, but it makes every module and the whole model run
//! on a plain CPU (the default demo trains on it), and it is the reference the GPU path is
//! checked against.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use burn::backend::ndarray::NdArrayTensor;
use burn::backend::NdArray;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use qerl_format::QuantizedWeight;

use crate::backend::{LoraPrims, QerlBackend, QuantWeight};
use crate::NnError;

type Cpu = NdArray<f32>;

/// A weight kept in its host (packed) form, and, while the process's budget of
/// [`DENSE_CACHE_BYTES`] lasts, its dense f32 rows after first use: small models (the embedded
/// one: 12 MB dense) then stop paying the dequantization in every forward and backward, large
/// ones keep only the packed form.
#[derive(Clone, Debug)]
pub struct HostWeight {
    pub packed: Arc<QuantizedWeight>,
    dense: Arc<OnceLock<Option<Vec<f32>>>>,
}

impl HostWeight {
    pub fn new(packed: QuantizedWeight) -> Self {
        HostWeight {
            packed: Arc::new(packed),
            dense: Arc::new(OnceLock::new()),
        }
    }

    /// Never caches its dense rows (the path of weights beyond the budget).
    #[cfg(test)]
    fn packed_only(packed: QuantizedWeight) -> Self {
        HostWeight {
            packed: Arc::new(packed),
            dense: Arc::new(OnceLock::from(None)),
        }
    }

    /// The dense `[n, k]` rows if this weight fits the cache budget (dequantized on first call).
    fn dense(&self) -> Option<&[f32]> {
        self.dense
            .get_or_init(|| {
                let [n, k] = self.dims();
                let bytes = n * k * 4;
                let taken = DENSE_CACHED.fetch_add(bytes, Ordering::Relaxed);
                if taken + bytes <= DENSE_CACHE_BYTES {
                    Some(self.packed.dequantize())
                } else {
                    DENSE_CACHED.fetch_sub(bytes, Ordering::Relaxed);
                    None
                }
            })
            .as_deref()
    }
}

/// Dense copies of quantized weights the CPU path keeps, in all (process-wide).
pub const DENSE_CACHE_BYTES: usize = 256 << 20;
static DENSE_CACHED: AtomicUsize = AtomicUsize::new(0);

impl QuantWeight for HostWeight {
    fn dims(&self) -> [usize; 2] {
        self.packed.shape()
    }
}

/// Values and shape of a float primitive.
///
/// Copies straight out of the array's memory: burn's `into_data` walks a shared array (one the
/// autodiff graph also holds, the usual case here) element by element through a dynamic-rank
/// iterator, which took 40% of a CPU training step.
fn host(t: FloatTensor<Cpu>) -> (Vec<f32>, Vec<usize>) {
    if let NdArrayTensor::F32(storage) = &t {
        let view = storage.view();
        let shape = view.shape().to_vec();
        if let Some(values) = view.as_slice() {
            return (values.to_vec(), shape);
        }
        if let Ok(matrix) = view.into_dimensionality::<ndarray::Ix2>() {
            return (matrix.iter().copied().collect(), shape);
        }
    }
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

/// Runs `f(first_row, block)` over `out` ([rows, cols]) cut into blocks of whole rows, one per
/// core; a product too small to pay for threads ([`MIN_ROWS_PER_THREAD`]) runs on this one.
fn par_row_blocks(out: &mut [f32], rows: usize, cols: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let block = rows.div_ceil(threads).max(MIN_ROWS_PER_THREAD);
    if block >= rows {
        f(0, out);
        return;
    }
    par_chunks(out, block * cols, |b, chunk| f(b * block, chunk));
}

/// `out [m, cols] = a [m, inner] · b`, `b` holding `[inner, cols]` read with the given (row,
/// column) strides (row-major, or the transpose of a row-major `[cols, inner]`), in blocks of
/// rows over the cores.
fn row_blocks_times(
    out: &mut [f32],
    a: &[f32],
    inner: usize,
    b: &[f32],
    b_strides: (usize, usize),
) {
    if a.is_empty() || out.is_empty() {
        return;
    }
    let m = a.len() / inner;
    let cols = out.len() / m;
    assert_eq!(
        (m * inner, m * cols),
        (a.len(), out.len()),
        "row_blocks_times: shapes"
    );
    assert_eq!(
        b.len(),
        inner * cols,
        "row_blocks_times: b is not [inner, cols]"
    );
    assert!(
        b_strides == (cols, 1) || b_strides == (1, inner),
        "row_blocks_times: b's strides"
    );
    par_row_blocks(out, m, cols, |first, block| {
        let rows = block.len() / cols;
        // SAFETY: a's rows first.. are [rows, inner]; b holds inner·cols values laid out as
        // its strides say (asserted above); block is [rows, cols].
        unsafe {
            sgemm(
                rows,
                inner,
                cols,
                1.0,
                &a[first * inner..],
                (inner, 1),
                b,
                b_strides,
                0.0,
                block,
                (cols, 1),
            )
        };
    });
}

/// Fewest rows of a product worth a thread of their own (decoding's few rows run on one).
const MIN_ROWS_PER_THREAD: usize = 64;

impl QerlBackend for Cpu {
    type QWeight = HostWeight;

    fn qweight_upload(
        _name: &str,
        weight: &QuantizedWeight,
        _device: &Self::Device,
    ) -> Result<HostWeight, NnError> {
        Ok(HostWeight::new(weight.clone()))
    }

    fn qweight_dequantize(weight: &HostWeight, _device: &Self::Device) -> FloatTensor<Self> {
        device_tensor(weight.packed.dequantize(), weight.dims().to_vec())
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
        let mut y = vec![0.0f32; m * n];
        if let Some(w) = weight.dense() {
            // Dense rows at hand: y = x·Wᵀ, W [n, k] read as Wᵀ [k, n].
            row_blocks_times(&mut y, &x, k, w, (1, k));
        } else {
            // Computed transposed, [n, m]: each task owns a tile of weight rows, which it
            // dequantizes once: yᵀ_tile = W_tile·xᵀ.
            let mut yt = vec![0.0f32; n * m];
            par_chunks(&mut yt, TILE_ROWS * m, |tile, out| {
                let rows = out.len() / m;
                let w = dequantize_rows(weight, tile * TILE_ROWS, rows);
                // SAFETY: w is [rows, k], x is [m, k] read as xᵀ [k, m], out is [rows, m].
                unsafe { sgemm(rows, k, m, 1.0, &w, (k, 1), &x, (1, k), 0.0, out, (m, 1)) };
            });
            for (j, col) in yt.chunks(m).enumerate() {
                for (i, v) in col.iter().enumerate() {
                    y[i * n + j] = *v;
                }
            }
        }
        if let Some(b) = bias {
            let b = host(b).0;
            y.chunks_mut(n)
                .for_each(|row| row.iter_mut().zip(&b).for_each(|(v, b)| *v += b));
        }
        // LoRA: T = x·Aᵀ [m, r], then y += s·T·Bᵀ.
        if let Some(l) = lora {
            let (a, a_shape) = host(l.a);
            let (b, _) = host(l.b);
            let r = a_shape[0];
            let mut t = vec![0.0f32; m * r];
            // SAFETY: x [m, k], A [r, k] read as Aᵀ [k, r], t [m, r]; then B [n, r] read as
            // Bᵀ [r, n] and y [m, n].
            unsafe {
                sgemm(m, k, r, 1.0, &x, (k, 1), &a, (1, k), 0.0, &mut t, (r, 1));
                sgemm(
                    m,
                    r,
                    n,
                    l.scale,
                    &t,
                    (r, 1),
                    &b,
                    (1, r),
                    1.0,
                    &mut y,
                    (n, 1),
                );
            }
        }
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
        if let Some(w) = weight.dense() {
            // dx = dy·W, W [n, k].
            row_blocks_times(&mut dx, &dy, n, w, (k, 1));
            return device_tensor(dx, vec![m, k]);
        }
        // Each task owns a block of dx rows and streams over the weight in tiles:
        // dx_block += dy_block[:, tile]·W_tile.
        let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
        let block = m.div_ceil(threads).max(1);
        par_chunks(&mut dx, block * k, |b, out| {
            let (first, rows) = (b * block, out.len() / k);
            for t in (0..n).step_by(TILE_ROWS) {
                let tile = TILE_ROWS.min(n - t);
                let w = dequantize_rows(weight, t, tile);
                // SAFETY: dy rows first.. of [m, n] from column t: [rows, tile] with row
                // stride n; w [tile, k]; out [rows, k].
                unsafe {
                    sgemm(
                        rows,
                        tile,
                        k,
                        1.0,
                        &dy[first * n + t..],
                        (n, 1),
                        &w,
                        (k, 1),
                        1.0,
                        out,
                        (k, 1),
                    )
                };
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

/// Weight rows dequantized together: a tile of `TILE_ROWS x k` f32.
const TILE_ROWS: usize = 64;

/// Rows `first..first + rows` of the weight, dense, [rows, k]: borrowed from the dense cache,
/// else dequantized.
fn dequantize_rows(weight: &HostWeight, first: usize, rows: usize) -> Cow<'_, [f32]> {
    let k = weight.dims()[1];
    if let Some(dense) = weight.dense() {
        return Cow::Borrowed(&dense[first * k..(first + rows) * k]);
    }
    let mut w = vec![0.0f32; rows * k];
    for (r, row) in w.chunks_mut(k).enumerate() {
        weight.packed.dequantize_row(first + r, row);
    }
    Cow::Owned(w)
}

/// `C = alpha·A·B + beta·C` for A [m, k], B [k, n], C [m, n] given as (row, column) strides
/// into the slices (matrixmultiply's blocked SGEMM).
///
/// # Safety
/// Every element the strides address must lie inside its slice.
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    c: &mut [f32],
    (rsc, csc): (usize, usize),
) {
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| {
        (rows.max(1) - 1) * rs + (cols.max(1) - 1) * cs
    };
    debug_assert!(m == 0 || k == 0 || last(m, k, rsa, csa) < a.len());
    debug_assert!(k == 0 || n == 0 || last(k, n, rsb, csb) < b.len());
    debug_assert!(m == 0 || n == 0 || last(m, n, rsc, csc) < c.len());
    matrixmultiply::sgemm(
        m,
        k,
        n,
        alpha,
        a.as_ptr(),
        rsa as isize,
        csa as isize,
        b.as_ptr(),
        rsb as isize,
        csb as isize,
        beta,
        c.as_mut_ptr(),
        rsc as isize,
        csc as isize,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use qerl_format::{QuantFormat, SourceDtype};
    use rand::{Rng, SeedableRng};

    fn random(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// The cached-dense and the packed-only paths against a plain triple loop on the
    /// dequantized weight: 150 outputs (tiles of 64, a partial last one), 14 rows, LoRA and bias.
    #[test]
    fn cached_and_packed_paths_match_the_dense_reference() {
        let seed = rand::rng().random::<u64>();
        let (m, n, k, r) = (14, 150, 96, 4);
        let w = random(seed, n * k);
        let q = QuantizedWeight::quantize(QuantFormat::Nvfp4, "w", &w, &[n, k], SourceDtype::F32)
            .unwrap();
        let deq = q.dequantize();
        let (x, dy) = (random(seed + 1, m * k), random(seed + 2, m * n));
        let (bias, a, b) = (
            random(seed + 3, n),
            random(seed + 4, r * k),
            random(seed + 5, n * r),
        );
        let scale = 0.5;
        let dot = |u: &[f32], v: &[f32]| u.iter().zip(v).map(|(p, q)| p * q).sum::<f32>();
        let mut y_ref = vec![0.0f32; m * n];
        for i in 0..m {
            let xi = &x[i * k..(i + 1) * k];
            let t: Vec<f32> = (0..r).map(|j| dot(xi, &a[j * k..(j + 1) * k])).collect();
            for o in 0..n {
                y_ref[i * n + o] = dot(xi, &deq[o * k..(o + 1) * k])
                    + bias[o]
                    + scale * dot(&t, &b[o * r..(o + 1) * r]);
            }
        }
        let mut dx_ref = vec![0.0f32; m * k];
        for i in 0..m {
            for c in 0..k {
                dx_ref[i * k + c] = (0..n).map(|o| dy[i * n + o] * deq[o * k + c]).sum();
            }
        }
        let close = |got: &[f32], want: &[f32], what: &str| {
            let worst = got
                .iter()
                .zip(want)
                .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-4, "{what}: relative error {worst} (seed {seed})");
        };
        for (name, weight) in [
            ("cached", HostWeight::new(q.clone())),
            ("packed", HostWeight::packed_only(q.clone())),
        ] {
            let y = host(Cpu::qlinear(
                device_tensor(x.clone(), vec![m, k]),
                &weight,
                Some(device_tensor(bias.clone(), vec![n])),
                Some(LoraPrims {
                    a: device_tensor(a.clone(), vec![r, k]),
                    b: device_tensor(b.clone(), vec![n, r]),
                    scale,
                }),
            ))
            .0;
            close(&y, &y_ref, &format!("{name} y"));
            let dx = host(Cpu::qlinear_dx(
                device_tensor(dy.clone(), vec![m, n]),
                &weight,
            ))
            .0;
            close(&dx, &dx_ref, &format!("{name} dx"));
        }
    }

    /// `host` reads contiguous, shared and strided (transposed) arrays as row-major values.
    #[test]
    fn host_reads_shared_and_transposed_arrays_in_row_major_order() {
        let (rows, cols) = (5, 7);
        let values = random(11, rows * cols);
        let t = Tensor::<Cpu, 2>::from_data(
            TensorData::new(values.clone(), [rows, cols]),
            &Default::default(),
        );
        let keep = t.clone(); // shared: the array has two owners
        assert_eq!(
            host(t.into_primitive().tensor()),
            (values.clone(), vec![rows, cols])
        );
        let transposed: Vec<f32> = (0..cols)
            .flat_map(|c| (0..rows).map(move |r| (r, c)))
            .map(|(r, c)| values[r * cols + c])
            .collect();
        let tt = keep.clone().transpose().into_primitive().tensor();
        assert_eq!(host(tt), (transposed, vec![cols, rows]));
        // a rank-3 strided view falls back to burn's own copy
        let t3 = keep
            .reshape([1, rows, cols])
            .swap_dims(1, 2)
            .into_primitive()
            .tensor();
        let (v3, s3) = host(t3);
        assert_eq!(s3, vec![1, cols, rows]);
        assert_eq!(v3[1], values[cols]);
    }
}
