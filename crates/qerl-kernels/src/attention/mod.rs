//! Fused causal self-attention with per-row key ranges and grouped-query heads, forward and
//! backward, flash-attention style: the `[seq, seq]` scores never leave a cube.
//!
//! Shapes (row-major, contiguous): `q`, `out`, `d_out`, `dq` `[batch, heads, seq, head_dim]`;
//! `k`, `v`, `dk`, `dv` `[batch, kv_heads, seq, head_dim]` (query head `h` reads kv head
//! `h / (heads / kv_heads)`, transformers' `repeat_kv` order, without repeating K/V in memory);
//! `lse` `[batch, heads, seq]` f32; `bounds` `[batch, 2]` u32. Query `i` of batch row `b` sees
//! key `j` when `start_b <= j < end_b` and `j <= i` (causal from position 0: the training
//! forward and a prefill). Right padding is `start = 0, end = length`; left padding is
//! `start = pad, end = seq`. A query that sees no key gets a zero output and gradient.
//!
//! On CUDA with bf16/f16 and cuBLAS, both directions run on cuBLAS instead (`blas`: the scores
//! of a few sequences at a time in f32, the products on the tensor cores; `QERL_ATTENTION=fused`
//! keeps the kernels below). The fused kernels use shared memory and per-unit loops only (no
//! plane operations, no tensor cores), so they run on lavapipe as on CUDA; every operand is
//! widened to f32 in shared memory and every sum accumulates in f32, whatever `F` (f32, f16,
//! bf16). Tiles are chosen per head size to fit the device's shared memory ([`Tiles`]).

mod backward;
#[cfg(feature = "cuda")]
pub mod blas;
mod forward;

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::device::{check_buffer, grid_1d, shape_err, KernelError};

/// Units per cube.
const UNITS: u32 = 128;

/// Score of a masked entry (finite: `max` and `exp` stay NaN-free on a row with nothing visible).
const MASKED: f32 = -1.0e30;

/// Shared memory a kernel may take: the least any CUDA device gives without an opt-in.
const SHARED_CAP: usize = 48 * 1024;

/// Whether query `i` sees key `j` (see the module docs).
#[cube]
fn visible(i: usize, j: usize, seq: usize, start: usize, end: usize) -> bool {
    i < seq && j >= start && j < end && j <= i
}

/// One attention problem.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq: usize,
    pub head_dim: usize,
    /// Multiplies `q·kᵀ` (usually `head_dim^-1/2`).
    pub scale: f32,
}

impl AttentionShape {
    fn q_len(&self) -> usize {
        self.batch * self.heads * self.seq * self.head_dim
    }

    fn kv_len(&self) -> usize {
        self.batch * self.kv_heads * self.seq * self.head_dim
    }

    fn rows(&self) -> usize {
        self.batch * self.heads * self.seq
    }

    fn check(&self) -> Result<(), KernelError> {
        let s = self;
        if s.batch == 0 || s.heads == 0 || s.kv_heads == 0 || s.seq == 0 || s.head_dim == 0 {
            return Err(shape_err("attention", format!("empty shape {s:?}")));
        }
        if !s.heads.is_multiple_of(s.kv_heads) {
            return Err(shape_err(
                "attention",
                format!("{} query heads over {} kv heads", s.heads, s.kv_heads),
            ));
        }
        if s.head_dim > 256 || s.batch * s.heads > 65_535 {
            return Err(shape_err(
                "attention",
                format!("head_dim {} > 256 or batch × heads > 65535", s.head_dim),
            ));
        }
        if s.q_len() >= u32::MAX as usize {
            return Err(shape_err("attention", "more than 2^32 elements".into()));
        }
        Ok(())
    }
}

/// Tile sizes `(queries, keys)` of the kernels for one head size; [`Tiles::plan`] takes the
/// largest that fit the device's shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Forward and dQ: a cube's queries and the keys of one step.
    pub forward: (usize, usize),
    /// dK/dV: the queries of one step and a cube's keys.
    pub dkdv: (usize, usize),
}

/// Bytes of shared memory of each kernel (all f32, rows padded by one).
fn forward_bytes(d: usize, (bq, bk): (usize, usize)) -> usize {
    4 * ((2 * bq + bk) * (d + 1) + bq * (bk + 1))
}

