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
//! The LoRA down-projection (`kernels::lora_down`, tests `cuda_lora_down_*`) has its own inputs
//! and bound, described above its tests at the end of this file.
//!
//! Needs a CUDA GPU (device 0) and the CUDA headers (NVRTC) at run time:
//! `cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored`.
#![cfg(feature = "cuda")]

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_engine::kernels::attention::{
    attention, attention_with, AttentionKernel, AttentionScratch, AttentionShape, OLora,
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

/// A LoRA down-projection `t [rows, rank]` (f32, read back) against the f64 product of the
/// kernel's own input `x [rows, width]` and the adapter `a [rank, width]`: every value written
/// and a relative L2 error below 1e-5 (f32 sums of exact products of F values).
fn assert_lora_t(what: &str, t: &[f64], x: &[f64], a: &[f64], rank: usize, seed: u64) {
    let width = a.len() / rank;
    let want: Vec<f64> = (0..t.len())
        .map(|i| {
            (0..width)
                .map(|j| x[(i / rank) * width + j] * a[(i % rank) * width + j])
                .sum()
        })
        .collect();
    assert!(
        t.iter().all(|v| v.is_finite()),
        "{what}: unwritten T, seed {seed}"
    );
    let num: f64 = t.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    let rel = (num / den).sqrt();
    assert!(
        rel < 1e-5,
        "{what}: T relative error {rel:.2e}, seed {seed}"
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

    // The o adapter whose LoRA down-projection the spans' merge computes (rank 16).
    let rank = 16;
    let q_dim = q_heads * hd;
    let a_f = to_f::<F>(
        &(0..rank * q_dim)
            .map(|_| g.random_range(-1.0f32..1.0))
            .collect::<Vec<_>>(),
    );
    let (ah, a_d) = (up(c, &a_f), f64s(&a_f));
    let head_sums = c.empty(m * q_heads * rank * 4);
    let counters = up_u32(c, &vec![0u32; m]);
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
                attention_with::<R, F>(c, shape, io, &scratch, splits, kernel, None);
                read::<F>(c, &out)
            };
            let tc = run(AttentionKernel::TensorCore);
            let simt = run(AttentionKernel::Simt);
            let case = format!("{what}, context {context}, splits {splits:?}");
            assert_close(&format!("tensor cores, {case}"), &tc, &want, seed);
            assert_close(&format!("simt, {case}"), &simt, &want, seed);
            assert_close(&format!("tensor cores vs simt, {case}"), &tc, &simt, seed);
            // With the o adapter: the same output bits, and where the context was split, `T`
            // from the merge (launched back to back, so a counter left non-zero or a head's
            // sums read before they land would show).
            for (kernel, plain) in [
                (AttentionKernel::TensorCore, &tc),
                (AttentionKernel::Simt, &simt),
            ] {
                for round in 0..8 {
                    let out = up(c, &vec![F::from(f32::NAN).unwrap(); m * q_dim]);
                    let t = up(c, &vec![f32::NAN; m * rank]);
                    let lora = OLora {
                        a: &ah,
                        rank,
                        t: &t,
                        head_sums: &head_sums,
                        counters: &counters,
                    };
                    let io = [&qh, &kh, &vh, &slh, &ph, &out];
                    let did =
                        attention_with::<R, F>(c, shape, io, &scratch, splits, kernel, Some(&lora));
                    let got = read::<F>(c, &out);
                    let lcase = format!("{kernel:?} with the o LoRA (round {round}), {case}");
                    assert_eq!(&got, plain, "{lcase}: output, seed {seed}");
                    assert!(did || splits != Some(2), "{lcase}: split but no projection");
                    if did {
                        let tv = read::<f32>(c, &t);
                        assert_lora_t(&lcase, &tv, &got, &a_d, rank, seed);
                    }
                }
            }
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
    attention_with::<R, half::bf16>(&c, shape, io, &scratch, None, AttentionKernel::Simt, None);
    let (got, want) = (read::<half::bf16>(&c, &auto), read::<half::bf16>(&c, &simt));
    assert_close("auto vs simt", &got, &want, seed);
    if std::env::var("QERL_ATTN").as_deref() != Ok("simt") {
        assert!(
            tc_launches() > before,
            "attention did not take the tensor-core kernel for bf16"
        );
    }
}

// LoRA down-projection (`kernels::lora_down`): `T_s [m, r] = X [m, K] · A_sᵀ` in f32.
//
// Inputs are uniform in [−1, 1), rounded to F (fresh seed each run, printed on failure); the
// reference is the f64 sum of the rounded products. Error bound, per output:
// |got − ref| ≤ 1e-4·Σ_k |x·a| (+1e-30). Why: the kernel forms each product exactly (`fma` of
// F values) and adds in f32 along a chain of at most 80 `fma`s a unit (10 vectors of 8 at
// K = 18944 in bf16, 19 of 4 in f32), then a 5-level plane tree and 7 plane additions, so any
// term goes through d < 100 roundings: |err| ≤ γ_d·Σ|x·a| ≈ d·2^-24·Σ|x·a| < 6e-6·Σ|x·a|.
// The bound leaves a factor > 10, and a missed or doubled vector (8 terms of 1000) is ~1e-3.
// The tensor-core kernel (`qerl_kernels::lora_down_mma`, same bound): exact products added by
// `mma` into f32 along at most 2·STEPS (≤ 40 here) products a warp, then ≤ 16 warps and ≤ 64
// cubes in order: fewer roundings than the plane kernel's chain.
// Outputs are poisoned with NaN before each launch and carry 32 NaN guard values past m·r
// that must stay NaN. Every case asserts that `lora_down` ran (returned true).

use qerl_engine::kernels::lora_down::{lora_down, tile};
use qerl_kernels::lora_down_mma;

const LD_MS: [usize; 5] = [1, 3, 8, 64, 200];
const LD_KS: [usize; 3] = [3584, 18944, 1000];
const LD_GUARD: usize = 32;

/// Random X `[200, K]` and three A `[16, K]` rounded to F (a rank-8 adapter is the first 8
/// rows), with the f64 reference `T_s[row][j]` and `Σ_k |x·a|` for every row and row of A.
struct LdCase<F> {
    k: usize,
    x: Vec<F>,
    a: [Vec<F>; 3],
    t: [Vec<f64>; 3],
    mag: [Vec<f64>; 3],
}

fn ld_case<F: Float>(g: &mut StdRng, k: usize) -> LdCase<F> {
    let rows = LD_MS[LD_MS.len() - 1];
    let mut uni = |n: usize| -> Vec<F> {
        to_f(
            &(0..n)
                .map(|_| g.random_range(-1.0..1.0))
                .collect::<Vec<f32>>(),
        )
    };
    let x = uni(rows * k);
    let a = [uni(16 * k), uni(16 * k), uni(16 * k)];
    let f64s = |v: &[F]| -> Vec<f64> { v.iter().map(|x| x.to_f64().unwrap()).collect() };
    let xd = f64s(&x);
    let (mut t, mut mag) = ([vec![], vec![], vec![]], [vec![], vec![], vec![]]);
    for s in 0..3 {
        let ad = f64s(&a[s]);
        for row in 0..rows {
            for j in 0..16 {
                let (xr, ar) = (&xd[row * k..][..k], &ad[j * k..][..k]);
                let (mut sum, mut abs) = (0.0f64, 0.0f64);
                for i in 0..k {
                    let p = xr[i] * ar[i];
                    sum += p;
                    abs += p.abs();
                }
                t[s].push(sum);
                mag[s].push(abs);
            }
        }
    }
    LdCase { k, x, a, t, mag }
}

/// Which LoRA down-projection kernel a case runs: the engine's plane kernel
/// (`kernels::lora_down`) or the tensor-core one (`qerl_kernels::lora_down_mma`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum LdKernel {
    Plane,
    Mma,
}

