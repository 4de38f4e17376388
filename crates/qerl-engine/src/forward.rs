//! One pass of the decoder over a flat batch of rows, each row one token of some sequence:
//! `(token, slot, position)`. Decode steps pass one row per slot; prefill passes every prompt
//! token (a long prompt may span several passes: its later rows read the keys the earlier ones
//! cached). Everything stays on the device; the host only enqueues launches.
//!
//! Per layer: add + RMSNorm, the q/k/v LoRA down-projections in one launch, the three products
//! with bias and LoRA in their epilogues, RoPE + KV write, attention, the o product, add +
//! RMSNorm, gate/up LoRA downs in one launch, the two products, SiLU·mul, the down product
//! (its residual add is fused into the next norm). At a few rows the LoRA down-projections of
//! q/k/v and gate/up run inside the norm launches ([`crate::kernels::fused_lora`]), o's inside
//! the attention's merge of its spans ([`crate::kernels::attention_combine`]) and down's inside
//! SiLU·mul (both CUDA), and the down product's K-slices are added by the next norm
//! ([`Residual::Parts`]). On CUDA with thread-block clusters, from 9 to 127 rows, the norms
//! take the q/k/v and gate/up LoRA down-projections instead
//! (`qerl_kernels::norm_cluster`, a row spread over a cluster's eight cubes). Past the few
//! rows, where the q/k/v and gate/up products split along K,
//! RoPE and SiLU·mul add their K-slices ([`crate::kernels::rope::rope_kv_parts`],
//! [`crate::kernels::act::silu_mul_parts`]) and the norms add o's and down's, in place of four
//! reduction launches. The products themselves are launched from [`crate::products`].

use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_kernels::gemm;

use crate::kernels::act::{silu_mul, silu_mul_parts};
use crate::kernels::attention::{
    attention_with, AttentionKernel, AttentionScratch, AttentionShape, OLora,
};
use crate::kernels::dense::DenseEpilogue;
use crate::kernels::fused_lora::{norm_lora, silu_lora, silu_slices};
use crate::kernels::fused_reduce_enabled;
use crate::kernels::norm::{add_rms_norm, embed, Residual};
use crate::kernels::rope::{rope_kv, rope_kv_parts, RopeShape};
use crate::kernels::sample::SampleScratch;
use crate::products::{linears, linears_or_parts, product, residual_product, LoraOutputs};
use crate::weights::{EngineWeights, Linear};
use crate::EngineError;

/// Activation buffers for up to `rows` rows, allocated once per engine.
#[derive(Debug)]
pub(crate) struct Workspace {
    pub rows: usize,
    /// The residual stream; the fused norm + LoRA kernel writes the sum into the other of
    /// `h` and `h2` (its cubes all read the old one), so the two take turns.
    pub h: Handle,
    pub h2: Handle,
    pub d: Handle,
    pub xn: Handle,
    pub q: Handle,
    pub k: Handle,
    pub v: Handle,
    pub attn: Handle,
    pub gate: Handle,
    pub up: Handle,
    pub act: Handle,
    /// LoRA `T = X·Aᵀ` of up to three adapters sharing an input, `[rows, rank]` f32 each, with
    /// the scratch of the kernel that computes them (its counters are `lora_counters`).
    pub lora: LoraOutputs,
    /// Final-norm output of the rows that get logits, `[logit_rows, hidden]`.
    pub xf: Handle,
    /// `[logit_rows, vocab]` f32.
    pub logits: Handle,
    pub logit_rows: usize,
    /// Partial outputs of the attention split along the sequence.
    pub attn_scratch: AttentionScratch,
    /// Partial LoRA sums of the kernels that add them across cubes (the spans' merge with o's
    /// adapter: `[rows, q_heads, rank]`; SiLU·mul with down's: `[rows, slices, rank]`), f32, and
    /// a counter a row, zero between launches.
    pub lora_sums: Handle,
    pub lora_counters: Handle,
    /// Per-chunk results of sampling the `logit_rows` rows.
    pub sample_scratch: SampleScratch,
}

