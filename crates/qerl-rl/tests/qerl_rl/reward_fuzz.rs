//! The grader under attack: inputs a policy could learn to emit (huge numbers, deep nesting,
//! long garbage), seeded fuzzing over random and mutated LaTeX, the property that a gold
//! answer matches itself in every spelling the extractor accepts, and grading speed.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use qerl_rl::reward::latex::parse_answer;
use qerl_rl::reward::*;

use super::reward_cases::MATH_CASES;

fn math(c: &str, a: &str) -> f32 {
    Math500Reward::new().score(c, a).unwrap()
}

/// Runs `f` and fails if it takes longer than `limit` (debug build, shared CPU: generous).
#[track_caller]
fn within<T>(limit: Duration, what: &str, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    let took = t.elapsed();
    assert!(took <= limit, "{what} took {took:?} (limit {limit:?})");
    out
}

#[test]
fn a_number_too_large_for_f64_matches_nothing() {
    let nines309 = "9".repeat(309);
    let nines400 = "9".repeat(400);
    for reference in ["18", "0", "100000", &nines309] {
        let c = format!("#### {nines309}");
        assert_eq!(Gsm8kReward::strict().score(&c, reference).unwrap(), 0.0);
        assert_eq!(Gsm8kReward::flexible().score(&c, reference).unwrap(), 0.0);
    }
    for reference in ["18", "\\infty", "10^{400}", "2"] {
        let c = format!("\\boxed{{{nines400}}}");
        assert_eq!(math(&c, reference), 0.0, "vs {reference}");
    }
    assert!(!numbers_equal(f64::INFINITY, f64::INFINITY));
    assert!(!numbers_equal(f64::NAN, 1.0));
    assert_eq!(parse_number(&nines400), None);
    assert_eq!(parse_math_number(&nines400), None);
    // Values that overflow while being evaluated are not equal either.
    assert_eq!(math("\\boxed{10^{400}}", "10^{401}"), 0.0);
    assert_eq!(math("\\boxed{2^{100000}}", "3^{100000}"), 0.0);
    assert_eq!(math("\\boxed{1000000!}", "999999!"), 0.0);
}

#[test]
fn deep_or_long_answers_are_graded_wrong_quickly_without_crashing() {
    let limit = Duration::from_secs(2);
    let minus = format!("\\boxed{{{}1}}", "-".repeat(70_000));
    within(limit, "70k minus signs", || {
        assert_eq!(math(&minus, "1"), 0.0);
        assert_eq!(math(&minus, "-1"), 0.0);
        assert_eq!(parse_math_number(&minus[7..minus.len() - 1]), None);
        assert_eq!(Gsm8kReward::strict().score(&minus, "1").unwrap(), 0.0);
    });
    let short_minus = format!("\\boxed{{{}1}}", "-".repeat(1000));
    within(limit, "1k minus signs", || {
        assert_eq!(math(&short_minus, "1"), 1.0, "an even number of signs");
    });
    let fracs = format!("{}1{}", "\\frac{".repeat(20_000), "}{2}".repeat(20_000));
    within(limit, "nested fractions", || {
        assert_eq!(math(&format!("\\boxed{{{fracs}}}"), "0"), 0.0);
        assert_eq!(parse_math_number(&fracs), None);
        let _ = normalize_math_answer(&fracs);
    });
    let parens = format!("\\boxed{{{}1{}}}", "(".repeat(50_000), ")".repeat(50_000));
    within(limit, "nested brackets", || {
        assert_eq!(math(&parens, "1"), 0.0)
    });
    let towers = format!("\\boxed{{{}2{}}}", "2^{".repeat(500), "}".repeat(500));
    within(limit, "power tower", || assert_eq!(math(&towers, "4"), 0.0));
    let unclosed = "\\boxed{".repeat(100_000);
    within(limit, "unclosed boxes", || {
        assert_eq!(math(&unclosed, "1"), 0.0);
        let _ = last_boxed(&unclosed);
    });
    let long_list = format!("\\boxed{{{}}}", vec!["1"; 100_000].join(","));
    within(limit, "a long list", || {
        assert_eq!(math(&long_list, "1, 1"), 0.0)
    });
    let hashes = format!("{}#### 5", "#### ".repeat(100_000));
    within(limit, "many markers", || {
        assert_eq!(Gsm8kReward::strict().score(&hashes, "5").unwrap(), 1.0);
    });
    let phrase = "the answer is ".repeat(50_000);
    within(limit, "many phrases", || {
        assert_eq!(Gsm8kReward::flexible().score(&phrase, "5").unwrap(), 0.0);
        assert_eq!(math(&phrase, "5"), 0.0);
    });
    // Long flat chains build deep trees without nesting brackets: bounded by the length limit.
    for chain in [
        format!("{}1", "1=".repeat(990)),
        format!("{}2", "2^".repeat(990)),
        format!("{}1", "1^4096^".repeat(280)),
        format!("5{}", "!".repeat(1990)),
        format!("{}1", "1/".repeat(990)),
        format!("{}x", "x^".repeat(990)),
    ] {
        within(limit, "a long chain", || {
            assert_eq!(math(&format!("\\boxed{{{chain}}}"), "0"), 0.0);
            assert!(!math_equiv(&chain, &format!("{chain}+1")));
        });
    }
    let big_exact = "\\boxed{\\binom{10^{30}}{10^{29}}}";
    within(limit, "huge binomial", || {
        assert_eq!(math(big_exact, "0"), 0.0)
    });
}

