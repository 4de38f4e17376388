//! [`Engine`]: batched generation with continuous batching over a fixed set of slots.
//!
//! A slot holds one sequence: its region of the KV cache (`capacity` positions) and its state
//! on the device (next token, position, generated count, finished flag, request id). The host
//! loop admits waiting requests into free slots (prefilling each distinct prompt once, in
//! passes of at most `prefill_rows` tokens, and copying its cache to the slots of the other
//! samples of the same prompt), then runs decode steps over the occupied slots; the sampled
//! ids go straight back into the next step. Finished flags come back asynchronously every
//! `check_every` steps (the read is enqueued behind the step and collected one interval later,
//! so it never stalls the device); a slot that can only stop by length is known free by the
//! host without reading anything.

use std::collections::{HashMap, VecDeque};

use cubecl::bytes::Bytes;
use cubecl::prelude::*;
use cubecl::server::{Handle, ServerError};

use crate::forward::{forward, pass_key, KvCache, Pass, Workspace};
use crate::kernels::fill::scatter;
use crate::kernels::rope::{copy_prefix, rope_tables};
use crate::kernels::sample::{sample, SlotState, Truncation};
use crate::weights::EngineWeights;
use crate::EngineError;

/// Sizes fixed when the engine is built.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Sequences decoded at once.
    pub slots: usize,
    /// Positions per slot: longest prompt + completion.
    pub capacity: usize,
    /// Most prompt tokens in one prefill pass.
    pub prefill_rows: usize,
    /// Decode steps between reads of the finished flags.
    pub check_every: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            slots: 64,
            capacity: 2048,
            prefill_rows: 4096,
            check_every: 16,
        }
    }
}

/// One sequence to generate. `id` seeds its random draws (with the run's seed), so a request
/// samples the same tokens whichever batch or slot it lands in.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: u32,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
}

/// Sampling settings of one `generate` call.
#[derive(Clone, Debug)]
pub struct Sampling {
    /// 0: greedy.
    pub temperature: f32,
    pub seed: u32,
    /// Token ids that end a sequence (kept as its last token).
    pub eos: Vec<u32>,
    /// Top-k / top-p truncation of the tempered distribution (default: none).
    pub truncation: Truncation,
}

/// A finished request: generated ids, their log-probabilities under the sampling
/// distribution (temperature applied), and whether it stopped on an end token.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub id: u32,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub stopped: bool,
}

/// Counters of one `generate` call.
#[derive(Clone, Copy, Debug, Default)]
pub struct GenerateStats {
    pub decode_steps: usize,
    pub prefill_passes: usize,
    pub prefill_tokens: usize,
}

/// The rollout engine over one model's weights.
pub struct Engine<R: Runtime, F: Float> {
    client: ComputeClient<R>,
    weights: EngineWeights,
    config: EngineConfig,
    cos_sin: (Handle, Handle),
    kv: KvCache,
    ws: Workspace,
    /// `0..slots`: the slot of decode row `i` is `i`.
    identity: Handle,
    /// Each slot's next token and position (`u32`, `slots` each): the decode pass's inputs,
    /// which captured steps bake in, so they live as long as the engine and every
    /// [`Engine::generate`] resets them rather than allocating its own (a graph captured in
    /// one call then replays correctly in the next).
    step_tokens: Handle,
    step_pos: Handle,
    pub stats: GenerateStats,
    /// Whether a device read may stay in flight while more work is submitted (CUDA: yes).
    async_reads: bool,
    /// Decode steps as CUDA graphs (CUDA sm_90; `QERL_GRAPH=0` turns them off).
    graphs: crate::step_graphs::StepGraphs,
    _float: std::marker::PhantomData<F>,
}

fn upload_u32<R: Runtime>(client: &ComputeClient<R>, v: &[u32]) -> Handle {
    let v = if v.is_empty() { &[0u32][..] } else { v };
    client.create_from_slice(u32::as_bytes(v))
}

