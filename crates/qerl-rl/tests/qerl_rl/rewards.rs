use qerl_rl::reward::*;

fn gsm(c: &str, a: &str) -> f32 {
    Gsm8kReward::strict().score(c, a).unwrap()
}

fn gsm_flex(c: &str, a: &str) -> f32 {
    Gsm8kReward::flexible().score(c, a).unwrap()
}

fn math(c: &str, a: &str) -> f32 {
    Math500Reward::new().score(c, a).unwrap()
}

#[test]
fn gsm8k_strict_hash_and_answer_tag() {
    assert_eq!(gsm("so she makes 18 dollars.\n#### 18", "18"), 1.0);
    assert_eq!(
        gsm(
            "<think>16-3-4=9, 9*2=18</think>\n<answer> 18.0 </answer>",
            "18"
        ),
        1.0
    );
    assert_eq!(gsm("<answer>\n18\n</answer>", "18"), 1.0);
    assert_eq!(gsm("#### $1,000.", "1000"), 1.0);
    assert_eq!(
        gsm("#### 1,000", "#### 1,000"),
        1.0,
        "reference given as a full solution"
    );
    assert_eq!(gsm("#### -5", "-5"), 1.0);
    assert_eq!(gsm("#### 17", "18"), 0.0);
    assert_eq!(
        gsm("<answer>\\boxed{18}</answer>", "18"),
        1.0,
        "a box inside the tag is unwrapped"
    );
    assert_eq!(gsm("<answer>#### 18</answer>", "18"), 1.0);
    assert_eq!(gsm("<answer>25%</answer>", "25"), 1.0);
}

#[test]
fn gsm8k_strict_takes_the_last_answer_and_needs_a_bare_number() {
    // The format instruction restated first, the real answer last.
    assert_eq!(
        gsm("<answer>answer here</answer> ... <answer>18</answer>", "18"),
        1.0
    );
    assert_eq!(gsm("#### 3\nactually\n#### 18", "18"), 1.0);
    // Strict needs the candidate to hold one number; units and words around it are fine.
    assert_eq!(gsm("<answer>18 dollars</answer>", "18"), 1.0);
    assert_eq!(gsm("<answer>17 or 18 dollars</answer>", "18"), 0.0);
    // No answer at all.
    assert_eq!(gsm("I think the answer is 18.", "18"), 0.0);
    assert_eq!(gsm("", "18"), 0.0);
    // An unclosed tag is no answer.
    assert_eq!(gsm("<answer>18", "18"), 0.0);
}

#[test]
fn gsm8k_flexible_takes_the_last_number() {
    assert_eq!(gsm_flex("The answer is $1,000.", "1000"), 1.0);
    assert_eq!(gsm_flex("<answer>18 dollars</answer>", "18"), 1.0);
    assert_eq!(gsm_flex("3 + 4 = 7, so 18.0", "18"), 1.0);
    assert_eq!(gsm_flex("no numbers here", "18"), 0.0);
    assert_eq!(gsm_flex("first 18 then 19", "18"), 0.0);
    assert_eq!(gsm_flex("half is 7/2", "3.5"), 1.0);
    assert_eq!(
        last_number("in 2023, she had -4.5 apples."),
        Some("-4.5".into())
    );
}

#[test]
fn gsm8k_bad_reference_is_an_error() {
    let e = Gsm8kReward::strict().score("#### 1", "").unwrap_err();
    assert!(e.to_string().contains("gsm8k"), "{e}");
    assert!(Gsm8kReward::strict().score("#### 1", "eighteen").is_err());
}

#[test]
fn number_helpers() {
    assert_eq!(normalize_number_text(" $1,000. "), "1000");
    assert_eq!(normalize_number_text("\\$18.50"), "18.50");
    assert_eq!(parse_number("18.0"), Some(18.0));
    assert_eq!(parse_number("1/4"), Some(0.25));
    assert_eq!(parse_number("inf"), None);
    assert_eq!(parse_number("NaN"), None);
    assert_eq!(parse_number("1/0"), None);
    assert!(numbers_equal(18.0, 18.000_000_1));
    assert!(!numbers_equal(1000.0, 1001.0));
    assert_eq!(extract_hash_answer("a\n#### 72\n"), Some("72"));
    assert_eq!(extract_hash_answer("no marker"), None);
    assert_eq!(extract_answer_tag("<answer> x </answer>"), Some("x"));
    assert_eq!(
        gsm8k_reference_answer("work\n#### 1,234"),
        Some("1234".into())
    );
}