/// Pieces random answers are built from.
const PIECES: &[&str] = &[
    "1",
    "2",
    "0",
    "9",
    ".",
    ",",
    "{",
    "}",
    "(",
    ")",
    "[",
    "]",
    "\\{",
    "\\}",
    "^",
    "_",
    "-",
    "+",
    "*",
    "/",
    "=",
    "<",
    "|",
    "!",
    "%",
    "&",
    "\\\\",
    "x",
    "y",
    "e",
    "i",
    "C",
    "\\frac",
    "\\sqrt",
    "\\pi",
    "\\infty",
    "\\cdot",
    "\\times",
    "\\left(",
    "\\right)",
    "\\text{",
    "\\text{ cm}",
    "\\begin{pmatrix}",
    "\\end{pmatrix}",
    "\\begin{array}",
    "\\end{bmatrix}",
    "\\pm",
    "\\cup",
    "\\le",
    "\\sin",
    "\\log_",
    "\\binom",
    "\\boxed{",
    "\\displaystyle",
    "\\,",
    "{,}",
    "$",
    " ",
    "°",
    "π",
    "é",
    "\\",
    "\\unknown",
    "####",
    "<answer>",
    "</answer>",
    "**",
    "\u{0}",
];

fn random_answer(rng: &mut StdRng) -> String {
    let n = rng.random_range(0..40);
    (0..n)
        .map(|_| PIECES[rng.random_range(0..PIECES.len())])
        .collect()
}

/// A mutation of `s`: a piece inserted, a character deleted or duplicated, or a span
/// repeated (char boundaries respected).
fn mutate(rng: &mut StdRng, s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let at = rng.random_range(0..=chars.len());
    let (head, tail): (String, String) =
        (chars[..at].iter().collect(), chars[at..].iter().collect());
    match rng.random_range(0..4) {
        0 => format!("{head}{}{tail}", PIECES[rng.random_range(0..PIECES.len())]),
        1 => format!("{head}{}", tail.chars().skip(1).collect::<String>()),
        2 => format!("{head}{head}{tail}"),
        _ => format!("{tail}{head}"),
    }
}