/// Runs `kernel` on the first `m` rows and `adapters` adapters of rank `rank`; asserts it
/// ran, and returns each output (m·rank values) after checking that its guard stayed NaN (and,
/// for the tensor-core kernel, that its counters are 0 again).
fn ld_run<F: Float + CubeElement>(
    c: &ComputeClient<R>,
    case: &LdCase<F>,
    m: usize,
    adapters: usize,
    rank: usize,
    kernel: LdKernel,
    what: &str,
) -> Vec<Vec<f32>> {
    let k = case.k;
    let xh = up(c, &case.x[..m * k]);
    let ah: Vec<Handle> = (0..adapters)
        .map(|s| up(c, &case.a[s][..rank * k]))
        .collect();
    let th: Vec<Handle> = (0..adapters)
        .map(|_| up(c, &vec![f32::NAN; m * rank + LD_GUARD]))
        .collect();
    let (ar, tr): (Vec<&Handle>, Vec<&Handle>) = (ah.iter().collect(), th.iter().collect());
    let counters = up_u32(c, &[0u32; 16]);
    let ran = match kernel {
        LdKernel::Plane => lora_down::<R, F>(c, &xh, m, &ar, rank, k, &tr),
        LdKernel::Mma => {
            let floats = lora_down_mma::scratch_floats::<R, F>(c, m, k);
            let sums = up(c, &vec![f32::NAN; floats.max(1)]);
            lora_down_mma::lora_down_mma::<R, F>(c, &xh, m, &ar, rank, k, &tr, &sums, &counters)
        }
    };
    assert!(ran, "{what}: {kernel:?} did not run on this device");
    let zeros = u32::from_bytes(&c.read_one(counters).unwrap()).to_vec();
    assert!(
        zeros.iter().all(|&z| z == 0),
        "{what}: counters left {zeros:?}"
    );
    th.iter()
        .map(|h| {
            let mut v = f32::from_bytes(&c.read_one(h.clone()).unwrap()).to_vec();
            let guard = v.split_off(m * rank);
            assert!(guard.iter().all(|g| g.is_nan()), "{what}: wrote past m·r");
            v
        })
        .collect()
}