impl Workspace {
    pub fn new<R: Runtime, F: Float>(
        client: &ComputeClient<R>,
        w: &EngineWeights,
        rows: usize,
        logit_rows: usize,
    ) -> Self {
        let s = &w.shape;
        let e = std::mem::size_of::<F>();
        let buf = |len: usize| client.empty(len.max(1) * e);
        let rank = w.max_rank().max(1);
        let lora_counters = client.create_from_slice(u32::as_bytes(&vec![0u32; rows.max(1)]));
        Workspace {
            rows,
            h: buf(rows * s.hidden),
            h2: buf(rows * s.hidden),
            d: buf(rows * s.hidden),
            xn: buf(rows * s.hidden.max(s.q_dim()).max(s.intermediate)),
            q: buf(rows * s.q_dim()),
            k: buf(rows * s.kv_dim()),
            v: buf(rows * s.kv_dim()),
            attn: buf(rows * s.q_dim()),
            gate: buf(rows * s.intermediate),
            up: buf(rows * s.intermediate),
            act: buf(rows * s.intermediate),
            lora: LoraOutputs {
                t: [0, 1, 2].map(|_| client.empty(rows * rank * 4)),
                sums: client.empty(lora_down_scratch::<R, F>(client, s, rows).max(1) * 4),
                counters: lora_counters.clone(),
                fold_counters: client.create_from_slice(u32::as_bytes(&[0u32; 2])),
            },
            xf: buf(logit_rows * s.hidden),
            logits: client.empty(logit_rows * s.vocab * 4),
            logit_rows,
            lora_sums: client
                .empty(rows * s.q_heads.max(silu_slices::<F>(s.intermediate)) * rank * 4),
            lora_counters,
            attn_scratch: AttentionScratch::new(
                client,
                s.q_heads,
                s.kv_heads,
                s.head_dim,
                AttentionScratch::target_for(client),
            ),
            sample_scratch: SampleScratch::new(client, logit_rows, s.vocab),
        }
    }
}

/// f32 values of scratch the tensor-core LoRA down-projections need at up to `rows` rows of
/// this shape: the largest over the products' depths (hidden, q_dim, intermediate), whatever
/// the adapters. 0 without CUDA.
#[cfg_attr(not(feature = "cuda"), allow(clippy::extra_unused_type_parameters))]
fn lora_down_scratch<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: &crate::shape::ModelShape,
    rows: usize,
) -> usize {
    #[cfg(feature = "cuda")]
    {
        use qerl_kernels::lora_down_mma::{scratch_floats, MAX_M};
        let m = rows.clamp(1, MAX_M);
        [s.hidden, s.q_dim(), s.intermediate]
            .iter()
            .map(|&k| scratch_floats::<R, F>(client, m, k))
            .max()
            .unwrap_or(0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (client, s, rows);
        0
    }
}

/// The caches of every layer: keys and values `[slots, kv_heads, capacity, head_dim]`.
#[derive(Debug)]
pub(crate) struct KvCache {
    pub layers: Vec<(Handle, Handle)>,
    pub slots: usize,
    pub capacity: usize,
}

/// Inputs of one pass: `rows` rows with their token, slot and position (device `u32`s), and
/// the rows whose logits are wanted (`logit_index`, `logit_count` ids into the rows).
pub(crate) struct Pass<'a> {
    pub rows: usize,
    pub tokens: &'a Handle,
    pub slot: &'a Handle,
    pub pos: &'a Handle,
    pub logit_index: &'a Handle,
    pub logit_count: usize,
    /// No row's position is at or past this (`max pos + 1`; the cache capacity when unknown):
    /// attention's split covers `0..context` only.
    pub context: usize,
}

/// What of a pass's launches its host-side inputs decide (rows, logit rows, the attention's
/// splits and span): two passes with the same key launch the same kernels with the same
/// arguments, so a captured graph of one replays the other (`crate::step_graphs`).
pub(crate) fn pass_key<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    w: &EngineWeights,
    kv: &KvCache,
    ws: &Workspace,
    p: &Pass<'_>,
) -> crate::step_graphs::StepKey {
    let att = attention_shape(&w.shape, kv, p);
    let (splits, span) =
        crate::kernels::attention::split_plan::<R, F>(client, &att, &ws.attn_scratch);
    (p.rows, p.logit_count, splits, span)
}

/// The attention's shape in pass `p` (its split covers the positions `0..context`).
fn attention_shape(s: &crate::ModelShape, kv: &KvCache, p: &Pass<'_>) -> AttentionShape {
    AttentionShape {
        rows: p.rows,
        q_heads: s.q_heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        capacity: kv.capacity,
        slots: kv.slots,
        context: p.context.min(kv.capacity),
    }
}

