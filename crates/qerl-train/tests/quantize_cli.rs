//! End to end: the `qerl` binary's `quantize` subcommand on small random checkpoints.

#[path = "../../qerl-format/tests/checkpoint_fixture.rs"]
mod fixture;

use std::path::Path;
use std::process::{Command, Output};

use qerl_format::checkpoint::QuantizedCheckpoint;
use qerl_format::{QuantFormat, QuantizedWeight};
use safetensors::Dtype;

fn qerl(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qerl"))
        .args(args)
        .output()
        .expect("run qerl")
}

fn quantize(input: &Path, output: &Path, format: Option<&str>) -> Output {
    let mut args = vec!["quantize".as_ref(), input.as_os_str(), output.as_os_str()];
    if let Some(f) = format {
        args.push("--format".as_ref());
        args.push(f.as_ref());
    }
    qerl(&args)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn quantize_each_format_and_report() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("model");
    let specs = fixture::model(Dtype::BF16, 21);
    fixture::write(&input, &specs, 2, Dtype::BF16);

    for (arg, format) in [
        (None, QuantFormat::Nvfp4),
        (Some("mxfp4"), QuantFormat::Mxfp4),
        (Some("nf4"), QuantFormat::Nf4),
    ] {
        let out = tmp.path().join(format.name());
        let run = quantize(&input, &out, arg);
        let (stdout, stderr) = (text(&run.stdout), text(&run.stderr));
        assert!(run.status.success(), "{format}: {stderr}");
        println!("{stdout}");
        assert!(
            stdout.contains(&format!("quantized 14 linears to {format}")),
            "{stdout}"
        );
        assert!(
            stdout.contains("size:") && stdout.contains("MB ->") && stdout.contains("x smaller"),
            "{stdout}"
        );
        for kind in ["q", "k", "v", "o", "gate", "up", "down"] {
            let row = stdout
                .lines()
                .find(|l| l.split_whitespace().next() == Some(kind))
                .unwrap_or_else(|| panic!("no row for {kind}: {stdout}"));
            let cols: Vec<&str> = row.split_whitespace().collect();
            assert_eq!(cols[1], "2", "{row}");
            let err: f64 = cols[2].parse().unwrap();
            assert!(err > 0.0 && err < 0.3, "{row}");
        }

        let q = QuantizedCheckpoint::open(&out).unwrap();
        assert_eq!(q.format(), format);
        assert_eq!(q.modules().len(), 14);
        let w = q.load("model.layers.1.mlp.down_proj").unwrap();
        assert_eq!(w.shape(), [fixture::HIDDEN, fixture::INTERMEDIATE]);
        assert_eq!(w.format(), format);
        if let QuantizedWeight::Nvfp4(w) = w {
            assert!(w.global_scale.is_finite() && w.global_scale > 0.0);
        }
        assert!(out.join("tokenizer.json").is_file());
    }
}

#[test]
fn failures_exit_nonzero_with_a_clear_message() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("model");
    let mut specs = fixture::model(Dtype::F32, 22);
    let bad = "model.layers.0.self_attn.q_proj.weight";
    let s = specs.iter_mut().find(|s| s.name == bad).unwrap();
    s.shape = vec![fixture::HIDDEN, 24];
    s.randomize(&mut rand::SeedableRng::seed_from_u64(3), 0.02);
    fixture::write(&input, &specs, 1, Dtype::F32);

    let out = tmp.path().join("out");
    let run = quantize(&input, &out, Some("nvfp4"));
    let stderr = text(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.starts_with("error: ")
            && stderr.contains(bad)
            && stderr.contains("model.safetensors"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!out.exists());
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);

    // A non-empty output directory is refused and left alone.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "keep").unwrap();
    let run = quantize(&input, &out, None);
    assert!(!run.status.success());
    assert!(
        text(&run.stderr).contains("not empty"),
        "{}",
        text(&run.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).unwrap(),
        "keep"
    );

    // A missing input directory.
    let run = quantize(&tmp.path().join("nope"), &tmp.path().join("o2"), None);
    assert!(!run.status.success());
    assert!(
        text(&run.stderr).contains("config.json"),
        "{}",
        text(&run.stderr)
    );

    // An unknown format is a usage error.
    let run = quantize(&input, &tmp.path().join("o3"), Some("int3"));
    assert!(!run.status.success());
    assert!(text(&run.stderr).contains("nvfp4"), "{}", text(&run.stderr));
}
