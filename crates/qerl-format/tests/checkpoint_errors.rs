//! Failure cases: each is a typed error naming the file and tensor or field, and leaves no
//! output directory (nor staging directory) behind.

mod checkpoint_fixture;

use std::path::Path;

use checkpoint_fixture as fx;
use qerl_format::checkpoint::{quantize_checkpoint, CheckpointError, HfCheckpoint};
use qerl_format::{FormatError, QuantFormat};
use safetensors::Dtype;

/// Runs quantize into `<tmp>/out`, expecting an error; checks nothing is left but `in`.
fn fails(tmp: &Path, format: QuantFormat) -> CheckpointError {
    let err = quantize_checkpoint(&tmp.join("in"), &tmp.join("out"), format, &mut |_| {})
        .expect_err("quantize should fail");
    assert!(!tmp.join("out").exists(), "output directory left behind");
    let names: Vec<_> = std::fs::read_dir(tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        vec![std::ffi::OsString::from("in")],
        "leftovers: {names:?}"
    );
    err
}

fn with_spec(tmp: &Path, shards: usize, edit: impl FnOnce(&mut Vec<fx::Spec>)) {
    let mut specs = fx::model(Dtype::BF16, 11);
    edit(&mut specs);
    fx::write(&tmp.join("in"), &specs, shards, Dtype::BF16);
}

fn spec<'a>(specs: &'a mut [fx::Spec], name: &str) -> &'a mut fx::Spec {
    specs.iter_mut().find(|s| s.name == name).unwrap()
}

#[test]
fn in_features_not_a_multiple_of_the_block() {
    let name = "model.layers.1.self_attn.o_proj.weight";
    // NVFP4/MXFP4 block along in_features; NF4 (bitsandbytes) over the flattened weight, so
    // it needs an element count that is not a multiple of 64.
    for (format, rows) in [
        (QuantFormat::Nvfp4, fx::HIDDEN),
        (QuantFormat::Mxfp4, fx::HIDDEN),
        (QuantFormat::Nf4, 63),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        with_spec(tmp.path(), 2, |specs| {
            let s = spec(specs, name);
            s.shape = vec![rows, 24];
            s.randomize(&mut rand::SeedableRng::seed_from_u64(1), 0.02);
        });
        let err = fails(tmp.path(), format);
        let msg = err.to_string();
        assert!(
            matches!(err, CheckpointError::Shape { ref tensor, .. } if tensor == name),
            "{err:?}"
        );
        assert!(
            msg.contains(name) && msg.contains("model-0000") && msg.contains("24"),
            "{msg}"
        );
    }
}

#[test]
fn one_dimensional_linear_weight() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "model.layers.0.mlp.up_proj.weight";
    with_spec(tmp.path(), 1, |specs| {
        let s = spec(specs, name);
        s.shape = vec![fx::INTERMEDIATE * fx::HIDDEN];
    });
    let err = fails(tmp.path(), QuantFormat::Nvfp4);
    let msg = err.to_string();
    assert!(
        msg.contains(name) && msg.contains("1-D") && msg.contains("model.safetensors"),
        "{msg}"
    );
}

#[test]
fn unsupported_linear_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "model.layers.0.self_attn.k_proj.weight";
    with_spec(tmp.path(), 1, |specs| {
        let s = spec(specs, name);
        s.dtype = Dtype::I32;
    });
    let err = fails(tmp.path(), QuantFormat::Mxfp4);
    assert!(
        matches!(err, CheckpointError::Dtype { ref tensor, .. } if tensor == name),
        "{err:?}"
    );
    assert!(err.to_string().contains("I32"), "{err}");
}

