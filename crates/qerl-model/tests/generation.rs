//! Generation for RL on the llama3_rope fixture: per-sequence EOS and stop strings, seeds,
//! batch independence, returned log-probs against a training-style forward, LoRA adapters.

mod common;

use common::{host, max_abs_diff, Cpu, Reference};
use qerl_model::{
    generate, load, load_with_adapter, score, Adapter, CausalLm, Decode, FinishReason,
    GenerationConfig, LoadOptions, LoraConfig, LoraSpec, ModelError, SamplingParams, TokenBatch,
};
use serde_json::json;

fn fixture() -> (CausalLm<Cpu>, Reference) {
    let r = Reference::load("llama3_rope");
    let m = load::<Cpu>(
        &r.model_dir(false),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    (m, r)
}

fn greedy(max_new_tokens: usize, eos: Vec<u32>) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        eos_token_ids: eos,
        ..GenerationConfig::default()
    }
}

/// Decodes token `t` as `t<id> `.
struct Ids;
impl Decode for Ids {
    fn decode(&self, ids: &[u32]) -> qerl_model::Result<String> {
        Ok(ids.iter().map(|t| format!("t{t} ")).collect())
    }
}

#[test]
fn eos_stops_each_sequence_on_its_own() {
    let (m, r) = fixture();
    let (prompts, conts, _) = r.greedy();
    // 101 is the 3rd greedy token of prompt 0 and the 12th of prompt 1; prompt 2 never makes it.
    assert_eq!(conts[0].iter().position(|&t| t == 101), Some(2));
    assert_eq!(conts[1].iter().position(|&t| t == 101), Some(11));
    assert!(!conts[2].contains(&101));
    let out = generate(&m, &prompts, &greedy(16, vec![7, 101]), None).unwrap();
    assert_eq!(out[0].tokens, conts[0][..3]);
    assert_eq!(out[0].finish, FinishReason::Eos(101));
    assert_eq!(out[1].tokens, conts[1][..12]);
    assert_eq!(out[1].finish, FinishReason::Eos(101));
    assert_eq!(out[2].tokens, conts[2]);
    assert_eq!(out[2].finish, FinishReason::Length);
    for c in &out {
        assert_eq!(c.logprobs.len(), c.tokens.len());
    }
    // max_new_tokens caps every sequence
    let out = generate(&m, &prompts, &greedy(2, vec![]), None).unwrap();
    assert!(out
        .iter()
        .zip(&conts)
        .all(|(c, e)| c.tokens == e[..2] && c.finish == FinishReason::Length));
}

#[test]
fn stop_strings_per_sequence() {
    let (m, r) = fixture();
    let (prompts, conts, _) = r.greedy();
    let stop = format!("t{} t{}", conts[1][4], conts[1][5]);
    let config = GenerationConfig {
        stop_strings: vec![stop.clone(), "never".into()],
        ..greedy(16, vec![])
    };
    let out = generate(&m, &prompts, &config, Some(&Ids)).unwrap();
    assert_eq!(out[1].tokens, conts[1][..6]);
    assert_eq!(out[1].finish, FinishReason::Stop(stop.clone()));
    assert_eq!(out[0].finish, FinishReason::Length);
    let text = Ids.decode(&out[1].tokens).unwrap();
    assert_eq!(
        qerl_model::generate::truncate_at_stop(&text, &config.stop_strings),
        Ids.decode(&conts[1][..4]).unwrap()
    );
    // stop strings need a decoder
    assert!(matches!(
        generate(&m, &prompts, &config, None),
        Err(ModelError::Input(_))
    ));
}

#[test]
fn sampling_is_seeded_and_independent_of_the_batch() {
    let (m, r) = fixture();
    let (prompts, _, _) = r.greedy();
    let config = GenerationConfig {
        max_new_tokens: 12,
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 50,
            top_p: 0.95,
        },
        seed: 1234,
        ..GenerationConfig::default()
    };
    let a = generate(&m, &prompts, &config, None).unwrap();
    let b = generate(&m, &prompts, &config, None).unwrap();
    assert_eq!(a, b);
    let other = generate(
        &m,
        &prompts,
        &GenerationConfig {
            seed: 99,
            ..config.clone()
        },
        None,
    )
    .unwrap();
    assert_ne!(a, other);
    // row 0 alone gives the same tokens as row 0 of the batch
    let alone = generate(&m, &prompts[..1], &config, None).unwrap();
    assert_eq!(alone[0].tokens, a[0].tokens);
    for (x, y) in alone[0].logprobs.iter().zip(&a[0].logprobs) {
        assert!((x - y).abs() < 1e-4);
    }
}

