//! The decode attention on CUDA in bf16 (and f16): the tensor-core kernel
//! (`kernels::attention_tc`) and the SIMT kernel, each forced through `attention_with`, against
//! an f64 host reference computed from the rounded inputs, and against each other.
//!
//! Inputs are fresh random numbers on every run (the seed is printed on failure); the output is
//! poisoned with NaN before each launch, and every cache position no row may read (past each
//! row's slot's filled positions, unused slots) holds NaN, so a read of one shows up as NaN in
//! the output. Rows differ in slot and context (1, 7, 16, 17, 63, 64, 300, 1000, and a row at
//! 500 of the slot filled to 1000, as in prefill: filled positions past a row's own must not
//! count). Splits: forced to 1, 2, 3 and 8, and the scratch's plan, over spans of the
//! capacity and of the longest context.
//!
//! Error bound, per element: |got − ref| ≤ 1e-2·(1 + |ref|). The scores are exact products of
//! F inputs summed in f32 (relative error ~1e-6); the tensor-core kernel rounds the weights
//! `P = e^(s − m)` to F for `P·V` (relative error ≤ u = 2^-8 in bf16 each), which moves
//! `Σ p v / Σ p` by at most u·max|v| = u (values in [−1, 1]); both kernels round the output
//! to F once (≤ u·|ref|). So |err| ≤ 2^-8·(1 + |ref|) + f32 noise ≈ 3.9e-3·(1 + |ref|): the
//! bound leaves a factor 2.5. f16 (u = 2^-11) passes the same bound with more room.
//!
//! Needs a CUDA GPU (device 0) and the CUDA headers (NVRTC) at run time:
//! `cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored`.
#![cfg(feature = "cuda")]

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_engine::kernels::attention::{
    attention, attention_with, AttentionKernel, AttentionScratch, AttentionShape,
};
use qerl_engine::kernels::attention_tc::{tc_applies, tc_launches};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type R = CudaRuntime;

fn client() -> ComputeClient<R> {
    std::panic::catch_unwind(|| R::client(&CudaDevice::new(0))).unwrap_or_else(|_| {
        panic!(
            "cuda_attention tests need a CUDA GPU (device 0), its driver and the CUDA headers; \
             no CUDA client could be created here"
        )
    })
}

fn rng() -> (StdRng, u64) {
    let seed: u64 = rand::rng().random();
    (StdRng::seed_from_u64(seed), seed)
}

/// Values as the device holds them: rounded to F.
fn to_f<F: Float>(v: &[f32]) -> Vec<F> {
    v.iter().map(|&x| F::from(x).unwrap()).collect()
}

fn up<F: Float + CubeElement>(c: &ComputeClient<R>, v: &[F]) -> Handle {
    c.create_from_slice(F::as_bytes(v))
}

fn up_u32(c: &ComputeClient<R>, v: &[u32]) -> Handle {
    c.create_from_slice(u32::as_bytes(v))
}

fn read<F: Float + CubeElement>(c: &ComputeClient<R>, h: &Handle) -> Vec<f64> {
    F::from_bytes(&c.read_one(h.clone()).unwrap())
        .iter()
        .map(|x| x.to_f64().unwrap())
        .collect()
}

/// `|got − want| ≤ 1e-2·(1 + |want|)` everywhere (see the module documentation), NaN fails.
fn assert_close(what: &str, got: &[f64], want: &[f64], seed: u64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let mut worst = (0.0f64, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite(),
            "{what}: element {i} is {g} (unwritten, or a NaN cache slot was read), seed {seed}"
        );
        let err = (g - w).abs() / (1.0 + w.abs());
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let (err, i) = worst;
    assert!(
        err <= 1e-2,
        "{what}: element {i}: got {} want {} (scaled error {err:.2e}), seed {seed}",
        got[i],
        want[i]
    );
}

/// Rows as (slot, context): distinct slots, then a second row of slot 6 at half its context.
const ROWS: [(u32, usize); 9] = [
    (3, 1),
    (0, 7),
    (7, 16),
    (1, 17),
    (9, 63),
    (4, 64),
    (2, 300),
    (6, 1000),
    (6, 500),
];
const SLOTS: usize = 10;
const CAPACITY: usize = 1024;

