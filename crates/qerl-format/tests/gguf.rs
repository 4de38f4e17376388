//! The GGUF importer: dequantization against gguf-py's, conversion of a synthetic Llama model
//! (names, shapes, q/k un-permutation, config, tokenizer files), refusals with named errors.

mod gguf_common;

use std::path::{Path, PathBuf};

use gguf_common::*;
use qerl_format::checkpoint::HfCheckpoint;
use qerl_format::gguf::{convert_gguf, ConvertOptions, GgufError, GgufFile, OutDtype};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf")
}

/// Every type qerl reads, on random blocks made by tools/gguf_oracle.py, against gguf-py's
/// dequantization of the same bytes (stored as F32 in the reference file).
#[test]
fn dequantization_matches_gguf_py_for_every_type() {
    let quant = GgufFile::open(&fixtures().join("dequant_types.gguf")).unwrap();
    let reference = GgufFile::open(&fixtures().join("dequant_types_ref.gguf")).unwrap();
    assert_eq!(quant.tensors.len(), 11);
    for t in &quant.tensors {
        let r = reference.tensor(&t.name).unwrap();
        assert_eq!(t.dims, r.dims, "{}", t.name);
        let got = quant.dequantize(t).unwrap();
        let want = reference.dequantize(r).unwrap();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() / w.abs().max(1e-3))
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-6,
            "{} ({}): relative error {worst}",
            t.name,
            t.ggml_type
        );
    }
}

