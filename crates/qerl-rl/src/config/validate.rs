//! Semantic checks of a [`TrainConfig`], each error naming its key.

use super::{ConfigError, TrainConfig};
use crate::aqn::SigmaSchedule;
use crate::data::DatasetKind;

/// The linear layers of a Qwen2 / Llama decoder layer, the names `lora.targets` may use.
pub const LORA_TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// The largest `lora.rank` accepted before the model is read (the trainer then also holds it
/// to the model's sizes): a rank such as `1e8` is refused here instead of in the allocator.
pub const MAX_LORA_RANK: usize = 1 << 16;

fn bad(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

fn ensure(ok: bool, key: &str, message: impl Into<String>) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(bad(key, message))
    }
}

fn finite_in(v: f64, lo: f64, hi: f64, key: &str, what: &str) -> Result<(), ConfigError> {
    ensure(
        v.is_finite() && v >= lo && v <= hi,
        key,
        format!("{v} is not {what}"),
    )
}

impl TrainConfig {
    /// Checks values that parse but make no sense. The first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ensure(
            !self.model.dir.as_os_str().is_empty(),
            "model.dir",
            "must not be empty",
        )?;

        ensure(self.lora.rank > 0, "lora.rank", "must be at least 1")?;
        finite_in(
            self.lora.alpha as f64,
            f64::MIN_POSITIVE,
            f64::MAX,
            "lora.alpha",
            "positive",
        )?;
        ensure(
            !self.lora.targets.is_empty(),
            "lora.targets",
            "must name at least one linear layer",
        )?;
        for t in &self.lora.targets {
            // a misspelled name would match no layer: 0 tensors trained, and exit 0
            let name = t.rsplit('.').next().unwrap_or(t);
            ensure(
                LORA_TARGETS.contains(&name),
                "lora.targets",
                format!(
                    "names `{t}`, which is not a linear layer of a Qwen2 / Llama decoder \
                     (valid names: {})",
                    LORA_TARGETS.join(", ")
                ),
            )?;
        }
        ensure(
            self.lora.rank <= MAX_LORA_RANK,
            "lora.rank",
            format!(
                "is {}, more than qerl accepts ({MAX_LORA_RANK}; a rank above the model's \
                 hidden size adds nothing)",
                self.lora.rank
            ),
        )?;

        if self.data.dataset == DatasetKind::Jsonl {
            ensure(
                self.data.path.is_some(),
                "data.path",
                "is required when data.dataset = \"jsonl\"",
            )?;
            ensure(
                !self.data.question_field.is_empty(),
                "data.question_field",
                "must not be empty",
            )?;
            ensure(
                !self.data.answer_field.is_empty(),
                "data.answer_field",
                "must not be empty",
            )?;
        }
        ensure(
            self.data.max_prompt_tokens > 0,
            "data.max_prompt_tokens",
            "must be at least 1",
        )?;

        let r = &self.rollout;
        ensure(
            r.group_size >= 2,
            "rollout.group_size",
            "must be at least 2 (advantages compare completions of one prompt)",
        )?;
        ensure(
            r.batch_prompts >= 1,
            "rollout.batch_prompts",
            "must be at least 1",
        )?;
        finite_in(
            r.temperature as f64,
            f64::MIN_POSITIVE,
            100.0,
            "rollout.temperature",
            "in (0, 100]",
        )?;
        finite_in(
            r.top_p as f64,
            f64::MIN_POSITIVE,
            1.0,
            "rollout.top_p",
            "in (0, 1]",
        )?;
        ensure(
            r.max_completion_tokens > 0,
            "rollout.max_completion_tokens",
            "must be at least 1",
        )?;

        let l = &self.loss;
        finite_in(l.eps_low as f64, 0.0, 0.999, "loss.eps_low", "in [0, 1)")?;
        finite_in(
            l.eps_high() as f64,
            0.0,
            10.0,
            "loss.eps_high",
            "in [0, 10]",
        )?;
        finite_in(
            l.beta() as f64,
            0.0,
            f64::MAX,
            "loss.beta",
            "finite and >= 0",
        )?;
        finite_in(l.std_eps as f64, 0.0, 1.0, "loss.std_eps", "in [0, 1]")?;
        ensure(l.mu >= 1, "loss.mu", "must be at least 1")?;
        ensure(
            l.max_sampling_rounds >= 1,
            "loss.max_sampling_rounds",
            "must be at least 1",
        )?;
        let cache = l.overlong_buffer(r.max_completion_tokens);
        ensure(
            cache <= r.max_completion_tokens,
            "loss.overlong_buffer",
            format!(
                "{cache} exceeds rollout.max_completion_tokens = {}",
                r.max_completion_tokens
            ),
        )?;
        if let Some(c) = l.tis_cap {
            finite_in(c as f64, 1.0, f64::MAX, "loss.tis_cap", "finite and >= 1")?;
        }

        let o = &self.optim;
        finite_in(o.lr, f64::MIN_POSITIVE, 1.0, "optim.lr", "in (0, 1]")?;
        finite_in(o.warmup_ratio, 0.0, 1.0, "optim.warmup_ratio", "in [0, 1]")?;
        finite_in(o.min_lr_ratio, 0.0, 1.0, "optim.min_lr_ratio", "in [0, 1]")?;
        finite_in(
            o.weight_decay as f64,
            0.0,
            1.0,
            "optim.weight_decay",
            "in [0, 1]",
        )?;
        finite_in(o.beta1 as f64, 0.0, 0.999_999, "optim.beta1", "in [0, 1)")?;
        finite_in(o.beta2 as f64, 0.0, 0.999_999_9, "optim.beta2", "in [0, 1)")?;
        finite_in(
            o.epsilon as f64,
            f64::MIN_POSITIVE,
            1.0,
            "optim.epsilon",
            "in (0, 1]",
        )?;
        finite_in(
            o.grad_clip as f64,
            0.0,
            f64::MAX,
            "optim.grad_clip",
            "finite and >= 0 (0 = off)",
        )?;
        ensure(o.grad_accum >= 1, "optim.grad_accum", "must be at least 1")?;

        let a = &self.aqn;
        ensure(
            a.num_stages >= 2,
            "aqn.num_stages",
            "must be at least 2 (stage 0 is noise-free)",
        )?;
        finite_in(
            a.sigma_start as f64,
            0.0,
            1.0,
            "aqn.sigma_start",
            "in [0, 1]",
        )?;
        finite_in(a.sigma_end as f64, 0.0, 1.0, "aqn.sigma_end", "in [0, 1]")?;
        if a.schedule == SigmaSchedule::Exponential {
            ensure(
                a.sigma_start > 0.0 && a.sigma_end > 0.0,
                if a.sigma_start > 0.0 {
                    "aqn.sigma_end"
                } else {
                    "aqn.sigma_start"
                },
                "must be > 0 for the exponential schedule (use schedule = \"none\" for no noise)",
            )?;
        }

        let specs = self.reward_specs();
        for (i, s) in specs.iter().enumerate() {
            let key = format!("rewards[{i}].name");
            crate::reward::by_name(&s.name).map_err(|e| bad(&key, e.to_string()))?;
            finite_in(
                s.weight as f64,
                f64::MIN,
                f64::MAX,
                &format!("rewards[{i}].weight"),
                "finite",
            )?;
        }
        ensure(
            specs.iter().filter(|s| s.accuracy).count() <= 1,
            "rewards",
            "at most one reward may have accuracy = true",
        )?;

        ensure(self.train.steps >= 1, "train.steps", "must be at least 1")?;
        ensure(
            !self.train.output_dir.as_os_str().is_empty(),
            "train.output_dir",
            "must not be empty",
        )?;

        let e = &self.eval;
        ensure(e.samples >= 1, "eval.samples", "must be at least 1")?;
        finite_in(
            e.temperature as f64,
            0.0,
            100.0,
            "eval.temperature",
            "in [0, 100] (0 = greedy)",
        )?;
        finite_in(
            e.top_p as f64,
            f64::MIN_POSITIVE,
            1.0,
            "eval.top_p",
            "in (0, 1]",
        )?;
        ensure(
            e.max_completion_tokens > 0,
            "eval.max_completion_tokens",
            "must be at least 1",
        )?;
        ensure(!e.dataset.is_empty(), "eval.dataset", "must not be empty")?;
        Ok(())
    }
}
