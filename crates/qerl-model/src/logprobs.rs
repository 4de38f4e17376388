//! Log-probabilities of chosen tokens from the final hidden states, without the
//! `[batch, seq, vocab]` logits: the rows that are scored are gathered first, then the lm_head,
//! log-softmax, gather and entropy run in chunks of rows ([`qerl_nn::lm_head_log_probs`]).

use burn::tensor::{Int, Tensor, TensorData};
use qerl_nn::{lm_head_log_probs, LogProbOptions, QerlBackend};

use crate::error::{ModelError, Result};
use crate::model::CausalLm;

impl<B: QerlBackend> CausalLm<B> {
    /// The output projection `[vocab, hidden]`: lm_head, or the embeddings when they are tied
    /// (frozen in RL training; trainable only under `set_base_trainable`, and then the
    /// chunked log-probabilities give it its gradient too).
    pub fn lm_head_weight(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(w) => w.val(),
            None => self.embed_tokens.val(),
        }
    }

    /// `log p(targets[i])` and the entropy (nats; 0 under [`qerl_nn::Entropy::Off`]) of the next-token
    /// distribution at `rows[i]` of the final hidden states `hidden [batch, len, hidden]`
    /// ([`hidden_states`](Self::hidden_states)), a row being `b * len + t`: `[rows.len()]`
    /// each, f32. Only the chosen rows go through the lm_head, `opts.rows(vocab)` at a time;
    /// under autodiff the gradient reaches `hidden` through a backward that recomputes each
    /// chunk's logits.
    pub fn token_log_probs(
        &self,
        hidden: Tensor<B, 3>,
        rows: &[usize],
        targets: &[u32],
        opts: &LogProbOptions,
    ) -> Result<(Tensor<B, 1>, Tensor<B, 1>)> {
        let [b, s, h] = hidden.dims();
        let vocab = self.config.vocab_size;
        if rows.len() != targets.len() {
            return Err(ModelError::Input(format!(
                "{} rows to score but {} target tokens",
                rows.len(),
                targets.len()
            )));
        }
        if let Some(r) = rows.iter().find(|&&r| r >= b * s) {
            return Err(ModelError::Input(format!(
                "row {r} is outside the hidden states of {b} x {s} positions"
            )));
        }
        if let Some(t) = targets.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::Input(format!(
                "target token {t} is outside the model's vocabulary (vocab_size {vocab} in `{}`)",
                self.config.path.display()
            )));
        }
        let device = self.device();
        if rows.is_empty() {
            let z = Tensor::<B, 1>::zeros([0], (&device, burn::tensor::DType::F32));
            return Ok((z.clone(), z));
        }
        let index = |v: Vec<i64>| {
            let n = v.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), &device)
        };
        let picked = hidden
            .reshape([b * s, h])
            .select(0, index(rows.iter().map(|&r| r as i64).collect()));
        let targets = index(targets.iter().map(|&t| t as i64).collect());
        Ok(lm_head_log_probs(
            picked,
            self.lm_head_weight(),
            targets,
            opts,
        ))
    }
}