impl<R: Runtime, F: Float + CubeElement> Engine<R, F> {
    /// Allocates the KV cache (`slots x capacity` positions) and the workspaces.
    pub fn new(
        client: ComputeClient<R>,
        weights: EngineWeights,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        let s = weights.shape.clone();
        s.validate()?;
        if config.slots == 0 || config.capacity == 0 || config.prefill_rows == 0 {
            return Err(EngineError::Config(format!(
                "{config:?}: sizes must be positive"
            )));
        }
        if config.capacity > s.max_positions {
            return Err(EngineError::Config(format!(
                "capacity {} exceeds the model's {} positions",
                config.capacity, s.max_positions
            )));
        }
        let (cos, sin) = rope_tables(&s.inv_freq, s.max_positions.min(config.capacity));
        let cos_sin = (
            client.create_from_slice(f32::as_bytes(&cos)),
            client.create_from_slice(f32::as_bytes(&sin)),
        );
        let mut weights = weights;
        // The tables only cover the engine's capacity.
        weights.shape.max_positions = s.max_positions.min(config.capacity);
        let cache = config.slots * s.kv_dim() * config.capacity * std::mem::size_of::<F>();
        let kv = KvCache {
            layers: (0..s.layers)
                .map(|_| (client.empty(cache), client.empty(cache)))
                .collect(),
            slots: config.slots,
            capacity: config.capacity,
        };
        let rows = config.prefill_rows.max(config.slots);
        let ws = Workspace::new::<R, F>(&client, &weights, rows, config.slots);
        let ids: Vec<u32> = (0..config.slots as u32).collect();
        let identity = upload_u32(&client, &ids);
        let zeros = vec![0u32; config.slots];
        let (step_tokens, step_pos) = (upload_u32(&client, &zeros), upload_u32(&client, &zeros));
        let async_reads = R::name(&client).contains("cuda");
        Ok(Engine {
            client,
            weights,
            config,
            cos_sin,
            kv,
            ws,
            identity,
            step_tokens,
            step_pos,
            stats: GenerateStats::default(),
            async_reads,
            graphs: Default::default(),
            _float: std::marker::PhantomData,
        })
    }

    pub fn weights(&self) -> &EngineWeights {
        &self.weights
    }

    /// Replaces the weights (new LoRA factors or norm gains after an optimizer step); the
    /// shape must not change.
    pub fn set_weights(&mut self, weights: EngineWeights) -> Result<(), EngineError> {
        let mut weights = weights;
        weights.shape.max_positions = self.weights.shape.max_positions;
        if weights.shape != self.weights.shape {
            return Err(EngineError::Config(
                "set_weights: the model shape changed".into(),
            ));
        }
        self.weights = weights;
        self.graphs.clear();
        Ok(())
    }

    /// Decode steps captured as CUDA graphs and replayed so far (CUDA sm_90; `QERL_GRAPH=0` turns
    /// them off), and why the graphs were turned off, if they were.
    pub fn graph_report(&self) -> (usize, usize, Option<String>) {
        (
            self.graphs.captured,
            self.graphs.replayed,
            self.graphs.off.clone(),
        )
    }

    /// The last captured decode step's kernels and programmatic edges, if any was captured.
    pub fn graph_edges(&self) -> Option<(usize, usize)> {
        self.graphs.last
    }

    pub fn client(&self) -> &ComputeClient<R> {
        &self.client
    }

    pub fn config(&self) -> EngineConfig {
        self.config
    }

