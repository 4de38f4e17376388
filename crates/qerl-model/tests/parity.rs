//! Parity with transformers (float32, eager attention) on the committed tiny checkpoints:
//! logits at every position, greedy continuations token for token (batched, left-padded,
//! KV-cached), NVFP4 checkpoints against their dequantized twins. References:
//! tests/fixtures/parity (tools/make_parity_fixture.py).

mod common;

use common::{host, max_abs_diff, Cpu, Reference};
use qerl_model::{
    generate, load, CausalLm, GenerationConfig, LoadOptions, Padding, Precision, QerlBackend,
    SamplingParams, TokenBatch,
};

/// f32 on the CPU against f32 PyTorch: only summation order differs.
const CPU_TOL: f32 = 1e-4;
const MODELS: [&str; 3] = ["llama_untied", "qwen2_tied", "llama3_rope"];

fn model<B: QerlBackend>(
    r: &Reference,
    nvfp4: bool,
    precision: Option<Precision>,
    device: &B::Device,
) -> CausalLm<B> {
    let options = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    load::<B>(&r.model_dir(nvfp4), &options, device).unwrap()
}

/// Logits of each reference sequence run alone, and of all of them in one padded batch (left
/// and right padding), against the reference. Returns the largest difference seen.
fn logits_vs<B: QerlBackend>(m: &CausalLm<B>, refs: &[(Vec<u32>, Vec<f32>)]) -> f32 {
    let vocab = m.config().vocab_size;
    let mut worst = 0f32;
    for (ids, expected) in refs {
        let got = host(m.forward(&TokenBatch::single(ids).unwrap()).unwrap());
        worst = worst.max(max_abs_diff(&got, expected));
    }
    let seqs: Vec<Vec<u32>> = refs.iter().map(|r| r.0.clone()).collect();
    for side in [Padding::Left, Padding::Right] {
        let batch = TokenBatch::new(&seqs, 0, side).unwrap();
        let got = host(m.forward(&batch).unwrap());
        for (row, (ids, expected)) in refs.iter().enumerate() {
            let pad = batch.len - ids.len();
            let first = if side == Padding::Left { pad } else { 0 };
            let start = (row * batch.len + first) * vocab;
            let rows = &got[start..start + ids.len() * vocab];
            worst = worst.max(max_abs_diff(rows, expected));
        }
    }
    worst
}

fn greedy_vs<B: QerlBackend>(m: &CausalLm<B>, r: &Reference) {
    let (prompts, expected, max_new) = r.greedy();
    let config = GenerationConfig {
        max_new_tokens: max_new,
        sampling: SamplingParams::greedy(),
        eos_token_ids: Vec::new(),
        ..GenerationConfig::default()
    };
    let out = generate(m, &prompts, &config, None).unwrap();
    for (i, (c, e)) in out.iter().zip(&expected).enumerate() {
        assert_eq!(&c.tokens, e, "prompt {i} of length {}", prompts[i].len());
    }
}

#[test]
fn logits_match_transformers_at_every_position() {
    let dev = Default::default();
    for name in MODELS {
        let r = Reference::load(name);
        let m = model::<Cpu>(&r, false, None, &dev);
        let worst = logits_vs(&m, &r.logits(false));
        println!("{name}: max |logit - transformers| = {worst:.2e}");
        assert!(worst < CPU_TOL, "{name}: {worst}");
    }
}

#[test]
fn greedy_continuations_match_transformers() {
    let dev = Default::default();
    for name in MODELS {
        let r = Reference::load(name);
        greedy_vs(&model::<Cpu>(&r, false, None, &dev), &r);
    }
}