#[test]
fn fuzzed_answers_never_panic_and_stay_fast() {
    let mut rng = StdRng::seed_from_u64(17);
    let rewards: Vec<Box<dyn Reward>> = ["gsm8k", "gsm8k_flexible", "math"]
        .iter()
        .map(|n| by_name(n).unwrap())
        .collect();
    let t = Instant::now();
    let mut slowest = Duration::ZERO;
    for round in 0..3000 {
        let (gold, base) = {
            let row = MATH_CASES[rng.random_range(0..MATH_CASES.len())];
            (row.1, row.0)
        };
        let pred = if round % 2 == 0 {
            random_answer(&mut rng)
        } else {
            let mut p = base.to_string();
            for _ in 0..rng.random_range(1..4) {
                p = mutate(&mut rng, &p);
            }
            p
        };
        let one = Instant::now();
        let _ = parse_answer(&pred);
        let _ = math_equiv(&pred, gold);
        let _ = math_equiv(gold, &pred);
        let _ = math_equiv(&pred, &pred);
        let _ = parse_math_number(&pred);
        let _ = normalize_math_answer(&pred);
        let boxed = format!("\\boxed{{{pred}}}");
        for r in &rewards {
            let _ = r.score(&boxed, gold);
            let _ = r.score(&pred, gold);
            let _ = r.score(gold, &pred);
        }
        let _ = explain("math", &boxed, gold);
        slowest = slowest.max(one.elapsed());
    }
    assert!(
        slowest < Duration::from_millis(200),
        "slowest fuzz case {slowest:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
}

#[test]
fn a_gold_answer_matches_itself_in_every_spelling() {
    let mut checked = 0;
    for &(_, gold, _) in MATH_CASES {
        if gold.trim().is_empty() {
            continue;
        }
        let spellings = [
            format!("\\boxed{{{gold}}}"),
            format!("so $\\boxed{{{gold}}}$."),
            format!("\\boxed{{ {gold} }}"),
            format!("\\boxed{{{{{gold}}}}}"),
            format!("\\boxed{{\\displaystyle {gold}}}"),
            format!("wrong \\boxed{{0}} then \\boxed{{{gold}}}"),
            format!("<think>work</think>\n<answer>{gold}</answer>"),
            format!("<answer>\\boxed{{{gold}}}</answer>"),
            format!("The answer is ${gold}$."),
            format!("Answer: ${gold}$"),
            format!("The final answer is $\\boxed{{{gold}}}$. I hope it is correct."),
            format!("The answer is \\({gold}\\)."),
        ];
        for s in &spellings {
            assert_eq!(math(s, gold), 1.0, "{s:?} vs {gold:?}");
            checked += 1;
        }
        // The reference given as a full solution works too.
        assert_eq!(math(&spellings[0], &spellings[1]), 1.0, "{gold:?}");
    }
    assert!(checked > 1000, "{checked}");
}

#[test]
fn gsm8k_gold_matches_itself_in_every_spelling() {
    let mut rng = StdRng::seed_from_u64(5);
    for _ in 0..300 {
        let n: i64 = rng.random_range(-5000..2_000_000);
        let plain = n.to_string();
        let grouped = {
            let digits = n.unsigned_abs().to_string();
            let mut out = String::new();
            for (i, c) in digits.chars().enumerate() {
                if i > 0 && (digits.len() - i) % 3 == 0 {
                    out.push(',');
                }
                out.push(c);
            }
            if n < 0 {
                format!("-{out}")
            } else {
                out
            }
        };
        let strict_spellings = [
            format!("#### {plain}"),
            format!("#### {grouped}"),
            format!("#### **{grouped}**"),
            format!("#### ${grouped}."),
            format!("#### {plain} dollars"),
            format!("<answer>{grouped}</answer>"),
            format!("<answer>\\boxed{{{plain}}}</answer>"),
            format!("so \\boxed{{{plain}}}"),
            format!("#### {plain}.0"),
        ];
        for s in &strict_spellings {
            assert_eq!(Gsm8kReward::strict().score(s, &plain).unwrap(), 1.0, "{s}");
            assert_eq!(
                Gsm8kReward::flexible().score(s, &plain).unwrap(),
                1.0,
                "{s}"
            );
            assert_eq!(
                Gsm8kReward::strict()
                    .score(s, &(n + 1).to_string())
                    .unwrap(),
                0.0,
                "{s} vs {}",
                n + 1
            );
        }
        for s in [
            format!("So the answer is {grouped}."),
            format!("The answer is **{plain}**"),
            format!("Answer: {plain}"),
        ] {
            assert_eq!(
                Gsm8kReward::flexible().score(&s, &plain).unwrap(),
                1.0,
                "{s}"
            );
        }
    }
}

#[test]
fn grading_speed() {
    let t = Instant::now();
    let mut n = 0usize;
    while t.elapsed() < Duration::from_millis(500) {
        for &(pred, gold, _) in MATH_CASES {
            let _ = math_equiv(pred, gold);
            n += 1;
        }
    }
    let per_second = n as f64 / t.elapsed().as_secs_f64();
    println!("MATH grading: {per_second:.0} answers/s (math-verify: ~1000/s)");
    // A debug build on a shared 2-core machine; release is ~10x faster.
    assert!(per_second > 1000.0, "{per_second:.0} answers/s");
}

#[test]
fn the_deepest_accepted_answers_fit_a_small_thread_stack() {
    // Just inside the nesting bound, every construct at once, graded on a 1 MiB stack (a
    // debug build; worker threads get 2 MiB by default).
    let depth = 19;
    let nested = [
        format!("{}1{}", "\\frac{".repeat(depth), "}{2}".repeat(depth)),
        format!("{}1{}", "\\sqrt{".repeat(depth), "}".repeat(depth)),
        format!("{}x{}", "(".repeat(depth), ")".repeat(depth)),
        format!("{}2{}", "2^{".repeat(depth), "}".repeat(depth)),
        format!("{}1{}", "\\{".repeat(depth), "\\}".repeat(depth)),
        format!("{}1", "1=".repeat(depth)),
        format!("{}1", "1/".repeat(depth)),
        format!("3{}", "!".repeat(depth)),
    ];
    let handle = std::thread::Builder::new()
        .stack_size(1 << 20)
        .spawn(move || {
            for a in &nested {
                let boxed = format!("\\boxed{{{a}}}");
                let _ = math(&boxed, a);
                let _ = math(&boxed, "1");
                let _ = explain("math", &boxed, a);
                assert!(parse_answer(a).is_ok(), "{a}");
            }
        })
        .unwrap();
    handle.join().unwrap();
}