#[test]
fn nan_in_a_linear_stops_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "model.layers.1.mlp.down_proj.weight";
    with_spec(tmp.path(), 3, |specs| {
        spec(specs, name).values[77] = f32::NAN
    });
    for format in QuantFormat::ALL {
        let err = fails(tmp.path(), format);
        match &err {
            CheckpointError::Quantize {
                tensor,
                file,
                source,
            } => {
                assert_eq!(tensor, name);
                assert!(file.to_string_lossy().contains("model-0000"), "{file:?}");
                assert!(
                    matches!(&**source, FormatError::NonFinite { index: 77, .. }),
                    "{source:?}"
                );
            }
            other => panic!("{format}: {other:?}"),
        }
        assert!(err.to_string().contains(name));
    }
}

#[test]
fn missing_shard_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    with_spec(tmp.path(), 3, |_| {});
    let gone = "model-00002-of-00003.safetensors";
    std::fs::remove_file(tmp.path().join("in").join(gone)).unwrap();
    let err = fails(tmp.path(), QuantFormat::Nvfp4);
    match &err {
        CheckpointError::MissingShard {
            index,
            shard,
            tensor,
        } => {
            assert_eq!(shard, gone);
            assert!(index.ends_with("model.safetensors.index.json"));
            assert!(!tensor.is_empty());
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains(gone));
}

