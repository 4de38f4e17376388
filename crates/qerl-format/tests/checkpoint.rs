//! Round trips: random checkpoints (BF16/F32, single file/sharded) quantized to NVFP4, MXFP4
//! and NF4, read back and checked bit for bit against the in-memory formats.

mod checkpoint_fixture;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use checkpoint_fixture as fx;
use qerl_format::checkpoint::layout::quantize_linear;
use qerl_format::checkpoint::{
    classify, quantize_checkpoint, HfCheckpoint, LinearKind, ProgressEvent, QuantizedCheckpoint,
};
use qerl_format::nf4::NF4_TABLE;
use qerl_format::{nvfp4, Nf4Weight, QuantFormat, QuantizedWeight, SourceDtype};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

fn source(dtype: Dtype) -> SourceDtype {
    match dtype {
        Dtype::BF16 => SourceDtype::BF16,
        Dtype::F16 => SourceDtype::F16,
        _ => SourceDtype::F32,
    }
}

/// NVFP4 global scale each module must get: fused q/k/v and gate/up minimum, own for o/down.
fn expected_globals(specs: &[fx::Spec]) -> HashMap<String, f32> {
    let own: HashMap<String, f32> = specs
        .iter()
        .filter(|s| classify(&s.name).is_some())
        .map(|s| {
            let m = classify(&s.name).unwrap().module;
            (m, nvfp4::global_scale(&s.values, source(s.dtype)))
        })
        .collect();
    let mut out = HashMap::new();
    for (module, g) in &own {
        let parent = module.rsplit_once('.').unwrap().0;
        let group: &[&str] = match module.rsplit('.').next().unwrap() {
            "q_proj" | "k_proj" | "v_proj" => &["q_proj", "k_proj", "v_proj"],
            "gate_proj" | "up_proj" => &["gate_proj", "up_proj"],
            _ => &[],
        };
        let g = group
            .iter()
            .map(|p| own[&format!("{parent}.{p}")])
            .fold(*g, f32::min);
        out.insert(module.clone(), g);
    }
    out
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn read_shard(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

fn round_trip(format: QuantFormat, dtype: Dtype, shards: usize, seed: u64) {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    let output = tmp.path().join("out");
    let specs = fx::model(dtype, seed);
    fx::write(&input, &specs, shards, dtype);

    let mut events = Vec::new();
    let report = quantize_checkpoint(&input, &output, format, &mut |e| events.push(e)).unwrap();
    let tag = format!("{format} {dtype:?} shards={shards}");

    // Progress: a scan pass for NVFP4 only, one event per tensor, one per shard.
    let passes: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            ProgressEvent::Pass { name, total } => Some((*name, *total)),
            _ => None,
        })
        .collect();
    let n_linear = fx::linear_names().len();
    let mut want_passes = vec![("quantize", specs.len())];
    if format == QuantFormat::Nvfp4 {
        want_passes.insert(0, ("scan", n_linear));
    }
    assert_eq!(passes, want_passes, "{tag}");
    let written = events
        .iter()
        .filter(|e| matches!(e, ProgressEvent::ShardWritten { .. }))
        .count();
    assert_eq!(written, shards, "{tag}");

    // Report.
    assert_eq!(report.layers.len(), n_linear, "{tag}");
    assert_eq!(report.kept, specs.len() - n_linear, "{tag}");
    assert!(report.output_bytes < report.input_bytes, "{tag}");
    for l in &report.layers {
        let bound = if format == QuantFormat::Nf4 {
            0.15
        } else {
            0.2
        };
        assert!(
            l.rel_error > 0.0 && l.rel_error < bound,
            "{tag}: {} error {}",
            l.module,
            l.rel_error
        );
    }
    assert_eq!(report.mean_error_by_kind().len(), 7, "{tag}");

    // Shard layout: same file names; every output tensor in its input tensor's file.
    let in_ckpt = HfCheckpoint::open(&input).unwrap();
    let files = fx::shard_of(&specs, shards);
    let file_names: BTreeSet<&String> = files.values().collect();
    let q = QuantizedCheckpoint::open(&output).unwrap();
    assert_eq!(q.format(), format);
    let out_files: BTreeSet<&String> = q
        .checkpoint()
        .shards()
        .iter()
        .map(|s| &s.file_name)
        .collect();
    assert_eq!(out_files, file_names, "{tag}");

    let globals = expected_globals(&specs);
    let mut expected_names = BTreeSet::new();
    for spec in &specs {
        let file = &files[&spec.name];
        let Some(linear) = classify(&spec.name) else {
            // Kept: same dtype, shape and bytes, in the same file.
            let out = q.checkpoint().raw(&spec.name).unwrap();
            let info = q.checkpoint().tensor_info(&spec.name).unwrap();
            assert_eq!(
                &q.checkpoint().shards()[info.shard].file_name,
                file,
                "{}",
                spec.name
            );
            assert_eq!(out.dtype, spec.dtype, "{}", spec.name);
            assert_eq!(out.shape, &spec.shape[..], "{}", spec.name);
            assert_eq!(
                out.data,
                in_ckpt.raw(&spec.name).unwrap().data,
                "{}",
                spec.name
            );
            expected_names.insert(spec.name.clone());
            continue;
        };
        let m = &linear.module;
        let shape = [spec.shape[0], spec.shape[1]];
        let sd = source(spec.dtype);
        let loaded = q.load(m).unwrap();
        assert_eq!(loaded.shape(), shape, "{m}");
        let want = match format {
            QuantFormat::Nvfp4 => {
                let g = globals[m];
                let w = nvfp4::Nvfp4Weight::quantize(m, &spec.values, &shape, sd, Some(g)).unwrap();
                let QuantizedWeight::Nvfp4(got) = &loaded else {
                    panic!("{m}: not NVFP4")
                };
                assert_eq!(got.global_scale.to_bits(), g.to_bits(), "{m} global scale");
                QuantizedWeight::Nvfp4(w)
            }
            QuantFormat::Mxfp4 => {
                QuantizedWeight::quantize(format, m, &spec.values, &shape, sd).unwrap()
            }
            QuantFormat::Nf4 => {
                // bitsandbytes' flat blocks: same as a [n/64, 64] matrix.
                let n = shape[0] * shape[1];
                let mut w = Nf4Weight::quantize(m, &spec.values, &[n / 64, 64]).unwrap();
                w.rows = shape[0];
                w.cols = shape[1];
                if shape[1] % 64 == 0 {
                    let direct =
                        QuantizedWeight::quantize(format, m, &spec.values, &shape, sd).unwrap();
                    assert_eq!(direct, QuantizedWeight::Nf4(w.clone()), "{m}");
                }
                QuantizedWeight::Nf4(w)
            }
        };
        assert_eq!(loaded, want, "{tag}: {m}");
        assert!(
            same_bits(&loaded.dequantize(), &want.dequantize()),
            "{tag}: {m} dequantized"
        );
        let again =
            quantize_linear(format, m, &spec.values, shape, sd, globals.get(m).copied()).unwrap();
        assert_eq!(again, want, "{m}");

        let parts: Vec<(&str, Dtype, Vec<usize>)> = match format {
            QuantFormat::Nvfp4 => vec![
                ("weight_packed", Dtype::U8, vec![shape[0], shape[1] / 2]),
                (
                    "weight_scale",
                    Dtype::F8_E4M3,
                    vec![shape[0], shape[1] / 16],
                ),
                ("weight_global_scale", Dtype::F32, vec![1]),
            ],
            QuantFormat::Mxfp4 => vec![
                ("weight_packed", Dtype::U8, vec![shape[0], shape[1] / 2]),
                ("weight_scale", Dtype::U8, vec![shape[0], shape[1] / 32]),
            ],
            QuantFormat::Nf4 => {
                let n = shape[0] * shape[1];
                let state = format!(
                    "{{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"{}\", \"shape\": [{}, {}]}}",
                    if dtype == Dtype::BF16 { "bfloat16" } else { "float32" },
                    shape[0],
                    shape[1]
                );
                let raw = q
                    .checkpoint()
                    .raw(&format!("{m}.weight.quant_state.bitsandbytes__nf4"))
                    .unwrap();
                assert_eq!(raw.data, state.as_bytes(), "{m} quant state");
                let map = q
                    .checkpoint()
                    .raw(&format!("{m}.weight.quant_map"))
                    .unwrap();
                let table: Vec<u8> = NF4_TABLE.iter().flat_map(|v| v.to_le_bytes()).collect();
                assert_eq!(map.data, &table[..]);
                vec![
                    ("weight", Dtype::U8, vec![n / 2, 1]),
                    ("weight.absmax", Dtype::F32, vec![n / 64]),
                    ("weight.quant_map", Dtype::F32, vec![16]),
                    (
                        "weight.quant_state.bitsandbytes__nf4",
                        Dtype::U8,
                        vec![state.len()],
                    ),
                ]
            }
        };
        for (suffix, pdtype, pshape) in parts {
            let name = format!("{m}.{suffix}");
            let info = q
                .checkpoint()
                .tensor_info(&name)
                .unwrap_or_else(|| panic!("{tag}: no {name}"));
            assert_eq!((info.dtype, &info.shape), (pdtype, &pshape), "{name}");
            assert_eq!(
                &q.checkpoint().shards()[info.shard].file_name,
                file,
                "{name}"
            );
            expected_names.insert(name);
        }
    }
    // Nothing else was written.
    let out_names: BTreeSet<String> = q.checkpoint().tensors().map(|t| t.name.clone()).collect();
    assert_eq!(out_names, expected_names, "{tag}");
    let mut modules = q.modules();
    modules.sort();
    let mut want_modules: Vec<String> = fx::linear_names()
        .iter()
        .map(|n| classify(n).unwrap().module)
        .collect();
    want_modules.sort();
    assert_eq!(modules, want_modules);

    // NVFP4: q/k/v and gate/up share the minimum of their own scales.
    if format == QuantFormat::Nvfp4 {
        for l in 0..fx::LAYERS {
            let g = |p: &str| match q.load(&format!("model.layers.{l}.{p}")).unwrap() {
                QuantizedWeight::Nvfp4(w) => w.global_scale,
                _ => unreachable!(),
            };
            let own = |p: &str| {
                let s = specs
                    .iter()
                    .find(|s| s.name == format!("model.layers.{l}.{p}.weight"))
                    .unwrap();
                nvfp4::global_scale(&s.values, source(dtype))
            };
            let (qs, ks, vs) = (
                g("self_attn.q_proj"),
                g("self_attn.k_proj"),
                g("self_attn.v_proj"),
            );
            assert!(qs == ks && ks == vs, "layer {l}: {qs} {ks} {vs}");
            let min = own("self_attn.q_proj")
                .min(own("self_attn.k_proj"))
                .min(own("self_attn.v_proj"));
            assert_eq!(qs, min);
            assert!(
                own("self_attn.q_proj") != own("self_attn.v_proj"),
                "fixture should differ"
            );
            assert_eq!(g("mlp.gate_proj"), g("mlp.up_proj"));
            assert_eq!(
                g("mlp.gate_proj"),
                own("mlp.gate_proj").min(own("mlp.up_proj"))
            );
            assert_eq!(g("self_attn.o_proj"), own("self_attn.o_proj"));
            assert_eq!(g("mlp.down_proj"), own("mlp.down_proj"));
        }
        let kinds: Vec<LinearKind> = report.mean_error_by_kind().iter().map(|k| k.0).collect();
        assert_eq!(kinds, LinearKind::ALL);
    }

    // Safetensors metadata and config.
    for shard in q.checkpoint().shards() {
        let meta = shard.metadata.as_ref().expect("__metadata__");
        assert_eq!(meta.len(), 1);
        assert_eq!(meta["format"], "pt");
        let bytes = read_shard(&shard.path);
        SafeTensors::deserialize(&bytes).unwrap();
    }
    let config = q.checkpoint().config();
    let input_config = fx::config(dtype);
    for (k, v) in input_config.as_object().unwrap() {
        assert_eq!(&config[k], v, "config key {k} kept");
    }
    let qc = &config["quantization_config"];
    check_quant_config(format, qc, dtype);

    // Index: same files, every tensor mapped to its file, total_size = bytes of tensor data.
    let index_path = output.join("model.safetensors.index.json");
    if shards > 1 {
        let index: Value = serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
        let map = index["weight_map"].as_object().unwrap();
        let mapped: BTreeMap<&String, &str> =
            map.iter().map(|(k, v)| (k, v.as_str().unwrap())).collect();
        assert_eq!(mapped.len(), out_names.len());
        let mut total = 0u64;
        for t in q.checkpoint().tensors() {
            assert_eq!(mapped[&t.name], q.checkpoint().shards()[t.shard].file_name);
            total += t.nbytes() as u64;
        }
        assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
    } else {
        assert!(!index_path.exists());
    }

    // Other files copied as they are, hidden ones not.
    for (name, content) in fx::extra_files() {
        assert_eq!(
            std::fs::read_to_string(output.join(name)).unwrap(),
            content,
            "{name}"
        );
    }
    assert!(!output.join(".cache").exists());
    let mut copied = report.copied.clone();
    copied.sort();
    let mut want: Vec<String> = fx::extra_files()
        .iter()
        .map(|(n, _)| n.to_string())
        .collect();
    want.sort();
    assert_eq!(copied, want);
    // No staging directory left next to the output.
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 2, "{leftovers:?}");
}

