use qerl_rl::aqn::*;

use crate::close;

fn sched(kind: SigmaSchedule) -> AqnSchedule {
    AqnSchedule {
        kind,
        ..AqnSchedule::default()
    }
}

#[test]
fn defaults_are_the_papers() {
    let s = AqnSchedule::default();
    assert_eq!(s.kind, SigmaSchedule::Exponential);
    assert_eq!((s.sigma_start, s.sigma_end, s.num_stages), (1e-2, 5e-4, 10));
}

#[test]
fn exponential_values_at_stage_boundaries() {
    // K = 10 stages over 100 steps: 10 steps each. Stage 0 (steps 0..=9) is noise-free; stage k
    // uses 1e-2 * (5e-4 / 1e-2)^((k-1)/8): stage 1 = 1e-2, stage 9 = 5e-4.
    let s = AqnSchedule::default();
    let ratio = (5e-4f64 / 1e-2).powf(1.0 / 8.0);
    assert_eq!(s.sigma(0, 100), 0.0);
    assert_eq!(s.sigma(9, 100), 0.0);
    close(s.sigma(10, 100) as f64, 1e-2, 1e-9);
    close(s.sigma(19, 100) as f64, 1e-2, 1e-9);
    close(s.sigma(20, 100) as f64, 1e-2 * ratio, 1e-9);
    close(s.sigma(55, 100) as f64, 1e-2 * ratio.powi(4), 1e-9);
    close(s.sigma(89, 100) as f64, 1e-2 * ratio.powi(7), 1e-9);
    close(s.sigma(90, 100) as f64, 5e-4, 1e-9);
    close(s.sigma(99, 100) as f64, 5e-4, 1e-9);
    close(s.sigma(100, 100) as f64, 5e-4, 1e-9);
    close(s.sigma(5000, 100) as f64, 5e-4, 1e-9);
    // Geometric: a constant ratio between consecutive noisy stages.
    let v = s.stage_sigmas();
    assert_eq!(v.len(), 10);
    assert_eq!(v[0], 0.0);
    for k in 1..9 {
        close(v[k + 1] as f64 / v[k] as f64, ratio, 1e-5);
    }
}

#[test]
fn stage_boundaries_match_the_reference_for_uneven_totals() {
    // Reference: interval = floor(step / (total / K)), clamped to K - 1. total 25, K 10: 2.5
    // steps per stage, so steps 0..=2 -> 0, 3..=4 -> 1, 5..=7 -> 2, ..., 24 -> 9.
    let s = AqnSchedule::default();
    let stages: Vec<usize> = (0..=25).map(|i| s.stage(i, 25)).collect();
    assert_eq!(&stages[..8], &[0, 0, 0, 1, 1, 2, 2, 2]);
    assert_eq!(stages[24], 9);
    assert_eq!(stages[25], 9);
    assert_eq!(s.stage(3, 0), 0, "an empty run stays in stage 0");
}

#[test]
fn other_shapes_share_endpoints() {
    for kind in [
        SigmaSchedule::Exponential,
        SigmaSchedule::Linear,
        SigmaSchedule::Cosine,
        SigmaSchedule::Logarithmic,
    ] {
        let s = sched(kind);
        assert_eq!(s.stage_sigma(0), 0.0, "{kind:?}");
        close(s.stage_sigma(1) as f64, 1e-2, 1e-9);
        close(s.stage_sigma(9) as f64, 5e-4, 1e-9);
        let v = s.stage_sigmas();
        assert!(
            v[1..].windows(2).all(|w| w[1] <= w[0]),
            "{kind:?} decreases: {v:?}"
        );
    }
    // Midpoint (stage 5, t = 0.5).
    let mid = (1e-2 + 5e-4) / 2.0;
    close(
        sched(SigmaSchedule::Linear).stage_sigma(5) as f64,
        mid,
        1e-9,
    );
    close(
        sched(SigmaSchedule::Cosine).stage_sigma(5) as f64,
        mid,
        1e-9,
    );
    close(
        sched(SigmaSchedule::Exponential).stage_sigma(5) as f64,
        (1e-2f64 * 5e-4).sqrt(),
        1e-9,
    );
    close(
        sched(SigmaSchedule::Logarithmic).stage_sigma(5) as f64,
        1e-2 - (1e-2 - 5e-4) * 5.5f64.ln() / 10f64.ln(),
        1e-9,
    );
    // Cosine starts slower than linear, logarithmic faster.
    let l = sched(SigmaSchedule::Linear).stage_sigma(2);
    assert!(sched(SigmaSchedule::Cosine).stage_sigma(2) > l);
    assert!(sched(SigmaSchedule::Logarithmic).stage_sigma(2) < l);
    assert!(sched(SigmaSchedule::None)
        .stage_sigmas()
        .iter()
        .all(|&x| x == 0.0));
}

#[test]
fn two_stages() {
    let s = AqnSchedule {
        num_stages: 2,
        ..AqnSchedule::default()
    };
    assert_eq!(s.sigma(0, 10), 0.0);
    assert_eq!(s.sigma(4, 10), 0.0);
    close(s.sigma(5, 10) as f64, 1e-2, 1e-9);
}

#[test]
fn noise_vectors_are_seeded_and_scaled() {
    let a = noise_vector(7, 3, 0, 64, 0.01);
    assert_eq!(
        a,
        noise_vector(7, 3, 0, 64, 0.01),
        "same (seed, step, norm): same noise"
    );
    assert_ne!(a, noise_vector(7, 3, 1, 64, 0.01), "another norm");
    assert_ne!(a, noise_vector(7, 4, 0, 64, 0.01), "another step");
    assert_ne!(a, noise_vector(8, 3, 0, 64, 0.01), "another seed");
    assert_eq!(noise_vector(7, 3, 0, 5, 0.0), vec![0.0; 5]);
    let big = noise_vector(1, 0, 0, 200_000, 0.02);
    let n = big.len() as f64;
    let mean = big.iter().map(|&x| x as f64).sum::<f64>() / n;
    let std = (big.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    close(mean, 0.0, 2e-4);
    close(std, 0.02, 4e-4);
    // Scaling by sigma: the same stream at another sigma is proportional.
    let one = noise_vector(5, 1, 2, 8, 1.0);
    let half = noise_vector(5, 1, 2, 8, 0.5);
    for (x, y) in one.iter().zip(&half) {
        close(*y as f64, *x as f64 * 0.5, 1e-6);
    }
}