fn convert_bytes(
    bytes: &[u8],
    dtype: OutDtype,
) -> (tempfile::TempDir, PathBuf, Result<(), GgufError>) {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("model.gguf");
    std::fs::write(&gguf, bytes).unwrap();
    let out = tmp.path().join("hf");
    let result = convert_gguf(&gguf, &out, &ConvertOptions { dtype }, &|_| {}).map(|_| ());
    (tmp, out, result)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn tiny_llama_converts_to_a_hugging_face_directory() {
    let (bytes, q0, k0) = tiny_llama();
    let (_tmp, out, result) = convert_bytes(&bytes, OutDtype::F32);
    result.unwrap();
    let config = read_json(&out.join("config.json"));
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    assert_eq!(config["hidden_size"], HIDDEN);
    assert_eq!(config["num_key_value_heads"], KV_HEADS);
    assert_eq!(config["head_dim"], HEAD_DIM);
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["rms_norm_eps"], 1e-5);
    assert_eq!(config["eos_token_id"], 2);
    assert_eq!(config["vocab_size"], vocab().0.len());

    let ckpt = HfCheckpoint::open(&out).unwrap();
    assert_eq!(ckpt.tensors().count(), 2 + 9 * LAYERS);
    let (q, _) = ckpt
        .read_f32("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    let (k, _) = ckpt
        .read_f32("model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(q, q0, "q rows back in Hugging Face order");
    assert_eq!(k, k0, "k rows back in Hugging Face order");
    let info = ckpt
        .tensor_info("model.layers.1.mlp.down_proj.weight")
        .unwrap();
    assert_eq!(info.shape, vec![HIDDEN, INTER]);

    let tok = read_json(&out.join("tokenizer.json"));
    assert_eq!(tok["model"]["type"], "BPE");
    assert_eq!(tok["model"]["merges"][2], serde_json::json!(["he", "ll"]));
    assert_eq!(tok["added_tokens"].as_array().unwrap().len(), 3);
    assert_eq!(tok["pre_tokenizer"]["pretokenizers"][0]["type"], "Digits");
    let tok_config = read_json(&out.join("tokenizer_config.json"));
    assert_eq!(tok_config["eos_token"], "<|im_end|>");
    assert!(tok_config["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    let generation = read_json(&out.join("generation_config.json"));
    assert_eq!(generation["eos_token_id"], 2);
}

#[test]
fn tiny_qwen2_keeps_its_rows_and_biases() {
    let (bytes, q0, k0) = tiny_model("qwen2");
    let (_tmp, out, result) = convert_bytes(&bytes, OutDtype::F32);
    result.unwrap();
    let config = read_json(&out.join("config.json"));
    assert_eq!(config["architectures"][0], "Qwen2ForCausalLM");
    assert_eq!(config["use_sliding_window"], false);
    let ckpt = HfCheckpoint::open(&out).unwrap();
    assert_eq!(ckpt.tensors().count(), 2 + 12 * LAYERS);
    let (q, _) = ckpt
        .read_f32("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    let (k, _) = ckpt
        .read_f32("model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(
        (q, k),
        (q0, k0),
        "Qwen2 rows are stored in Hugging Face order"
    );
    let info = ckpt
        .tensor_info("model.layers.1.self_attn.k_proj.bias")
        .unwrap();
    assert_eq!(info.shape, vec![KV_HEADS * HEAD_DIM]);
    let tok = read_json(&out.join("tokenizer.json"));
    let split = &tok["pre_tokenizer"]["pretokenizers"][0];
    assert_eq!(split["type"], "Split");
    assert!(split["pattern"]["Regex"]
        .as_str()
        .unwrap()
        .contains(r"\p{N}|"));
}

/// Version 2 has the same layout as 3 (3 only added big-endian files).
#[test]
fn version_2_converts_too() {
    let mut b = tiny_llama().0;
    b[4..8].copy_from_slice(&2u32.to_le_bytes());
    let (_tmp, _out, result) = convert_bytes(&b, OutDtype::F32);
    result.unwrap();
}

#[test]
fn bf16_output_rounds_every_value() {
    let (bytes, q0, _) = tiny_llama();
    let (_tmp, out, result) = convert_bytes(&bytes, OutDtype::Bf16);
    result.unwrap();
    let ckpt = HfCheckpoint::open(&out).unwrap();
    let (q, _) = ckpt
        .read_f32("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    let rounded: Vec<f32> = q0
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    assert_eq!(q, rounded);
    assert_eq!(
        read_json(&out.join("config.json"))["torch_dtype"],
        "bfloat16"
    );
}

#[test]
fn a_non_empty_output_directory_is_refused_and_kept() {
    let (bytes, _, _) = tiny_llama();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("m.gguf");
    std::fs::write(&gguf, &bytes).unwrap();
    let out = tmp.path().join("hf");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let err = convert_gguf(&gguf, &out, &ConvertOptions::default(), &|_| {}).unwrap_err();
    assert!(err.to_string().contains("refusing to overwrite"), "{err}");
    assert_eq!(
        std::fs::read_to_string(out.join("keep.txt")).unwrap(),
        "mine"
    );
    // An empty directory is fine.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    convert_gguf(&gguf, &empty, &ConvertOptions::default(), &|_| {}).unwrap();
}

/// Replaces the value bytes of a u32 metadata key in a built image.
fn set_u32(bytes: &mut [u8], key: &str, value: u32) {
    let needle = [
        &(key.len() as u64).to_le_bytes()[..],
        key.as_bytes(),
        &4u32.to_le_bytes(),
    ]
    .concat();
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap()
        + needle.len();
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

fn error_of(bytes: &[u8]) -> String {
    let (_tmp, out, result) = convert_bytes(bytes, OutDtype::F32);
    assert!(!out.exists(), "a failed conversion leaves no output");
    result.unwrap_err().to_string()
}

#[test]
fn bad_files_give_errors_naming_file_and_field() {
    let (good, _, _) = tiny_llama();

    let err = error_of(b"GGML\x03\0\0\0");
    assert!(
        err.contains("model.gguf") && err.contains("not a GGUF file"),
        "{err}"
    );

    let mut v1 = good.clone();
    v1[4] = 1;
    assert!(error_of(&v1).contains("GGUF version 1 is not supported"));

    let mut big_endian = good.clone();
    big_endian[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(error_of(&big_endian).contains("big-endian"));

    let mut lying = good.clone();
    lying[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let err = error_of(&lying);
    assert!(
        err.contains("header tensor_count") && err.contains("do not fit"),
        "{err}"
    );

    let mut heads = good.clone();
    set_u32(&mut heads, "llama.attention.head_count_kv", 3);
    let err = error_of(&heads);
    assert!(
        err.contains("metadata `llama.attention.head_count_kv`"),
        "{err}"
    );

    let mut layers = good.clone();
    set_u32(&mut layers, "llama.block_count", 3);
    let err = error_of(&layers);
    assert!(
        err.contains("model.layers.2.") && err.contains("is missing"),
        "{err}"
    );

    let mut vocab = good.clone();
    set_u32(&mut vocab, "llama.vocab_size", 7);
    assert!(error_of(&vocab).contains("`llama.vocab_size` is 7"));

    let truncated = &good[..good.len() - 100];
    let err = error_of(truncated);
    assert!(
        err.contains("past the end of the file") && err.contains("truncated"),
        "{err}"
    );

    let err = error_of(&good[..200]);
    assert!(
        err.contains("(at byte") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn unsupported_architectures_types_and_tokenizers_are_named() {
    let mut b = GgufBuilder::default();
    b.str("general.architecture", "gemma");
    let err = error_of(&b.build());
    assert!(err.contains("`general.architecture` is `gemma`"), "{err}");

    let (good, _, _) = tiny_llama();
    let mut q2k = good.clone();
    // blk.1.attn_q.weight is Q4_1 (type 3): relabel it Q2_K (10), whose size qerl does not know.
    let name = "blk.1.attn_q.weight";
    let needle = [&(name.len() as u64).to_le_bytes()[..], name.as_bytes()].concat();
    let at = q2k.windows(needle.len()).position(|w| w == needle).unwrap() + needle.len();
    let type_at = at + 4 + 2 * 8;
    assert_eq!(q2k[type_at..type_at + 4], 3u32.to_le_bytes());
    q2k[type_at..type_at + 4].copy_from_slice(&10u32.to_le_bytes());
    let err = error_of(&q2k);
    assert!(
        err.contains("blk.1.attn_q.weight") && err.contains("Q2_K"),
        "{err}"
    );
}

/// Prefixes of the file are refused with an error naming it (no panic), and the full file
/// parses.
#[test]
fn truncations_are_errors_naming_the_file() {
    let (good, _, _) = tiny_llama();
    let path = Path::new("trunc.gguf");
    let file = GgufFile::from_bytes(path, good.clone()).unwrap();
    // The last tensor's padding is not needed: only cuts into real bytes must fail.
    let last_end = file
        .tensors
        .iter()
        .map(|t| file.data_start + t.offset + t.n_bytes.unwrap())
        .max()
        .unwrap() as usize;
    // Every cut through the header and the first tensor; then every 97th byte of the data.
    let header_end = file.data_start as usize + 64;
    let lengths = (0..header_end).chain((header_end..last_end).step_by(97));
    for len in lengths.chain([last_end - 1]) {
        let err = GgufFile::from_bytes(path, good[..len].to_vec())
            .expect_err(&format!("prefix of {len} bytes parsed"));
        assert!(err.to_string().contains("trunc.gguf"), "{err}");
    }
}