/// The log-probs returned with the tokens are what a training forward over prompt + completion
/// gives: `log_softmax(logits / T)` at the sampled token.
#[test]
fn returned_logprobs_match_a_full_forward() {
    let (m, r) = fixture();
    let (prompts, _, _) = r.greedy();
    let t = 0.8f32;
    let config = GenerationConfig {
        max_new_tokens: 10,
        sampling: SamplingParams {
            temperature: t,
            top_k: 0,
            top_p: 0.9,
        },
        seed: 5,
        ..GenerationConfig::default()
    };
    let out = generate(&m, &prompts, &config, None).unwrap();
    let vocab = m.config().vocab_size;
    for (p, c) in prompts.iter().zip(&out) {
        let mut seq = p.clone();
        seq.extend(&c.tokens);
        let logits = host(m.forward(&TokenBatch::single(&seq).unwrap()).unwrap());
        for (j, (&tok, &lp)) in c.tokens.iter().zip(&c.logprobs).enumerate() {
            let row = &logits[(p.len() - 1 + j) * vocab..][..vocab];
            let max = row.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
            let lse = max / t as f64
                + row
                    .iter()
                    .map(|&x| ((x as f64 - max) / t as f64).exp())
                    .sum::<f64>()
                    .ln();
            let expected = row[tok as usize] as f64 / t as f64 - lse;
            assert!(
                (lp as f64 - expected).abs() < 1e-4,
                "step {j}: {lp} vs {expected}"
            );
        }
    }
}

#[test]
fn score_reports_top_k_and_token_logprobs() {
    let (m, _) = fixture();
    let ids = [5u32, 17, 300, 44, 9];
    let s = score(&m, &ids, 3).unwrap();
    assert_eq!(s.len(), 5);
    assert_eq!(s[0].logprob, None);
    let logits = host(m.forward(&TokenBatch::single(&ids).unwrap()).unwrap());
    let vocab = m.config().vocab_size;
    for (i, p) in s.iter().enumerate() {
        assert_eq!(p.token, ids[i]);
        let row = &logits[i * vocab..(i + 1) * vocab];
        let max = row.iter().fold(f32::MIN, |a, &b| a.max(b));
        let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let expected: Vec<u32> = order[..3].iter().map(|&j| j as u32).collect();
        assert_eq!(p.top.iter().map(|t| t.0).collect::<Vec<_>>(), expected);
        assert!((p.top[0].1 - (row[order[0]] - lse)).abs() < 1e-4);
        if i + 1 < ids.len() {
            let next = s[i + 1].logprob.unwrap();
            assert!((next - (row[ids[i + 1] as usize] - lse)).abs() < 1e-4);
        }
    }
    assert!(matches!(
        score(&m, &[5, 9999], 3),
        Err(ModelError::Input(_))
    ));
}

