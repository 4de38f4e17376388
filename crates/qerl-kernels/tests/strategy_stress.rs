//! The training products back to back, through every product strategy, against a host reference.
//!
//! Issue 16 item 4: with `QERL_GEMM=tuned` a 7B GRPO step reported a gradient norm of 1.4e10
//! where the tensor-core path gives 0.42. A single product checked alone (tests/kernels.rs) waits
//! for the device before reading, so it cannot see the failures that only show in a training
//! step: an output read by the next product before its writer finished (cuBLAS runs on its own
//! CUDA stream, ordered with cubecl's only by host syncs), a buffer handed back to cubecl's pool
//! while a product still reads it, a tuning pass starting in the middle of the step, or a buffer
//! made on one host thread (one cubecl stream) and used on another. So each round here runs what
//! a training step runs, without waiting in between:
//!
//! * a forward of three linears chained (each output is the next input): a plain one, one with
//!   bias and LoRA (`lora_down`, then the product with both in its epilogue), one with LoRA only;
//! * the backward dX chain through the same three weights;
//! * every input that is not needed any more (the uploaded X and dY, LoRA's `T`) dropped as soon
//!   as its consumer is queued, and a buffer of the same size made at once and filled with NaN
//!   bytes, so a product that still reads freed memory reads NaN;
//! * M changing from round to round across the tuner's power-of-two buckets (one round in the
//!   decode kernel's range), so a tuning pass starts in the middle of a chain; layer shapes
//!   drawn per run, so the tuning cache on disk does not answer every key.
//!
//! Next to every output a live "canary" buffer with a known byte pattern is made; it must be
//! unchanged at the end of the round (a product, or a tuning pass timing candidates, that writes
//! memory it does not own).
//!
//! Every output is read only at the end of its round and checked against the f64 product of
//! the values the device was given (the previous output as read back), so a consumer that ran
//! before its producer finished shows up as a wrong output even if memory is right by then.
//! The two-thread test runs the same rounds from two host threads at once (two cubecl streams)
//! on weights uploaded by the main thread, with each round's first input and dY uploaded by the
//! main thread and used directly by the worker's first product (the plain linear, which cuBLAS
//! reads without a widening kernel in between).
//!
//! CUDA: `#[ignore]`d (needs a GPU): `source tools/device_cuda_libs.sh && cargo test --release
//! -p qerl-kernels --features cuda --test strategy_stress -- --ignored` (without libcublas the
//! GPU tests fail unless `QERL_STRESS_WITHOUT_CUBLAS=1`). wgpu (lavapipe here) runs the same
//! body at small sizes on the portable kernels: no tensor cores or cuBLAS there, so it checks the
//! test and cubecl's own ordering, not the strategies.

use std::sync::Mutex;

use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_format::{QuantFormat, QuantizedWeight, SourceDtype};
use qerl_kernels::{gemm, DeviceWeight};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

/// The strategy switch is process-wide: tests of this binary take turns.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn normal(rng: &mut StdRng, len: usize, std: f32) -> Vec<f32> {
    let d = Normal::new(0.0f32, std).unwrap();
    (0..len).map(|_| d.sample(rng)).collect()
}

fn to_f<F: Float>(v: &[f32]) -> Vec<F> {
    v.iter().map(|&x| F::from(x).unwrap()).collect()
}

/// Values as the device sees them: rounded to `F`, widened to f64.
fn rounded<F: Float>(v: &[f32]) -> Vec<f64> {
    to_f::<F>(v).iter().map(|x| x.to_f64().unwrap()).collect()
}

fn upload<R: Runtime, F: Float + CubeElement>(c: &ComputeClient<R>, v: &[f32]) -> Handle {
    c.create_from_slice(F::as_bytes(&to_f::<F>(v)))
}

fn read<R: Runtime, F: Float + CubeElement>(c: &ComputeClient<R>, h: &Handle) -> Vec<f64> {
    let bytes = c.read_one(h.clone()).expect("read back");
    F::from_bytes(&bytes)
        .iter()
        .map(|x| x.to_f64().unwrap())
        .collect()
}

