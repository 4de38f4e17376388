//! The products of a decoder layer as the engine launches them: the LoRA down-projections
//! (inside the products' own launch where [`gemm::matmul_folding_lora_down`] takes them, else
//! a launch before), the 4-bit products sharing an input as one segment launch (or their
//! unreduced K-slices, for the kernel after them to add), the down product whose K-slices the
//! next norm adds, and the dense products.

use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_kernels::gemm::{self, LoraEpilogue, SegmentsOutcome};

use crate::kernels::dense::{self, dense, DenseEpilogue};
use crate::weights::{Frozen, Linear, LoraWeights};
use crate::EngineError;

/// Up to this many rows (every decode batch) the LoRA down-projections go through
/// [`crate::kernels::lora_down`] (plane operations, CUDA) or else the dense kernel (rows in
/// groups of [`dense::MAX_ROWS`]; the rank-r weights stay in cache): on an H100
/// at 64 rows the tensor-core path took 12 us for each of the seven plus a split-K reduce each
/// (ncu, 2026-11-24): 3.5 ms of a 25 ms step.
const LORA_DENSE_MAX_ROWS: usize = 256;

/// From this many rows the LoRA down-projections go to the tensor-core kernel
/// ([`qerl_kernels::lora_down_mma`]) where it runs; below, the plane kernel. On an H200
/// (2026-11-29, one 7B decode step under ncu) at 64 rows the tensor-core kernel took 5.4 µs
/// (K = 3584) and 10.3 µs (K = 18944) against the plane kernel's 5.9-6.3 and 8.6, and the step
/// 6.80 ms against 6.72-6.76; at 256 rows the step took 16.41-16.47 ms against 16.55-16.64.
/// `QERL_LORA_MMA_MIN_ROWS` (read once) moves the line, for A/B timing.
fn lora_mma_min_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("QERL_LORA_MMA_MIN_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(128)
    })
}

/// The 4-bit products' LoRA epilogue of adapter `a` with its down-projection `t`.
fn lora_epilogue<'a>(t: &'a Handle, a: &'a LoraWeights) -> LoraEpilogue<'a> {
    LoraEpilogue {
        t,
        b: &a.b,
        rank: a.rank,
        scale: a.scale,
    }
}

/// A product whose output the next norm adds to the residual stream (o, down) into `d`, or,
/// where it would end in a split-K reduction of its own, its unreduced K-slices for that norm
/// to add ([`crate::kernels::norm::Residual::Parts`]): one launch fewer a layer. Up to
/// [`crate::kernels::fused_lora::MAX_ROWS`] rows through the decode kernel's K-slices; past
/// them through the segment launch of one product ([`linears_or_parts`]). `t_ready`: the
/// kernel before filled `t[0]`.
pub(crate) fn residual_product<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    layer: &Linear,
    d: &Handle,
    lora_t: &LoraOutputs,
    t_ready: bool,
) -> Result<Option<gemm::SplitParts>, EngineError> {
    if m > crate::kernels::fused_lora::MAX_ROWS {
        let keep = crate::kernels::residual_parts_enabled();
        return linears_or_parts::<R, F>(client, x, m, &[layer], &[d], lora_t, t_ready, keep);
    }
    let fuse = crate::kernels::fused_lora::enabled();
    let (Frozen::Quant(wq), true) = (&layer.weight, fuse) else {
        linears::<R, F>(client, x, m, &[layer], &[d], lora_t, t_ready)?;
        return Ok(None);
    };
    if !t_ready {
        lora_downs::<R, F>(client, x, m, &[layer], lora_t)?;
    }
    let lora = layer.lora.as_ref().map(|a| lora_epilogue(&lora_t.t[0], a));
    Ok(gemm::matmul_or_parts::<R, F>(
        client,
        x,
        m,
        wq,
        layer.bias.as_ref(),
        lora,
        d,
    )?)
}

/// Where a layer's LoRA down-projections go: `t`, up to three `[rows, rank]` f32 outputs, and
/// the scratch of the tensor-core kernel that adds its K-chunks across cubes (`sums`, and
/// `counters`: a u32 a 16-row group, 0 between launches), and of a product that computes its
/// own (`fold_counters`: two u32, 0 between launches; [`gemm::matmul_folding_lora_down`]).
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct LoraOutputs {
    pub t: [Handle; 3],
    pub sums: Handle,
    pub counters: Handle,
    pub fold_counters: Handle,
}