/// Enqueues one pass; the logits of the selected rows land in `ws.logits`.
pub(crate) fn forward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    w: &EngineWeights,
    cos_sin: &(Handle, Handle),
    kv: &KvCache,
    ws: &Workspace,
    p: &Pass<'_>,
) -> Result<(), EngineError> {
    let s = &w.shape;
    let m = p.rows;
    debug_assert!(m <= ws.rows && p.logit_count <= ws.logit_rows);
    embed::<R, F>(client, &w.embed, s.vocab, p.tokens, m, s.hidden, &ws.h);
    let rope = RopeShape {
        rows: m,
        q_heads: s.q_heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        capacity: kv.capacity,
        slots: kv.slots,
        max_positions: s.max_positions,
    };
    let att = attention_shape(s, kv, p);
    // Which of `h`, `h2` holds the residual stream.
    let (mut res, mut spare) = (&ws.h, &ws.h2);
    // The down product's unreduced K-slices, where it left them for the next norm.
    let mut down_parts: Option<gemm::SplitParts> = None;
    for (l, layer) in w.layers.iter().enumerate() {
        let residual = match (&down_parts, l) {
            (_, 0) => Residual::None,
            (Some(p), _) => Residual::Parts(&p.parts, p.splits),
            (None, _) => Residual::Dense(&ws.d),
        };
        let t_ready = norm::<R, F>(
            client,
            s,
            m,
            (&mut res, &mut spare),
            residual,
            &layer.attn_norm,
            &[&layer.q, &layer.k, &layer.v],
            ws,
        );
        // Past the rows the fused LoRA kernels take, a split q/k/v product's K-slices go
        // straight into RoPE, which adds them and the biases (one reduction launch fewer).
        let qkv_biases = match (&layer.q.bias, &layer.k.bias, &layer.v.bias) {
            (Some(q), Some(k), Some(v)) => Some(Some([q, k, v])),
            (None, None, None) => Some(None),
            _ => None,
        };
        let keep = m > crate::kernels::fused_lora::MAX_ROWS
            && fused_reduce_enabled()
            && crate::kernels::rope_parts_enabled()
            && qkv_biases.is_some();
        let qkv_parts = linears_or_parts::<R, F>(
            client,
            &ws.xn,
            m,
            &[&layer.q, &layer.k, &layer.v],
            &[&ws.q, &ws.k, &ws.v],
            &ws.lora,
            t_ready,
            keep,
        )?;
        let (k_cache, v_cache) = &kv.layers[l];
        if let (Some(sp), Some(biases)) = (&qkv_parts, qkv_biases) {
            rope_kv_parts::<R, F>(
                client,
                rope,
                (&sp.parts, sp.splits),
                biases,
                &ws.q,
                p.slot,
                p.pos,
                &cos_sin.0,
                &cos_sin.1,
                k_cache,
                v_cache,
            );
        } else {
            rope_kv::<R, F>(
                client, rope, &ws.q, &ws.k, &ws.v, p.slot, p.pos, &cos_sin.0, &cos_sin.1, k_cache,
                v_cache,
            );
        }
        let fuse = crate::kernels::fused_lora::enabled();
        let o_lora = layer.o.lora.as_ref().filter(|_| fuse).map(|a| OLora {
            a: &a.a,
            rank: a.rank,
            t: &ws.lora.t[0],
            head_sums: &ws.lora_sums,
            counters: &ws.lora_counters,
        });
        let io = [&ws.q, k_cache, v_cache, p.slot, p.pos, &ws.attn];
        let t_ready = attention_with::<R, F>(
            client,
            att,
            io,
            &ws.attn_scratch,
            None,
            AttentionKernel::Auto,
            o_lora.as_ref(),
        );
        // Past the fused kernels' rows, o's K-slices go to the next norm (as down's do).
        let o_parts = if m > crate::kernels::fused_lora::MAX_ROWS {
            residual_product::<R, F>(client, &ws.attn, m, &layer.o, &ws.d, &ws.lora, t_ready)?
        } else {
            linears::<R, F>(
                client,
                &ws.attn,
                m,
                &[&layer.o],
                &[&ws.d],
                &ws.lora,
                t_ready,
            )?;
            None
        };
        let t_ready = norm::<R, F>(
            client,
            s,
            m,
            (&mut res, &mut spare),
            match &o_parts {
                Some(p) => Residual::Parts(&p.parts, p.splits),
                None => Residual::Dense(&ws.d),
            },
            &layer.mlp_norm,
            &[&layer.gate, &layer.up],
            ws,
        );
        // Past the rows where SiLU·mul takes the down product's LoRA, the gate/up product's
        // K-slices go straight into the activation (one reduction launch fewer).
        let keep = m > crate::kernels::fused_lora::MAX_ROWS
            && fused_reduce_enabled()
            && layer.gate.bias.is_none()
            && layer.up.bias.is_none();
        let parts = linears_or_parts::<R, F>(
            client,
            &ws.xn,
            m,
            &[&layer.gate, &layer.up],
            &[&ws.gate, &ws.up],
            &ws.lora,
            t_ready,
            keep,
        )?;
        if let Some(p) = &parts {
            silu_mul_parts::<R, F>(client, &p.parts, p.splits, m, s.intermediate, &ws.act);
        }
        let t_ready = parts.is_none()
            && layer.down.lora.as_ref().filter(|_| fuse).is_some_and(|a| {
                silu_lora::<R, F>(
                    client,
                    &ws.gate,
                    &ws.up,
                    &ws.act,
                    m,
                    s.intermediate,
                    &a.a,
                    a.rank,
                    &ws.lora.t[0],
                    &ws.lora_sums,
                    &ws.lora_counters,
                )
            });
        if !t_ready && parts.is_none() {
            silu_mul::<R, F>(client, &ws.gate, &ws.up, &ws.act, m * s.intermediate);
        }
        down_parts =
            residual_product::<R, F>(client, &ws.act, m, &layer.down, &ws.d, &ws.lora, t_ready)?;
    }
    let n = p.logit_count;
    if n == 0 {
        // A prefill pass that ends no prompt: its rows only fill the cache.
        return Ok(());
    }
    let residual = match (&down_parts, w.layers.is_empty()) {
        (_, true) => Residual::None,
        (Some(p), _) => Residual::Parts(&p.parts, p.splits),
        (None, _) => Residual::Dense(&ws.d),
    };
    add_rms_norm::<R, F>(
        client,
        res,
        m,
        residual,
        &w.final_norm,
        Some(p.logit_index),
        n,
        s.hidden,
        s.rms_eps,
        &ws.xf,
    );
    product::<R, F, f32>(
        client,
        &ws.xf,
        n,
        w.lm_head(),
        s.vocab,
        s.hidden,
        DenseEpilogue::default(),
        &ws.logits,
    )
}

