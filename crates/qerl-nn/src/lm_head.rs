//! Log-probabilities and entropies of chosen tokens through the lm_head, a chunk of rows at a
//! time, so that the `[tokens, vocab]` logits never exist at once (the idea of Liger's fused
//! linear cross-entropy and Apple's Cut Cross-Entropy; the implementation is ours, on burn ops).
//!
//! For hidden states `h [M, K]`, the output projection `W [V, K]`, a temperature `T` and the
//! chosen tokens `y [M]`, with `z = h·Wᵀ / T` (the product in the backend's float type, then
//! cast to f32 as the unfused path did):
//!
//! ```text
//! logp_i = z_{i,y_i} - lse_i            lse_i = log Σ_v exp z_{i,v}
//! H_i    = lse_i - Σ_v p_{i,v} z_{i,v}  (entropy, nats)   p = softmax(z)
//! ```
//!
//! Forward: per chunk of at most `rows` tokens ([`chunks`]: equal sizes), `z`, its row max, `exp`, the sums, the gathered
//! `z_y`; only `[M]` numbers (log p, entropy, lse) survive the chunk. Backward (with upstream
//! gradients `g` of log p and `e` of the entropy), per chunk, recomputing `z` and
//! `p = exp(z - lse)` from the kept `lse`:
//!
//! ```text
//! dz  = g·onehot(y) - p ⊙ (g + e·(z - E_p[z]))      E_p[z] = lse - H
//! dh  = (dz / T)·W      = (-(p ⊙ c) / T)·W + (g / T)·W[y]
//! dW  = (dz / T)ᵀ·h     (only when W is trainable: tied embeddings under `qerl sft`)
//! ```
//!
//! Peak extra memory is a few `[rows, V]` f32 buffers in each pass instead of the full
//! `[M, V]` logits in the float type, their f32 copy, the log-softmax and its gradient.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorPrimitive};

use crate::backend::QerlBackend;

/// Device memory a chunk takes per vocabulary entry of one row, as measured: the unfused
/// element-wise passes each leave an f32 `[rows, V]` buffer (the product's output, its f32
/// copy, the scaled and shifted logits, `exp`, `p`, `dz` and its cast), and the allocator's pool
/// rounds them up. On an H100 (bf16, hidden 3584, V 152,064) 256-row chunks raised the pool by
/// 1.49 GB over forward + backward: 38 bytes a logit.
const BYTES_PER_LOGIT: usize = 40;

/// Default memory budget of one chunk's temporaries: 2 GiB (320 rows of Qwen2.5's 152,064-entry
/// vocabulary; 4,096 rows, the cap, of a vocabulary up to ~13k).
pub const DEFAULT_CHUNK_BUDGET_BYTES: usize = 2 << 30;

/// Most rows a chunk takes when the budget is chosen from memory: enough to keep the product
/// efficient; more gains nothing.
pub const MAX_CHUNK_ROWS: usize = 4096;

/// How [`lm_head_log_probs`] runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogProbOptions {
    /// The sampling temperature the logits are divided by (TRL's `GRPOTrainer` convention;
    /// `<= 0` or `1` leaves them as they are).
    pub temperature: f32,
    /// Tokens (rows) per chunk; `0` chooses it from [`DEFAULT_CHUNK_BUDGET_BYTES`].
    pub chunk_rows: usize,
    pub entropy: Entropy,
}

/// Whether [`lm_head_log_probs`] computes the entropy, and whether it is differentiable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Entropy {
    /// Not computed: 0.
    #[default]
    Off,
    /// Computed, without a gradient (a metric: the backward skips its term).
    Metric,
    /// Computed and differentiable (an entropy bonus in the loss).
    Differentiable,
}

impl Default for LogProbOptions {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            chunk_rows: 0,
            entropy: Entropy::Off,
        }
    }
}

impl LogProbOptions {
    /// Rows per chunk for a vocabulary of `vocab` entries.
    pub fn rows(&self, vocab: usize) -> usize {
        if self.chunk_rows > 0 {
            self.chunk_rows
        } else {
            rows_for_budget(vocab, DEFAULT_CHUNK_BUDGET_BYTES)
        }
    }

    fn scaled(&self) -> bool {
        self.temperature > 0.0 && self.temperature != 1.0
    }
}

/// Rows per chunk whose temporaries fit `budget_bytes` for a vocabulary of `vocab` entries:
/// a multiple of 64 (16 below 64 rows) in `[16, MAX_CHUNK_ROWS]`.
pub fn rows_for_budget(vocab: usize, budget_bytes: usize) -> usize {
    let rows = budget_bytes / (vocab.max(1) * BYTES_PER_LOGIT);
    let rows = if rows >= 64 {
        rows / 64 * 64
    } else {
        rows / 16 * 16
    };
    rows.clamp(16, MAX_CHUNK_ROWS)
}