/// The cached incremental path gives the same logits as a full forward of the whole sequence,
/// for every row of a left-padded batch and every decode step.
#[test]
fn kv_cache_decode_equals_full_forward() {
    let dev = Default::default();
    let r = Reference::load("llama3_rope");
    let m = model::<Cpu>(&r, false, None, &dev);
    let vocab = m.config().vocab_size;
    let prompts = vec![vec![5, 9, 200, 31, 7], vec![44], vec![100, 101, 102]];
    let fed: Vec<Vec<u32>> = vec![vec![17, 18, 19, 20], vec![300, 2, 250, 1], vec![7, 7, 7, 7]];
    let batch = TokenBatch::new(&prompts, 0, Padding::Left).unwrap();
    let mut cache = m.new_cache(3, batch.len + 4);
    let mut step_logits = vec![host(m.prefill(&batch, &mut cache).unwrap())];
    for t in 0..4 {
        let ids: Vec<u32> = fed.iter().map(|f| f[t]).collect();
        step_logits.push(host(m.decode(&ids, &mut cache).unwrap()));
    }
    assert_eq!(cache.len(), batch.len + 4);
    for row in 0..3 {
        let mut full_seq = prompts[row].clone();
        full_seq.extend(&fed[row]);
        let full = host(m.forward(&TokenBatch::single(&full_seq).unwrap()).unwrap());
        for (t, logits) in step_logits.iter().enumerate() {
            let pos = prompts[row].len() - 1 + t;
            let expected = &full[pos * vocab..(pos + 1) * vocab];
            let got = &logits[row * vocab..(row + 1) * vocab];
            let d = max_abs_diff(got, expected);
            assert!(d < 1e-4, "row {row} step {t}: {d}");
        }
    }
}

/// An NVFP4 checkpoint (compressed-tensors, as `qerl quantize` writes it), run through the
/// 4-bit path, against its dequantized BF16 twin (the same checkpoint with every weight
/// dequantized to bf16, what transformers' decompression produces) and against transformers.
#[test]
fn nvfp4_checkpoint_matches_its_dequantized_twin() {
    let dev = Default::default();
    for name in ["llama_untied", "qwen2_tied"] {
        let r = Reference::load(name);
        let refs = r.logits(true);
        let twin = model::<Cpu>(&r, true, Some(Precision::Bf16), &dev);
        let twin_vs_hf = logits_vs(&twin, &refs);
        let q = model::<Cpu>(&r, true, None, &dev);
        assert_eq!(q.layers[0].self_attn.q_proj.precision(), Precision::Nvfp4);
        let q_vs_hf = logits_vs(&q, &refs);
        let mut q_vs_twin = 0f32;
        for (ids, _) in &refs {
            let b = TokenBatch::single(ids).unwrap();
            q_vs_twin = q_vs_twin.max(max_abs_diff(
                &host(q.forward(&b).unwrap()),
                &host(twin.forward(&b).unwrap()),
            ));
        }
        let dense = model::<Cpu>(&r, false, None, &dev);
        let dense_vs_q = logits_vs(&dense, &refs);
        println!(
            "{name}: twin vs transformers {twin_vs_hf:.2e}, nvfp4 vs transformers {q_vs_hf:.2e}, \
             nvfp4 vs twin {q_vs_twin:.2e} (bf16 original vs nvfp4 reference {dense_vs_q:.2e})"
        );
        // The twin has exactly transformers' weights.
        assert!(twin_vs_hf < CPU_TOL, "{name}: {twin_vs_hf}");
        // The 4-bit path uses the unrounded dequantized weights: bf16 rounding of the weights
        // (relative 2^-9) is the only difference.
        assert!(
            q_vs_twin < 2e-2 && q_vs_hf < 2e-2,
            "{name}: {q_vs_twin} {q_vs_hf}"
        );
        // and quantization itself moves the logits far more than that
        assert!(dense_vs_q > 5.0 * q_vs_twin, "{name}: {dense_vs_q}");
    }
}