/// A buffer of `bytes` 0xFF bytes (NaN in f32, f16 and bf16), made right after a buffer of that
/// size was dropped so that the pool is likely to hand it the freed memory.
fn nan_bytes<R: Runtime>(c: &ComputeClient<R>, bytes: usize) -> Handle {
    c.create_from_slice(&vec![0xffu8; bytes])
}

/// The bytes of canary `tag`: a byte pattern, not values any product would compute.
fn canary_bytes(len: usize, tag: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ tag.wrapping_mul(97)) as u8)
        .collect()
}

/// A live buffer made right after an output, so the pool is likely to place it next to that
/// output: a product (or a tuning pass timing one) that writes past its output, or into memory
/// it does not own, changes it.
fn canary<R: Runtime>(c: &ComputeClient<R>, len: usize, tag: usize) -> (Handle, usize) {
    (c.create_from_slice(&canary_bytes(len, tag)), tag)
}

/// A LoRA adapter: `A[r, K]`, `B[N, r]` on the device and as the device sees them.
struct Adapter {
    a: Handle,
    b: Handle,
    a_ref: Vec<f64>,
    b_ref: Vec<f64>,
    rank: usize,
    scale: f32,
}

/// One linear of the chain: `[n, k]` NVFP4 weight, optional bias and adapter.
struct Linear {
    n: usize,
    k: usize,
    weight: DeviceWeight,
    deq: Vec<f64>,
    bias: Option<(Handle, Vec<f64>)>,
    lora: Option<Adapter>,
}

fn random_weight(rng: &mut StdRng, n: usize, k: usize) -> QuantizedWeight {
    let mut w = normal(rng, n * k, 0.05);
    for _ in 0..(n * k / 97).max(1) {
        let i = rng.random_range(0..n * k);
        w[i] *= 20.0;
    }
    QuantizedWeight::quantize(
        QuantFormat::Nvfp4,
        "stress.weight",
        &w,
        &[n, k],
        SourceDtype::F32,
    )
    .unwrap()
}

impl Linear {
    fn new<R: Runtime, F: Float + CubeElement>(
        c: &ComputeClient<R>,
        rng: &mut StdRng,
        (n, k): (usize, usize),
        with_bias: bool,
        rank: Option<usize>,
    ) -> Linear {
        let w = random_weight(rng, n, k);
        let weight = DeviceWeight::upload(c, &w).unwrap();
        let deq = w.dequantize().iter().map(|&v| v as f64).collect();
        let bias = with_bias.then(|| {
            let b = normal(rng, n, 0.5);
            (upload::<R, F>(c, &b), rounded::<F>(&b))
        });
        let lora = rank.map(|rank| {
            let (a, b) = (normal(rng, rank * k, 0.1), normal(rng, n * rank, 0.1));
            Adapter {
                a: upload::<R, F>(c, &a),
                b: upload::<R, F>(c, &b),
                a_ref: rounded::<F>(&a),
                b_ref: rounded::<F>(&b),
                rank,
                scale: 2.0,
            }
        });
        Linear {
            n,
            k,
            weight,
            deq,
            bias,
            lora,
        }
    }