/// The LoRA down-projections `t[i] = x · A_iᵀ` of `layers` (those with an adapter): one launch
/// for up to three adapters of equal rank when few rows (tensor cores from
/// [`lora_mma_min_rows`], else plane operations, else the portable dense kernel), else one
/// each.
pub(crate) fn lora_downs<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    layers: &[&Linear],
    lora_t: &LoraOutputs,
) -> Result<(), EngineError> {
    let k = layers[0].k;
    let t = &lora_t.t;
    let adapters: Vec<_> = layers.iter().filter_map(|l| l.lora.as_ref()).collect();
    let same_rank = adapters.windows(2).all(|p| p[0].rank == p[1].rank);
    if adapters.len() == layers.len() && same_rank && m <= LORA_DENSE_MAX_ROWS {
        let a: Vec<&Handle> = adapters.iter().map(|a| &a.a).collect();
        let out: Vec<&Handle> = t.iter().take(a.len()).collect();
        let rank = adapters[0].rank;
        // Unless `QERL_LORA_DOWN=dense` (read once) keeps the portable dense kernel, for A/B
        // timing (`QERL_LORA_MMA=0` skips the tensor-core kernel).
        static DENSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let forced =
            *DENSE.get_or_init(|| std::env::var("QERL_LORA_DOWN").is_ok_and(|v| v == "dense"));
        let mma = m >= lora_mma_min_rows();
        let ran = !forced
            && ((mma && lora_down_mma::<R, F>(client, x, m, &a, rank, k, &out, lora_t))
                || crate::kernels::lora_down::lora_down::<R, F>(client, x, m, &a, rank, k, &out));
        if !ran {
            dense::<R, F, f32>(client, x, m, &a, rank, k, Default::default(), &out);
        }
    } else {
        for (i, a) in layers.iter().enumerate() {
            if let Some(a) = &a.lora {
                gemm::lora_down::<R, F>(client, x, &a.a, &t[i], m, k, a.rank)?;
            }
        }
    }
    Ok(())
}

/// [`qerl_kernels::lora_down_mma`] where it runs (CUDA builds, bf16/f16 with `mma`).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(feature = "cuda"), allow(clippy::extra_unused_type_parameters))]
fn lora_down_mma<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    a: &[&Handle],
    rank: usize,
    k: usize,
    out: &[&Handle],
    lora_t: &LoraOutputs,
) -> bool {
    #[cfg(feature = "cuda")]
    {
        qerl_kernels::lora_down_mma::lora_down_mma::<R, F>(
            client,
            x,
            m,
            a,
            rank,
            k,
            out,
            &lora_t.sums,
            &lora_t.counters,
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (client, x, m, a, rank, k, out, lora_t);
        false
    }
}

/// Linears that share the input `x [m, k]`: their LoRA down-projections (none when `t_ready`,
/// the norm before having filled `t`; inside the products' launch where
/// [`folding_lora_down`] takes them; else [`lora_downs`]), then each product with bias and
/// LoRA in its epilogue.
pub(crate) fn linears<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    layers: &[&Linear],
    outputs: &[&Handle],
    lora_t: &LoraOutputs,
    t_ready: bool,
) -> Result<(), EngineError> {
    linears_or_parts::<R, F>(client, x, m, layers, outputs, lora_t, t_ready, false).map(|_| ())
}

/// [`linears`]; with `keep_parts`, where the products run as one split segment launch, their
/// unreduced K-slices (biases not added) instead of the outputs
/// ([`gemm::matmul_segments_or_parts`]; a single product too).
#[allow(clippy::too_many_arguments)]
pub(crate) fn linears_or_parts<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    layers: &[&Linear],
    outputs: &[&Handle],
    lora_t: &LoraOutputs,
    t_ready: bool,
    keep_parts: bool,
) -> Result<Option<gemm::SplitParts>, EngineError> {
    if !t_ready {
        // The products' launch may compute their `T` itself (one launch fewer).
        let folded = folding_lora_down::<R, F>(client, x, m, layers, outputs, lora_t, keep_parts)?;
        if let Some(outcome) = folded {
            return Ok(outcome);
        }
        lora_downs::<R, F>(client, x, m, layers, lora_t)?;
    }
    let t = &lora_t.t;
    // 4-bit weights sharing the input: one decode launch for all where the kernel takes them
    // (a single one too where it may keep its K-slices).
    let quant: Vec<gemm::SegmentProduct<'_>> = layers
        .iter()
        .enumerate()
        .zip(outputs)
        .filter_map(|((i, l), y)| match &l.weight {
            Frozen::Quant(wq) => Some(gemm::SegmentProduct {
                weight: wq,
                bias: l.bias.as_ref(),
                lora: l.lora.as_ref().map(|a| lora_epilogue(&t[i], a)),
                y,
            }),
            Frozen::Dense(_) => None,
        })
        .collect();
    if (layers.len() > 1 || keep_parts) && quant.len() == layers.len() {
        match gemm::matmul_segments_or_parts::<R, F>(client, x, m, &quant, keep_parts)? {
            SegmentsOutcome::Written => return Ok(None),
            SegmentsOutcome::Parts(p) => return Ok(Some(p)),
            SegmentsOutcome::NotTaken => {}
        }
    }
    for ((i, l), y) in layers.iter().enumerate().zip(outputs) {
        match &l.weight {
            Frozen::Quant(wq) => {
                let lora = l.lora.as_ref().map(|a| lora_epilogue(&t[i], a));
                gemm::matmul::<R, F>(client, x, m, wq, l.bias.as_ref(), lora, y)?;
            }
            Frozen::Dense(d) => {
                let epilogue = DenseEpilogue {
                    bias: l.bias.as_ref(),
                    lora: l.lora.as_ref().map(|a| (&t[i], &a.b, a.rank, a.scale)),
                };
                product::<R, F, F>(client, x, m, d, l.n, l.k, epilogue, y)?;
            }
        }
    }
    Ok(None)
}

