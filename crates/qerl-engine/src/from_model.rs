//! The engine over a loaded (or training) burn model: its weights shared, not copied, and
//! `qerl_model::generate`'s contract on top of [`Engine`].
//!
//! The frozen 4-bit weights are the model's own device buffers ([`DeviceWeight`] handles are
//! reference counted); embeddings, lm_head and biases are the model's tensors' buffers. LoRA
//! factors (f32 master weights in the model) are cast to the compute type and the norm gains
//! (weight + AQN noise) summed in f32: small copies, made again by each call, so an engine
//! always runs the policy as it is after the last optimizer step.

use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::server::Handle;
use qerl_model::generate::{Completion as ModelCompletion, Decode, FinishReason, GenerationConfig};
use qerl_model::rope::Rope;
use qerl_model::CausalLm;
use qerl_nn::{NoisyRmsNorm, Nvfp4Linear};

use crate::engine::{Engine, EngineConfig, Request, Sampling};
use crate::kernels::sample::Truncation;
use crate::shape::ModelShape;
use crate::weights::{EngineWeights, Frozen, Layer, Linear, LoraWeights};
use crate::EngineError;

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// The buffer of a tensor, made contiguous first if it is a strided view.
fn handle_of<R, F, I, BT, const D: usize>(t: Tensor<Cube<R, F, I, BT>, D>) -> Handle
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let prim = match t.into_primitive() {
        TensorPrimitive::Float(p) => p,
        TensorPrimitive::QFloat(p) => p,
    };
    let prim = if prim.is_contiguous_buffer() {
        prim
    } else {
        into_contiguous(prim)
    };
    prim.handle
}

/// The model's shape as the engine sees it.
pub fn shape_of(config: &qerl_model::ModelConfig) -> ModelShape {
    ModelShape {
        name: config.path.display().to_string(),
        vocab: config.vocab_size,
        hidden: config.hidden_size,
        intermediate: config.intermediate_size,
        layers: config.num_hidden_layers,
        q_heads: config.num_attention_heads,
        kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
        qkv_bias: config.qkv_bias,
        o_bias: config.o_bias,
        mlp_bias: config.mlp_bias,
        tied_embeddings: config.tie_word_embeddings,
        rms_eps: config.rms_norm_eps as f32,
        inv_freq: Rope::new(config).inv_freq().to_vec(),
        max_positions: config.max_position_embeddings,
    }
}

/// The engine's view of `model`: frozen buffers shared, LoRA and norm gains as fresh copies.
pub fn weights_from_model<R, F, I, BT>(
    model: &CausalLm<Cube<R, F, I, BT>>,
) -> Result<EngineWeights, EngineError>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let shape = shape_of(&model.config);
    shape.validate()?;
    let compute = F::dtype();
    let gain = |n: &NoisyRmsNorm<Cube<R, F, I, BT>>| {
        // The kernels add weight and noise in f32 after rounding each to the compute type.
        let mut g = n.weight.val().cast(compute).cast(DType::F32);
        if let Some(z) = n.noise() {
            g = g + z.clone().cast(compute).cast(DType::F32);
        }
        handle_of(g)
    };
    let linear = |l: &Nvfp4Linear<Cube<R, F, I, BT>>, name: &str| -> Result<Linear, EngineError> {
        let [n, k] = l.dims();
        let weight = match (l.quant_weight(), &l.dense) {
            (Some(q), _) => Frozen::Quant(q.clone()),
            (None, Some(d)) => Frozen::Dense(handle_of(d.val().cast(compute))),
            (None, None) => {
                return Err(EngineError::Shape(format!("{name}: no frozen weight")));
            }
        };
        Ok(Linear {
            n,
            k,
            weight,
            bias: l.bias.as_ref().map(|b| handle_of(b.val().cast(compute))),
            lora: l.lora().map(|a| LoraWeights {
                a: handle_of(a.a.val().cast(compute)),
                b: handle_of(a.b.val().cast(compute)),
                rank: a.rank(),
                scale: a.scale,
            }),
        })
    };
    let mut layers = Vec::with_capacity(model.layers.len());
    for (i, l) in model.layers.iter().enumerate() {
        let name = |m: &str| format!("model.layers.{i}.{m}");
        layers.push(Layer {
            attn_norm: gain(&l.input_layernorm),
            q: linear(&l.self_attn.q_proj, &name("self_attn.q_proj"))?,
            k: linear(&l.self_attn.k_proj, &name("self_attn.k_proj"))?,
            v: linear(&l.self_attn.v_proj, &name("self_attn.v_proj"))?,
            o: linear(&l.self_attn.o_proj, &name("self_attn.o_proj"))?,
            mlp_norm: gain(&l.post_attention_layernorm),
            gate: linear(&l.mlp.gate_proj, &name("mlp.gate_proj"))?,
            up: linear(&l.mlp.up_proj, &name("mlp.up_proj"))?,
            down: linear(&l.mlp.down_proj, &name("mlp.down_proj"))?,
        });
    }
    Ok(EngineWeights {
        shape,
        embed: handle_of(model.embed_tokens.val().cast(compute)),
        layers,
        final_norm: gain(&model.norm),
        lm_head: model
            .lm_head
            .as_ref()
            .map(|h| handle_of(h.val().cast(compute))),
    })
}