    /// `y = x·deq(W)ᵀ (+ bias) (+ s·(x·Aᵀ)·Bᵀ)` in f64 for `m` rows of `x`.
    fn forward_ref(&self, x: &[f64], m: usize) -> Vec<f64> {
        let (n, k) = (self.n, self.k);
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            let t: Vec<f64> = self.lora.as_ref().map_or(vec![], |l| {
                (0..l.rank)
                    .map(|r| dot(xr, &l.a_ref[r * k..(r + 1) * k]))
                    .collect()
            });
            for j in 0..n {
                let mut v = dot(xr, &self.deq[j * k..(j + 1) * k]);
                if let Some((_, b)) = &self.bias {
                    v += b[j];
                }
                if let Some(l) = &self.lora {
                    let br = &l.b_ref[j * l.rank..(j + 1) * l.rank];
                    v += l.scale as f64 * dot(&t, br);
                }
                y[i * n + j] = v;
            }
        }
        y
    }

    /// `dx = dy·deq(W)` in f64 for `m` rows of `dy`.
    fn dx_ref(&self, dy: &[f64], m: usize) -> Vec<f64> {
        let (n, k) = (self.n, self.k);
        let mut dx = vec![0.0; m * k];
        for i in 0..m {
            let out = &mut dx[i * k..(i + 1) * k];
            for j in 0..n {
                let g = dy[i * n + j];
                for (o, w) in out.iter_mut().zip(&self.deq[j * k..(j + 1) * k]) {
                    *o += g * w;
                }
            }
        }
        dx
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Sizes of one run: the chain's widths `d0 -> d1 -> d2 -> d3`, the rows of each round, the
/// LoRA rank.
struct Plan {
    widths: [usize; 4],
    rows: Vec<usize>,
    rank: usize,
}

impl Plan {
    /// On a GPU: widths drawn in multiples of 32 (the tensor cores' stage; dX on them needs
    /// `N % 32 == 0`), rows across the tuner's buckets 8, 32, 64, 128, 256 and 512 and back.
    fn gpu(rng: &mut StdRng) -> Plan {
        let mut width = || 32 * rng.random_range(6..=16);
        Plan {
            widths: [width(), width(), width(), width()],
            rows: vec![40, 5, 72, 136, 24, 264, 72, 520, 40],
            rank: 16,
        }
    }

    /// On a GPU, at a 7B model's widths (hidden 3584, k_proj 512): two rounds whose buckets the
    /// random-width plan also visits, so their keys differ only in N and K.
    fn gpu_7b() -> Plan {
        Plan {
            widths: [3584, 512, 3584, 1024],
            rows: vec![264, 130],
            rank: 16,
        }
    }

    /// On a CPU Vulkan driver: small enough for the portable kernels to run in seconds.
    fn cpu(rng: &mut StdRng) -> Plan {
        let mut width = || 16 * rng.random_range(2..=5);
        Plan {
            widths: [width(), width(), width(), width()],
            rows: vec![17, 3, 33, 9],
            rank: 4,
        }
    }
}

/// The chain: plain, bias + LoRA, LoRA only.
fn build_chain<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    rng: &mut StdRng,
    plan: &Plan,
) -> Vec<Linear> {
    let d = plan.widths;
    vec![
        Linear::new::<R, F>(c, rng, (d[1], d[0]), false, None),
        Linear::new::<R, F>(c, rng, (d[2], d[1]), true, Some(plan.rank)),
        Linear::new::<R, F>(c, rng, (d[3], d[2]), false, Some(plan.rank)),
    ]
}

/// What one round leaves to check: the device buffers, read once the round is queued.
struct Round {
    m: usize,
    x0: Vec<f64>,
    dy0: Vec<f64>,
    /// Output of each linear, in order.
    ys: Vec<Handle>,
    /// dX of each linear, last linear first.
    dxs: Vec<Handle>,
    /// Live buffers that nothing may change, with their pattern's tag.
    canaries: Vec<(Handle, usize)>,
}

/// The device buffers a queued round leaves: outputs, dX, canaries.
struct Queued {
    ys: Vec<Handle>,
    dxs: Vec<Handle>,
    canaries: Vec<(Handle, usize)>,
}