/// The add + RMSNorm before `layers` (which read its output `ws.xn`), with their LoRA
/// down-projections into `ws.lora.t` in the same launch where every layer has an adapter of
/// one rank and a fused kernel takes them: on CUDA with clusters, past a few rows,
/// `qerl_kernels::norm_cluster` (the residual in place; also without adapters); at a few
/// rows [`norm_lora`] (then the sum goes to the spare residual buffer and the two swap).
/// Returns whether `ws.lora.t` is filled.
#[allow(clippy::too_many_arguments)]
fn norm<'a, R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    s: &crate::ModelShape,
    m: usize,
    (res, spare): (&mut &'a Handle, &mut &'a Handle),
    d: Residual<'_>,
    gain: &Handle,
    layers: &[&Linear],
    ws: &Workspace,
) -> bool {
    // No LoRA down-projections where the products after the norm compute their own.
    let folds = crate::products::folds_lora_down::<R, F>(client, m, layers, &ws.lora);
    let adapters: Vec<_> = match folds {
        true => Vec::new(),
        false => layers.iter().filter_map(|l| l.lora.as_ref()).collect(),
    };
    let rank = adapters.first().map_or(0, |a| a.rank);
    let uniform = adapters.len() == layers.len() && adapters.iter().all(|a| a.rank == rank);
    #[cfg(feature = "cuda")]
    if uniform || adapters.is_empty() {
        use qerl_kernels::norm_cluster::{add_norm_lora, Add};
        let add = match d {
            Residual::None => Add::None,
            Residual::Dense(h) => Add::Dense(h),
            Residual::Parts(p, slices) => Add::Parts(p, slices),
        };
        let a: Vec<&Handle> = adapters.iter().map(|a| &a.a).collect();
        let t: Vec<&Handle> = ws.lora.t.iter().take(a.len()).collect();
        let h: &Handle = res;
        if add_norm_lora::<R, F>(
            client,
            h,
            add,
            gain,
            m,
            s.hidden,
            s.rms_eps,
            &ws.xn,
            (&a, rank, &t),
            None,
        ) {
            return !a.is_empty();
        }
    }
    let fused = uniform
        && norm_lora::<R, F>(
            client,
            res,
            d,
            spare,
            gain,
            m,
            s.hidden,
            s.rms_eps,
            &ws.xn,
            &adapters.iter().map(|a| &a.a).collect::<Vec<_>>(),
            rank,
            &ws.lora.t.iter().take(adapters.len()).collect::<Vec<_>>(),
        );
    if fused {
        if !matches!(d, Residual::None) {
            std::mem::swap(res, spare);
        }
    } else {
        add_rms_norm::<R, F>(
            client, res, m, d, gain, None, m, s.hidden, s.rms_eps, &ws.xn,
        );
    }
    fused
}