#[test]
fn boxed_extraction() {
    assert_eq!(
        last_boxed("so \\boxed{\\frac{1}{2}}."),
        Some("\\frac{1}{2}")
    );
    assert_eq!(
        last_boxed("\\boxed{\\frac{\\sqrt{3}}{2}} and more"),
        Some("\\frac{\\sqrt{3}}{2}")
    );
    assert_eq!(
        last_boxed("\\boxed{1} then \\boxed{ {2} + {3} }"),
        Some("{2} + {3}")
    );
    assert_eq!(
        last_boxed("set \\boxed{\\{1,2\\}}"),
        Some("\\{1,2\\}"),
        "escaped braces do not count"
    );
    assert_eq!(last_boxed("$\\boxed 5$"), Some("5"));
    assert_eq!(last_boxed("\\fbox{7}"), Some("7"));
    assert_eq!(last_boxed("\\boxed{unclosed"), None);
    assert_eq!(last_boxed("nothing"), None);
}

#[test]
fn math_hard_cases() {
    // Fractions in every spelling are one answer.
    for pred in [
        "\\boxed{\\frac{1}{2}}",
        "\\boxed{0.5}",
        "\\boxed{1/2}",
        "\\boxed{\\dfrac12}",
        "\\boxed{\\tfrac{1}{2}}",
        "\\boxed{.5}",
    ] {
        assert_eq!(math(pred, "\\frac{1}{2}"), 1.0, "{pred}");
        assert_eq!(math(pred, "0.5"), 1.0, "{pred} vs 0.5");
    }
    assert_eq!(math("\\boxed{-\\frac{3}{4}}", "-0.75"), 1.0);
    assert_eq!(math("\\boxed{\\frac{-3}{4}}", "-\\frac34"), 1.0);
    assert_eq!(math("\\boxed{\\frac{3}{4}}", "0.7"), 0.0);
    // \left / \right, spaces.
    assert_eq!(
        math(
            "\\boxed{(3, \\frac{\\pi}{2})}",
            "\\left( 3, \\frac{\\pi}{2} \\right)"
        ),
        1.0
    );
    // Degrees, units, text, percent, dollars, thousands.
    assert_eq!(math("\\boxed{90^\\circ}", "90"), 1.0);
    assert_eq!(math("\\boxed{90^{\\circ}}", "90"), 1.0);
    assert_eq!(math("\\boxed{5 \\text{ cm}}", "5"), 1.0);
    assert_eq!(math("\\boxed{12 \\text{inches}}", "12"), 1.0);
    assert_eq!(math("\\boxed{3\\text{ cm}^2}", "3"), 1.0);
    assert_eq!(math("\\boxed{\\text{(B)}}", "(B)"), 1.0);
    assert_eq!(math("\\boxed{10\\%}", "10"), 1.0);
    assert_eq!(math("\\boxed{\\$18.50}", "18.5"), 1.0);
    assert_eq!(math("\\boxed{1{,}000}", "1000"), 1.0);
    assert_eq!(math("\\boxed{1,000.}", "1000"), 1.0);
    // "x = 5" keeps the right-hand side.
    assert_eq!(math("\\boxed{x = 5}", "5"), 1.0);
    // Tuples element-wise, intervals keep their brackets.
    assert_eq!(math("\\boxed{(1, 0.5)}", "(1,\\frac{1}{2})"), 1.0);
    assert_eq!(math("\\boxed{[1,2)}", "(1,2)"), 0.0);
    assert_eq!(math("\\boxed{(1,2)}", "(1,2,3)"), 0.0);
    // Symbolic answers compare as normalised text.
    assert_eq!(math("\\boxed{2\\sqrt3}", "2\\sqrt{3}"), 1.0);
    assert_eq!(
        math("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),
        1.0
    );
    assert_eq!(math("\\boxed{\\pi}", "2\\pi"), 0.0);
    // \rightarrow is not a \right.
    assert_eq!(normalize_math_answer("a \\rightarrow b"), "a\\rightarrowb");
}

#[test]
fn math_extraction_fallbacks() {
    assert_eq!(
        math("<think>..</think><answer>\\frac{1}{2}</answer>", "0.5"),
        1.0
    );
    assert_eq!(math("<answer>so \\boxed{7}</answer>", "7"), 1.0);
    assert_eq!(
        math("the answer is 7", "7"),
        1.0,
        "no box, no tag: the answer phrase"
    );
    assert_eq!(math("I computed 7", "7"), 0.0, "no box, tag or phrase");
    assert_eq!(math("\\boxed{}", "7"), 0.0, "an empty box is never right");
    // The reference may be a full solution with a box.
    assert_eq!(
        math("\\boxed{14/3}", "so $x = \\boxed{\\frac{14}{3}}$."),
        1.0
    );
    assert!(Math500Reward::new().score("\\boxed{1}", "  ").is_err());
}

#[test]
fn math_number_parser() {
    assert_eq!(parse_math_number("\\frac{1}{4}"), Some(0.25));
    assert_eq!(parse_math_number("-\\frac{\\frac{1}{2}}{2}"), Some(-0.25));
    assert_eq!(parse_math_number("\\frac{1}{0}"), None);
    assert_eq!(parse_math_number("\\sqrt{2}"), None);
    assert_eq!(parse_math_number("\\frac{1}{2}x"), None);
}

#[test]
fn format_rewards() {
    let f = FormatReward::think_answer();
    assert_eq!(
        f.score("<think>\na\nb\n</think>\n\n<answer>\n5\n</answer>", "")
            .unwrap(),
        1.0
    );
    assert_eq!(f.score("<answer>5</answer>", "").unwrap(), 0.0);
    assert_eq!(
        f.score("<think>a</think> text <answer>5</answer>", "")
            .unwrap(),
        0.0
    );
    assert_eq!(
        FormatReward::boxed().score("so \\boxed{5}", "").unwrap(),
        1.0
    );
    assert!(FormatReward::new("bad", "(").is_err());
    assert!(by_name("nope").is_err());
    assert_eq!(by_name("gsm8k_flexible").unwrap().name(), "gsm8k_flexible");
}

#[test]
fn length_reward_counts_characters_and_caps_at_one() {
    let l = by_name("length").unwrap();
    assert_eq!(l.name(), "length");
    assert_eq!(l.score("", "7").unwrap(), 0.0);
    assert!((l.score(&"ab".repeat(150), "7").unwrap() - 0.3).abs() < 1e-6);
    // characters, not bytes
    assert!((l.score(&"é".repeat(500), "").unwrap() - 0.5).abs() < 1e-6);
    assert_eq!(l.score(&"x".repeat(5000), "").unwrap(), 1.0);
}

struct Panicky;
impl Reward for Panicky {
    fn name(&self) -> &str {
        "panicky"
    }
    fn score(&self, completion: &str, _: &str) -> Result<f32, RewardError> {
        if completion.contains("boom") {
            panic!("exploded on {completion}");
        }
        if completion.contains("nan") {
            return Ok(f32::NAN);
        }
        if completion.contains("err") {
            return Err(RewardError::Other {
                reward: "panicky".into(),
                message: "custom failure".into(),
            });
        }
        Ok(0.5)
    }
}

#[test]
fn reward_set_isolates_failures() {
    let set = RewardSet::new()
        .with(Gsm8kReward::strict(), 1.0)
        .with(Panicky, 2.0)
        .with_accuracy("gsm8k")
        .unwrap();
    let completions = ["#### 18", "boom #### 18", "nan", "err #### 3", "#### 18"];
    let answers = ["18", "18", "18", "18", "not a number"];
    let s = set.score_batch(&completions, &answers);
    assert_eq!(s.names, ["gsm8k", "panicky"]);
    assert_eq!(s.totals, vec![2.0, 1.0, 0.0, 0.0, 1.0]);
    assert_eq!(s.per_reward[0], vec![1.0, 1.0, 0.0, 0.0, 0.0]);
    assert_eq!(s.per_reward[1], vec![0.5, 0.0, 0.0, 0.0, 0.5]);
    assert_eq!(s.correct, vec![true, true, false, false, false]);
    assert_eq!(s.accuracy(), Some(0.4));
    // boom (panic), nan (non-finite), err (Err), bad reference (Err).
    assert_eq!(s.failure_count(), 4);
    let samples: Vec<usize> = s.failures.iter().map(|f| f.sample).collect();
    assert_eq!(samples, vec![1, 2, 3, 4]);
    assert!(
        s.failures[0].message.contains("panicked: exploded on boom"),
        "{:?}",
        s.failures[0]
    );
    assert!(s.failures[1].message.contains("non-finite"));
    assert_eq!(s.failures[3].reward, "gsm8k");
    let (mean, std) = s.total_mean_std();
    crate::close(mean as f64, 0.8, 1e-6);
    // deviations 1.2, 0.2, -0.8, -0.8, 0.2: squares sum to 2.8, population variance 0.56.
    crate::close(std as f64, 0.56f64.sqrt(), 1e-6);
    let per = s.per_reward_mean_std();
    crate::close(per[1].1 as f64, 0.2, 1e-6);
}

#[test]
fn reward_set_presets() {
    let set = RewardSet::gsm8k();
    assert_eq!(set.names(), ["format", "gsm8k"]);
    assert_eq!(set.weights(), [0.2, 2.0]);
    let s = set.score("<think>9*2</think>\n<answer>18</answer>", "18");
    crate::close(s.total as f64, 2.2, 1e-6);
    assert_eq!(s.correct, Some(true));
    let s = set.score("#### 18", "18");
    crate::close(s.total as f64, 2.0, 1e-6);
    assert!(RewardSet::new().with_accuracy("missing").is_err());
    let m = RewardSet::math();
    assert_eq!(m.score("\\boxed{1/2}", "\\frac{1}{2}").correct, Some(true));
    let named =
        RewardSet::from_names(&[("gsm8k_flexible".into(), 1.0)], Some("gsm8k_flexible")).unwrap();
    assert_eq!(named.score("it is 18", "18").total, 1.0);
    assert_eq!(
        RewardSet::new().score_batch(&["x"], &["y"]).accuracy(),
        None
    );
}