fn check_quant_config(format: QuantFormat, qc: &Value, dtype: Dtype) {
    match format {
        QuantFormat::Nf4 => {
            assert_eq!(qc["quant_method"], "bitsandbytes");
            assert_eq!(qc["load_in_4bit"], true);
            assert_eq!(qc["bnb_4bit_quant_type"], "nf4");
            assert_eq!(qc["bnb_4bit_use_double_quant"], false);
            let compute = if dtype == Dtype::BF16 {
                "bfloat16"
            } else {
                "float32"
            };
            assert_eq!(qc["bnb_4bit_compute_dtype"], compute);
        }
        _ => {
            let (ct, strategy, group) = match format {
                QuantFormat::Nvfp4 => ("nvfp4-pack-quantized", "tensor_group", 16),
                _ => ("mxfp4-pack-quantized", "group", 32),
            };
            assert_eq!(qc["quant_method"], "compressed-tensors");
            assert_eq!(qc["format"], ct);
            assert_eq!(qc["ignore"], serde_json::json!(["lm_head"]));
            assert!(qc["version"].is_string());
            let groups = qc["config_groups"].as_object().unwrap();
            assert_eq!(groups.len(), 1);
            let g = groups.values().next().unwrap();
            assert_eq!(g["targets"], serde_json::json!(["Linear"]));
            let w = &g["weights"];
            assert_eq!(w["num_bits"], 4);
            assert_eq!(w["type"], "float");
            assert_eq!(w["strategy"], strategy);
            assert_eq!(w["group_size"], group);
            assert_eq!(w["symmetric"], true);
            assert_eq!(w["dynamic"], false);
        }
    }
}