/// Queues one round (forward chain, then the dX chain) for `m` rows whose first input and
/// output gradient are the given device buffers; nothing waits for the device.
fn queue_round<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    chain: &[Linear],
    m: usize,
    x0: Handle,
    dy0: Handle,
) -> Queued {
    let size = std::mem::size_of::<F>();
    let mut canaries = Vec::new();
    // Buffers made only to take freed memory; dropped after the next linear is queued.
    let mut grabbers = Vec::new();
    let mut x = x0;
    let mut ys = Vec::new();
    for (i, layer) in chain.iter().enumerate() {
        let y = c.empty(m * layer.n * size);
        canaries.push(canary(c, m * layer.n * size, canaries.len()));
        let t = layer.lora.as_ref().map(|l| {
            let t = c.empty(m * l.rank * 4);
            gemm::lora_down::<R, F>(c, &x, &l.a, &t, m, layer.k, l.rank).unwrap();
            t
        });
        let epilogue = layer
            .lora
            .as_ref()
            .zip(t.as_ref())
            .map(|(l, t)| gemm::LoraEpilogue {
                t,
                b: &l.b,
                rank: l.rank,
                scale: l.scale,
            });
        let bias = layer.bias.as_ref().map(|(h, _)| h);
        gemm::matmul::<R, F>(c, &x, m, &layer.weight, bias, epilogue, &y).unwrap();
        grabbers.clear();
        if let Some(t) = t {
            drop(t);
            grabbers.push(nan_bytes(
                c,
                m * layer.lora.as_ref().map_or(0, |l| l.rank) * 4,
            ));
        }
        if i == 0 {
            // The uploaded input is needed by nothing else.
            drop(x);
            grabbers.push(nan_bytes(c, m * layer.k * size));
        }
        ys.push(y.clone());
        x = y;
    }
    let mut dy = dy0;
    let mut dxs = Vec::new();
    for (i, layer) in chain.iter().enumerate().rev() {
        let dx = c.empty(m * layer.k * size);
        canaries.push(canary(c, m * layer.k * size, canaries.len()));
        gemm::matmul_transposed::<R, F>(c, &dy, m, &layer.weight, &dx).unwrap();
        grabbers.clear();
        if i == chain.len() - 1 {
            drop(dy);
            grabbers.push(nan_bytes(c, m * layer.n * size));
        }
        dxs.push(dx.clone());
        dy = dx;
    }
    Queued { ys, dxs, canaries }
}

/// Relative Frobenius error of `got` against `want`, with every element finite.
fn check(what: &str, got: &[f64], want: &[f64], tol: f64, seed: u64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        return Err(format!(
            "{what}: element {i} is {} (read freed or unwritten memory), seed {seed}",
            got[i]
        ));
    }
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want
        .iter()
        .map(|w| w * w)
        .sum::<f64>()
        .max(f64::MIN_POSITIVE);
    let rel = (num / den).sqrt();
    if rel > tol {
        return Err(format!(
            "{what}: relative error {rel:.3e} > {tol:.1e}, seed {seed}"
        ));
    }
    Ok(())
}

/// Reads a round back and checks every output against the f64 product of its device input.
fn check_round<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    chain: &[Linear],
    round: &Round,
    what: &str,
    tol: f64,
    seed: u64,
) -> Result<(), String> {
    let m = round.m;
    let mut x = round.x0.clone();
    for (i, (layer, y)) in chain.iter().zip(&round.ys).enumerate() {
        let got = read::<R, F>(c, y);
        let want = layer.forward_ref(&x, m);
        check(&format!("{what} M={m} forward {i}"), &got, &want, tol, seed)?;
        x = got;
    }
    let mut dy = round.dy0.clone();
    for (step, dx) in round.dxs.iter().enumerate() {
        let i = chain.len() - 1 - step;
        let got = read::<R, F>(c, dx);
        let want = chain[i].dx_ref(&dy, m);
        check(&format!("{what} M={m} dX {i}"), &got, &want, tol, seed)?;
        dy = got;
    }
    for (h, tag) in &round.canaries {
        let got = c.read_one(h.clone()).expect("read back");
        let want = canary_bytes(got.len(), *tag);
        if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
            return Err(format!(
                "{what} M={m}: live buffer {tag} (made next to an output) changed at byte {at} \
                 of {}: something wrote memory it does not own, seed {seed}",
                got.len()
            ));
        }
    }
    Ok(())
}

/// Set to run the GPU tests without cuBLAS (the tensor-core strategies and a tuner choosing
/// among them only); by default a GPU run without libcublas fails, since the strategy under
/// suspicion would silently go unchecked.
const WITHOUT_CUBLAS_ENV: &str = "QERL_STRESS_WITHOUT_CUBLAS";

