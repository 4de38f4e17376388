use qerl_rl::data::{DatasetKind, PromptSampler};
use qerl_rl::eval::*;

#[test]
fn gsm8k_strict_and_flexible() {
    let v = judge(DatasetKind::Gsm8k, "<answer>18</answer>", "18");
    assert!(v.strict && v.flexible);
    let v = judge(DatasetKind::Gsm8k, "She makes $18 a day.", "#### 18");
    assert!(!v.strict && v.flexible);
    assert_eq!(
        (v.strict_answer, v.flexible_answer.as_deref()),
        (None, Some("18"))
    );
    let v = judge(DatasetKind::Gsm8k, "#### 17", "18");
    assert!(!v.strict && !v.flexible);
    let v = judge(DatasetKind::Gsm8k, "#### 18", "not a number");
    assert!(
        !v.strict && !v.flexible,
        "an unreadable reference is never matched"
    );
}

#[test]
fn math_strict_and_flexible() {
    let v = judge(DatasetKind::Math500, "so \\boxed{\\frac12}", "0.5");
    assert!(v.strict && v.flexible);
    let v = judge(DatasetKind::Math500, "the answer is 0.5", "\\frac{1}{2}");
    assert!(!v.strict && v.flexible);
    let v = judge(
        DatasetKind::Jsonl,
        "<answer>(1,2)</answer>",
        "\\left(1, 2\\right)",
    );
    assert!(v.strict && v.flexible);
    let v = judge(DatasetKind::Math500, "nothing", "3");
    assert!(!v.strict && !v.flexible);
}

#[test]
fn pass_at_one_is_the_mean_over_samples() {
    let yes = judge(DatasetKind::Gsm8k, "#### 1", "1");
    let flex = judge(DatasetKind::Gsm8k, "1", "1");
    let no = judge(DatasetKind::Gsm8k, "#### 2", "1");
    let mut p = PassAtOne::default();
    p.add_question(&[yes.clone(), no.clone(), no.clone(), flex.clone()]);
    p.add_question(&[no.clone(), no.clone(), no.clone(), no.clone()]);
    assert_eq!((p.questions, p.samples), (2, 8));
    assert_eq!(p.strict(), 1.0 / 8.0);
    assert_eq!(p.flexible(), 2.0 / 8.0);
    assert_eq!(p.pass_at_k_strict(), 0.5);
    assert_eq!(PassAtOne::default().strict(), 0.0);
}

#[test]
fn prompt_sampler_covers_each_epoch() {
    let mut s = PromptSampler::new(10, true, 3);
    let mut first: Vec<usize> = (0..5).flat_map(|_| s.next_batch(2)).collect();
    assert_eq!(s.epoch(), 0);
    let shuffled = first.clone();
    first.sort();
    assert_eq!(
        first,
        (0..10).collect::<Vec<_>>(),
        "every example once per epoch"
    );
    assert_ne!(shuffled, (0..10).collect::<Vec<_>>());
    let mut second: Vec<usize> = s.next_batch(10);
    assert_eq!(s.epoch(), 1);
    assert_ne!(second, shuffled, "a new order each epoch");
    second.sort();
    assert_eq!(second, first);
    // Same seed, same order; no shuffle: file order, wrapping around.
    let mut again = PromptSampler::new(10, true, 3);
    assert_eq!(again.next_batch(10), shuffled);
    let mut plain = PromptSampler::new(3, false, 0);
    assert_eq!(plain.next_batch(4), vec![0, 1, 2, 0]);
}
