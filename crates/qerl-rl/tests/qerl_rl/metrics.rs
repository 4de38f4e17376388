use std::io::Write;

use qerl_rl::metrics::*;
use qerl_rl::reward::RewardSet;

fn record(step: usize) -> StepMetrics {
    let mut m = StepMetrics {
        step,
        entropy: 0.8 - step as f32 * 0.01,
        kl: 0.001 * step as f32,
        clip_frac_low: 0.01,
        clip_frac_high: 0.02,
        loss: -0.1,
        grad_norm: 0.5,
        lr: 1e-5 * (step as f64 / 30.0),
        zero_std_frac: 0.25,
        sigma: if step < 10 {
            0.0
        } else {
            1e-2 * 0.7f32.powi(step as i32 / 10)
        },
        rollout_tokens_per_s: 1234.5,
        step_time_s: 2.5,
        peak_memory_bytes: Some(1 << 30),
        ..Default::default()
    };
    let scores = RewardSet::gsm8k().score_batch(
        &[
            "<think>a</think><answer>18</answer>",
            "#### 3",
            "#### 18",
            "nothing",
        ],
        &["18", "18", "18", "18"],
    );
    m.set_rewards(&scores);
    m.reward_mean += step as f32 * 0.02;
    m.set_lengths(&[100 + step, 50, 2048, 10], &[false, false, true, false]);
    m
}

#[test]
fn step_metrics_helpers() {
    let m = record(0);
    // Totals: 2.2 (format + correct), 0, 2.0, 0: mean 1.05; accuracy 2 of 4.
    assert!((m.reward_mean - 1.05).abs() < 1e-6);
    assert_eq!(m.accuracy, 0.5);
    let f: MeanStd = m.rewards["format"];
    assert_eq!(f.mean, 0.25);
    assert!((f.std - 0.75f32.sqrt() / 2.0).abs() < 1e-6, "{f:?}");
    assert_eq!(m.rewards["gsm8k"].mean, 0.5);
    assert_eq!(m.reward_failures, 0);
    assert_eq!(
        (m.completion_len_mean, m.completion_len_max),
        ((100 + 50 + 2048 + 10) as f32 / 4.0, 2048)
    );
    assert_eq!(m.truncated_frac, 0.25);
}

#[test]
fn jsonl_round_trip_and_append() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run/metrics.jsonl");
    let mut w = MetricsWriter::append(&path).unwrap();
    let mut recs: Vec<StepMetrics> = (0..3).map(record).collect();
    recs[2].loss = f32::NAN; // a diverged step must not make the log unreadable
    for r in &recs {
        w.write(r).unwrap();
    }
    drop(w);
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.lines().count(), 3);
    assert!(text.lines().all(|l| l.starts_with("{\"step\":")));

    // Reopening appends.
    let mut w = MetricsWriter::append(&path).unwrap();
    w.write(&record(3)).unwrap();
    let mut back = read_jsonl(&path).unwrap();
    assert_eq!(back.len(), 4);
    // serde_json (without its float_roundtrip feature) may read an f64 back one ulp off.
    for (b, r) in back.iter_mut().zip(&recs) {
        assert!(
            (b.lr - r.lr).abs() <= 1e-15 * r.lr.abs().max(1e-300),
            "{} vs {}",
            b.lr,
            r.lr
        );
        b.lr = r.lr;
    }
    assert_eq!(back[0], recs[0]);
    assert_eq!(back[1], recs[1]);
    assert!(back[2].loss.is_nan());
    let mut fixed = back[2].clone();
    fixed.loss = -0.1;
    let mut want = recs[2].clone();
    want.loss = -0.1;
    assert_eq!(fixed, want);
    assert_eq!(back[3].step, 3);
    assert_eq!(back[3].peak_memory_bytes, Some(1 << 30));

    // Missing fields default; a broken line is reported with its number.
    std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap()
        .write_all(b"{\"step\": 9}\n{oops\n")
        .unwrap();
    let e = read_jsonl(&path).unwrap_err();
    assert!(matches!(e, MetricsError::Json { line: 6, .. }), "{e}");
    assert!(e.to_string().contains("metrics.jsonl:6"), "{e}");
}

fn check_png(path: &std::path::Path) {
    let bytes = std::fs::read(path).unwrap();
    assert!(bytes.len() > 1000, "PNG is {} bytes", bytes.len());
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (PLOT_WIDTH, PLOT_HEIGHT));
    let px = &buf[..info.buffer_size()];
    let dark = px.chunks(3).filter(|p| p.iter().all(|&c| c < 100)).count();
    let blue = px.chunks(3).filter(|p| p == &[31, 119, 180]).count();
    assert!(
        dark > 500,
        "labels and titles are drawn ({dark} dark pixels)"
    );
    assert!(blue > 500, "curves are drawn ({blue} curve pixels)");
}

#[test]
fn png_of_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let recs: Vec<StepMetrics> = (0..40).map(record).collect();
    let path = dir.path().join("plots/run.png");
    plot_run(&recs, &path).unwrap();
    check_png(&path);
    // QERL_KEEP_PLOT=/tmp/run.png keeps a copy to look at.
    if let Some(keep) = std::env::var_os("QERL_KEEP_PLOT") {
        std::fs::copy(&path, keep).unwrap();
    }
}

#[test]
fn png_of_degenerate_runs() {
    let dir = tempfile::tempdir().unwrap();
    // Empty run: panels say NO DATA.
    let p = dir.path().join("empty.png");
    plot_run(&[], &p).unwrap();
    assert!(std::fs::metadata(&p).unwrap().len() > 1000);
    // One step, and a run with NaN and constant curves.
    plot_run(&[record(0)], &dir.path().join("one.png")).unwrap();
    let mut recs: Vec<StepMetrics> = (0..5).map(record).collect();
    recs[2].entropy = f32::NAN;
    for r in &mut recs {
        r.accuracy = 0.5;
    }
    plot_run(&recs, &dir.path().join("flat.png")).unwrap();
    check_png(&dir.path().join("flat.png"));
}
