use qerl_rl::advantage::*;

use crate::close;

#[test]
fn grpo_and_dr_grpo_advantages() {
    // Group 0: [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350.
    // Group 1: [2, 2, 2, 2]: mean 2, std 0 -> advantages 0.
    let r = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0];
    let a = group_advantages(&r, 4, AdvantageKind::Grpo { eps: 1e-4 }).unwrap();
    let s = (1.0f64 / 3.0).sqrt();
    let want = 0.5 / (s + 1e-4);
    for (got, sign) in a[..4].iter().zip([1.0, -1.0, -1.0, 1.0]) {
        close(*got as f64, sign * want, 1e-5);
    }
    assert!(a[4..].iter().all(|&x| x == 0.0));
    let d = group_advantages(&r, 4, AdvantageKind::DrGrpo).unwrap();
    assert_eq!(d, vec![0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]);
    let stats = group_stats(&r, 4).unwrap();
    close(stats[0].1 as f64, s, 1e-6);
    assert_eq!(stats[1], (2.0, 0.0));
    assert_eq!(AdvantageKind::default(), AdvantageKind::Grpo { eps: 1e-4 });
}

#[test]
fn advantages_are_normalised_per_group() {
    // Any group: GRPO advantages have mean 0 and (unbiased) std ~1.
    let r = [0.2, 2.2, 0.0, 2.0, 0.2, 1.0];
    let a = group_advantages(&r, 6, AdvantageKind::Grpo { eps: 0.0 }).unwrap();
    let mean: f64 = a.iter().map(|&x| x as f64).sum::<f64>() / 6.0;
    let var: f64 = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / 5.0;
    close(mean, 0.0, 1e-6);
    close(var.sqrt(), 1.0, 1e-5);
}

#[test]
fn ragged_and_empty_inputs() {
    assert_eq!(
        group_advantages(&[1.0, 2.0, 3.0], 2, AdvantageKind::DrGrpo),
        Err(AdvantageError::Ragged {
            len: 3,
            group_size: 2
        })
    );
    assert_eq!(group_stats(&[1.0], 0), Err(AdvantageError::ZeroGroupSize));
    assert_eq!(zero_std_fraction(&[], 4), Ok(0.0));
    assert_eq!(
        group_advantages(&[5.0], 1, AdvantageKind::Grpo { eps: 1e-4 }).unwrap(),
        vec![0.0]
    );
}

#[test]
fn zero_std_groups_and_filter() {
    let r = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.3, 0.3 + 1e-8];
    assert_eq!(zero_std_fraction(&r, 2).unwrap(), 0.75);
    assert_eq!(filter_groups(&r, 2).unwrap(), (vec![1], 3));
    assert!(is_flat_group(&[0.5]));
    assert!(!is_flat_group(&[0.5, 0.6]));
}

#[test]
fn dynamic_sampling_refills_the_batch() {
    let mut batch = DynamicBatch::new(2, 2);
    // Round 1: one flat group, one informative.
    let kept = batch.offer_round([("a", vec![1.0, 1.0]), ("b", vec![0.0, 1.0])]);
    assert_eq!(kept, 1);
    assert!(!batch.is_full());
    // Round 2: flat, informative (fills the batch), informative (overflow).
    let kept = batch.offer_round([
        ("c", vec![0.0, 0.0]),
        ("d", vec![1.0, 0.0]),
        ("e", vec![0.0, 2.0]),
    ]);
    assert_eq!(kept, 2);
    assert!(batch.is_full());
    assert_eq!(batch.len(), 2);
    let (groups, stats) = batch.take();
    let names: Vec<&str> = groups.iter().map(|(p, _)| *p).collect();
    assert_eq!(names, ["b", "d"]);
    assert_eq!(groups[1].1, vec![1.0, 0.0]);
    assert_eq!(
        stats,
        DynamicSamplingStats {
            offered: 5,
            kept: 3,
            dropped_flat: 2,
            overflow: 1,
            rounds: 2,
        }
    );
}

#[test]
fn dynamic_sampling_gives_a_partial_batch_when_rounds_run_out() {
    let mut batch: DynamicBatch<usize> = DynamicBatch::new(3, 4);
    let max_rounds = 3;
    let mut round = 0;
    while !batch.is_full() && batch.stats().rounds < max_rounds {
        round += 1;
        // Every round: one informative group, one flat.
        batch.offer_round([(round, vec![0.0, 1.0, 0.0]), (100 + round, vec![1.0; 3])]);
    }
    assert!(!batch.is_empty() && !batch.is_full());
    let (groups, stats) = batch.take();
    assert_eq!(groups.len(), 3);
    assert_eq!(stats.rounds, 3);
    assert_eq!(stats.dropped_flat, 3);
}

#[test]
fn overlong_shaping_dapo() {
    // L_max 20, L_cache 4: no penalty up to 16, then linear to -1 at 20, -1 beyond.
    assert_eq!(overlong_penalty(0, 20, 4), 0.0);
    assert_eq!(overlong_penalty(16, 20, 4), 0.0);
    assert_eq!(overlong_penalty(17, 20, 4), -0.25);
    assert_eq!(overlong_penalty(18, 20, 4), -0.5);
    assert_eq!(overlong_penalty(20, 20, 4), -1.0);
    assert_eq!(overlong_penalty(25, 20, 4), -1.0);
    // DAPO's own numbers: L_max 20480, L_cache 4096.
    close(overlong_penalty(18432, 20480, 4096) as f64, -0.5, 1e-6);
    // No buffer: only beyond L_max.
    assert_eq!(overlong_penalty(20, 20, 0), 0.0);
    assert_eq!(overlong_penalty(21, 20, 0), -1.0);
    // A buffer larger than L_max is capped at L_max.
    assert_eq!(overlong_penalty(10, 20, 40), -0.5);
    let mut r = vec![1.0, 1.0, 0.0];
    apply_overlong_shaping(&mut r, &[10, 18, 20], 20, 4);
    assert_eq!(r, vec![1.0, 0.5, -1.0]);
}

#[test]
fn completion_masks() {
    let lengths = [2, 3, 5];
    let truncated = [false, true, false];
    assert_eq!(
        completion_mask(&lengths, &truncated, 3, true),
        vec![1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    );
    assert_eq!(
        completion_mask(&lengths, &truncated, 3, false),
        vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    );
}