#[test]
fn weight_map_naming_a_tensor_the_shard_lacks() {
    let tmp = tempfile::tempdir().unwrap();
    with_spec(tmp.path(), 2, |_| {});
    let index_path = tmp.path().join("in/model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] =
        "model-00001-of-00002.safetensors".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let err = fails(tmp.path(), QuantFormat::Nf4);
    assert!(
        matches!(err, CheckpointError::NotInShard { ref tensor, .. } if tensor == "model.layers.9.mlp.up_proj.weight"),
        "{err:?}"
    );
}

#[test]
fn index_without_weight_map() {
    let tmp = tempfile::tempdir().unwrap();
    with_spec(tmp.path(), 2, |_| {});
    std::fs::write(
        tmp.path().join("in/model.safetensors.index.json"),
        "{\"metadata\": {}}",
    )
    .unwrap();
    let err = fails(tmp.path(), QuantFormat::Nvfp4);
    assert!(
        matches!(err, CheckpointError::Field { ref field, .. } if field == "weight_map"),
        "{err:?}"
    );
}

#[test]
fn corrupt_header_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    with_spec(tmp.path(), 1, |_| {});
    let path = tmp.path().join("in/model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..16].copy_from_slice(b"garbage!");
    std::fs::write(&path, &bytes).unwrap();
    let err = fails(tmp.path(), QuantFormat::Nvfp4);
    assert!(
        matches!(err, CheckpointError::Header { ref path, .. } if path.ends_with("model.safetensors")),
        "{err:?}"
    );
    // A truncated file, too.
    std::fs::write(&path, &bytes[..4]).unwrap();
    let err = fails(tmp.path(), QuantFormat::Nvfp4);
    assert!(matches!(err, CheckpointError::Header { .. }), "{err:?}");
}

#[test]
fn missing_or_invalid_config() {
    let tmp = tempfile::tempdir().unwrap();
    with_spec(tmp.path(), 1, |_| {});
    let config = tmp.path().join("in/config.json");
    std::fs::remove_file(&config).unwrap();
    let err = fails(tmp.path(), QuantFormat::Nvfp4);
    assert!(
        matches!(err, CheckpointError::MissingConfig { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("config.json"));
    std::fs::write(&config, "{not json").unwrap();
    let err = fails(tmp.path(), QuantFormat::Nvfp4);
    assert!(
        matches!(err, CheckpointError::Json { ref path, .. } if path.ends_with("config.json")),
        "{err:?}"
    );
}

#[test]
fn no_weights_at_all() {
    let tmp = tempfile::tempdir().unwrap();
    with_spec(tmp.path(), 1, |_| {});
    std::fs::remove_file(tmp.path().join("in/model.safetensors")).unwrap();
    let err = fails(tmp.path(), QuantFormat::Nvfp4);
    assert!(matches!(err, CheckpointError::NoWeights { .. }), "{err:?}");
    assert!(HfCheckpoint::open(&tmp.path().join("in")).is_err());
}

#[test]
fn existing_output_directory() {
    let tmp = tempfile::tempdir().unwrap();
    with_spec(tmp.path(), 1, |_| {});
    let (input, out) = (tmp.path().join("in"), tmp.path().join("out"));
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let err = quantize_checkpoint(&input, &out, QuantFormat::Nvfp4, &mut |_| {}).unwrap_err();
    assert!(
        matches!(err, CheckpointError::OutputExists { .. }),
        "{err:?}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("keep.txt")).unwrap(),
        "mine"
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2);

    // An empty directory is fine.
    std::fs::remove_file(out.join("keep.txt")).unwrap();
    quantize_checkpoint(&input, &out, QuantFormat::Nvfp4, &mut |_| {}).unwrap();
    assert!(out.join("model.safetensors").is_file());

    // The input itself, or a directory inside it, is refused.
    let err =
        quantize_checkpoint(&input, &input.join("q"), QuantFormat::Nvfp4, &mut |_| {}).unwrap_err();
    assert!(matches!(err, CheckpointError::OutputPath { .. }), "{err:?}");
    assert!(!input.join("q").exists());
}

#[test]
fn staging_left_by_a_killed_run_is_removed_by_the_next() {
    let tmp = tempfile::tempdir().unwrap();
    with_spec(tmp.path(), 1, |_| {});
    // A process id nobody has (no /proc entry), and one that is alive (init).
    let dead = (4_000_000u32..)
        .find(|p| !Path::new(&format!("/proc/{p}")).exists())
        .unwrap();
    let stale = tmp.path().join(format!(".out.qerl-tmp-{dead}"));
    let live = tmp.path().join(".out.qerl-tmp-1");
    let other = tmp.path().join(format!(".other.qerl-tmp-{dead}"));
    for d in [&stale, &live, &other] {
        std::fs::create_dir(d).unwrap();
        std::fs::write(d.join("model.safetensors"), "half written").unwrap();
    }
    quantize_checkpoint(
        &tmp.path().join("in"),
        &tmp.path().join("out"),
        QuantFormat::Nvfp4,
        &mut |_| {},
    )
    .unwrap();
    assert!(!stale.exists(), "the killed run's staging is removed");
    assert!(live.exists(), "a running process's staging is kept");
    assert!(other.exists(), "another output's staging is not ours");
}

#[test]
fn symlinks_in_the_input_copy_regular_files_only() {
    let tmp = tempfile::tempdir().unwrap();
    with_spec(tmp.path(), 1, |_| {});
    let input = tmp.path().join("in");
    // A link to a regular file outside the tree (a Hugging Face snapshot's blobs) is copied
    // as the file.
    let blob = tmp.path().join("blob.json");
    std::fs::write(&blob, "{\"a\": 1}").unwrap();
    std::os::unix::fs::symlink(&blob, input.join("linked.json")).unwrap();
    let out = tmp.path().join("out");
    quantize_checkpoint(&input, &out, QuantFormat::Nvfp4, &mut |_| {}).unwrap();
    let copied = out.join("linked.json");
    assert!(!std::fs::symlink_metadata(&copied)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read_to_string(&copied).unwrap(), "{\"a\": 1}");
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_file(&blob).unwrap();
    std::fs::remove_file(input.join("linked.json")).unwrap();

    // A link to a directory (here a loop), to a device, or dangling is refused, naming it.
    for (name, target, words) in [
        ("loop", input.clone(), "to the directory"),
        ("zero", "/dev/zero".into(), "not a regular file"),
        ("gone", tmp.path().join("nothing"), "cannot be read"),
    ] {
        let link = input.join(name);
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = fails(tmp.path(), QuantFormat::Nvfp4);
        assert!(matches!(err, CheckpointError::Symlink { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains(&link.display().to_string()) && msg.contains(words),
            "{msg}"
        );
        std::fs::remove_file(&link).unwrap();
    }
}
