//! The GRPO / DAPO / Dr. GRPO trainer: one model serves rollouts (its inner, graph-free view)
//! and the training forward; the KL reference is the same model with LoRA disabled.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::AutodiffModule;
use burn::module::ParamId;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::{AdaptorRecord, AdaptorRecordV1};
use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;
use qerl_model::config::eos_token_ids;
use qerl_model::{
    load, CausalLm, ChatTemplate, GenerationConfig, GenerationDefaults, QerlBackend,
    SamplingParams, Tokenizer,
};
use qerl_rl::advantage::{group_advantages, zero_std_fraction};
use qerl_rl::data::{load_jsonl, Example, PromptSampler};
use qerl_rl::metrics::StepMetrics;
use qerl_rl::reward::RewardSet;
use qerl_rl::TrainConfig;
use rand::{Rng, SeedableRng};

use crate::checkpoint::{self, TrainerState, CONFIG_FILE, OPTIMIZER_FILE};
use crate::dist::{Communicator, Single};
use crate::dp::{gather_f32, global_scores, shard, GlobalRounds, RoundReport};
use crate::load_options::load_options;
use crate::noise::{set_noise, step_noise};
use crate::peft::{self, AdapterMeta, HostTensor, PEFT_PREFIX};
use crate::rollout::{encode_prompts, merge_scores, sample_groups_at, score_groups, Group};
use crate::update::{update, TrainBatch, UpdateConfig, UpdateStats};

/// A backend the trainer runs on: autodiff over a qerl backend.
pub trait TrainBackend: AutodiffBackend<InnerBackend: QerlBackend> + QerlBackend {}
impl<B: AutodiffBackend<InnerBackend: QerlBackend> + QerlBackend> TrainBackend for B {}

/// What a run needs besides the model: the resolved config, tokenizer, rewards and data.
pub struct TrainSetup {
    pub config: TrainConfig,
    pub tokenizer: Tokenizer,
    pub rewards: RewardSet,
    pub examples: Vec<Example>,
    /// Wrap prompts in the model's ChatML template (else the plain text).
    pub chat: bool,
}

impl TrainSetup {
    /// Rewards and data from the config; the tokenizer from `tokenizer` or the model directory.
    pub fn from_config(config: TrainConfig, tokenizer: Option<&Path>) -> Result<Self> {
        config.validate()?;
        let config = config.resolved();
        let tokenizer = Tokenizer::for_model(&config.model.dir, tokenizer)?;
        let rewards = config.reward_set()?;
        let file = config
            .data
            .file()
            .context("data.path is required for dataset = \"jsonl\"")?;
        let examples = load_jsonl(&file, &config.data.field_spec())?;
        anyhow::ensure!(!examples.is_empty(), "`{}` has no examples", file.display());
        Ok(TrainSetup {
            config,
            tokenizer,
            rewards,
            examples,
            chat: true,
        })
    }
}