fn dkdv_bytes(d: usize, (bq, bk): (usize, usize)) -> usize {
    4 * ((2 * bq + 2 * bk) * (d + 1) + 2 * bq * (bk + 1) + 2 * bq)
}

impl Tiles {
    /// The largest tiles for `head_dim` within `shared_bytes` (capped at 48 KiB).
    pub fn plan(head_dim: usize, shared_bytes: usize) -> Result<Tiles, KernelError> {
        let cap = shared_bytes.min(SHARED_CAP);
        let forward = [(16, 32), (16, 16), (8, 16), (8, 8)]
            .into_iter()
            .find(|&t| forward_bytes(head_dim, t) <= cap);
        let dkdv = [(16, 16), (8, 16), (8, 8)]
            .into_iter()
            .find(|&t| dkdv_bytes(head_dim, t) <= cap);
        match (forward, dkdv) {
            (Some(forward), Some(dkdv)) => Ok(Tiles { forward, dkdv }),
            _ => Err(shape_err(
                "attention",
                format!("head_dim {head_dim} does not fit {cap} bytes of shared memory"),
            )),
        }
    }

    fn for_device<R: Runtime>(
        client: &ComputeClient<R>,
        head_dim: usize,
    ) -> Result<Tiles, KernelError> {
        Tiles::plan(
            head_dim,
            client.properties().hardware.max_shared_memory_size,
        )
    }
}

/// Uploads per-row key ranges `[start, end)` as the `bounds` buffer (ends clamped to `seq`).
pub fn upload_bounds<R: Runtime>(
    client: &ComputeClient<R>,
    ranges: &[(usize, usize)],
    seq: usize,
) -> Handle {
    let words: Vec<u32> = ranges
        .iter()
        .flat_map(|&(s, e)| [s.min(seq) as u32, e.min(seq) as u32])
        .collect();
    client.create_from_slice(u32::as_bytes(&words))
}

fn check_common<F>(
    shape: &AttentionShape,
    q: &Handle,
    k: &Handle,
    v: &Handle,
    bounds: &Handle,
    lse: &Handle,
) -> Result<(), KernelError> {
    shape.check()?;
    let e = std::mem::size_of::<F>();
    check_buffer("attention", "q", q, shape.q_len() * e)?;
    check_buffer("attention", "k", k, shape.kv_len() * e)?;
    check_buffer("attention", "v", v, shape.kv_len() * e)?;
    check_buffer("attention", "bounds", bounds, shape.batch * 8)?;
    check_buffer("attention", "lse", lse, shape.rows() * 4)
}

/// Forward: writes `out` and `lse` (see the module docs for the shapes).
#[allow(clippy::too_many_arguments)]
pub fn forward<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: &AttentionShape,
    q: &Handle,
    k: &Handle,
    v: &Handle,
    bounds: &Handle,
    out: &Handle,
    lse: &Handle,
) -> Result<(), KernelError> {
    check_common::<F>(shape, q, k, v, bounds, lse)?;
    check_buffer(
        "attention",
        "out",
        out,
        shape.q_len() * std::mem::size_of::<F>(),
    )?;
    #[cfg(feature = "cuda")]
    if blas::usable::<R, F>(client)
        && blas::forward::<R, F>(client, shape, q, k, v, bounds, out, lse)?
    {
        return Ok(());
    }
    let s = shape;
    let (bq, bk) = Tiles::for_device(client, s.head_dim)?.forward;
    // SAFETY: buffer sizes checked above; the kernel bounds every index by `seq`, `head_dim`
    // and the key ranges (clamped to `seq` by `upload_bounds`).
    unsafe {
        forward::forward_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(s.seq.div_ceil(bq) as u32, (s.batch * s.heads) as u32, 1),
            CubeDim::new_1d(UNITS),
            ArrayArg::from_raw_parts(q.clone(), s.q_len()),
            ArrayArg::from_raw_parts(k.clone(), s.kv_len()),
            ArrayArg::from_raw_parts(v.clone(), s.kv_len()),
            ArrayArg::from_raw_parts(bounds.clone(), s.batch * 2),
            ArrayArg::from_raw_parts(out.clone(), s.q_len()),
            ArrayArg::from_raw_parts(lse.clone(), s.rows()),
            s.seq as u32,
            s.heads as u32,
            s.kv_heads as u32,
            s.scale,
            s.head_dim,
            bq,
            bk,
        );
    }
    Ok(())
}