/// Every strategy a product above the decode kernel can take on this client for `F`.
fn strategies<R: Runtime, F: Float>(c: &ComputeClient<R>, gpu: bool) -> Vec<gemm::Strategy> {
    // Auto first: the default, tensor cores below `cublas_min_m` rows and cuBLAS from there.
    let mut all = vec![gemm::Strategy::Auto, gemm::Strategy::TensorCores];
    all.extend(gemm::TileConfig::ALL.map(gemm::Strategy::TensorCoresTiles));
    if gemm::cublas_usable::<R, F>(c) {
        all.push(gemm::Strategy::Cublas);
    } else {
        let name = std::any::type_name::<F>();
        assert!(
            !gpu || std::env::var_os(WITHOUT_CUBLAS_ENV).is_some(),
            "libcublas cannot be loaded for {name}: `source tools/device_cuda_libs.sh` first, or \
             set {WITHOUT_CUBLAS_ENV}=1 to check the tensor-core strategies alone"
        );
        eprintln!("note: no cuBLAS for {name} here");
    }
    // Last: the tuner then picks among candidates whose kernels are already compiled, and its
    // passes start in the middle of chains.
    all.push(gemm::Strategy::Tuned);
    all
}

/// Restores the strategy in force before, even when a check panics.
struct StrategyGuard(gemm::Strategy);

impl StrategyGuard {
    fn set(s: gemm::Strategy) -> StrategyGuard {
        let before = gemm::strategy().expect("QERL_GEMM");
        gemm::set_strategy(s);
        StrategyGuard(before)
    }
}

impl Drop for StrategyGuard {
    fn drop(&mut self) {
        gemm::set_strategy(self.0);
    }
}

fn fresh_seed() -> u64 {
    rand::rng().random()
}

fn supported<R: Runtime, F: Float>(c: &ComputeClient<R>) -> bool {
    let ok = c.properties().supports_type(F::as_type_native_unchecked());
    if !ok {
        eprintln!("skipped: this device has no {}", std::any::type_name::<F>());
    }
    ok
}

/// A round's first input and output gradient: host values, then the device buffers.
type Inputs = (Vec<f32>, Vec<f32>, Handle, Handle);

/// Runs `rounds` rounds of `plan` on `chain` from this thread, each round's inputs made by
/// `inputs` (which may hand over buffers made on another thread), queued back to back; reads
/// and checks each round only after the next one is queued.
fn run_rounds<R: Runtime, F: Float + CubeElement>(
    c: &ComputeClient<R>,
    chain: &[Linear],
    rows: &[usize],
    mut inputs: impl FnMut(usize) -> Inputs,
    what: &str,
    tol: f64,
    seed: u64,
) -> Result<(), String> {
    let mut pending: Option<Round> = None;
    for &m in rows {
        let (x0, dy0, x0_h, dy0_h) = inputs(m);
        let queued = queue_round::<R, F>(c, chain, m, x0_h, dy0_h);
        let round = Round {
            m,
            x0: rounded::<F>(&x0),
            dy0: rounded::<F>(&dy0),
            ys: queued.ys,
            dxs: queued.dxs,
            canaries: queued.canaries,
        };
        if let Some(previous) = pending.replace(round) {
            check_round::<R, F>(c, chain, &previous, what, tol, seed)?;
        }
    }
    match pending {
        Some(last) => check_round::<R, F>(c, chain, &last, what, tol, seed),
        None => Ok(()),
    }
}

/// Every strategy, `plan.rows` rounds each, from one thread.
pub fn back_to_back<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64, gpu: bool) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let seed = fresh_seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let plans = if gpu {
        vec![Plan::gpu(&mut rng), Plan::gpu_7b()]
    } else {
        vec![Plan::cpu(&mut rng)]
    };
    for plan in &plans {
        let chain = build_chain::<R, F>(&c, &mut rng, plan);
        let (d0, d3) = (plan.widths[0], plan.widths[3]);
        for strategy in strategies::<R, F>(&c, gpu) {
            let _s = StrategyGuard::set(strategy);
            let what = format!("{strategy:?} widths {:?}", plan.widths);
            let mut data = StdRng::seed_from_u64(rng.random());
            let inputs = |m: usize| {
                let (x0, dy0) = (
                    normal(&mut data, m * d0, 1.0),
                    normal(&mut data, m * d3, 1.0),
                );
                let (xh, dyh) = (upload::<R, F>(&c, &x0), upload::<R, F>(&c, &dy0));
                (x0, dy0, xh, dyh)
            };
            if let Err(e) = run_rounds::<R, F>(&c, &chain, &plan.rows, inputs, &what, tol, seed) {
                panic!("{e}");
            }
        }
    }
}

