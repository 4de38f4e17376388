//! The data-parallel pieces of a training step, on top of a [`Communicator`]:
//!
//! * the global batch: a round's prompts are sharded across ranks ([`shard`]), a prompt's G
//!   samples stay on one rank, so group advantages are exact;
//! * DAPO dynamic sampling decided on the gathered rewards of all ranks ([`GlobalRounds`]), so
//!   every rank keeps exactly the groups a single process would keep, in the same order;
//! * the gradient all-reduce ([`all_reduce_grads`]): every trainable parameter's gradient to
//!   the host, summed over ranks, back into burn. The loss of each rank is normalised by the
//!   *global* batch (`GlobalNormalizer` with global counts), so the sum is the gradient of the
//!   whole batch, and global-norm clipping after it sees the global gradient;
//! * reduced metrics ([`RoundReport`], [`global_scores`]): per-sample scores, lengths and
//!   truncation gathered in global order, so rank 0 logs what a single process would.
//!
//! With world size 1 none of this communicates or converts anything: the trainer's single-rank
//! path is the plain one.

use std::collections::BTreeSet;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use qerl_rl::advantage::{DynamicBatch, DynamicSamplingStats};
use qerl_rl::reward::{BatchScores, RewardFailure};
use serde::{Deserialize, Serialize};

pub use crate::dist::shard;
use crate::dist::{gather_json, CommError, Communicator};

/// Every rank's `f32` vector (any lengths), in rank order; the raw bits travel.
pub fn gather_f32(comm: &dyn Communicator, v: &[f32]) -> Result<Vec<Vec<f32>>, CommError> {
    if comm.world_size() == 1 {
        return Ok(vec![v.to_vec()]);
    }
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Ok(comm
        .all_gather(&bytes)?
        .iter()
        .map(|b| {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect()
        })
        .collect())
}

/// DAPO dynamic sampling over the global batch. Each round, every rank offers the rewards of
/// its own groups; the groups of all ranks go through one [`DynamicBatch`] in global order (rank
/// order = prompt order, since shards are contiguous), identically on every rank. The payload
/// of a group is `Some` on the rank that holds it and `None` elsewhere.
pub struct GlobalRounds<T> {
    batch: DynamicBatch<Option<T>>,
    group_size: usize,
}

impl<T> GlobalRounds<T> {
    pub fn new(group_size: usize, target_groups: usize) -> Self {
        GlobalRounds {
            batch: DynamicBatch::new(group_size, target_groups),
            group_size,
        }
    }

    /// Offers one round: this rank's groups with their rewards, and every rank's flat rewards
    /// (`[groups * G]` each, rank order, from [`gather_f32`]).
    pub fn offer_round(&mut self, rank: usize, mine: Vec<(T, Vec<f32>)>, all: &[Vec<f32>]) {
        let mut mine = mine.into_iter();
        let g = self.group_size;
        let groups = all.iter().enumerate().flat_map(|(r, rewards)| {
            rewards
                .chunks(g)
                .map(move |c| (r, c.to_vec()))
                .collect::<Vec<_>>()
        });
        let offered: Vec<(Option<T>, Vec<f32>)> = groups
            .map(|(r, rewards)| {
                let payload = (r == rank).then(|| mine.next().expect("own groups in order").0);
                (payload, rewards)
            })
            .collect();
        self.batch.offer_round(offered);
    }

    pub fn is_full(&self) -> bool {
        self.batch.is_full()
    }

    /// This rank's kept groups (in order), and the global counters.
    pub fn take(self) -> (Vec<T>, DynamicSamplingStats) {
        let (groups, stats) = self.batch.take();
        (groups.into_iter().filter_map(|(p, _)| p).collect(), stats)
    }
}

/// What a rank reports of one rollout round, for the metrics (host values, JSON on the wire).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RoundReport {
    pub names: Vec<String>,
    pub totals: Vec<f32>,
    pub per_reward: Vec<Vec<f32>>,
    pub correct: Vec<bool>,
    /// `(sample, reward, message)`.
    pub failures: Vec<(usize, String, String)>,
    pub lengths: Vec<usize>,
    pub truncated: Vec<bool>,
}

impl RoundReport {
    pub fn new(scores: BatchScores, lengths: Vec<usize>, truncated: Vec<bool>) -> Self {
        RoundReport {
            names: scores.names,
            totals: scores.totals,
            per_reward: scores.per_reward,
            correct: scores.correct,
            failures: scores
                .failures
                .into_iter()
                .map(|f| (f.sample, f.reward, f.message))
                .collect(),
            lengths,
            truncated,
        }
    }