    fn check(&self, requests: &[Request]) -> Result<(), EngineError> {
        let vocab = self.weights.shape.vocab;
        let mut ids = std::collections::HashSet::new();
        for r in requests {
            if r.prompt.is_empty() {
                return Err(EngineError::Request(format!(
                    "request {}: empty prompt",
                    r.id
                )));
            }
            if r.max_new_tokens == 0 {
                return Err(EngineError::Request(format!(
                    "request {}: max_new_tokens is 0",
                    r.id
                )));
            }
            if r.prompt.len() + r.max_new_tokens > self.config.capacity {
                return Err(EngineError::Request(format!(
                    "request {}: prompt {} + {} new tokens exceed the engine's capacity of {} positions",
                    r.id,
                    r.prompt.len(),
                    r.max_new_tokens,
                    self.config.capacity
                )));
            }
            if let Some(t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::Request(format!(
                    "request {}: token id {t} is outside the vocabulary ({vocab})",
                    r.id
                )));
            }
            if !ids.insert(r.id) {
                return Err(EngineError::Request(format!(
                    "request id {} appears twice",
                    r.id
                )));
            }
        }
        Ok(())
    }

    /// Generates every request; completions come back in request order.
    pub fn generate(
        &mut self,
        requests: &[Request],
        sampling: &Sampling,
    ) -> Result<Vec<Completion>, EngineError> {
        self.check(requests)?;
        self.stats = GenerateStats::default();
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let c = self.client.clone();
        let slots = self.config.slots;
        let cap_new = requests.iter().map(|r| r.max_new_tokens).max().unwrap_or(1);
        let n_req = requests.len();
        let zeros = vec![0u32; slots];
        let zeros_h = upload_u32(&c, &zeros);
        for target in [&self.step_tokens, &self.step_pos] {
            scatter(&c, target, slots, &self.identity, &zeros_h, slots);
        }
        let state = SlotState {
            tokens: self.step_tokens.clone(),
            pos: self.step_pos.clone(),
            generated: upload_u32(&c, &zeros),
            done: upload_u32(&c, &vec![1u32; slots]),
            request: upload_u32(&c, &zeros),
            rng_id: upload_u32(&c, &zeros),
            max_new: upload_u32(&c, &vec![1u32; slots]),
            // Indexed by request (`request` holds the request's index), not by slot.
            out_tokens: c.empty(n_req * cap_new * 4),
            out_logprob: c.empty(n_req * cap_new * 4),
            slots,
            requests: n_req,
            capacity_new: cap_new,
        };
        let eos = upload_u32(&c, &sampling.eos);

        let mut waiting: VecDeque<usize> = (0..n_req).collect();
        // Per slot: the request index and an upper bound of its generated count.
        let mut occupant: Vec<Option<(usize, usize)>> = vec![None; slots];
        // A finished-flags read in flight, with the request each slot held when it was enqueued.
        let mut pending_flags: Option<(FlagsRead, Vec<Option<usize>>)> = None;
        let mut steps_since_check = 0usize;
        let mut finished = vec![false; n_req];
        loop {
            // Free slots whose request is certainly done (by length) or flagged done.
            for o in occupant.iter_mut() {
                if let Some((r, gen)) = *o {
                    if gen >= requests[r].max_new_tokens || finished[r] {
                        finished[r] = true;
                        *o = None;
                    }
                }
            }
            let free: Vec<usize> = (0..slots).filter(|&s| occupant[s].is_none()).collect();
            if !free.is_empty() && !waiting.is_empty() {
                let admitted: Vec<(usize, usize)> = free
                    .iter()
                    .map_while(|&s| waiting.pop_front().map(|r| (s, r)))
                    .collect();
                self.admit(requests, &admitted, &state, &eos, sampling)?;
                for &(s, r) in &admitted {
                    occupant[s] = Some((r, 1));
                }
            }
            let live = occupant.iter().rposition(Option::is_some);
            let Some(last) = live else { break };
            let rows = last + 1;
            // A slot's row sits at position prompt + generated - 1; one more for safety.
            let context = occupant
                .iter()
                .flatten()
                .map(|&(r, gen)| requests[r].prompt.len() + gen + 1)
                .max()
                .unwrap_or(self.config.capacity);
            let pass = Pass {
                rows,
                tokens: &state.tokens,
                slot: &self.identity,
                pos: &state.pos,
                logit_index: &self.identity,
                logit_count: rows,
                context,
            };
            let key = pass_key::<R, F>(&c, &self.weights, &self.kv, &self.ws, &pass);
            let (w, cs, kv, ws) = (&self.weights, &self.cos_sin, &self.kv, &self.ws);
            self.graphs.run(&c, key, &self.identity, || {
                forward::<R, F>(&c, w, cs, kv, ws, &pass)
            })?;
            sample(
                &c,
                &self.ws.logits,
                rows,
                self.weights.shape.vocab,
                &self.identity,
                &eos,
                sampling.eos.len(),
                &state,
                sampling.temperature,
                sampling.seed,
                sampling.truncation,
                &self.ws.sample_scratch,
            );
            self.stats.decode_steps += 1;
            for (_, gen) in occupant.iter_mut().flatten() {
                *gen += 1;
            }
            steps_since_check += 1;
            if !sampling.eos.is_empty() && steps_since_check >= self.config.check_every {
                steps_since_check = 0;
                if let Some((f, held)) = pending_flags.take() {
                    apply_flags(&read_flags(f)?, &held, &occupant, &mut finished);
                }
                let held = occupant.iter().map(|o| o.map(|(r, _)| r)).collect();
                let read: FlagsRead = Box::pin(c.read_async(vec![state.done.clone()]));
                pending_flags = Some((read, held));
                if !self.async_reads {
                    // wgpu cannot submit work while a read's staging buffer is mapped: the
                    // flags are collected at once there.
                    let (f, held) = pending_flags.take().expect("just set");
                    apply_flags(&read_flags(f)?, &held, &occupant, &mut finished);
                }
            }
        }
        let out = c.read(vec![
            state.out_tokens.clone(),
            state.out_logprob.clone(),
            state.generated.clone(),
        ]);
        let toks = u32::from_bytes(&out[0]);
        let lps = f32::from_bytes(&out[1]);
        let eos_set: std::collections::HashSet<u32> = sampling.eos.iter().copied().collect();
        Ok(requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let row = &toks[i * cap_new..i * cap_new + r.max_new_tokens];
                let len = row
                    .iter()
                    .position(|t| eos_set.contains(t))
                    .map_or(r.max_new_tokens, |p| p + 1);
                Completion {
                    id: r.id,
                    tokens: row[..len].to_vec(),
                    logprobs: lps[i * cap_new..i * cap_new + len].to_vec(),
                    stopped: len < r.max_new_tokens || eos_set.contains(&row[len - 1]),
                }
            })
            .collect())
    }

    /// Prefills the admitted `(slot, request)` pairs: each distinct prompt once, its cache
    /// copied to the slots of its other samples; then samples their first token.
    fn admit(
        &mut self,
        requests: &[Request],
        admitted: &[(usize, usize)],
        state: &SlotState,
        eos: &Handle,
        sampling: &Sampling,
    ) -> Result<(), EngineError> {
        let c = self.client.clone();
        // Distinct prompts, in order of first appearance: (prompt, source slot, all slots).
        let mut groups: Vec<PromptGroup<'_>> = Vec::new();
        let mut by_prompt: HashMap<&[u32], usize> = HashMap::new();
        for &(s, r) in admitted {
            let p = requests[r].prompt.as_slice();
            let g = *by_prompt.entry(p).or_insert_with(|| {
                groups.push(PromptGroup {
                    prompt: p,
                    source: s,
                    members: Vec::new(),
                });
                groups.len() - 1
            });
            groups[g].members.push((s, r));
        }
        // Slot state: position of the last prompt token (sampling advances it), counts, ids.
        let slots: Vec<u32> = admitted.iter().map(|&(s, _)| s as u32).collect();
        let pos: Vec<u32> = admitted
            .iter()
            .map(|&(_, r)| requests[r].prompt.len() as u32 - 1)
            .collect();
        let req: Vec<u32> = admitted.iter().map(|&(_, r)| r as u32).collect();
        let rng: Vec<u32> = admitted.iter().map(|&(_, r)| requests[r].id).collect();
        let max_new: Vec<u32> = admitted
            .iter()
            .map(|&(_, r)| requests[r].max_new_tokens as u32)
            .collect();
        let zeros = vec![0u32; admitted.len()];
        let idx = upload_u32(&c, &slots);
        let n = admitted.len();
        let s_total = self.config.slots;
        for (target, values) in [
            (&state.pos, &pos),
            (&state.request, &req),
            (&state.rng_id, &rng),
            (&state.max_new, &max_new),
            (&state.generated, &zeros),
            (&state.done, &zeros),
        ] {
            scatter(&c, target, s_total, &idx, &upload_u32(&c, values), n);
        }
        // Prefill passes over the distinct prompts' tokens.
        let mut rows: Vec<(u32, u32, u32)> = Vec::new(); // (token, slot, pos)
        let mut ends: Vec<(usize, usize)> = Vec::new(); // (group, row index in this pass)
        let flush = |this: &mut Self,
                     rows: &mut Vec<(u32, u32, u32)>,
                     ends: &mut Vec<(usize, usize)>|
         -> Result<(), EngineError> {
            if rows.is_empty() {
                return Ok(());
            }
            let tokens: Vec<u32> = rows.iter().map(|r| r.0).collect();
            let slot: Vec<u32> = rows.iter().map(|r| r.1).collect();
            let pos: Vec<u32> = rows.iter().map(|r| r.2).collect();
            // Logit rows: the last prompt row of each group ending here, once per sample.
            let mut index = Vec::new();
            let mut slot_of = Vec::new();
            for &(g, row) in ends.iter() {
                for &(s, _) in &groups[g].members {
                    index.push(row as u32);
                    slot_of.push(s as u32);
                }
            }
            let (th, sh, ph) = (
                upload_u32(&c, &tokens),
                upload_u32(&c, &slot),
                upload_u32(&c, &pos),
            );
            let ih = upload_u32(&c, &index);
            let count = index.len();
            let s = &this.weights.shape;
            // At most one sampled row per admitted slot: within the logits buffer.
            let pass = Pass {
                rows: rows.len(),
                tokens: &th,
                slot: &sh,
                pos: &ph,
                logit_index: &ih,
                logit_count: count.min(this.ws.logit_rows),
                context: pos.iter().map(|&p| p as usize + 1).max().unwrap_or(1),
            };
            forward::<R, F>(&c, &this.weights, &this.cos_sin, &this.kv, &this.ws, &pass)?;
            this.stats.prefill_passes += 1;
            this.stats.prefill_tokens += rows.len();
            // Copy each finished group's cache to its other slots (before any sampling step).
            let (mut src, mut dst, mut len) = (Vec::new(), Vec::new(), Vec::new());
            for &(g, _) in ends.iter() {
                for &(sl, _) in groups[g].members.iter().skip(1) {
                    src.push(groups[g].source as u32);
                    dst.push(sl as u32);
                    len.push(groups[g].prompt.len() as u32);
                }
            }
            if !src.is_empty() {
                let (sh, dh, lh) = (
                    upload_u32(&c, &src),
                    upload_u32(&c, &dst),
                    upload_u32(&c, &len),
                );
                for (k, v) in &this.kv.layers {
                    copy_prefix::<R, F>(
                        &c,
                        k,
                        v,
                        this.kv.slots,
                        s.kv_heads,
                        this.kv.capacity,
                        s.head_dim,
                        &sh,
                        &dh,
                        &lh,
                        src.len(),
                    );
                }
            }
            let so = upload_u32(&c, &slot_of);
            if count > 0 {
                sample(
                    &c,
                    &this.ws.logits,
                    pass.logit_count,
                    s.vocab,
                    &so,
                    eos,
                    sampling.eos.len(),
                    state,
                    sampling.temperature,
                    sampling.seed,
                    sampling.truncation,
                    &this.ws.sample_scratch,
                );
            }
            rows.clear();
            ends.clear();
            Ok(())
        };
        for (g, group) in groups.iter().enumerate() {
            let (prompt, src_slot) = (group.prompt, &group.source);
            for (p, &tok) in prompt.iter().enumerate() {
                if rows.len() == self.config.prefill_rows {
                    flush(self, &mut rows, &mut ends)?;
                }
                rows.push((tok, *src_slot as u32, p as u32));
            }
            ends.push((g, rows.len() - 1));
        }
        flush(self, &mut rows, &mut ends)
    }
}

/// A distinct prompt among the requests admitted together: prefilled once into `source`, its
/// cache copied to the other `members` (`(slot, request)` pairs, `source`'s first).
struct PromptGroup<'a> {
    prompt: &'a [u32],
    source: usize,
    members: Vec<(usize, usize)>,
}

/// A device read of the finished flags, collected one check interval after it was enqueued.
type FlagsRead<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Vec<Bytes>, ServerError>> + Send + 'a>,
>;

/// Marks finished the requests whose slot's flag is set, when the slot still holds the request
/// it held as the flags were read.
fn apply_flags(
    flags: &[u32],
    held: &[Option<usize>],
    occupant: &[Option<(usize, usize)>],
    finished: &mut [bool],
) {
    for (s, o) in occupant.iter().enumerate() {
        if let (Some((r, _)), Some(&d)) = (o, flags.get(s)) {
            if d != 0 && held[s] == Some(*r) {
                finished[*r] = true;
            }
        }
    }
}

fn read_flags(f: FlagsRead<'_>) -> Result<Vec<u32>, EngineError> {
    let bytes = cubecl::future::block_on(f).map_err(|e| EngineError::Device(format!("{e:?}")))?;
    Ok(u32::from_bytes(&bytes[0]).to_vec())
}
