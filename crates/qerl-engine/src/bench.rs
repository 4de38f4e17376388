//! The rollout benchmark: a model of a preset shape with random weights made on the device (no
//! checkpoint), batches of distinct random prompts, sampling at T = 1 without early stop.
//! Reports the prefill time, the decode time per step, output tokens per second, the bytes of
//! weights one decode step reads over its time (the bandwidth a memory-bound step achieves),
//! and the allocator's memory.

use std::time::Instant;

use cubecl::prelude::*;

use crate::engine::{Engine, EngineConfig, Request, Sampling};
use crate::shape::ModelShape;
use crate::weights::{EngineWeights, RandomPrecision};
use crate::EngineError;

/// What to run.
#[derive(Clone, Debug)]
pub struct RolloutSpec {
    pub shape: ModelShape,
    pub precision: RandomPrecision,
    pub lora_rank: Option<usize>,
    pub batches: Vec<usize>,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub prefill_rows: usize,
    /// Top-k / top-p of the sampling (T = 1).
    pub truncation: crate::Truncation,
}

/// One measured batch size.
#[derive(Clone, Debug)]
pub struct RolloutRow {
    pub shape: String,
    pub precision: RandomPrecision,
    pub batch: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Prompt prefill and the first sampled token.
    pub prefill_ms: f64,
    /// Each later token of the whole batch.
    pub decode_ms_per_step: f64,
    pub total_s: f64,
    /// Generated tokens per second over the whole call (prefill included).
    pub tokens_per_s: f64,
    /// Generated tokens per second of the decode steps alone.
    pub decode_tokens_per_s: f64,
    /// Weight bytes a decode step reads, over the step time.
    pub weight_tb_per_s: f64,
    /// Bytes the allocator held (reserved from the driver) after the run.
    pub reserved_mb: f64,
    pub in_use_mb: f64,
    /// Decode steps captured as CUDA graphs and replayed (CUDA sm_90; `QERL_GRAPH=0` turns them
    /// off), and why graphs were turned off, if they were.
    pub graph_steps: (usize, usize),
    /// The last captured step's kernels and programmatic edges.
    pub graph_edges: Option<(usize, usize)>,
    pub graph_off: Option<String>,
    /// A hash of the timed run's sampled tokens (FNV-1a over the completions in order): two
    /// builds or settings that compute the same logits sample the same tokens (the sampler's
    /// randomness is counter-based), so equal digests say the runs agree.
    pub token_digest: u64,
}

/// Bytes of weights one decode step reads: the decoder's frozen weights (4.5 bits an element
/// for NVFP4: codes and one E4M3 scale per 16) and the lm_head in `elem` bytes.
pub fn weight_bytes(shape: &ModelShape, precision: RandomPrecision, elem: usize) -> f64 {
    let layer = shape.layer_params() as f64;
    let frozen = match precision {
        RandomPrecision::Nvfp4 => layer * 4.5 / 8.0,
        RandomPrecision::Bf16 => layer * elem as f64,
    };
    frozen + (shape.vocab * shape.hidden * elem) as f64
}

/// `QERL_BENCH_PREFILL_RUNS` (1 to 4; 2 by default): the prefill-only runs before the timed
/// one. On CUDA the timed run's tokens depend on their number (docs/benchmarks/rollout.md,
/// session 35), which this knob lets an experiment pin down.
fn prefill_runs() -> usize {
    std::env::var("QERL_BENCH_PREFILL_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| (1..=4).contains(n))
        .unwrap_or(2)
}

/// Runs every batch size of `spec` on one engine per batch (the KV cache sized for it).
pub fn rollout<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    spec: &RolloutSpec,
    mut progress: impl FnMut(&RolloutRow),
) -> Result<Vec<RolloutRow>, EngineError> {
    let weights = EngineWeights::random::<R, F>(
        client,
        &spec.shape,
        spec.precision,
        spec.lora_rank,
        0x00C0_FFEE,
    )?;
    let elem = std::mem::size_of::<F>();
    let bytes = weight_bytes(&spec.shape, spec.precision, elem);
    let mut rows = Vec::new();
    for &batch in &spec.batches {
        let config = EngineConfig {
            slots: batch,
            capacity: spec.prompt_tokens + spec.new_tokens,
            prefill_rows: spec
                .prefill_rows
                .max(spec.prompt_tokens.min(spec.prefill_rows)),
            check_every: 16,
        };
        let mut engine = Engine::<R, F>::new(client.clone(), weights.clone(), config)?;
        let requests = |new: usize| -> Vec<Request> {
            (0..batch as u32)
                .map(|i| Request {
                    id: i,
                    prompt: (0..spec.prompt_tokens as u32)
                        .map(|p| (i.wrapping_mul(7919) ^ p.wrapping_mul(104_729)) % 30_000 + 100)
                        .collect(),
                    max_new_tokens: new,
                })
                .collect()
        };
        let sampling = Sampling {
            temperature: 1.0,
            seed: 7,
            eos: vec![],
            truncation: spec.truncation,
        };
        // One whole run before timing: it compiles every kernel of this batch size and, on
        // CUDA, captures the graph of every decode step the timed run will replay. (Until
        // session 35 only two tokens ran first, and the timed run and the prefill run below each
        // captured a graph, whose cost the subtraction below cancelled only where the two
        // captures cost the same.)
        engine.generate(&requests(spec.new_tokens), &sampling)?;
        // The prefill alone (with the one decode step a call always runs), the fastest of
        // two runs (`QERL_BENCH_PREFILL_RUNS`, 1 to 4, for experiments): the decode time is the
        // timed run's less this.
        let mut prefill = f64::INFINITY;
        for _ in 0..prefill_runs() {
            let t = Instant::now();
            engine.generate(&requests(1), &sampling)?;
            prefill = prefill.min(t.elapsed().as_secs_f64());
        }
        let t = Instant::now();
        let done = engine.generate(&requests(spec.new_tokens), &sampling)?;
        let total = t.elapsed().as_secs_f64();
        let token_digest = done
            .iter()
            .flat_map(|c| c.tokens.iter())
            .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
                (h ^ t as u64).wrapping_mul(0x100_0000_01b3)
            });
        // The timed run's decode steps beyond the one the prefill run also ran.
        let steps = spec.new_tokens.saturating_sub(2).max(1);
        let step = ((total - prefill) / steps as f64).max(1e-9);
        let usage = client.memory_usage().ok();
        let (captured, replayed, graph_off) = engine.graph_report();
        let row = RolloutRow {
            shape: spec.shape.name.clone(),
            precision: spec.precision,
            batch,
            prompt_tokens: spec.prompt_tokens,
            new_tokens: spec.new_tokens,
            prefill_ms: prefill * 1e3,
            decode_ms_per_step: step * 1e3,
            total_s: total,
            tokens_per_s: (batch * spec.new_tokens) as f64 / total,
            decode_tokens_per_s: batch as f64 / step,
            weight_tb_per_s: bytes / step / 1e12,
            reserved_mb: usage
                .as_ref()
                .map_or(0.0, |u| u.bytes_reserved as f64 / 1e6),
            in_use_mb: usage.as_ref().map_or(0.0, |u| u.bytes_in_use as f64 / 1e6),
            graph_steps: (captured, replayed),
            graph_edges: engine.graph_edges(),
            graph_off,
            token_digest,
        };
        progress(&row);
        rows.push(row);
        drop(engine);
        client.memory_cleanup();
    }
    Ok(rows)
}