/// Log-probability of `targets [M]` and entropy of the (temperature-scaled) next-token
/// distribution for final hidden states `hidden [M, K]` and the output projection
/// `weight [V, K]` (lm_head, or the tied embeddings), `opts.rows(V)` rows at a time: `[M]`
/// each, f32 whatever the backend's float type.
///
/// Under `Autodiff<B>` the gradient reaches `hidden`, and `weight` when it is tracked (a
/// trainable lm_head or tied embeddings); the backward recomputes each chunk's logits. The
/// entropy is 0 under [`Entropy::Off`], a constant under [`Entropy::Metric`], and
/// differentiable under [`Entropy::Differentiable`].
pub fn lm_head_log_probs<B: QerlBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    opts: &LogProbOptions,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let [m, k] = hidden.dims();
    let [_, kw] = weight.dims();
    assert_eq!(
        k, kw,
        "lm_head_log_probs: hidden [{m}, {k}] against weight [.., {kw}]"
    );
    assert_eq!(
        targets.dims()[0],
        m,
        "lm_head_log_probs: {} targets for {m} rows",
        targets.dims()[0]
    );
    if m == 0 {
        let z = Tensor::<B, 1>::zeros([0], (&hidden.device(), DType::F32));
        return (z.clone(), z);
    }
    let out = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::lm_head_log_probs(
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        targets.into_primitive(),
        *opts,
    )));
    let logp = out.clone().slice([0..m, 0..1]).reshape([m]);
    let entropy = out.slice([0..m, 1..2]).reshape([m]);
    let entropy = match opts.entropy {
        Entropy::Differentiable => entropy,
        // the backward ignores its gradient: make that visible
        Entropy::Off | Entropy::Metric => entropy.detach(),
    };
    (logp, entropy)
}

/// The default [`QerlBackend::lm_head_log_probs`]: the chunked forward on any backend (no
/// graph of its own: under `Autodiff` the override below records the custom backward).
pub(crate) fn forward_prim<B: QerlBackend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    opts: LogProbOptions,
) -> FloatTensor<B> {
    let (out, _) = forward::<B>(f2(hidden), f2(weight), i1(targets), &opts);
    out.into_primitive().tensor()
}

/// `m` rows in chunks of at most `rows`, all of one size give or take a row (`m = 1100`,
/// `rows = 512`: 366, 367, 367), so that the allocator reuses one set of buffers instead of
/// keeping a second, smaller set for a short last chunk.
pub fn chunks(m: usize, rows: usize) -> Vec<std::ops::Range<usize>> {
    let n = m.div_ceil(rows.max(1));
    (0..n).map(|i| i * m / n..(i + 1) * m / n).collect()
}

fn f2<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn f1<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn i1<B: Backend>(p: IntTensor<B>) -> Tensor<B, 1, Int> {
    Tensor::from_primitive(p)
}

/// `op(a)·op(b)` through [`QerlBackend::dense_matmul`] (cuBLAS on CUDA, no autotuning).
fn dense<B: QerlBackend>(a: Tensor<B, 2>, a_t: bool, b: Tensor<B, 2>, b_t: bool) -> Tensor<B, 2> {
    let (a, b) = (a.into_primitive().tensor(), b.into_primitive().tensor());
    f2(B::dense_matmul(a, a_t, b, b_t, 1.0))
}

/// `z = h_c·Wᵀ` in the float type, then f32, divided by the temperature: `[rows, V]`.
fn logits_chunk<B: QerlBackend>(
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    opts: &LogProbOptions,
) -> Tensor<B, 2> {
    let z = dense::<B>(h, false, w, true).cast(DType::F32);
    if opts.scaled() {
        z.div_scalar(opts.temperature)
    } else {
        z
    }
}

/// Chunked forward: `([M, 2] = (log p, entropy), lse [M])`, all f32.
fn forward<B: QerlBackend>(
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    y: Tensor<B, 1, Int>,
    opts: &LogProbOptions,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let [m, k] = h.dims();
    let rows = opts.rows(w.dims()[0]);
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for std::ops::Range { start, end } in chunks(m, rows) {
        let z = logits_chunk(h.clone().slice([start..end, 0..k]), w.clone(), opts);
        let max = z.clone().max_dim(1); // [c, 1]
        let zs = z - max.clone();
        let e = zs.clone().exp();
        let sum = e.clone().sum_dim(1);
        let log_sum = sum.clone().log();
        let yc = y.clone().slice(start..end).unsqueeze_dim::<2>(1);
        // log_softmax as burn computes it: shifted - log(sum(exp(shifted)))
        let logp = zs.clone().gather(1, yc) - log_sum.clone();
        let ent = if opts.entropy != Entropy::Off {
            log_sum.clone() - (e * zs).sum_dim(1) / sum
        } else {
            logp.zeros_like()
        };
        outs.push(Tensor::cat(vec![logp, ent], 1));
        lses.push(max + log_sum);
    }
    (Tensor::cat(outs, 0), Tensor::cat(lses, 0).reshape([m]))
}