/// A PEFT adapter changes the model exactly as merging `W + (alpha/r) B A` into the weights.
#[test]
fn peft_adapter_equals_merged_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    let config = common::small_config(json!({}));
    let tensors = common::write_model(&base, &config, 7);
    let (r, alpha) = (4usize, 8.0f32);
    let mut rng = qerl_model::sampling::Rng::new(3);
    let mut rand = |n: usize| {
        (0..n)
            .map(|_| rng.next_open01() - 0.5)
            .collect::<Vec<f32>>()
    };
    let mut lora = Vec::new();
    let mut merged = tensors.clone();
    for layer in 0..2 {
        for (module, d_out, d_in) in [("self_attn.q_proj", 32, 32), ("mlp.down_proj", 32, 48)] {
            let name = format!("model.layers.{layer}.{module}");
            let (a, b) = (rand(r * d_in), rand(d_out * r));
            lora.push((
                format!("base_model.model.{name}.lora_A.weight"),
                a.clone(),
                vec![r, d_in],
            ));
            lora.push((
                format!("base_model.model.{name}.lora_B.weight"),
                b.clone(),
                vec![d_out, r],
            ));
            let w = merged
                .iter_mut()
                .find(|t| t.0 == format!("{name}.weight"))
                .unwrap();
            for o in 0..d_out {
                for i in 0..d_in {
                    let ba: f32 = (0..r).map(|k| b[o * r + k] * a[k * d_in + i]).sum();
                    w.1[o * d_in + i] += alpha / r as f32 * ba;
                }
            }
        }
    }
    let adapter_dir = tmp.path().join("adapter");
    std::fs::create_dir_all(&adapter_dir).unwrap();
    common::write_safetensors(&adapter_dir.join("adapter_model.safetensors"), &lora);
    let adapter_config = json!({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj", "down_proj"], "bias": "none"});
    std::fs::write(
        adapter_dir.join("adapter_config.json"),
        adapter_config.to_string(),
    )
    .unwrap();
    let merged_dir = tmp.path().join("merged");
    common::write_model(&merged_dir, &config, 7);
    common::write_safetensors(&merged_dir.join("model.safetensors"), &merged);

    let dev = Default::default();
    let adapter = Adapter::open(&adapter_dir).unwrap();
    assert_eq!(
        adapter.config,
        LoraConfig {
            rank: 4,
            alpha: 8.0
        }
    );
    let with =
        load_with_adapter::<Cpu>(&base, &LoadOptions::default(), Some(&adapter), &dev).unwrap();
    assert!(with.layers[0].self_attn.q_proj.lora().is_some());
    assert!(with.layers[0].self_attn.k_proj.lora().is_none());
    let reference = load::<Cpu>(&merged_dir, &LoadOptions::default(), &dev).unwrap();
    let plain = load::<Cpu>(&base, &LoadOptions::default(), &dev).unwrap();
    let batch = TokenBatch::single(&[3, 1, 4, 1, 5, 9, 2, 6]).unwrap();
    let got = host(with.forward(&batch).unwrap());
    let d = max_abs_diff(&got, &host(reference.forward(&batch).unwrap()));
    assert!(d < 1e-4, "adapter vs merged: {d}");
    // forward_base disables the adapters
    let d = max_abs_diff(
        &host(with.forward_base(&batch).unwrap()),
        &host(plain.forward(&batch).unwrap()),
    );
    assert!(d < 1e-6, "base: {d}");
    assert!(max_abs_diff(&got, &host(plain.forward(&batch).unwrap())) > 1e-2);

    // fresh adapters (B = 0) change nothing
    let fresh = LoadOptions {
        lora: Some(LoraSpec {
            config: LoraConfig {
                rank: 2,
                alpha: 4.0,
            },
            targets: vec![],
        }),
        ..LoadOptions::default()
    };
    let f = load::<Cpu>(&base, &fresh, &dev).unwrap();
    assert!(f.layers[1].mlp.up_proj.lora().is_some());
    assert!(
        max_abs_diff(
            &host(f.forward(&batch).unwrap()),
            &host(plain.forward(&batch).unwrap())
        ) < 1e-6
    );

    // a mis-shaped adapter names the tensor
    lora[0].2 = vec![r, 16];
    lora[0].1.truncate(r * 16);
    common::write_safetensors(&adapter_dir.join("adapter_model.safetensors"), &lora);
    let bad = Adapter::open(&adapter_dir).unwrap();
    let e = load_with_adapter::<Cpu>(&base, &LoadOptions::default(), Some(&bad), &dev).unwrap_err();
    assert!(
        e.to_string()
            .contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
        "{e}"
    );
    // DoRA is refused, naming the key
    std::fs::write(
        adapter_dir.join("adapter_config.json"),
        json!({"r": 4, "use_dora": true}).to_string(),
    )
    .unwrap();
    let e = Adapter::open(&adapter_dir).unwrap_err();
    assert!(
        e.to_string().contains("adapter_config.json") && e.to_string().contains("use_dora"),
        "{e}"
    );
}