    fn scores(self) -> BatchScores {
        BatchScores {
            names: self.names,
            totals: self.totals,
            per_reward: self.per_reward,
            correct: self.correct,
            failures: self
                .failures
                .into_iter()
                .map(|(sample, reward, message)| RewardFailure {
                    sample,
                    reward,
                    message,
                })
                .collect(),
        }
    }
}

/// Per round: the scores; per completion: its length and whether it was truncated.
pub type GlobalScores = (Vec<BatchScores>, Vec<usize>, Vec<bool>);

/// The step's scores, lengths and truncation flags over all ranks, in global order (round by
/// round, rank by rank), from each rank's per-round reports.
pub fn global_scores(
    comm: &dyn Communicator,
    rounds: Vec<RoundReport>,
) -> Result<GlobalScores, CommError> {
    let all = if comm.world_size() == 1 {
        vec![rounds]
    } else {
        gather_json(comm, &rounds)?
    };
    let n = all.first().map_or(0, Vec::len);
    if let Some((rank, r)) = all.iter().enumerate().find(|(_, r)| r.len() != n) {
        return Err(CommError::Remote(format!(
            "rank {rank} reports {} rollout rounds, rank 0 {n}",
            r.len()
        )));
    }
    let mut per_rank: Vec<_> = all.into_iter().map(Vec::into_iter).collect();
    let (mut parts, mut lengths, mut truncated) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        for it in per_rank.iter_mut() {
            let mut r = it.next().expect("equal round counts");
            lengths.append(&mut r.lengths);
            truncated.append(&mut r.truncated);
            parts.push(r.scores());
        }
    }
    Ok((parts, lengths, truncated))
}

/// Trainable parameters (float parameters that require a gradient), in visit order, which is
/// the same on every rank.
struct Trainable<'a> {
    grads: &'a mut GradientsParams,
    /// Gradient values of every trainable parameter (zeros where this rank has none).
    values: Vec<f32>,
    /// 1 where this rank has a gradient for the parameter.
    present: Vec<f32>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Trainable<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let val = param.val();
        if !val.is_require_grad() {
            return;
        }
        match self.grads.remove::<B::InnerBackend, D>(param.id) {
            Some(g) => {
                self.values
                    .extend(g.cast(DType::F32).into_data().iter::<f32>());
                self.present.push(1.0);
            }
            None => {
                self.values
                    .extend(std::iter::repeat_n(0.0, val.shape().num_elements()));
                self.present.push(0.0);
            }
        }
    }
}

/// Puts the summed gradients back (in the parameter's dtype), for the parameters some rank had
/// a gradient for: the others stay without one, as in a single process.
struct Restore<'a> {
    grads: &'a mut GradientsParams,
    values: &'a [f32],
    present: &'a [f32],
    at: usize,
    index: usize,
    seen: BTreeSet<ParamId>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Restore<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let val = param.val();
        if !val.is_require_grad() {
            return;
        }
        let inner = val.inner();
        let shape = inner.shape();
        let n = shape.num_elements();
        let values = &self.values[self.at..self.at + n];
        self.at += n;
        let present = self.present[self.index] > 0.0;
        self.index += 1;
        if present && self.seen.insert(param.id) {
            let data = TensorData::new(values.to_vec(), shape);
            let g = Tensor::<B::InnerBackend, D>::from_data(data, (&inner.device(), inner.dtype()));
            self.grads.register(param.id, g);
        }
    }
}

/// Replaces `grads` (this rank's) by their sum over all ranks. Every rank calls it once per
/// optimizer step, also a rank without samples in the batch (its gradients count as zero).
pub fn all_reduce_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    comm: &dyn Communicator,
) -> Result<(), CommError> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut t = Trainable {
        grads,
        values: Vec::new(),
        present: Vec::new(),
    };
    module.visit(&mut t);
    let (mut values, present) = (t.values, t.present);
    let split = values.len();
    values.extend(present);
    comm.all_reduce_sum(&mut values)?;
    let (values, present) = values.split_at(split);
    let mut r = Restore {
        grads,
        values,
        present,
        at: 0,
        index: 0,
        seen: BTreeSet::new(),
    };
    module.visit(&mut r);
    Ok(())
}