/// Quantizing a BF16 checkpoint at load time gives an NVFP4 model as far from the BF16 one as
/// the checkpoint compressed-tensors wrote (the two differ in the q/k/v and gate/up global
/// scales, fused in the checkpoint, per tensor at load time, so their roundings differ).
#[test]
fn quantize_at_load_errs_like_the_nvfp4_checkpoint() {
    let dev = Default::default();
    for name in ["llama_untied", "qwen2_tied"] {
        let r = Reference::load(name);
        let dense = model::<Cpu>(&r, false, None, &dev);
        let on_load = model::<Cpu>(&r, false, Some(Precision::Nvfp4), &dev);
        let stored = model::<Cpu>(&r, true, None, &dev);
        let b = TokenBatch::single(&r.logits(false)[2].0).unwrap();
        let [d, l, s] = [&dense, &on_load, &stored].map(|m| host(m.forward(&b).unwrap()));
        let rms = |a: &[f32], b: &[f32]| {
            (a.iter()
                .zip(b)
                .map(|(x, y)| ((x - y) as f64).powi(2))
                .sum::<f64>()
                / a.len() as f64)
                .sqrt()
        };
        let (e_load, e_stored) = (rms(&l, &d), rms(&s, &d));
        println!("{name}: rms logit error vs bf16: quantized on load {e_load:.3e}, checkpoint {e_stored:.3e}");
        assert!(
            e_load > 0.0 && e_load < 1.5 * e_stored && e_stored < 1.5 * e_load,
            "{e_load} {e_stored}"
        );
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    use qerl_nn::backends::Wgpu;

    /// f32 on wgpu (lavapipe on a CPU machine): the qerl kernels and burn's cube kernels.
    #[test]
    fn logits_and_greedy_on_wgpu() {
        let dev = qerl_nn::backends::wgpu_device_or_exit();
        for name in MODELS {
            let r = Reference::load(name);
            let m = model::<Wgpu>(&r, false, None, &dev);
            let worst = logits_vs(&m, &r.logits(false));
            println!("wgpu {name}: max |logit - transformers| = {worst:.2e}");
            assert!(worst < 1e-3, "{name}: {worst}");
            greedy_vs(&m, &r);
        }
        let r = Reference::load("qwen2_tied");
        let q = model::<Wgpu>(&r, true, None, &dev);
        let worst = logits_vs(&q, &r.logits(true));
        println!("wgpu qwen2_tied nvfp4 vs transformers: {worst:.2e}");
        assert!(worst < 2e-2, "{worst}");
    }
}

/// bf16 activations on CUDA (run on a GPU machine:
/// `cargo test --features qerl-train/cuda -p qerl-model --test parity -- --ignored cuda`).
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use qerl_nn::backends::Cuda;

    /// Largest |a - b| relative to the largest |b|.
    fn rel(worst: f32, refs: &[(Vec<u32>, Vec<f32>)]) -> f32 {
        let scale = refs
            .iter()
            .flat_map(|r| r.1.iter())
            .fold(0f32, |m, &x| m.max(x.abs()));
        worst / scale
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo test --features qerl-train/cuda -- --ignored cuda"]
    fn cuda_bf16_logits_greedy_and_nvfp4() {
        let dev = Default::default();
        for name in MODELS {
            let r = Reference::load(name);
            let m = model::<Cuda>(&r, false, None, &dev);
            let refs = r.logits(false);
            let worst = logits_vs(&m, &refs);
            let (prompts, expected, max_new) = r.greedy();
            let config = GenerationConfig {
                max_new_tokens: max_new,
                sampling: SamplingParams::greedy(),
                ..GenerationConfig::default()
            };
            let out = generate(&m, &prompts, &config, None).unwrap();
            let agree: Vec<usize> = out
                .iter()
                .zip(&expected)
                .map(|(c, e)| c.tokens.iter().zip(e).take_while(|(a, b)| a == b).count())
                .collect();
            println!(
                "cuda bf16 {name}: max |logit - transformers f32| = {worst:.3e} ({:.2}% of max |logit|); \
                 greedy tokens equal to the f32 reference before the first difference: {agree:?} of {max_new}",
                100.0 * rel(worst, &refs)
            );
            assert!(rel(worst, &refs) < 0.03, "{name}: {worst}");
        }
        for name in ["llama_untied", "qwen2_tied"] {
            let r = Reference::load(name);
            let refs = r.logits(true);
            let q = model::<Cuda>(&r, true, None, &dev);
            assert_eq!(q.layers[0].self_attn.q_proj.precision(), Precision::Nvfp4);
            let worst = logits_vs(&q, &refs);
            println!(
                "cuda bf16 {name} nvfp4: max |logit - transformers nvfp4 f32| = {worst:.3e} ({:.2}%)",
                100.0 * rel(worst, &refs)
            );
            assert!(rel(worst, &refs) < 0.03, "{name}: {worst}");
        }
    }
}