/// The gradients of [`forward`] (given its `out` and `lse` and the upstream `d_out`): writes
/// `dq` `[batch, heads, seq, head_dim]`, `dk` and `dv` `[batch, kv_heads, seq, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn backward<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: &AttentionShape,
    q: &Handle,
    k: &Handle,
    v: &Handle,
    bounds: &Handle,
    out: &Handle,
    lse: &Handle,
    d_out: &Handle,
    dq: &Handle,
    dk: &Handle,
    dv: &Handle,
) -> Result<(), KernelError> {
    check_common::<F>(shape, q, k, v, bounds, lse)?;
    let s = shape;
    let e = std::mem::size_of::<F>();
    check_buffer("attention", "out", out, s.q_len() * e)?;
    check_buffer("attention", "d_out", d_out, s.q_len() * e)?;
    check_buffer("attention", "dq", dq, s.q_len() * e)?;
    check_buffer("attention", "dk", dk, s.kv_len() * e)?;
    check_buffer("attention", "dv", dv, s.kv_len() * e)?;
    let tiles = Tiles::for_device(client, s.head_dim)?;
    let dvec = client.empty(s.rows() * 4);
    let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
    // SAFETY: as in `forward`; `dvec` is ours and sized to the rows.
    unsafe {
        backward::row_dot_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(s.rows().div_ceil(UNITS as usize)),
            CubeDim::new_1d(UNITS),
            arr(d_out, s.q_len()),
            arr(out, s.q_len()),
            arr(&dvec, s.rows()),
            s.rows() as u32,
            s.head_dim,
        );
    }
    #[cfg(feature = "cuda")]
    if blas::usable::<R, F>(client)
        && blas::backward::<R, F>(
            client,
            s,
            (q, k, v),
            bounds,
            lse,
            &dvec,
            d_out,
            (dq, dk, dv),
        )?
    {
        return Ok(());
    }
    // SAFETY: as above.
    unsafe {
        let (bq, bk) = tiles.forward;
        backward::dq_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(s.seq.div_ceil(bq) as u32, (s.batch * s.heads) as u32, 1),
            CubeDim::new_1d(UNITS),
            arr(q, s.q_len()),
            arr(k, s.kv_len()),
            arr(v, s.kv_len()),
            arr(d_out, s.q_len()),
            arr(lse, s.rows()),
            arr(&dvec, s.rows()),
            arr(bounds, s.batch * 2),
            arr(dq, s.q_len()),
            s.seq as u32,
            s.heads as u32,
            s.kv_heads as u32,
            s.scale,
            s.head_dim,
            bq,
            bk,
        );
        let (bq, bk) = tiles.dkdv;
        backward::dkdv_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(s.seq.div_ceil(bk) as u32, (s.batch * s.kv_heads) as u32, 1),
            CubeDim::new_1d(UNITS),
            arr(q, s.q_len()),
            arr(k, s.kv_len()),
            arr(v, s.kv_len()),
            arr(d_out, s.q_len()),
            arr(lse, s.rows()),
            arr(&dvec, s.rows()),
            arr(bounds, s.batch * 2),
            arr(dk, s.kv_len()),
            arr(dv, s.kv_len()),
            s.seq as u32,
            s.heads as u32,
            s.kv_heads as u32,
            s.scale,
            s.head_dim,
            bq,
            bk,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_the_shared_memory() {
        // lavapipe: 32 KiB; CUDA: capped at 48 KiB.
        for (d, bytes) in [
            (16, 32 << 10),
            (64, 32 << 10),
            (128, 32 << 10),
            (128, 227 << 10),
        ] {
            let t = Tiles::plan(d, bytes).unwrap();
            assert!(
                forward_bytes(d, t.forward) <= bytes.min(SHARED_CAP),
                "{d} {t:?}"
            );
            assert!(dkdv_bytes(d, t.dkdv) <= bytes.min(SHARED_CAP), "{d} {t:?}");
        }
        assert_eq!(Tiles::plan(128, 48 << 10).unwrap().forward, (16, 32));
        assert!(Tiles::plan(256, 8 << 10).is_err());
    }
}