/// `layers`' products (sharing `x`) with their LoRA down-projections computed inside the
/// products' launch ([`gemm::matmul_folding_lora_down`]): `Some(parts or None)` where that
/// ran, `None` where it does not apply (nothing launched).
#[allow(clippy::too_many_arguments)]
fn folding_lora_down<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    layers: &[&Linear],
    outputs: &[&Handle],
    lora_t: &LoraOutputs,
    keep_parts: bool,
) -> Result<Option<Option<gemm::SplitParts>>, EngineError> {
    let Some((products, a)) = fold_products(layers, outputs, lora_t) else {
        return Ok(None);
    };
    let fold = gemm::LoraFold {
        a: &a,
        counters: &lora_t.fold_counters,
    };
    let outcome =
        gemm::matmul_folding_lora_down::<R, F>(client, x, m, &products, &fold, keep_parts)?;
    Ok(match outcome {
        SegmentsOutcome::NotTaken => None,
        SegmentsOutcome::Written => Some(None),
        SegmentsOutcome::Parts(p) => Some(Some(p)),
    })
}

/// `layers`' products into `outputs` with their LoRA epilogues reading `lora_t`, and their
/// adapters' `A`: `None` unless every weight is 4-bit with an adapter.
fn fold_products<'a>(
    layers: &[&'a Linear],
    outputs: &[&'a Handle],
    lora_t: &'a LoraOutputs,
) -> Option<(Vec<gemm::SegmentProduct<'a>>, Vec<&'a Handle>)> {
    let mut products = Vec::with_capacity(layers.len());
    let mut a = Vec::with_capacity(layers.len());
    for ((l, y), t) in layers.iter().zip(outputs).zip(&lora_t.t) {
        let (Frozen::Quant(wq), Some(lora)) = (&l.weight, &l.lora) else {
            return None;
        };
        products.push(gemm::SegmentProduct {
            weight: wq,
            bias: l.bias.as_ref(),
            lora: Some(lora_epilogue(t, lora)),
            y,
        });
        a.push(&lora.a);
    }
    Some((products, a))
}

/// Whether `layers`' products at `m` rows compute their own LoRA down-projections
/// ([`folding_lora_down`], as [`linears_or_parts`] runs them when `T` is not ready): then the
/// kernel before them need not (the norm). Nothing is launched.
pub(crate) fn folds_lora_down<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    m: usize,
    layers: &[&Linear],
    lora_t: &LoraOutputs,
) -> bool {
    // The outputs are not read by the query: `T`'s buffers stand in for them.
    let outputs: Vec<&Handle> = lora_t.t.iter().take(layers.len()).collect();
    fold_products(layers, &outputs, lora_t)
        .is_some_and(|(products, _)| gemm::folds_lora_down::<R, F>(client, m, &products))
}

/// A dense product: the tensor-core kernel for many rows where it applies, the engine's
/// memory-bound kernel otherwise.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product<R: Runtime, F: Float, O: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    d: &Handle,
    n: usize,
    k: usize,
    epilogue: DenseEpilogue<'_>,
    y: &Handle,
) -> Result<(), EngineError> {
    if m > dense::MAX_ROWS {
        let lora = epilogue
            .lora
            .map(|(t, b, rank, scale)| LoraEpilogue { t, b, rank, scale });
        if gemm::dense_matmul::<R, F, O>(client, x, m, d, n, k, epilogue.bias, lora, y)? {
            return Ok(());
        }
    }
    dense::<R, F, O>(client, x, m, &[d], n, k, epilogue, &[y]);
    Ok(())
}