#[test]
fn nvfp4_bf16_single_file() {
    round_trip(QuantFormat::Nvfp4, Dtype::BF16, 1, 1);
}

#[test]
fn nvfp4_f32_sharded() {
    round_trip(QuantFormat::Nvfp4, Dtype::F32, 3, 2);
}

#[test]
fn mxfp4_bf16_sharded() {
    round_trip(QuantFormat::Mxfp4, Dtype::BF16, 2, 3);
}

#[test]
fn mxfp4_f32_single_file() {
    round_trip(QuantFormat::Mxfp4, Dtype::F32, 1, 4);
}

#[test]
fn nf4_bf16_single_file() {
    round_trip(QuantFormat::Nf4, Dtype::BF16, 1, 5);
}

#[test]
fn nf4_f32_sharded() {
    round_trip(QuantFormat::Nf4, Dtype::F32, 3, 6);
}

#[test]
fn config_json_is_python_sorted_json() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    fx::write(&input, &fx::model(Dtype::BF16, 7), 1, Dtype::BF16);
    for format in QuantFormat::ALL {
        let out = tmp.path().join(format.name());
        quantize_checkpoint(&input, &out, format, &mut |_| {}).unwrap();
        let text = std::fs::read_to_string(out.join("config.json")).unwrap();
        // json.dump(indent=2, sort_keys=True): sorted keys, Python float repr.
        assert!(
            text.starts_with("{\n  \"architectures\": [\n    \"Qwen2ForCausalLM\"\n  ],\n"),
            "{text}"
        );
        assert!(text.contains("\n  \"rms_norm_eps\": 1e-06,\n"), "{text}");
        assert!(text.contains("\n  \"rope_theta\": 1000000.0,\n"), "{text}");
        assert_eq!(text.ends_with('\n'), format == QuantFormat::Nf4);
        let keys: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("  \""))
            .map(|l| l.trim().split('"').nth(1).unwrap())
            .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        assert!(keys.contains(&"quantization_config"));
    }
}