/// Every (m, K, adapters, rank) of the sweep against the reference, in F (the tensor-core
/// kernel: where it applies, K a multiple of 32; it must not claim the others).
fn ld_check<F: Float + CubeElement>(kernel: LdKernel) {
    let c = client();
    let (mut g, seed) = rng();
    let name = std::any::type_name::<F>();
    for k in LD_KS {
        let case = ld_case::<F>(&mut g, k);
        for m in LD_MS {
            for adapters in 1..=3 {
                for rank in [16, 8] {
                    if kernel == LdKernel::Mma && !k.is_multiple_of(32) {
                        assert!(!lora_down_mma::applies::<R, F>(&c, m, adapters, rank, k));
                        continue;
                    }
                    let tl = tile::<R, F>(&c, m, adapters, rank, k);
                    let what = format!(
                        "{kernel:?} {name} m {m} K {k} adapters {adapters} rank {rank} tile {tl:?}"
                    );
                    let got = ld_run(&c, &case, m, adapters, rank, kernel, &what);
                    for (s, out) in got.iter().enumerate() {
                        for row in 0..m {
                            for j in 0..rank {
                                let (v, at) = (out[row * rank + j] as f64, row * 16 + j);
                                let (want, mag) = (case.t[s][at], case.mag[s][at]);
                                assert!(
                                    (v - want).abs() <= 1e-4 * mag + 1e-30,
                                    "{what}: T_{s}[{row}][{j}] = {v}, want {want} (Σ|x·a| {mag}), seed {seed}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_lora_down_bf16() {
    ld_check::<half::bf16>(LdKernel::Plane);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_lora_down_mma_bf16() {
    ld_check::<half::bf16>(LdKernel::Mma);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_lora_down_mma_f16() {
    ld_check::<half::f16>(LdKernel::Mma);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_lora_down_f32() {
    ld_check::<f32>(LdKernel::Plane);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_lora_down_f16() {
    ld_check::<half::f16>(LdKernel::Plane);
}

/// Batch invariance in bf16: each of the first 64 rows computed alone, and the first 3 and 8
/// rows as batches, equal those rows of the 64- and 200-row batches bit for bit (the plane
/// kernel's tiles differ between these sizes; the tensor-core kernel's row groups do).
fn ld_batch_invariant(kernel: LdKernel) {
    type F = half::bf16;
    let c = client();
    let (mut g, seed) = rng();
    for k in LD_KS
        .into_iter()
        .filter(|k| kernel == LdKernel::Plane || k.is_multiple_of(32))
    {
        let case = ld_case::<F>(&mut g, k);
        for (adapters, rank) in [(3, 16), (1, 16), (2, 8)] {
            let what = |m: usize| format!("K {k} adapters {adapters} rank {rank} m {m}");
            if kernel == LdKernel::Plane && std::env::var("QERL_LORA_DOWN_TILE").is_err() {
                assert_ne!(
                    tile::<R, F>(&c, 1, adapters, rank, k),
                    tile::<R, F>(&c, 64, adapters, rank, k),
                    "{}: one tile for 1 and 64 rows: nothing to compare",
                    what(64)
                );
            }
            let full = ld_run(&c, &case, 200, adapters, rank, kernel, &what(200));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            let mut parts = vec![(0, ld_run(&c, &case, 64, adapters, rank, kernel, &what(64)))];
            for m in [3, 8] {
                parts.push((0, ld_run(&c, &case, m, adapters, rank, kernel, &what(m))));
            }
            for row in 0..64 {
                let one = LdCase {
                    k,
                    x: case.x[row * k..][..k].to_vec(),
                    a: case.a.clone(),
                    t: Default::default(),
                    mag: Default::default(),
                };
                parts.push((row, ld_run(&c, &one, 1, adapters, rank, kernel, &what(1))));
            }
            for (first, part) in &parts {
                for (s, out) in part.iter().enumerate() {
                    let rows = out.len() / rank;
                    let want = &full[s][first * rank..(first + rows) * rank];
                    assert_eq!(
                        bits(out),
                        bits(want),
                        "rows {first}..{}: {} differs from 200 rows in adapter {s}, seed {seed}",
                        first + rows,
                        what(rows)
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_lora_down_batch_invariant() {
    ld_batch_invariant(LdKernel::Plane);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_lora_down_mma_batch_invariant() {
    ld_batch_invariant(LdKernel::Mma);
}

/// The LoRA down-projections fused into the norm (`kernels::fused_lora`) in bf16 at Qwen2.5-7B
/// width, the residual a product's output or its unreduced K-slices: the norm's output and
/// residual equal the unfused kernel's bit for bit, `T` equals an f64 host product of the
/// kernel's own (rounded) row and the adapter within a relative L2 error of 1e-5 (f32 sums of
/// 3,584 exact products), and row 0's `T` is the same bits alone and in a batch of 8.
#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_fused_lora_bf16() {
    use qerl_engine::kernels::fused_lora::norm_lora;
    use qerl_engine::kernels::norm::{add_rms_norm, Residual};
    type F = half::bf16;
    let c = client();
    let (mut g, seed) = rng();
    let mut uni = |n: usize| -> Vec<f32> { (0..n).map(|_| g.random_range(-1.0f32..1.0)).collect() };
    let nan = |c: &ComputeClient<R>, n: usize| up::<F>(c, &vec![F::NAN; n]);
    let nan32 = |c: &ComputeClient<R>, n: usize| up::<f32>(c, &vec![f32::NAN; n]);
    let (dim, rank, max_rows) = (3584, 16, 8);
    let h = to_f::<F>(&uni(max_rows * dim));
    let d = to_f::<F>(&uni(max_rows * dim));
    let gain: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
    let a: Vec<Vec<F>> = (0..3).map(|_| to_f::<F>(&uni(rank * dim))).collect();
    let gh = up::<f32>(&c, &gain);
    let ah: Vec<Handle> = a.iter().map(|v| up(&c, v)).collect();
    for slices in [0, 2] {
        let mut t_alone: Vec<Vec<f64>> = Vec::new();
        for m in [1, 5, 8] {
            let what = format!("norm_lora bf16 rows {m} slices {slices}");
            // The slices: f32 partial sums; the dense residual is what their reduction stores.
            let parts = uni(slices.max(1) * m * dim);
            let dense: Vec<F> = if slices == 0 {
                d[..m * dim].to_vec()
            } else {
                (0..m * dim)
                    .map(|i| {
                        F::from_f32((0..slices).fold(0.0f32, |acc, s| acc + parts[s * m * dim + i]))
                    })
                    .collect()
            };
            let (dh, ph) = (up(&c, &dense), up::<f32>(&c, &parts));
            let residual = if slices == 0 {
                Residual::Dense(&dh)
            } else {
                Residual::Parts(&ph, slices)
            };
            let hh = up(&c, &h[..m * dim]);
            let (h_out, y) = (nan(&c, m * dim), nan(&c, m * dim));
            let th: Vec<Handle> = (0..3).map(|_| nan32(&c, m * rank)).collect();
            let ran = norm_lora::<R, F>(
                &c,
                &hh,
                residual,
                &h_out,
                &gh,
                m,
                dim,
                1e-6,
                &y,
                &ah.iter().collect::<Vec<_>>(),
                rank,
                &th.iter().collect::<Vec<_>>(),
            );
            assert!(ran, "{what}: applies");
            let (h_ref, y_ref) = (up(&c, &h[..m * dim]), nan(&c, m * dim));
            add_rms_norm::<R, F>(
                &c,
                &h_ref,
                m,
                Residual::Dense(&dh),
                &gh,
                None,
                m,
                dim,
                1e-6,
                &y_ref,
            );
            let yv = read::<F>(&c, &y);
            assert_eq!(
                yv,
                read::<F>(&c, &y_ref),
                "{what}: norm output, seed {seed}"
            );
            assert_eq!(
                read::<F>(&c, &h_out),
                read::<F>(&c, &h_ref),
                "{what}: residual, seed {seed}"
            );
            let ts: Vec<Vec<f64>> = th.iter().map(|t| read::<f32>(&c, t)).collect();
            for (s, t) in ts.iter().enumerate() {
                let a_s: Vec<f64> = a[s].iter().map(|v| v.to_f64()).collect();
                assert_lora_t(&format!("{what} adapter {s}"), t, &yv, &a_s, rank, seed);
            }
            if m == 1 {
                t_alone = ts;
            } else if slices == 0 {
                for (s, t) in ts.iter().enumerate() {
                    assert_eq!(
                        t[..rank],
                        t_alone[s][..],
                        "{what}: row 0 of adapter {s} differs from alone, seed {seed}"
                    );
                }
            }
        }
    }
}

/// SiLU·mul with the down adapter's LoRA down-projection (`kernels::fused_lora::silu_lora`,
/// slices summed by the row's last cube) in bf16 at Qwen2.5-7B's intermediate width: the
/// activation equals `silu_mul`'s bit for bit, `T` equals an f64 host product of the kernel's
/// own activation and the adapter within a relative L2 error of 1e-5 (f32 sums of 18,944
/// exact products), launched 4 times back to back at each batch (a counter left non-zero or a
/// slice's sums read before they land would show), and row 0's `T` is the same bits alone and
/// in a batch.
#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_silu_lora_bf16() {
    use qerl_engine::kernels::act::silu_mul;
    use qerl_engine::kernels::fused_lora::{silu_lora, silu_slices};
    type F = half::bf16;
    let c = client();
    let (mut g, seed) = rng();
    let mut uni = |n: usize| -> Vec<F> {
        to_f(
            &(0..n)
                .map(|_| g.random_range(-2.0f32..2.0))
                .collect::<Vec<_>>(),
        )
    };
    let (width, rank, rows) = (18944, 16, 8);
    let a = uni(rank * width);
    let (gate, upv) = (uni(rows * width), uni(rows * width));
    let (ah, gh, uh) = (up(&c, &a), up(&c, &gate), up(&c, &upv));
    let sums = c.empty(rows * silu_slices::<F>(width) * rank * 4);
    let counters = up_u32(&c, &vec![0u32; rows]);
    let mut alone = Vec::new();
    for m in [1, 4, 8] {
        for round in 0..4 {
            let what = format!("silu_lora bf16 rows {m} round {round}");
            let out = up(&c, &vec![F::NAN; m * width]);
            let t = up(&c, &vec![f32::NAN; m * rank]);
            let ran = silu_lora::<R, F>(
                &c, &gh, &uh, &out, m, width, &ah, rank, &t, &sums, &counters,
            );
            assert!(ran, "{what}: applies");
            let want_out = up(&c, &vec![F::NAN; m * width]);
            silu_mul::<R, F>(&c, &gh, &uh, &want_out, m * width);
            let ov = read::<F>(&c, &out);
            assert_eq!(
                ov,
                read::<F>(&c, &want_out),
                "{what}: activation, seed {seed}"
            );
            let tv = read::<f32>(&c, &t);
            let a_d: Vec<f64> = a.iter().map(|v| v.to_f64()).collect();
            assert_lora_t(&what, &tv, &ov, &a_d, rank, seed);
            if m == 1 && round == 0 {
                alone = tv[..rank].to_vec();
            } else {
                assert_eq!(
                    tv[..rank],
                    alone[..],
                    "{what}: row 0 differs from alone, seed {seed}"
                );
            }
        }
    }
}

/// SiLU·mul from a split gate/up product's K-slices (`kernels::act::silu_mul_parts`) in bf16 at
/// Qwen2.5-7B's intermediate width, 64 rows, 2 and 9 slices: equal bit for bit to `silu_mul` of
/// the slices summed in order in f32 and rounded to bf16 (what the product's reduction writes).
#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_silu_mul_parts_bf16() {
    use qerl_engine::kernels::act::{silu_mul, silu_mul_parts};
    type F = half::bf16;
    let c = client();
    let (mut g, seed) = rng();
    let (width, rows) = (18944, 64);
    for splits in [2, 9] {
        let parts: Vec<f32> = (0..splits * rows * 2 * width)
            .map(|_| g.random_range(-2.0f32..2.0))
            .collect();
        let sum = |r: usize, col: usize| {
            (0..splits).fold(0.0f32, |a, s| a + parts[(s * rows + r) * 2 * width + col])
        };
        let gate: Vec<F> = to_f(
            &(0..rows * width)
                .map(|i| sum(i / width, i % width))
                .collect::<Vec<_>>(),
        );
        let upv: Vec<F> = to_f(
            &(0..rows * width)
                .map(|i| sum(i / width, width + i % width))
                .collect::<Vec<_>>(),
        );
        let want = up(&c, &vec![F::NAN; rows * width]);
        silu_mul::<R, F>(&c, &up(&c, &gate), &up(&c, &upv), &want, rows * width);
        let out = up(&c, &vec![F::NAN; rows * width]);
        silu_mul_parts::<R, F>(&c, &up(&c, &parts), splits, rows, width, &out);
        assert_eq!(
            read::<F>(&c, &out),
            read::<F>(&c, &want),
            "silu_mul_parts bf16 splits {splits}: differs from the reduced form, seed {seed}"
        );
    }
}

/// The add + RMSNorm spread over a cluster with the LoRA down-projections
/// (`qerl_kernels::norm_cluster`, sm_90) in bf16 at Qwen2.5 widths (896, 3584, 5120), at 1,
/// 9, 64 and 130 rows, 1, 2, 4 and 8 rows a cluster, the residual nothing, a product's output
/// or its 2 or 9 unreduced K-slices, with three, two or no adapters of rank 16: the norm's
/// output and the residual equal the engine's unfused kernel's bit for bit (its sums of squares
/// meet in the same tree), `T` equals an f64 host product of the kernel's own (rounded) row and
/// the adapter within a relative L2 error of 1e-5 (f32 sums of exact products), and row 0's `T`
/// is the same bits at 1 and 64 rows. Outputs are poisoned with NaN before each launch.
#[test]
#[ignore = "needs a CUDA GPU: cargo test -p qerl-engine --features cuda --test kernels_cuda -- --ignored"]
fn cuda_norm_cluster_bf16() {
    use qerl_engine::kernels::norm::{add_rms_norm, Residual};
    use qerl_kernels::norm_cluster::{add_norm_lora, launches, Add};
    type F = half::bf16;
    let c = client();
    let (mut g, seed) = rng();
    let mut uni = |n: usize| -> Vec<f32> { (0..n).map(|_| g.random_range(-1.0f32..1.0)).collect() };
    let rank = 16;
    let before = launches();
    let mut case = 0usize;
    for dim in [3584, 896, 5120] {
        let max_rows = 130;
        let h = to_f::<F>(&uni(max_rows * dim));
        let d = to_f::<F>(&uni(max_rows * dim));
        let gain: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
        let a: Vec<Vec<F>> = (0..3).map(|_| to_f::<F>(&uni(rank * dim))).collect();
        let gh = up::<f32>(&c, &gain);
        let ah: Vec<Handle> = a.iter().map(|v| up(&c, v)).collect();
        let mut row0_alone: Option<Vec<f64>> = None;
        for rpc in [1, 2, 4, 8] {
            for m in [1, 9, 64, 130] {
                case += 1;
                // The residual and adapters rotate with the case; the row-0 pair is fixed.
                let pair = rpc == 4 && (m == 1 || m == 64);
                let kind = if pair { 1 } else { case % 4 };
                let segments = if pair { 3 } else { [3, 2, 0][case % 3] };
                let slices = [0, 0, 2, 9][kind];
                let what = format!(
                    "norm_cluster dim {dim} rows {m} rpc {rpc} residual {kind} slices {slices} \
                     adapters {segments}"
                );
                let parts = uni(slices.max(1) * m * dim);
                let (dh, ph) = (up(&c, &d[..m * dim]), up::<f32>(&c, &parts));
                let (add, residual) = match kind {
                    0 => (Add::None, Residual::None),
                    1 => (Add::Dense(&dh), Residual::Dense(&dh)),
                    _ => (Add::Parts(&ph, slices), Residual::Parts(&ph, slices)),
                };
                let hh = up(&c, &h[..m * dim]);
                let y = up(&c, &vec![F::NAN; m * dim]);
                let th: Vec<Handle> = (0..segments)
                    .map(|_| up::<f32>(&c, &vec![f32::NAN; m * rank]))
                    .collect();
                let ran = add_norm_lora::<R, F>(
                    &c,
                    &hh,
                    add,
                    &gh,
                    m,
                    dim,
                    1e-6,
                    &y,
                    (
                        &ah.iter().take(segments).collect::<Vec<_>>(),
                        rank,
                        &th.iter().collect::<Vec<_>>(),
                    ),
                    Some(rpc),
                );
                assert!(ran, "{what}: applies");
                let (h_ref, y_ref) = (up(&c, &h[..m * dim]), up(&c, &vec![F::NAN; m * dim]));
                add_rms_norm::<R, F>(&c, &h_ref, m, residual, &gh, None, m, dim, 1e-6, &y_ref);
                let yv = read::<F>(&c, &y);
                let yr = read::<F>(&c, &y_ref);
                let diff = yv.iter().zip(&yr).filter(|(a, b)| a != b).count();
                assert!(
                    diff == 0,
                    "{what}: norm output differs from the unfused kernel's in {diff} of {} \
                     elements (first at {:?}), seed {seed}",
                    yv.len(),
                    yv.iter().zip(&yr).position(|(a, b)| a != b)
                );
                assert_eq!(
                    read::<F>(&c, &hh),
                    read::<F>(&c, &h_ref),
                    "{what}: residual, seed {seed}"
                );
                for (s, t) in th.iter().enumerate() {
                    let t = read::<f32>(&c, t);
                    let a_s: Vec<f64> = a[s].iter().map(|v| v.to_f64()).collect();
                    assert_lora_t(&format!("{what} adapter {s}"), &t, &yv, &a_s, rank, seed);
                    if pair && s == 0 {
                        match &row0_alone {
                            None => row0_alone = Some(t[..rank].to_vec()),
                            Some(alone) => assert_eq!(
                                &t[..rank],
                                &alone[..],
                                "{what}: row 0's T differs from alone, seed {seed}"
                            ),
                        }
                    }
                }
            }
        }
    }
    assert_eq!(
        launches() - before,
        case,
        "norm_cluster: every case launched it"
    );
}
