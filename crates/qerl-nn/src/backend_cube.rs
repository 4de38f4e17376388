//! [`QerlBackend`] for CubeCL backends (wgpu, CUDA): the `qerl-kernels` kernels on burn tensors.

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::Float;
use cubecl::zspace::metadata::Metadata;
use qerl_format::QuantizedWeight;
use qerl_kernels::attention::{self as fused, AttentionShape};
use qerl_kernels::blas::{self, DenseProduct};
use qerl_kernels::rope::{self, RopeShape};
use qerl_kernels::{dequant, gemm, rms_norm, silu_mul, upload, DeviceWeight};

use crate::backend::{burn_dense_matmul, burn_lora_backward, LoraPrims, QerlBackend, QuantWeight};
use crate::NnError;

impl QuantWeight for DeviceWeight {
    fn dims(&self) -> [usize; 2] {
        [self.n, self.k]
    }
}

/// Runs `$body` with `$F` bound to the element type of `$dtype` (f32, f16 or bf16).
macro_rules! with_float {
    ($dtype:expr, $F:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $F = f32;
                $body
            }
            DType::F16 => {
                type $F = half::f16;
                $body
            }
            DType::BF16 => {
                type $F = half::bf16;
                $body
            }
            other => panic!("qerl kernels run on f32, f16 or bf16 tensors, not {other:?}"),
        }
    };
}

/// A contiguous 2-D tensor and its dims.
fn matrix<R: CubeRuntime>(t: CubeTensor<R>, what: &str) -> (CubeTensor<R>, usize, usize) {
    let t = into_contiguous(t);
    let shape = t.shape();
    assert_eq!(
        shape.num_dims(),
        2,
        "{what}: expected a matrix, got {shape:?}"
    );
    let [a, b] = shape.dims::<2>();
    (t, a, b)
}

fn vector<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    into_contiguous(t)
}

/// A new uninitialised contiguous tensor like `like` (same client, device).
fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    let bytes = shape.num_elements() * dtype.size();
    let handle = like.client.empty(bytes);
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        handle,
        dtype,
    )
}

/// RoPE tables, contiguous and of the activations' type `dtype`.
fn rope_tables<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    dtype: DType,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let cast = |t: CubeTensor<R>| {
        let t = into_contiguous(t);
        if t.dtype == dtype {
            t
        } else {
            into_contiguous(CubeBackend::<R, F, I, BT>::float_cast(t, dtype.into()))
        }
    };
    (cast(cos), cast(sin))
}

/// The kernels' shape from `q [b, h, s, d]` and `k [b, kv, s, d]`.
fn attention_shape<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    scale: f32,
) -> AttentionShape {
    let [batch, heads, seq, head_dim] = q.shape().dims::<4>();
    let kv_heads = k.shape().dims::<4>()[1];
    assert_eq!(q.dtype, k.dtype, "attention: q and k types");
    AttentionShape {
        batch,
        heads,
        kv_heads,
        seq,
        head_dim,
        scale,
    }
}

/// Runs `products` on cuBLAS when it can take them here; `false` (nothing launched) where it
/// cannot, or where it failed (said once on stderr), so that the caller falls back to burn's
/// matmul.
fn on_blas<R: CubeRuntime, E: Float>(like: &CubeTensor<R>, products: &[DenseProduct<'_>]) -> bool {
    match blas::products::<R, E>(&like.client, products) {
        Ok(ran) => ran,
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("qerl: cuBLAS product failed ({e}); using burn's matmul"));
            false
        }
    }
}