/// Both kernels over every split of the module documentation against the host reference and
/// each other, for one head shape in `F`.
fn check<F: Float + CubeElement>(c: &ComputeClient<R>, q_heads: usize, kv_heads: usize, hd: usize) {
    let (mut g, seed) = rng();
    let what = format!(
        "{q_heads}/{kv_heads} heads of {hd}, {}",
        std::any::type_name::<F>()
    );
    let group = q_heads / kv_heads;
    let m = ROWS.len();
    // Filled positions of each slot: the longest context of its rows; NaN elsewhere.
    let mut filled = [0usize; SLOTS];
    for &(s, ctx) in &ROWS {
        filled[s as usize] = filled[s as usize].max(ctx);
    }
    let len = SLOTS * kv_heads * CAPACITY * hd;
    let mut kc = vec![f32::NAN; len];
    let mut vc = vec![f32::NAN; len];
    for (s, &f) in filled.iter().enumerate() {
        for h in 0..kv_heads {
            let at = (s * kv_heads + h) * CAPACITY * hd;
            for i in at..at + f * hd {
                kc[i] = g.random_range(-1.0..1.0);
                vc[i] = g.random_range(-1.0..1.0);
            }
        }
    }
    // Queries of a few units: scores of standard deviation ~1.3, so the softmax is neither
    // flat nor one-hot.
    let q: Vec<f32> = (0..m * q_heads * hd)
        .map(|_| g.random_range(-4.0..4.0))
        .collect();
    let (qf, kf, vf) = (to_f::<F>(&q), to_f::<F>(&kc), to_f::<F>(&vc));
    let (qh, kh, vh) = (up(c, &qf), up(c, &kf), up(c, &vf));
    let slot: Vec<u32> = ROWS.iter().map(|r| r.0).collect();
    let pos: Vec<u32> = ROWS.iter().map(|r| r.1 as u32 - 1).collect();
    let (slh, ph) = (up_u32(c, &slot), up_u32(c, &pos));

    // Host reference from the rounded inputs.
    let f64s = |v: &[F]| -> Vec<f64> { v.iter().map(|x| x.to_f64().unwrap()).collect() };
    let (qd, kd, vd) = (f64s(&qf), f64s(&kf), f64s(&vf));
    let mut want = Vec::with_capacity(m * q_heads * hd);
    for (r, &(s, ctx)) in ROWS.iter().enumerate() {
        for h in 0..q_heads {
            let base = (s as usize * kv_heads + h / group) * CAPACITY * hd;
            let qr = &qd[(r * q_heads + h) * hd..(r * q_heads + h + 1) * hd];
            let sc: Vec<f64> = (0..ctx)
                .map(|j| {
                    let k = &kd[base + j * hd..base + (j + 1) * hd];
                    qr.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..hd {
                want.push((0..ctx).map(|j| e[j] * vd[base + j * hd + i]).sum::<f64>() / z);
            }
        }
    }

    let scratch = AttentionScratch::new(c, q_heads, kv_heads, hd, 160);
    let max_ctx = ROWS.iter().map(|r| r.1).max().unwrap();
    for context in [CAPACITY, max_ctx] {
        let shape = AttentionShape {
            rows: m,
            q_heads,
            kv_heads,
            head_dim: hd,
            capacity: CAPACITY,
            slots: SLOTS,
            context,
        };
        assert!(
            tc_applies::<R, F>(c, &shape),
            "{what}: the tensor-core kernel does not apply on this device"
        );
        for splits in [Some(1), Some(2), Some(3), Some(8), None] {
            let run = |kernel: AttentionKernel| -> Vec<f64> {
                let out = up(c, &vec![F::from(f32::NAN).unwrap(); m * q_heads * hd]);
                let io = [&qh, &kh, &vh, &slh, &ph, &out];
                attention_with::<R, F>(c, shape, io, &scratch, splits, kernel);
                read::<F>(c, &out)
            };
            let tc = run(AttentionKernel::TensorCore);
            let simt = run(AttentionKernel::Simt);
            let case = format!("{what}, context {context}, splits {splits:?}");
            assert_close(&format!("tensor cores, {case}"), &tc, &want, seed);
            assert_close(&format!("simt, {case}"), &simt, &want, seed);
            assert_close(&format!("tensor cores vs simt, {case}"), &tc, &simt, seed);
        }
    }
}

/// Qwen2.5-7B: 28 query heads over 4 key-value heads (groups of 7) of 128 channels.
#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_attention_bf16_qwen7b_shape() {
    check::<half::bf16>(&client(), 28, 4, 128);
}

/// Small and awkward heads: a group of 4 at 64 channels, a full group of 16 (both row halves
/// of the tile), groups of 1, 96 channels (8-byte value vectors) and 16 (4-byte ones).
#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_attention_bf16_small_shapes() {
    let c = client();
    for (q_heads, kv_heads, hd) in [
        (8, 2, 64),
        (32, 2, 64),
        (4, 4, 128),
        (12, 2, 96),
        (6, 2, 16),
    ] {
        check::<half::bf16>(&c, q_heads, kv_heads, hd);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_attention_f16_shapes() {
    let c = client();
    for (q_heads, kv_heads, hd) in [(28, 4, 128), (8, 2, 64)] {
        check::<half::f16>(&c, q_heads, kv_heads, hd);
    }
}

/// `attention` takes the tensor-core kernel for bf16 where it applies (unless the process runs
/// with `QERL_ATTN=simt`), and keeps f32 and too-large heads on the SIMT kernel.
#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_attention_auto_dispatch() {
    let c = client();
    let (mut g, seed) = rng();
    let (q_heads, kv_heads, hd, slots, cap) = (8, 2, 64, 2, 64);
    let shape = AttentionShape {
        rows: 2,
        q_heads,
        kv_heads,
        head_dim: hd,
        capacity: cap,
        slots,
        context: cap,
    };
    assert!(tc_applies::<R, half::bf16>(&c, &shape));
    assert!(!tc_applies::<R, f32>(&c, &shape));
    assert!(!tc_applies::<R, half::bf16>(
        &c,
        &AttentionShape {
            head_dim: 256,
            ..shape
        }
    ));
    assert!(!tc_applies::<R, half::bf16>(
        &c,
        &AttentionShape {
            q_heads: 34,
            ..shape
        }
    ));
    let uni = |g: &mut StdRng, n: usize| -> Vec<half::bf16> {
        to_f(
            &(0..n)
                .map(|_| g.random_range(-1.0..1.0))
                .collect::<Vec<f32>>(),
        )
    };
    let len = slots * kv_heads * cap * hd;
    let (qh, kh, vh) = (
        up(&c, &uni(&mut g, 2 * q_heads * hd)),
        up(&c, &uni(&mut g, len)),
        up(&c, &uni(&mut g, len)),
    );
    let (slh, ph) = (up_u32(&c, &[1, 0]), up_u32(&c, &[40, 63]));
    let scratch = AttentionScratch::new(&c, q_heads, kv_heads, hd, 16);
    let nan = || up(&c, &vec![half::bf16::NAN; 2 * q_heads * hd]);
    let (auto, simt) = (nan(), nan());
    let before = tc_launches();
    attention::<R, half::bf16>(&c, shape, &qh, &kh, &vh, &slh, &ph, &auto, &scratch, None);
    let io = [&qh, &kh, &vh, &slh, &ph, &simt];
    attention_with::<R, half::bf16>(&c, shape, io, &scratch, None, AttentionKernel::Simt);
    let (got, want) = (read::<half::bf16>(&c, &auto), read::<half::bf16>(&c, &simt));
    assert_close("auto vs simt", &got, &want, seed);
    if std::env::var("QERL_ATTN").as_deref() != Ok("simt") {
        assert!(
            tc_launches() > before,
            "attention did not take the tensor-core kernel for bf16"
        );
    }
}
