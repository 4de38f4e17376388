//! `qerl_model::export`: a model saved as a Hugging Face checkpoint loads back to the same
//! logits; a 4-bit model exports its dequantized weights; only dense models become trainable.

use std::path::{Path, PathBuf};

use burn::tensor::Tensor;
use qerl_model::export::{save_pretrained, ExportDtype};
use qerl_model::{load, CausalLm, LoadOptions, Precision, TokenBatch};

type B = qerl_nn::backends::Cpu;

fn fixture(arch: &str, precision: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../../tests/fixtures/compressed-tensors/{arch}/{precision}"
    ))
}

fn logits(m: &CausalLm<B>) -> Vec<f32> {
    let b = TokenBatch::single(&[5, 17, 300, 44, 9, 120, 3]).unwrap();
    let l: Tensor<B, 3> = m.forward(&b).unwrap();
    l.into_data().iter::<f32>().collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn saved_models_load_back_to_the_same_logits() {
    let dev = Default::default();
    for arch in ["qwen2_tied", "llama_untied"] {
        let model = load::<B>(&fixture(arch, "bf16"), &LoadOptions::default(), &dev).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        save_pretrained(&model, tmp.path(), ExportDtype::F32).unwrap();
        let back = load::<B>(tmp.path(), &LoadOptions::default(), &dev).unwrap();
        let d = max_diff(&logits(&model), &logits(&back));
        assert_eq!(d, 0.0, "{arch}: f32 export is exact");
        // bf16 export: the source weights are bf16 already, so still exact
        let tmp = tempfile::tempdir().unwrap();
        save_pretrained(&model, tmp.path(), ExportDtype::Bf16).unwrap();
        let back = load::<B>(tmp.path(), &LoadOptions::default(), &dev).unwrap();
        assert_eq!(
            max_diff(&logits(&model), &logits(&back)),
            0.0,
            "{arch}: bf16"
        );
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["torch_dtype"], "bfloat16");
    }
}

#[test]
fn a_4bit_model_exports_its_dequantized_twin_and_cannot_be_fully_trained() {
    let dev = Default::default();
    let dir = fixture("qwen2_tied", "nvfp4");
    let mut q = load::<B>(&dir, &LoadOptions::default(), &dev).unwrap();
    let twin = load::<B>(
        &dir,
        &LoadOptions {
            precision: Some(Precision::Bf16),
            ..Default::default()
        },
        &dev,
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    save_pretrained(&q, tmp.path(), ExportDtype::F32).unwrap();
    let cfg = std::fs::read_to_string(tmp.path().join("config.json")).unwrap();
    assert!(!cfg.contains("quantization_config"), "a dense export");
    let back = load::<B>(tmp.path(), &LoadOptions::default(), &dev).unwrap();
    // the twin rounds each dequantized weight to bf16 (as compressed-tensors does); the f32
    // export keeps them exact: the logits differ by that rounding only
    let (t, b) = (logits(&twin), logits(&back));
    let scale = t.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = max_diff(&t, &b);
    assert!(
        d < 1e-2 * scale,
        "the export is the dequantized twin: {d} (max |logit| {scale})"
    );
    let err = q.set_base_trainable().unwrap_err().to_string();
    assert!(err.contains("quantized"), "{err}");
}