/// A seed mixed from the run seed, the step and a stream number.
pub fn mix(seed: u64, step: usize, stream: u64) -> u64 {
    let mut z = seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream.rotate_left(29);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The optimizer moments of a loaded record, as f32. burn converts every float tensor of a
/// loaded record to the backend's float type (bf16 on CUDA), but the trained parameters are f32
/// master weights and CubeCL backends do not promote mixed dtypes: a bf16 moment beside an f32
/// gradient reads garbage (NaN weights after the first step of a resumed CUDA run). The round
/// trip through bf16 costs the moments their low mantissa bits, nothing else.
fn moments_f32<B, M>(record: M) -> M
where
    B: TrainBackend,
    M: IntoIterator<Item = (ParamId, AdaptorRecord<AdamW, B>)>
        + FromIterator<(ParamId, AdaptorRecord<AdamW, B>)>,
{
    fn f32_state<B: burn::tensor::backend::Backend, const D: usize>(
        s: AdamWState<B, D>,
    ) -> AdamWState<B, D> {
        let m = s.momentum;
        AdamWState {
            momentum: AdaptiveMomentumState {
                time: m.time,
                moment_1: m.moment_1.cast(DType::F32),
                moment_2: m.moment_2.cast(DType::F32),
                max_moment_2: m.max_moment_2.map(|t| t.cast(DType::F32)),
            },
        }
    }
    record
        .into_iter()
        .map(|(id, r)| {
            let r = match r {
                AdaptorRecord::V1(AdaptorRecordV1::Rank1(s)) => {
                    AdaptorRecord::V1(AdaptorRecordV1::Rank1(f32_state(s)))
                }
                AdaptorRecord::V1(AdaptorRecordV1::Rank2(s)) => {
                    AdaptorRecord::V1(AdaptorRecordV1::Rank2(f32_state(s)))
                }
                other => other,
            };
            (id, r)
        })
        .collect()
}

/// The process's peak resident set (`VmHWM` of /proc/self/status), where the OS reports it.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The trainer. Under data parallelism one per rank, each with its own copy of the policy:
/// every rank samples the same global prompts, rolls out its shard of them, and applies the
/// same all-reduced gradients, so all copies stay identical.
pub struct Trainer<B: TrainBackend> {
    model: Option<CausalLm<B>>,
    optim: OptimizerAdaptor<AdamW, CausalLm<B>, B>,
    pub setup: TrainSetup,
    prompts: Vec<Vec<u32>>,
    answers: Vec<String>,
    sampler: PromptSampler,
    pub state: TrainerState,
    generation: GenerationConfig,
    comm: Box<dyn Communicator>,
}

impl<B: TrainBackend> Trainer<B> {
    /// Loads the model with fresh LoRA adapters (A uniform in ±1/sqrt(d_in) from the run seed,
    /// B zero: PEFT's initialisation) and a fresh optimizer.
    pub fn new(setup: TrainSetup, device: &B::Device) -> Result<Self> {
        let c = &setup.config;
        let options = load_options(&c.model, &c.lora);
        let dir = &c.model.dir;
        let mut model = load::<B>(dir, &options, device)
            .with_context(|| format!("cannot load the model in `{}`", dir.display()))?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(mix(c.train.seed, 0, 0x10AA));
        let mut init = BTreeMap::new();
        for (name, lin) in peft::linears(&model) {
            if let Some(l) = lin.lora() {
                let ([r, d_in], [d_out, _]) = (l.a.dims(), l.b.dims());
                let bound = 1.0 / (d_in as f32).sqrt();
                let a = (0..r * d_in)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                let a = HostTensor {
                    shape: vec![r, d_in],
                    values: a,
                };
                let b = HostTensor {
                    shape: vec![d_out, r],
                    values: vec![0.0; d_out * r],
                };
                init.insert(format!("{PEFT_PREFIX}{name}.lora_A.weight"), a);
                init.insert(format!("{PEFT_PREFIX}{name}.lora_B.weight"), b);
            }
        }
        peft::load_trained(&mut model, &init, None, &BTreeMap::new())?;
        let o = &c.optim;
        let optim = AdamWConfig::new()
            .with_beta_1(o.beta1)
            .with_beta_2(o.beta2)
            .with_epsilon(o.epsilon)
            .with_weight_decay(o.weight_decay)
            .init::<B, CausalLm<B>>();
        let chat = setup
            .chat
            .then(|| ChatTemplate::for_model(dir))
            .transpose()?;
        let questions: Vec<String> = setup.examples.iter().map(|e| e.question.clone()).collect();
        let prompts = encode_prompts(
            &questions,
            &c.data.prompt,
            chat.as_ref(),
            &setup.tokenizer,
            c.data.max_prompt_tokens,
        )?;
        let answers = setup.examples.iter().map(|e| e.answer.clone()).collect();
        let defaults = GenerationDefaults::from_dir(dir)?;
        let generation = GenerationConfig {
            max_new_tokens: c.rollout.max_completion_tokens,
            sampling: SamplingParams {
                temperature: c.rollout.temperature,
                top_p: c.rollout.top_p,
                top_k: 0,
            },
            seed: 0,
            eos_token_ids: eos_token_ids(model.config(), &defaults),
            stop_strings: Vec::new(),
            pad_token_id: defaults
                .pad_token_id
                .or(model.config().pad_token_id)
                .unwrap_or(0),
        };
        let sampler = PromptSampler::new(setup.examples.len(), c.data.shuffle, c.train.seed);
        let state = TrainerState {
            step: 0,
            seed: c.train.seed,
            prompts_consumed: 0,
            param_ids: BTreeMap::new(),
            trained_norms: c.lora.train_norms,
        };
        Ok(Trainer {
            model: Some(model),
            optim,
            prompts,
            answers,
            sampler,
            state,
            generation,
            setup,
            comm: Box::new(Single),
        })
    }

    /// Makes this trainer one rank of a data-parallel group (the default is [`Single`]).
    pub fn with_communicator(mut self, comm: Box<dyn Communicator>) -> Self {
        self.comm = comm;
        self
    }

    pub fn communicator(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// Whether this rank logs and writes checkpoints (rank 0).
    pub fn is_main(&self) -> bool {
        self.comm.rank() == 0
    }

    /// [`new`](Self::new), then the adapter, norms, optimizer state and counters of a
    /// checkpoint (a checkpoint directory or a run directory with a `latest` file).
    pub fn resume(setup: TrainSetup, dir: &Path, device: &B::Device) -> Result<Self> {
        let dir = checkpoint::resolve_checkpoint(dir)?;
        let state = TrainerState::read(&dir)?;
        let mut t = Self::new(setup, device)?;
        let (lora, norms) = peft::read_trained(&dir, state.trained_norms)?;
        peft::load_trained(t.model_mut(), &lora, norms.as_ref(), &state.param_ids)?;
        let record = NamedMpkFileRecorder::<FullPrecisionSettings>::new()
            .load(dir.join(OPTIMIZER_FILE), device)
            .with_context(|| format!("cannot read the optimizer state in `{}`", dir.display()))?;
        t.optim = t.optim.load_record(moments_f32(record));
        if state.prompts_consumed > 0 {
            t.sampler.next_batch(state.prompts_consumed);
        }
        t.state = state;
        Ok(t)
    }

    pub fn model(&self) -> &CausalLm<B> {
        self.model
            .as_ref()
            .expect("the model is present between steps")
    }

    pub fn model_mut(&mut self) -> &mut CausalLm<B> {
        self.model
            .as_mut()
            .expect("the model is present between steps")
    }

    pub fn config(&self) -> &TrainConfig {
        &self.setup.config
    }

    /// The AQN sigma of the current step and its noise vectors.
    fn noise(&self) -> (f32, Option<Vec<Vec<f32>>>) {
        let c = &self.setup.config;
        let sigma = c.aqn.schedule().sigma(self.state.step, c.train.steps);
        let m = self.model().config();
        let noise = step_noise(
            self.state.seed,
            self.state.step,
            2 * m.num_hidden_layers + 1,
            m.hidden_size,
            sigma,
        );
        (sigma, noise)
    }

    /// One rollout batch and its `mu` updates; returns the step's metrics.
    pub fn train_step(&mut self) -> Result<StepMetrics> {
        let start = Instant::now();
        let c = self.setup.config.clone();
        let step = self.state.step;
        let g = c.rollout.group_size;
        let (sigma, noise) = self.noise();
        // Rollouts on the graph-free view of the model, with this step's noise.
        let mut inner = self.model().valid();
        set_noise(&mut inner, noise.as_deref());
        let dynamic = c.loss.dynamic_sampling();
        let rounds = if dynamic {
            c.loss.max_sampling_rounds.max(1)
        } else {
            1
        };
        let max_len = c.rollout.max_completion_tokens;
        let overlong = c.loss.overlong_buffer(max_len);
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let mut dyn_batch = GlobalRounds::<Group>::new(g, c.rollout.batch_prompts);
        let mut kept = Vec::new();
        let mut reports = Vec::new();
        let mut zero_std = 0.0;
        let mut rollout_time = 0.0f64;
        for round in 0..rounds {
            // every rank draws the same global prompts and rolls out its contiguous shard
            let idx = self.sampler.next_batch(c.rollout.batch_prompts);
            self.state.prompts_consumed += idx.len();
            let mine = shard(idx.len(), rank, world);
            let prompts: Vec<(usize, Vec<u32>)> = idx[mine.clone()]
                .iter()
                .map(|&i| (i, self.prompts[i].clone()))
                .collect();
            let gen = GenerationConfig {
                seed: mix(self.state.seed, step, 0x5A3 + round as u64),
                ..self.generation.clone()
            };
            let t = Instant::now();
            let mut groups = sample_groups_at(
                &inner,
                &prompts,
                g,
                &gen,
                &self.setup.tokenizer,
                mine.start * g,
            )?;
            rollout_time += t.elapsed().as_secs_f64();
            let scores = score_groups(
                &mut groups,
                &self.answers,
                &self.setup.rewards,
                max_len,
                overlong,
            );
            let (mut lengths, mut truncated) = (Vec::new(), Vec::new());
            for grp in &groups {
                lengths.extend(grp.completions.iter().map(|c| c.tokens.len()));
                truncated.extend(grp.truncated());
            }
            reports.push(RoundReport::new(scores, lengths, truncated));
            let mine_rewards: Vec<f32> = groups.iter().flat_map(|x| x.rewards.clone()).collect();
            let all = gather_f32(self.comm.as_ref(), &mine_rewards)?;
            if round == 0 {
                zero_std = zero_std_fraction(&all.concat(), g)?;
            }
            if dynamic {
                let offered = groups
                    .into_iter()
                    .map(|x| {
                        let r = x.rewards.clone();
                        (x, r)
                    })
                    .collect();
                dyn_batch.offer_round(rank, offered, &all);
                if dyn_batch.is_full() {
                    break;
                }
            } else {
                kept = groups;
            }
        }
        let (mut groups_dropped, mut sampling_rounds) = (0, 1);
        if dynamic {
            let (groups, stats) = dyn_batch.take();
            kept = groups;
            groups_dropped = stats.dropped_flat;
            sampling_rounds = stats.rounds;
        }
        drop(inner);

        // The update.
        let lr = c.lr_schedule().lr(step);
        let mut stats = UpdateStats::default();
        // the update runs on every rank when any rank kept groups (a rank without any
        // still sums gradients and steps the optimizer)
        let kept_anywhere = if world == 1 {
            !kept.is_empty()
        } else {
            crate::dist::any(self.comm.as_ref(), !kept.is_empty())?
        };
        if kept_anywhere {
            let batch = if kept.is_empty() {
                TrainBatch::empty()
            } else {
                self.train_batch(&kept)?
            };
            let train_noise = if c.aqn.rollouts_only {
                None
            } else {
                noise.as_deref()
            };
            let mut model = self.model.take().expect("model");
            set_noise(&mut model, train_noise);
            let loss_cfg = c.loss.policy_loss(max_len);
            let cfg = UpdateConfig {
                loss: &loss_cfg,
                mu: c.loss.mu.max(1),
                grad_accum: c.optim.grad_accum.max(1),
                grad_clip: c.optim.grad_clip,
                temperature: c.rollout.temperature,
                tis_cap: c.loss.tis_cap,
                lr,
                logprob_chunk_tokens: c.optim.logprob_chunk_tokens,
                activation_checkpointing: c.optim.activation_checkpointing,
                train_noise,
                comm: self.comm.as_ref(),
            };
            let result = update(model, &mut self.optim, &batch, &cfg, &mut stats);
            let mut model = result?;
            set_noise(&mut model, None);
            self.model = Some(model);
        }
        self.state.step += 1;
        if world > 1 {
            // the update's statistics are sums of per-rank parts (global normaliser)
            let mut v = [
                stats.loss,
                stats.clip_frac_low,
                stats.clip_frac_high,
                stats.kl,
                stats.entropy,
            ];
            self.comm.all_reduce_sum(&mut v)?;
            [
                stats.loss,
                stats.clip_frac_low,
                stats.clip_frac_high,
                stats.kl,
                stats.entropy,
            ] = v;
            let times = gather_f32(self.comm.as_ref(), &[rollout_time as f32])?;
            rollout_time = times.iter().map(|t| t[0] as f64).fold(0.0, f64::max);
        }
        let (parts, lengths, truncated) = global_scores(self.comm.as_ref(), reports)?;

        let mut m = StepMetrics {
            step,
            entropy: stats.entropy,
            kl: stats.kl,
            clip_frac_low: stats.clip_frac_low,
            clip_frac_high: stats.clip_frac_high,
            loss: stats.loss,
            grad_norm: stats.grad_norm,
            lr,
            zero_std_frac: zero_std,
            groups_dropped,
            sampling_rounds,
            sigma,
            rollout_time_s: rollout_time as f32,
            ..StepMetrics::default()
        };
        m.set_rewards(&merge_scores(parts));
        m.set_lengths(&lengths, &truncated);
        m.rollout_tokens_per_s =
            lengths.iter().sum::<usize>() as f32 / rollout_time.max(1e-9) as f32;
        m.step_time_s = start.elapsed().as_secs_f32();
        m.peak_memory_bytes = B::memory_usage(&self.model().device())
            .map(|(_, reserved)| reserved)
            .or_else(peak_rss_bytes);
        Ok(m)
    }

    /// The training batch of this rank's kept groups, with their group advantages.
    fn train_batch(&self, kept: &[Group]) -> Result<TrainBatch> {
        let c = &self.setup.config;
        let rewards: Vec<f32> = kept.iter().flat_map(|x| x.rewards.clone()).collect();
        let adv = group_advantages(&rewards, c.rollout.group_size, c.loss.advantage_kind())?;
        let (mut prompts, mut comps, mut masked) = (Vec::new(), Vec::new(), Vec::new());
        for grp in kept {
            for (comp, cut) in grp.completions.iter().zip(grp.truncated()) {
                prompts.push(grp.prompt.as_slice());
                comps.push((comp.tokens.as_slice(), comp.logprobs.as_slice()));
                masked.push(cut && c.loss.mask_truncated() || comp.tokens.is_empty());
            }
        }
        let pad = self.generation.pad_token_id;
        Ok(TrainBatch::new(&prompts, &comps, adv, &masked, pad)?
            .padded_to_multiple(crate::update::TRAIN_LENGTH_MULTIPLE, pad))
    }

    /// Writes `output_dir/checkpoint-<step>` atomically; returns its path.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        let c = self.setup.config.clone();
        let meta = AdapterMeta {
            rank: c.lora.rank,
            alpha: c.lora.alpha,
            targets: c.lora.targets.clone(),
            base_model: c.model.dir.display().to_string(),
            norms: self.state.trained_norms,
        };
        let name = checkpoint::checkpoint_name(self.state.step);
        let record = self.optim.to_record();
        let model = self.model.as_mut().expect("model");
        let mut state = self.state.clone();
        state.param_ids = peft::param_ids(model);
        checkpoint::write_atomically(&c.train.output_dir, &name, |dir| {
            peft::write_adapter(model, &meta, dir)?;
            let optimizer = dir.join(OPTIMIZER_FILE);
            NamedMpkFileRecorder::<FullPrecisionSettings>::new()
                .record(record, optimizer.clone())
                .with_context(|| {
                    format!("cannot write the optimizer state `{}`", optimizer.display())
                })?;
            state.write(dir)?;
            let config = dir.join(CONFIG_FILE);
            std::fs::write(&config, c.to_toml())
                .with_context(|| format!("cannot write `{}`", config.display()))?;
            Ok(())
        })
    }
}