impl<R, F, I, BT> QerlBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type QWeight = DeviceWeight;

    fn memory_usage(device: &Self::Device) -> Option<(u64, u64)> {
        let m = R::client(device).memory_usage().ok()?;
        Some((m.bytes_in_use, m.bytes_reserved))
    }

    fn float_upload(
        name: &str,
        data: TensorData,
        device: &Self::Device,
    ) -> Result<CubeTensor<R>, NnError> {
        if !matches!(
            data.dtype,
            DType::F32 | DType::F16 | DType::BF16 | DType::F64
        ) {
            return Ok(Self::float_from_data(data, device));
        }
        // As burn's `from_data` (cubecl's layout, pitched rows included), staged on CUDA.
        let client = R::client(device);
        let (shape, dtype) = (data.shape.clone(), data.dtype);
        let layout = upload::create_tensor(&client, name, data.bytes, shape.clone(), dtype.size())
            .map_err(|e| NnError::Kernel {
                name: name.to_string(),
                source: e.into(),
            })?;
        Ok(CubeTensor::new(
            client,
            layout.memory,
            Metadata::new(shape, layout.strides),
            device.clone(),
            dtype,
        ))
    }

    fn qweight_upload(
        name: &str,
        weight: &QuantizedWeight,
        device: &Self::Device,
    ) -> Result<DeviceWeight, NnError> {
        let client = R::client(device);
        DeviceWeight::upload(&client, weight).map_err(|source| NnError::Kernel {
            name: name.to_string(),
            source,
        })
    }

    fn qweight_dequantize(weight: &DeviceWeight, device: &Self::Device) -> CubeTensor<R> {
        let client = R::client(device);
        let dtype = F::dtype();
        let shape = Shape::new([weight.n, weight.k]);
        let handle = client.empty(shape.num_elements() * dtype.size());
        let out = CubeTensor::new_contiguous(client, device.clone(), shape, handle, dtype);
        with_float!(dtype, E => {
            dequant::dequantize::<R, E>(&out.client, weight, &out.handle)
                .expect("dequantize shapes");
        });
        out
    }

    fn qlinear(
        x: CubeTensor<R>,
        weight: &DeviceWeight,
        bias: Option<CubeTensor<R>>,
        lora: Option<LoraPrims<Self>>,
    ) -> CubeTensor<R> {
        let (x, m, k) = matrix(x, "qlinear x");
        assert_eq!(
            k, weight.k,
            "qlinear: x has {k} columns, weight is [{}, {}]",
            weight.n, weight.k
        );
        let dtype = x.dtype;
        let y = empty(&x, Shape::new([m, weight.n]), dtype);
        let bias = bias.map(vector);
        let lora = lora.map(|l| {
            let (a, r, _) = matrix(l.a, "LoRA A");
            let (b, _, _) = matrix(l.b, "LoRA B");
            let t = empty(&x, Shape::new([m, r]), DType::F32);
            (a, b, t, r, l.scale)
        });
        with_float!(dtype, E => {
            if let Some((a, _, t, r, _)) = &lora {
                gemm::lora_down::<R, E>(&x.client, &x.handle, &a.handle, &t.handle, m, k, *r)
                    .expect("LoRA shapes");
            }
            let epilogue = lora.as_ref().map(|(_, b, t, r, s)| gemm::LoraEpilogue {
                t: &t.handle,
                b: &b.handle,
                rank: *r,
                scale: *s,
            });
            gemm::matmul::<R, E>(
                &x.client,
                &x.handle,
                m,
                weight,
                bias.as_ref().map(|b| &b.handle),
                epilogue,
                &y.handle,
            )
            .expect("qlinear shapes");
        });
        y
    }

    fn dense_matmul(
        a: CubeTensor<R>,
        a_t: bool,
        b: CubeTensor<R>,
        b_t: bool,
        alpha: f32,
    ) -> CubeTensor<R> {
        let (a, ar, ac) = matrix(a, "dense_matmul a");
        let (b, br, bc) = matrix(b, "dense_matmul b");
        let (m, k) = if a_t { (ac, ar) } else { (ar, ac) };
        let (kb, n) = if b_t { (bc, br) } else { (br, bc) };
        assert_eq!(
            k, kb,
            "dense_matmul: op(a) is [{m}, {k}], op(b) is [{kb}, {n}]"
        );
        if a.dtype == b.dtype {
            let c = empty(&a, Shape::new([m, n]), a.dtype);
            let product = DenseProduct {
                a: &a.handle,
                a_t,
                b: &b.handle,
                b_t,
                c: &c.handle,
                m,
                n,
                k,
                alpha,
            };
            if with_float!(a.dtype, E => on_blas::<R, E>(&a, &[product])) {
                return c;
            }
        }
        burn_dense_matmul::<Self>(a, a_t, b, b_t, alpha)
    }

    fn lora_backward(
        g: CubeTensor<R>,
        x: CubeTensor<R>,
        lora: LoraPrims<Self>,
        want: [bool; 3],
    ) -> [Option<CubeTensor<R>>; 3] {
        let (g, m, n) = matrix(g, "LoRA backward dy");
        let (x, _, k) = matrix(x, "LoRA backward x");
        let (a, r, _) = matrix(lora.a, "LoRA A");
        let (b, _, _) = matrix(lora.b, "LoRA B");
        let s = lora.scale;
        let dtype = g.dtype;
        if [&x, &a, &b].iter().all(|t| t.dtype == dtype) {
            let [want_dx, want_da, want_db] = want;
            let new = |rows: usize, cols: usize| empty(&g, Shape::new([rows, cols]), dtype);
            let (gb, dx, da) = (new(m, r), new(m, k), new(r, k));
            let (t, db) = (new(m, r), new(n, r));
            let p = |a, a_t, b, b_t, c, (m, n, k), alpha| DenseProduct {
                a,
                a_t,
                b,
                b_t,
                c,
                m,
                n,
                k,
                alpha,
            };
            let mut products = Vec::new();
            if want_dx || want_da {
                products.push(p(
                    &g.handle,
                    false,
                    &b.handle,
                    false,
                    &gb.handle,
                    (m, r, n),
                    s,
                ));
            }
            if want_dx {
                products.push(p(
                    &gb.handle,
                    false,
                    &a.handle,
                    false,
                    &dx.handle,
                    (m, k, r),
                    1.0,
                ));
            }
            if want_da {
                products.push(p(
                    &gb.handle,
                    true,
                    &x.handle,
                    false,
                    &da.handle,
                    (r, k, m),
                    1.0,
                ));
            }
            if want_db {
                products.push(p(
                    &x.handle,
                    false,
                    &a.handle,
                    true,
                    &t.handle,
                    (m, r, k),
                    1.0,
                ));
                products.push(p(
                    &g.handle,
                    true,
                    &t.handle,
                    false,
                    &db.handle,
                    (n, r, m),
                    s,
                ));
            }
            if products.is_empty() {
                return [None, None, None];
            }
            if with_float!(dtype, E => on_blas::<R, E>(&g, &products)) {
                return [(want_dx, dx), (want_da, da), (want_db, db)].map(|(w, t)| w.then_some(t));
            }
        }
        burn_lora_backward::<Self>(g, x, LoraPrims { a, b, scale: s }, want)
    }

    fn qlinear_dx(dy: CubeTensor<R>, weight: &DeviceWeight) -> CubeTensor<R> {
        let (dy, m, n) = matrix(dy, "qlinear_dx dy");
        assert_eq!(
            n, weight.n,
            "qlinear_dx: dy has {n} columns, weight is [{}, {}]",
            weight.n, weight.k
        );
        let dx = empty(&dy, Shape::new([m, weight.k]), dy.dtype);
        with_float!(dy.dtype, E => {
            gemm::matmul_transposed::<R, E>(&dy.client, &dy.handle, m, weight, &dx.handle)
                .expect("qlinear_dx shapes");
        });
        dx
    }

    fn attention_forward(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        ranges: &[(usize, usize)],
        scale: f32,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        let shape = attention_shape(&q, &k, scale);
        let out = empty(&q, q.shape(), q.dtype);
        let lse = empty(
            &q,
            Shape::new([shape.batch, shape.heads, shape.seq]),
            DType::F32,
        );
        let bounds = fused::upload_bounds(&q.client, ranges, shape.seq);
        with_float!(q.dtype, E => {
            fused::forward::<R, E>(
                &q.client, &shape, &q.handle, &k.handle, &v.handle, &bounds, &out.handle,
                &lse.handle,
            )
            .expect("attention shapes");
        });
        (out, lse)
    }

    fn attention_backward(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        out: CubeTensor<R>,
        lse: CubeTensor<R>,
        d_out: CubeTensor<R>,
        ranges: &[(usize, usize)],
        scale: f32,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        let (out, lse) = (into_contiguous(out), into_contiguous(lse));
        // The upstream gradient may come in another float type (an f32 loss over bf16
        // activations): the kernels read one type.
        let d_out = into_contiguous(d_out);
        let d_out = if d_out.dtype == q.dtype {
            d_out
        } else {
            burn_cubecl::kernel::cast(d_out, q.dtype)
        };
        let shape = attention_shape(&q, &k, scale);
        let dq = empty(&q, q.shape(), q.dtype);
        let dk = empty(&q, k.shape(), q.dtype);
        let dv = empty(&q, k.shape(), q.dtype);
        let bounds = fused::upload_bounds(&q.client, ranges, shape.seq);
        with_float!(q.dtype, E => {
            fused::backward::<R, E>(
                &q.client, &shape, &q.handle, &k.handle, &v.handle, &bounds, &out.handle,
                &lse.handle, &d_out.handle, &dq.handle, &dk.handle, &dv.handle,
            )
            .expect("attention shapes");
        });
        (dq, dk, dv)
    }

    fn rope_heads(
        x: CubeTensor<R>,
        cos: CubeTensor<R>,
        sin: CubeTensor<R>,
        shape: RopeShape,
    ) -> CubeTensor<R> {
        let (x, ..) = matrix(x, "rope x");
        let (cos, sin) = rope_tables::<R, F, I, BT>(cos, sin, x.dtype);
        let y = empty(&x, Shape::new(shape.head_major()), x.dtype);
        with_float!(x.dtype, E => {
            rope::forward::<R, E>(&x.client, &x.handle, &cos.handle, &sin.handle, shape, &y.handle)
                .expect("rope shapes");
        });
        y
    }

    fn rope_heads_backward(
        dy: CubeTensor<R>,
        cos: CubeTensor<R>,
        sin: CubeTensor<R>,
        shape: RopeShape,
    ) -> CubeTensor<R> {
        let dy = into_contiguous(dy);
        let (cos, sin) = rope_tables::<R, F, I, BT>(cos, sin, dy.dtype);
        let rows = shape.batch * shape.seq;
        let dx = empty(
            &dy,
            Shape::new([rows, shape.heads * shape.head_dim]),
            dy.dtype,
        );
        with_float!(dy.dtype, E => {
            rope::backward::<R, E>(&dy.client, &dy.handle, &cos.handle, &sin.handle, shape, &dx.handle)
                .expect("rope shapes");
        });
        dx
    }

    fn silu_mul(g: CubeTensor<R>, u: CubeTensor<R>) -> CubeTensor<R> {
        let (g, rows, dim) = matrix(g, "silu_mul g");
        let (u, ..) = matrix(u, "silu_mul u");
        assert_eq!(
            u.shape().dims::<2>(),
            [rows, dim],
            "silu_mul: g and u shapes"
        );
        let h = empty(&g, Shape::new([rows, dim]), g.dtype);
        with_float!(g.dtype, E => {
            silu_mul::forward::<R, E>(&g.client, &g.handle, &u.handle, rows * dim, &h.handle)
                .expect("silu_mul shapes");
        });
        h
    }

    fn silu_mul_backward(
        g: CubeTensor<R>,
        u: CubeTensor<R>,
        dh: CubeTensor<R>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let (g, rows, dim) = matrix(g, "silu_mul g");
        let (u, ..) = matrix(u, "silu_mul u");
        let (dh, ..) = matrix(dh, "silu_mul dh");
        for (what, t) in [("u", &u), ("dh", &dh)] {
            assert_eq!(
                t.shape().dims::<2>(),
                [rows, dim],
                "silu_mul: g and {what} shapes"
            );
        }
        let dg = empty(&g, Shape::new([rows, dim]), g.dtype);
        let du = empty(&g, Shape::new([rows, dim]), g.dtype);
        with_float!(g.dtype, E => {
            silu_mul::backward::<R, E>(
                &g.client,
                &g.handle,
                &u.handle,
                &dh.handle,
                rows * dim,
                &dg.handle,
                &du.handle,
            )
            .expect("silu_mul shapes");
        });
        (dg, du)
    }

    fn noisy_rms_norm(
        x: CubeTensor<R>,
        w: CubeTensor<R>,
        z: Option<CubeTensor<R>>,
        eps: f64,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let (x, rows, dim) = matrix(x, "rms_norm x");
        let (w, z) = (vector(w), z.map(vector));
        let y = empty(&x, Shape::new([rows, dim]), x.dtype);
        let rstd = empty(&x, Shape::new([rows]), DType::F32);
        with_float!(x.dtype, E => {
            rms_norm::forward::<R, E>(
                &x.client,
                &x.handle,
                &w.handle,
                z.as_ref().map(|z| &z.handle),
                rows,
                dim,
                eps as f32,
                &y.handle,
                &rstd.handle,
            )
            .expect("rms_norm shapes");
        });
        (y, rstd)
    }

    fn noisy_rms_norm_backward(
        dy: CubeTensor<R>,
        x: CubeTensor<R>,
        w: CubeTensor<R>,
        z: Option<CubeTensor<R>>,
        rstd: CubeTensor<R>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let (dy, rows, dim) = matrix(dy, "rms_norm dy");
        let (x, _, _) = matrix(x, "rms_norm x");
        let (w, z, rstd) = (vector(w), z.map(vector), vector(rstd));
        let dx = empty(&x, Shape::new([rows, dim]), x.dtype);
        let dw = empty(&x, Shape::new([dim]), x.dtype);
        with_float!(x.dtype, E => {
            rms_norm::backward::<R, E>(
                &x.client,
                &dy.handle,
                &x.handle,
                &w.handle,
                z.as_ref().map(|z| &z.handle),
                &rstd.handle,
                rows,
                dim,
                &dx.handle,
                &dw.handle,
            )
            .expect("rms_norm shapes");
        });
        (dx, dw)
    }
}