/// The same rounds from two host threads at once (two cubecl streams, two memory pools), on
/// weights uploaded by this thread; each round's X and dY are uploaded by this thread and
/// handed to the worker, whose first product reads them directly.
///
/// The worker keeps those buffers until it has read its last round back. Dropping a buffer
/// made on another thread right after queuing its consumer is unsafe in cubecl 0.10 whatever
/// the kernel: the slice goes back to its maker's pool at once (on CUDA the cross-stream "GC"
/// task holds only memory ids, cubecl-runtime-0.10.0/src/stream/event.rs:166-187), and the
/// maker's next allocation can overwrite it before the consumer's stream has run. This test
/// failed that way on lavapipe (forward 0 wrong on both workers) before the buffers were kept.
pub fn two_threads<R: Runtime, F: Float + CubeElement>(device: &R::Device, tol: f64, gpu: bool)
where
    R::Device: Send + Sync,
{
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let seed = fresh_seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let plan = if gpu {
        Plan::gpu(&mut rng)
    } else {
        Plan::cpu(&mut rng)
    };
    let chain = build_chain::<R, F>(&c, &mut rng, &plan);
    let (d0, d3) = (plan.widths[0], plan.widths[3]);
    for strategy in strategies::<R, F>(&c, gpu) {
        let _s = StrategyGuard::set(strategy);
        let what = format!("{strategy:?} widths {:?}", plan.widths);
        let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
            // Rendezvous channels: a worker gets a round's inputs the moment this thread has
            // queued their upload, and uses them at once.
            let (senders, workers): (Vec<_>, Vec<_>) = (0..2)
                .map(|w| {
                    let (tx, rx) = std::sync::mpsc::sync_channel(0);
                    let (chain, rows, what) = (&chain, &plan.rows, format!("{what} thread {w}"));
                    let worker = scope.spawn(move || {
                        let c = R::client(device);
                        // The main thread's buffers are dropped here only after the last round
                        // was read back (see `two_threads`).
                        let mut handed_over = Vec::new();
                        let inputs = move |_m: usize| {
                            let (x0, dy0, xh, dyh): Inputs = rx.recv().expect("inputs of a round");
                            handed_over.push((xh.clone(), dyh.clone()));
                            (x0, dy0, xh, dyh)
                        };
                        run_rounds::<R, F>(&c, chain, rows, inputs, &what, tol, seed)
                    });
                    (tx, worker)
                })
                .unzip();
            let mut data = StdRng::seed_from_u64(rng.random());
            'rounds: for &m in &plan.rows {
                for tx in &senders {
                    let (x0, dy0) = (
                        normal(&mut data, m * d0, 1.0),
                        normal(&mut data, m * d3, 1.0),
                    );
                    let (xh, dyh) = (upload::<R, F>(&c, &x0), upload::<R, F>(&c, &dy0));
                    // A worker that failed has stopped taking inputs.
                    if tx.send((x0, dy0, xh, dyh)).is_err() {
                        break 'rounds;
                    }
                }
            }
            drop(senders);
            workers
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("worker panicked".into())))
                .collect()
        });
        let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}

/// Writes one element; launched with an impossible grid to make the device record a failed
/// launch.
#[cube(launch_unchecked)]
fn touch_one(out: &mut Array<f32>) {
    if ABSOLUTE_POS == 0 {
        out[0] = 1.0;
    }
}