/// Whether the engine can run `config`: any valid sampling (greedy, temperature, top-k, top-p:
/// transformers' warpers, as the burn path; the log-probabilities are the untruncated tempered
/// ones, as there).
pub fn supports(config: &GenerationConfig) -> bool {
    config.sampling.validate().is_ok()
}

/// Most sequences the engine decodes at once from [`generate`].
pub const MAX_SLOTS: usize = 256;

/// [`qerl_model::generate_from_row`] on the engine: the same prompts in, the same
/// [`ModelCompletion`]s out (tokens, log-probabilities under the sampling distribution, why each
/// stopped). Row `i` draws from the random stream of `first_row + i`. Stop strings end a
/// completion where its decoded text first contains one (checked after generation: the engine
/// runs such a sequence on to its end token or length).
pub fn generate<R, F, I, BT>(
    model: &CausalLm<Cube<R, F, I, BT>>,
    prompts: &[Vec<u32>],
    config: &GenerationConfig,
    decoder: Option<&dyn Decode>,
    first_row: usize,
) -> Result<Vec<ModelCompletion>, EngineError>
where
    R: CubeRuntime,
    F: FloatElement + cubecl::prelude::Float + cubecl::prelude::CubeElement,
    I: IntElement,
    BT: BoolElement,
{
    if !supports(config) {
        return Err(EngineError::Request(
            "the engine samples with a temperature only (top_k = 0, top_p = 1)".into(),
        ));
    }
    qerl_model::generate::check_new_tokens(&model.config, config.max_new_tokens)
        .map_err(|e| EngineError::Request(e.to_string()))?;
    if !config.stop_strings.is_empty() && decoder.is_none() {
        return Err(EngineError::Request(
            "stop strings need a tokenizer to decode with".into(),
        ));
    }
    if prompts.is_empty() || config.max_new_tokens == 0 {
        return Ok(prompts
            .iter()
            .map(|_| ModelCompletion {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finish: FinishReason::Length,
            })
            .collect());
    }
    let weights = weights_from_model(model)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let capacity = (longest + config.max_new_tokens).min(weights.shape.max_positions);
    let engine_config = EngineConfig {
        slots: prompts.len().min(MAX_SLOTS),
        capacity,
        prefill_rows: 4096,
        check_every: 16,
    };
    let device = model.device();
    let client = R::client(&device);
    let mut engine = Engine::<R, F>::new(client, weights, engine_config)?;
    let requests: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            id: (first_row + i) as u32,
            prompt: p.clone(),
            max_new_tokens: config.max_new_tokens,
        })
        .collect();
    let sampling = Sampling {
        temperature: config.sampling.temperature,
        seed: (config.seed ^ (config.seed >> 32)) as u32,
        eos: config.eos_token_ids.clone(),
        truncation: Truncation {
            top_k: config.sampling.top_k,
            top_p: config.sampling.top_p,
        },
    };
    let out = engine.generate(&requests, &sampling)?;
    out.into_iter()
        .map(|c| {
            let mut done = ModelCompletion {
                finish: match c.tokens.last() {
                    Some(t) if c.stopped && config.eos_token_ids.contains(t) => {
                        FinishReason::Eos(*t)
                    }
                    _ => FinishReason::Length,
                },
                tokens: c.tokens,
                logprobs: c.logprobs,
            };
            if let Some(d) = decoder.filter(|_| !config.stop_strings.is_empty()) {
                cut_at_stop_string(&mut done, d, &config.stop_strings)?;
            }
            Ok(done)
        })
        .collect()
}

/// Ends `c` at the first token whose decoded prefix contains a stop string, as the burn
/// path's generation loop does while sampling.
fn cut_at_stop_string(
    c: &mut ModelCompletion,
    d: &dyn Decode,
    stops: &[String],
) -> Result<(), EngineError> {
    let window = 4 * stops.iter().map(|s| s.chars().count()).max().unwrap_or(0) + 4;
    for end in 1..=c.tokens.len() {
        let tail = d
            .decode(&c.tokens[end.saturating_sub(window)..end])
            .map_err(|e| EngineError::Request(format!("decoding a completion: {e}")))?;
        if let Some(s) = stops.iter().find(|s| tail.contains(s.as_str())) {
            c.tokens.truncate(end);
            c.logprobs.truncate(end);
            c.finish = FinishReason::Stop(s.clone());
            break;
        }
    }
    Ok(())
}