/// Byte-for-byte comparison with compressed-tensors' own output: the fixtures in
/// `tests/fixtures/compressed-tensors` (made by `tools/make_ct_fixture.py` on the H100 with
/// compressed-tensors 0.20.0; `QERL_CT_FIXTURE=DIR` points at another such output). Every
/// `<model>/bf16` is quantized and each file of `<model>/nvfp4` must come out identical
/// (config.json, model.safetensors, generation_config.json).
#[test]
fn matches_compressed_tensors_byte_for_byte() {
    let root = std::env::var_os("QERL_CT_FIXTURE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/compressed-tensors")
        });
    let tmp = tempfile::tempdir().unwrap();
    let mut models = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        let (src, want) = (dir.join("bf16"), dir.join("nvfp4"));
        if !src.is_dir() || !want.is_dir() {
            continue;
        }
        let out = tmp.path().join(dir.file_name().unwrap());
        quantize_checkpoint(&src, &out, QuantFormat::Nvfp4, &mut |_| {}).unwrap();
        for file in std::fs::read_dir(&want).unwrap() {
            let file = file.unwrap().path();
            let name = file.file_name().unwrap().to_owned();
            let got = std::fs::read(out.join(&name)).unwrap();
            assert!(
                got == std::fs::read(&file).unwrap(),
                "{} differs",
                file.display()
            );
        }
        models += 1;
    }
    assert!(
        models > 0,
        "no <model>/bf16 + <model>/nvfp4 pairs under {root:?}"
    );
}