/// Queues a launch the device refuses (a grid's z of 2^20 cubes, past CUDA's 65535).
fn queue_failing_launch<R: Runtime>(c: &ComputeClient<R>, target: &Handle) {
    // SAFETY: the kernel writes element 0 of a 1-element buffer; the launch itself is refused.
    unsafe {
        touch_one::launch_unchecked::<R>(
            c,
            CubeCount::Static(1, 1, 1 << 20),
            CubeDim::new_1d(1),
            ArrayArg::from_raw_parts(target.clone(), 1),
        );
    }
}

/// A launch that failed just before the first product of a new key is reported by that
/// product, not erased by the tuning pass it starts (CubeCL's tuner flushes the stream's error
/// list and drops it): the error is what tells the caller an output was never written.
///
/// GPU only: wgpu validates dispatches itself and may take the device thread down with a
/// refused one, which would fail every later test of this binary.
pub fn earlier_failure_reported<R: Runtime, F: Float + CubeElement>(device: &R::Device, gpu: bool) {
    if !gpu {
        eprintln!("skipped: refused launches are only provoked on CUDA");
        return;
    }
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let c = R::client(device);
    if !supported::<R, F>(&c) {
        return;
    }
    let target = c.create_from_slice(f32::as_bytes(&[0.0f32]));
    // Control: this device reports the refused launch at all.
    queue_failing_launch(&c, &target);
    if c.flush().is_ok() {
        eprintln!("skipped: this runtime accepted or ignored the impossible grid");
        return;
    }
    let seed = fresh_seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // A shape no earlier run is likely to have tuned (the key is exact in N and K).
    let (n, k, m) = (
        32 * rng.random_range(40..200),
        32 * rng.random_range(40..200),
        96,
    );
    let layer = Linear::new::<R, F>(&c, &mut rng, (n, k), false, None);
    let x = upload::<R, F>(&c, &normal(&mut rng, m * k, 1.0));
    let y = c.empty(m * n * std::mem::size_of::<F>());
    let _s = StrategyGuard::set(gemm::Strategy::Tuned);
    queue_failing_launch(&c, &target);
    let product = gemm::matmul::<R, F>(&c, &x, m, &layer.weight, None, None, &y);
    let after = c.flush();
    assert!(
        product.is_err() || after.is_err(),
        "a refused launch before a tuning pass was lost: the product returned {product:?} and \
         the device reports nothing (N={n} K={k}, seed {seed})"
    );
}

macro_rules! stress {
    ($name:ident, $runtime:ty, $device:expr, $float:ty, $tol:expr, $gpu:expr $(, #[$attr:meta])?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $(#[$attr])? #[test]
            fn training_products_back_to_back() {
                super::back_to_back::<$runtime, $float>(&$device, $tol, $gpu)
            }

            $(#[$attr])? #[test]
            fn training_products_from_two_threads() {
                super::two_threads::<$runtime, $float>(&$device, $tol, $gpu)
            }

            $(#[$attr])? #[test]
            fn earlier_failure_reported_by_a_tuned_product() {
                super::earlier_failure_reported::<$runtime, $float>(&$device, $gpu)
            }
        }
    };
}

#[cfg(feature = "wgpu")]
stress!(
    wgpu_f32,
    cubecl::wgpu::WgpuRuntime,
    cubecl::wgpu::WgpuDevice::default(),
    f32,
    1e-5,
    false
);

#[cfg(feature = "wgpu")]
stress!(
    wgpu_f16,
    cubecl::wgpu::WgpuRuntime,
    cubecl::wgpu::WgpuDevice::default(),
    half::f16,
    2e-3,
    false
);

#[cfg(feature = "cuda")]
stress!(cuda_bf16, cubecl::cuda::CudaRuntime, cubecl::cuda::CudaDevice::new(0), half::bf16,
    1e-2, true,
    #[ignore = "needs a CUDA GPU: cargo test --release -p qerl-kernels --features cuda --test strategy_stress -- --ignored"]);
#[cfg(feature = "cuda")]
stress!(cuda_f16, cubecl::cuda::CudaRuntime, cubecl::cuda::CudaDevice::new(0), half::f16,
    2e-3, true,
    #[ignore = "needs a CUDA GPU: cargo test --release -p qerl-kernels --features cuda --test strategy_stress -- --ignored"]);
