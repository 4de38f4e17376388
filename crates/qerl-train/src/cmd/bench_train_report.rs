//! What `qerl bench train` prints and counts: the step times, the update's flops, the table.

use qerl_model::ModelConfig;
use qerl_train::update::TrainBatch;

use super::bench_train::TrainArgs;

/// One measured GRPO step.
#[derive(Clone, Debug, Default)]
pub(super) struct StepTimes {
    pub rollout_s: f64,
    pub reference_s: f64,
    pub update_s: f64,
    /// Forward + backward flops of the update (the recomputation of checkpointing not counted).
    pub update_flops: f64,
    /// Largest `reserved` the device allocator reported after a phase (bytes); on the CPU the
    /// process's peak resident set.
    pub peak_reserved: Option<u64>,
    /// The update's loss and global gradient norm before clipping: random weights give similar
    /// values every step, so a jump points at a wrong product (issue 16, item 4).
    pub loss: f32,
    pub grad_norm: f32,
    /// The allocator's reservation after the rollout, the reference and the update (bytes).
    pub reserved_after: Vec<Option<u64>>,
}

/// Forward + backward flops of the update on one micro-batch (padded rows as computed):
/// decoder linears `2·P` a token forward and `2·P` for `dX` (the frozen weights get no
/// gradient), LoRA `2·r·(in + out)` forward and three times that backward, attention
/// `4·s·keys·q_dim` a sequence and layer forward and twice that backward, the lm_head on the
/// counted completion tokens `2·V·h` forward and `2·V·h` backward.
pub(super) fn update_flops(c: &ModelConfig, rank: usize, m: &TrainBatch) -> f64 {
    let (h, i, layers) = (
        c.hidden_size as f64,
        c.intermediate_size as f64,
        c.num_hidden_layers as f64,
    );
    let (q, kv) = (c.q_dim() as f64, c.kv_dim() as f64);
    let tokens = (m.rows() * m.tokens.len) as f64;
    let s = m.tokens.len as f64;
    let linear = 2.0 * h * q + 2.0 * h * kv + 3.0 * h * i;
    let lora = rank as f64 * (2.0 * (h + q) + 2.0 * (h + kv) + 2.0 * (h + i) + (i + h));
    let per_token = layers * (4.0 * linear + 8.0 * lora);
    let attention = m.rows() as f64 * layers * 3.0 * 4.0 * s * s * q;
    let head = 4.0 * c.vocab_size as f64 * h * m.tokens_counted() as f64;
    tokens * per_token + attention + head
}

pub(super) fn describe(t: &StepTimes) -> String {
    format!(
        "rollout {:.2} s, reference {:.2} s, update {:.2} s ({:.2} TFLOP/s), peak reserved {} \
         (after rollout / reference / update: {}), loss {:.4}, gradient norm {:.4}",
        t.rollout_s,
        t.reference_s,
        t.update_s,
        t.update_flops / t.update_s.max(1e-9) / 1e12,
        gb(t.peak_reserved),
        t.reserved_after
            .iter()
            .map(|r| gb(*r))
            .collect::<Vec<_>>()
            .join(" / "),
        t.loss,
        t.grad_norm
    )
}

fn gb(bytes: Option<u64>) -> String {
    bytes.map_or("n/a".into(), |b| format!("{:.1} GB", b as f64 / 1e9))
}

pub(super) type Row = (String, Option<Vec<StepTimes>>, Option<usize>);

/// Markdown table: the mean of the steps after the first (the first alone when there is one).
pub(super) fn print_table(a: &TrainArgs, rows: &[Row]) {
    println!();
    println!("| shape | weights | prompts x G | tokens | step s | rollout s | reference s | update s | update TFLOP/s | peak reserved GB | first step s | max context |");
    println!("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (p, steps, fits) in rows {
        let head = format!(
            "| {} | {p} | {} x {} | {} + {} |",
            a.shape, a.prompts, a.group, a.prompt_len, a.completion_len
        );
        let Some(steps) = steps else {
            println!("{head} OOM | | | | | | | |");
            continue;
        };
        let warm = if steps.len() > 1 {
            &steps[1..]
        } else {
            &steps[..]
        };
        let n = warm.len() as f64;
        let mean = |f: fn(&StepTimes) -> f64| warm.iter().map(f).sum::<f64>() / n;
        let (r, f, u) = (
            mean(|t| t.rollout_s),
            mean(|t| t.reference_s),
            mean(|t| t.update_s),
        );
        let tflops = mean(|t| t.update_flops / t.update_s.max(1e-9) / 1e12);
        let peak = steps.iter().filter_map(|t| t.peak_reserved).max();
        let first = &steps[0];
        println!(
            "{head} {:.2} | {r:.2} | {f:.2} | {u:.2} | {tflops:.2} | {} | {:.1} | {} |",
            r + f + u,
            gb(peak).trim_end_matches(" GB"),
            first.rollout_s + first.reference_s + first.update_s,
            fits.map_or("-".into(), |c| c.to_string())
        );
    }
}