/// What the backward keeps: the inputs (references to buffers that exist anyway), the
/// forward's `[M, 2]` result and the `[M]` log-sum-exps.
#[derive(Clone, Debug)]
struct LmHeadState<B: QerlBackend> {
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    opts: LogProbOptions,
}

#[derive(Debug)]
struct LmHeadBackward;

impl<B: QerlBackend> Backward<B, 2> for LmHeadBackward {
    type State = LmHeadState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [ph, pw] = ops.parents;
        let s = ops.state;
        let (dh, dw) = backward::<B>(
            f2(s.hidden),
            f2(s.weight),
            i1(s.targets),
            f2(s.out),
            f1(s.lse),
            f2(grad),
            &s.opts,
            pw.is_some(),
        );
        if let Some(node) = ph {
            grads.register::<B>(node.id, dh.into_primitive().tensor());
        }
        if let (Some(node), Some(dw)) = (pw, dw) {
            grads.register::<B>(node.id, dw.into_primitive().tensor());
        }
    }
}

/// The chunked backward: `dh [M, K]` in `h`'s float type and, when `want_dw`, `dW [V, K]` in
/// `W`'s (accumulated in f32 over the chunks).
#[allow(clippy::too_many_arguments)]
fn backward<B: QerlBackend>(
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    y: Tensor<B, 1, Int>,
    out: Tensor<B, 2>,
    lse: Tensor<B, 1>,
    grad: Tensor<B, 2>,
    opts: &LogProbOptions,
    want_dw: bool,
) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
    let [m, k] = h.dims();
    let [v, _] = w.dims();
    let (hdt, wdt) = (h.dtype(), w.dtype());
    let grad = grad.cast(DType::F32);
    let inv_t = if opts.scaled() {
        1.0 / opts.temperature
    } else {
        1.0
    };
    let rows = opts.rows(v);
    let mut dhs = Vec::new();
    let mut dw = want_dw.then(|| Tensor::<B, 2>::zeros([v, k], (&w.device(), DType::F32)));
    for std::ops::Range { start, end } in chunks(m, rows) {
        let hc = h.clone().slice([start..end, 0..k]);
        let z = logits_chunk(hc.clone(), w.clone(), opts);
        let g = grad.clone().slice([start..end, 0..1]); // [c, 1]
        let lse_c = lse.clone().slice(start..end).unsqueeze_dim::<2>(1);
        let coef = if opts.entropy == Entropy::Differentiable {
            // E_p[z] = lse - H
            let mean_z = lse_c.clone() - out.clone().slice([start..end, 1..2]);
            let e = grad.clone().slice([start..end, 1..2]);
            (z.clone() - mean_z) * e + g.clone()
        } else {
            g.clone()
        };
        let p = (z - lse_c).exp();
        // the soft part of dz / T (the one-hot part is added through W[y] below)
        let dz = (p * coef).mul_scalar(-inv_t).cast(wdt);
        let yc = y.clone().slice(start..end);
        let gy = g.mul_scalar(inv_t); // [c, 1], f32
        let dh = dense::<B>(dz.clone(), false, w.clone(), false).cast(hdt)
            + (w.clone().select(0, yc.clone()).cast(DType::F32) * gy.clone()).cast(hdt);
        dhs.push(dh);
        if let Some(acc) = dw.take() {
            let dense = dense::<B>(dz, true, hc.clone().cast(wdt), false).cast(DType::F32);
            let picked = hc.cast(DType::F32) * gy;
            dw = Some((acc + dense).select_assign(0, yc, picked, IndexingUpdateOp::Add));
        }
    }
    (Tensor::cat(dhs, 0), dw.map(|d| d.cast(wdt)))
}

/// The [`QerlBackend::lm_head_log_probs`] of `Autodiff<B, C>`: the chunked forward on `B` and
/// the recomputing backward above. Parents: `hidden` and `weight` (the latter untracked, as the
/// frozen lm_head is, gets no gradient and costs nothing).
pub(crate) fn autodiff_log_probs<B: QerlBackend, C: CheckpointStrategy>(
    hidden: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    targets: IntTensor<B>,
    opts: LogProbOptions,
) -> FloatTensor<Autodiff<B, C>> {
    match LmHeadBackward
        .prepare::<C>([hidden.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, lse) = forward::<B>(
                f2(hidden.primitive.clone()),
                f2(weight.primitive.clone()),
                i1(targets.clone()),
                &opts,
            );
            let out = out.into_primitive().tensor();
            let state = LmHeadState::<B> {
                hidden: hidden.primitive,
                weight: weight.primitive,
                targets,
                out: out.clone(),
                lse: lse.into_primitive().tensor(),
                opts,
            };
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward_prim::<B>(
            hidden.primitive,
            weight.primitive,
            targets,
            opts,
        )),
    }
}
