//! A table of graded answers (issue 17): each kind of spelling with right and wrong variants.
//! `MATH_CASES` rows are `(predicted final answer, reference, equal?)`, graded as the content
//! of a `\boxed{}`; most rows are also checked the other way round (`SYMMETRIC`).

use qerl_rl::reward::*;

/// `(pred, gold, expected)`.
pub const MATH_CASES: &[(&str, &str, bool)] = &[
    // The issue's examples.
    (r"\sqrt{452}", r"2\sqrt{113}", true),
    (r"\pi \cdot 288", r"288 \pi", true),
    (r"11 + 11 \sqrt{5}", r"11 \sqrt{5} + 11", true),
    (r"{\displaystyle 12}", "12", true),
    (r"65\ \text{square units}", "65", true),
    (r"2516_{8}", "2516_8", true),
    (r"\text{C}", r"\text{(C)}", true),
    (
        r"\begin{bmatrix} 1 & 2 \\ 3 & 4 \end{bmatrix}",
        r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
        true,
    ),
    (r"\sqrt{451}", r"2\sqrt{113}", false),
    (r"289\pi", r"288 \pi", false),
    (r"11 + 11 \sqrt{6}", r"11 \sqrt{5} + 11", false),
    (r"11 \sqrt{5}", r"11 \sqrt{5} + 11", false),
    (r"{\displaystyle 13}", "12", false),
    (r"66\ \text{square units}", "65", false),
    (r"2516_{9}", "2516_8", false),
    ("2516", "2516_8", false),
    ("1358", "2516_8", false),
    ("2517_8", "2516_8", false),
    (r"\text{D}", r"\text{(C)}", false),
    (
        r"\begin{bmatrix} 1 & 2 \\ 3 & 5 \end{bmatrix}",
        r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
        false,
    ),
    (
        r"\begin{bmatrix} 1 & 3 \\ 2 & 4 \end{bmatrix}",
        r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
        false,
    ),
    (
        r"\begin{bmatrix} 1 & 2 & 3 & 4 \end{bmatrix}",
        r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
        false,
    ),
    // Fractions in every spelling.
    (r"\frac{1}{2}", r"\frac12", true),
    (r"\dfrac12", r"\frac{1}{2}", true),
    (r"\tfrac{1}{2}", "0.5", true),
    ("1/2", r"\frac{1}{2}", true),
    (".5", r"\frac{1}{2}", true),
    (r"\frac{2}{4}", r"\frac{1}{2}", true),
    (r"\frac{-1}{-2}", r"\frac{1}{2}", true),
    (r"\frac{1}{3}", r"\frac{1}{2}", false),
    ("0.49", r"\frac{1}{2}", false),
    (r"-\frac{3}{4}", r"\frac{-3}{4}", true),
    (r"-\frac{3}{4}", "-0.75", true),
    (r"\frac{3}{-4}", r"-\frac34", true),
    (r"\frac{3}{4}", r"-\frac34", false),
    (r"\frac{7}{2}", "3.5", true),
    (r"3\frac{1}{2}", r"\frac{7}{2}", true),
    ("3.4", r"\frac{7}{2}", false),
    (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}", true),
    (r"\frac{\sqrt3}{3}", r"\frac{1}{\sqrt3}", true),
    (r"\frac{\sqrt3}{2}", r"\frac{\sqrt2}{2}", false),
    (r"\frac{14}{3}", r"4\frac{2}{3}", true),
    (r"\frac{100}{3}", r"33\frac{1}{3}", true),
    (r"\frac{a}{b}", r"\frac{a}{b}", true),
    (r"\frac{2a}{2b}", r"\frac{a}{b}", true),
    (r"\frac{b}{a}", r"\frac{a}{b}", false),
    // Rounded decimals are not exact answers; a decimal reference accepts exact values.
    ("0.333", r"\frac{1}{3}", false),
    ("0.3333333", r"\frac{1}{3}", false),
    ("0.866", r"\frac{\sqrt3}{2}", false),
    ("3.14", r"\pi", false),
    ("3.14159", r"\pi", false),
    ("1.414", r"\sqrt{2}", false),
    (r"\frac{1}{3}", "0.33", true),
    (r"\pi", "3.14", true),
    (r"\sqrt{2}", "1.41", true),
    (r"\sqrt{2}", "1.42", false),
    ("0.34", "0.33", false),
    ("0.330", "0.33", true),
    ("2.50", "2.5", true),
    // Roots.
    (r"\sqrt{8}", r"2\sqrt{2}", true),
    (r"\sqrt{12}", r"2\sqrt3", true),
    (r"\sqrt[3]{8}", "2", true),
    (r"\sqrt[3]{-27}", "-3", true),
    (r"\sqrt{16}", "4", true),
    (r"\sqrt 3", r"\sqrt{3}", true),
    (r"3\sqrt{2}", r"\sqrt{18}", true),
    (r"\sqrt{18}", r"3\sqrt{3}", false),
    (r"\frac{\sqrt{2}}{2}", r"\sqrt2/2", true),
    (r"\sqrt{2}", "2", false),
    (r"2\sqrt{5}", r"\sqrt{20}", true),
    (r"5\sqrt{2}", r"\sqrt{50}", true),
    (r"5\sqrt{2}", r"\sqrt{52}", false),
    // pi.
    (r"2\pi", r"\pi \cdot 2", true),
    (r"\frac{\pi}{4}", r"\frac14\pi", true),
    (r"\pi/4", r"\frac{\pi}{4}", true),
    ("0.785", r"\frac{\pi}{4}", false),
    (r"\frac{\pi}{3}", r"\frac{\pi}{4}", false),
    (r"4\pi", "4", false),
    (r"\frac{9\pi}{2}", r"4.5\pi", true),
    (r"36\pi", r"36 \pi", true),
    (r"\pi r^2", r"r^2 \pi", true),
    (r"\frac{4}{3}\pi", r"\frac{4\pi}{3}", true),
    (r"\frac{3}{4}\pi", r"\frac{4\pi}{3}", false),
    // Powers.
    ("2^{10}", "1024", true),
    ("2^10", "1024", true),
    ("2^{11}", "1024", false),
    (r"x^2", r"x \cdot x", true),
    ("(x+1)^2", "x^2+2x+1", true),
    ("(x+1)^2", "x^2+2x+2", false),
    ("10^{-3}", "0.001", true),
    ("2^{-1}", r"\frac12", true),
    (r"e^{i\pi}", "-1", true),
    ("3^4", "81", true),
    ("3^4", "64", false),
    ("x^{-1}", r"\frac{1}{x}", true),
    (r"\left(\frac{1}{2}\right)^{3}", r"\frac18", true),
    // Implicit and explicit products.
    ("2x", r"2 \cdot x", true),
    ("xy", "yx", true),
    ("3(x+1)", "3x+3", true),
    (r"2\times 3", "6", true),
    (r"2 \cdot 3", "6", true),
    ("x(x-1)", "x^2 - x", true),
    ("3x+3", "3x+1", false),
    ("2*x*y", "2xy", true),
    ("2xy", "2x", false),
    (r"4 \div 2", "2", true),
    (r"(2)(3)", "6", true),
    // \left, \right, spacing.
    (
        r"\left(3, \frac{\pi}{2}\right)",
        r"(3, \frac{\pi}{2})",
        true,
    ),
    (r"\left[ 1, 2 \right]", "[1,2]", true),
    (r"\left( 1, 2 \right]", "[1,2]", false),
    (r"1\!000", "1000", true),
    (r"\; 7 \quad", "7", true),
    // Text and roman.
    (r"\text{Evelyn}", "Evelyn", true),
    (r"\mathrm{odd}", r"\text{odd}", true),
    (r"\text{even}", r"\text{odd}", false),
    (r"\textbf{18}", "18", true),
    (r"\text{no solution}", r"\text{No Solution}", true),
    (r"\text{Devon}", r"\text{Evelyn}", false),
    // Units and degrees.
    (r"90^\circ", "90", true),
    (r"90^{\circ}", "90", true),
    ("90°", "90", true),
    (r"45^\circ", "90", false),
    (r"5\text{ cm}", "5", true),
    (r"5 \text{ cm}^2", "5", true),
    (r"12 \mbox{ inches}", "12", true),
    (r"3 \text{ units}", "4", false),
    (r"\$18.50", "18.5", true),
    (r"18.50 \text{ dollars}", "18.5", true),
    (r"30 \mathrm{mph}", "30", true),
    ("12 inches", "12", true),
    ("13 inches", "12", false),
    (r"6 \text{ square feet}", "6", true),
    (r"7\text{ cm}", "5", false),
    // Percent.
    (r"10\%", "10", true),
    ("25%", "25", true),
    (r"10\%", "11", false),
    (r"12.5\%", "12.5", true),
    (r"25\%", "0.25", true),
    (r"25\%", r"\frac14", true),
    (r"25\%", "0.5", false),
    (r"25\%", r"25\%", true),
    (r"25\%", r"26\%", false),
    // Thousands separators.
    ("1,000", "1000", true),
    ("1{,}000", "1000", true),
    (r"1\,000", "1000", true),
    ("10,000,000", "10000000", true),
    ("1,000", "100", false),
    ("1{,}234{,}567", "1234567", true),
    ("1{,}234{,}568", "1234567", false),
    ("1,000.5", "1000.5", true),
    (r"10,\!080", "10080", true),
    (r"11,\! 111,\! 111,\! 100", "11111111100", true),
    (r"\$32,\!348", "32348", true),
    (r"32,\!349", "32348", false),
    ("12,102", "12102", true),
    ("(12,102)", "(12, 102)", true),
    (r"(2,12) \cup (12,102)", r"(12,102) \cup (2,12)", true),
    (r"(2,12) \cup (12,102)", r"(2,12) \cup (12,103)", false),
    // Bases.
    ("101_2", "101_{2}", true),
    ("1011_2", "101_2", false),
    ("101_{3}", "101_2", false),
    (r"10_{\text{ten}}", "10", true),
    ("777_8", "777_{8}", true),
    // \displaystyle and braces.
    (r"{\displaystyle \frac{1}{2}}", "0.5", true),
    (r"{{7}}", "7", true),
    (r"{{8}}", "7", false),
    // Intervals.
    ("[2, 5)", "[2,5)", true),
    ("(2,5]", "[2,5)", false),
    (r"(-\infty, 3]", r"(-\infty,3]", true),
    (r"(-\infty, 3)", r"(-\infty, 3]", false),
    (
        r"(-\infty, 0) \cup (1, \infty)",
        r"(1,\infty)\cup(-\infty,0)",
        true,
    ),
    (
        r"(-\infty, 0) \cup (2, \infty)",
        r"(1,\infty)\cup(-\infty,0)",
        false,
    ),
    (r"[0, \frac{1}{2}]", "[0, 0.5]", true),
    (r"(-\infty, \infty)", r"(-\infty,\infty)", true),
    (r"(-\infty, -3]", r"(-\infty, 3]", false),
    (r"\left[ -2, \frac{7}{3} \right)", r"[-2, \frac73)", true),
    (r"(\infty, 3]", r"(-\infty, 3]", false),
    // Tuples and vectors.
    ("(1, 2)", "(1,2)", true),
    ("(2,1)", "(1,2)", false),
    ("(1, 2, 3)", "(1,2)", false),
    (r"\left( \frac{1}{2}, -3 \right)", "(0.5, -3)", true),
    (r"\langle 1, 2 \rangle", r"\langle 1,2\rangle", true),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", "(1, 2)", true),
    (r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}", "(1, 2)", false),
    ("(3, -1, 2)", r"(3,-1,2)", true),
    (r"(2\sqrt2, \pi)", r"(\sqrt8, \pi)", true),
    // Sets and lists (order does not matter).
    (r"\{1, 2, 3\}", r"\{3, 2, 1\}", true),
    ("1, 2", "2, 1", true),
    ("1, 2", "1, 3", false),
    (r"\{1,2\}", r"\{1,2,3\}", false),
    ("x = 1, x = 2", "1, 2", true),
    (r"1 \text{ and } 2", "1, 2", true),
    (r"\emptyset", r"\varnothing", true),
    ("-2, 3", "3, -2", true),
    ("-2, 3", "2, 3", false),
    (r"\frac12, -1", r"-1, 0.5", true),
    ("1, 1, 2", "1, 2, 2", false),
    // Matrices in any environment.
    (
        r"\begin{pmatrix} \frac12 & 0 \\ 0 & 1\end{pmatrix}",
        r"\begin{bmatrix} 0.5 & 0 \\ 0 & 1 \end{bmatrix}",
        true,
    ),
    (
        r"\begin{matrix} 1 & 0 \\ 0 & 1 \end{matrix}",
        r"\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}",
        true,
    ),
    (
        r"\left[\begin{array}{cc} 1 & 0 \\ 0 & 1 \end{array}\right]",
        r"\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}",
        true,
    ),
    (
        r"\begin{pmatrix} 1 & 0 \\ 0 & -1 \end{pmatrix}",
        r"\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}",
        false,
    ),
    (
        r"\begin{pmatrix} -\frac{1}{3} \\ \frac{2}{3} \end{pmatrix}",
        r"\begin{pmatrix} -1/3 \\ 2/3 \end{pmatrix}",
        true,
    ),
    // Equations.
    ("x = 5", "5", true),
    ("5", "x=5", true),
    ("x = 6", "5", false),
    ("y = 2x + 3", "y = 3 + 2x", true),
    ("y=2x+3", "2x - y + 3 = 0", true),
    ("y = 2x+4", "y=2x+3", false),
    ("k = 5", "5", true),
    ("x^2 + y^2 = 25", "y^2 + x^2 = 25", true),
    ("x^2 + y^2 = 26", "y^2 + x^2 = 25", false),
    (r"a = \frac{1}{2}", "0.5", true),
    ("f(x) = 2x + 1", "2x+1", true),
    ("f(x) = 2x + 2", "2x+1", false),
    (r"x \in [2, 5)", "[2, 5)", true),
    (r"x \in [2, 5]", "[2, 5)", false),
    // Inequalities.
    (r"x \le 3", r"x \leq 3", true),
    (r"3 \ge x", r"x \le 3", true),
    ("x < 3", r"x \le 3", false),
    ("x > -2", "-2 < x", true),
    (r"-2 \le x \le 7", "[-2, 7]", true),
    (r"-2 < x \le 7", "[-2, 7]", false),
    (r"-2 < x \le 7", "(-2, 7]", true),
    (r"7 \ge x > -2", "(-2, 7]", true),
    ("x > 3", r"(3, \infty)", true),
    (r"x \ge 3", r"(3, \infty)", false),
    (r"x \ge 3", r"[3, \infty)", true),
    ("x < 3", r"(-\infty, 3)", true),
    ("3 > x", r"(-\infty, 3)", true),
    ("x < 4", r"(-\infty, 3)", false),
    // Choice letters.
    ("C", "(C)", true),
    ("(C)", "C", true),
    (r"\textbf{(C)}", "C", true),
    ("B", "C", false),
    (r"\text{(A)}", r"\text{(B)}", false),
    (r"\text{(E)}", "E", true),
    // Complex numbers.
    ("3+4i", "4i+3", true),
    ("1 - i", "-i + 1", true),
    ("i", "-i", false),
    (r"\sqrt{-4}", "2i", true),
    ("3-4i", "3+4i", false),
    (
        r"\frac{1}{2} + \frac{\sqrt{3}}{2} i",
        r"\frac{1+i\sqrt3}{2}",
        true,
    ),
    // Functions.
    (r"\sin x", r"\sin(x)", true),
    (r"\ln 8", r"3\ln 2", true),
    (r"\log_2 8", "3", true),
    ("e^2", "e^{2}", true),
    (r"\binom{5}{2}", "10", true),
    ("5!", "120", true),
    ("|-3|", "3", true),
    (r"\frac{5!}{3!}", "20", true),
    (r"\cos x", r"\sin x", false),
    (r"\binom{6}{2}", "10", false),
    (r"\tan\frac{\pi}{4}", "1", true),
    (r"\sin^2 x + \cos^2 x", r"\cos^2x+\sin^2x", true),
    // Plus-minus.
    (r"1 \pm \sqrt{2}", r"1+\sqrt2, 1-\sqrt2", true),
    (r"\pm 3", "3, -3", true),
    (r"1\pm\sqrt2", r"1+\sqrt2", false),
    (r"\{1\pm\sqrt{5},-2\}", r"\{-2, 1+\sqrt5, 1-\sqrt5\}", true),
    (r"\{1\pm\sqrt{5},-2\}", r"\{1+\sqrt5, -2\}", false),
    // MATH-500 style answers, each with a wrong neighbour.
    (r"\dfrac{3}{56}", r"\frac{3}{56}", true),
    (r"\frac{3}{57}", r"\frac{3}{56}", false),
    (r"3\sqrt{13}", r"\sqrt{117}", true),
    (r"3\sqrt{13}", r"\sqrt{116}", false),
    ("6-5i", "6 - 5i", true),
    ("6+5i", "6 - 5i", false),
    ("42_8", "52_8", false),
    ("(6,31,-1)", r"\left(6, 31, -1\right)", true),
    ("(6,31,1)", "(6,31,-1)", false),
    (r"\frac{270}{7}\text{ degrees}", r"\frac{270}7", true),
    (r"\frac{270}{7}", r"\frac{270}{8}", false),
    ("5x - 7y + 11z + 4 = 0", "-5x + 7y - 11z - 4 = 0", true),
    ("5x - 7y + 11z + 4 = 0", "5x - 7y + 11z - 4 = 0", false),
    ("y = -2x", "y=-2x", true),
    ("y = 2x", "y=-2x", false),
    ("2k+2", "2(k+1)", true),
    ("2k+1", "2(k+1)", false),
    ("p - q", "-q + p", true),
    ("q - p", "p - q", false),
    ("x^5 - x^4 + x^3 - x^2 + x - 1", "(x-1)(x^4+x^2+1)", true),
    ("x^5 - x^4 + x^3 - x^2 + x + 1", "(x-1)(x^4+x^2+1)", false),
    ("(a+5)(b+2)", "ab + 2a + 5b + 10", true),
    ("(a+5)(b+3)", "ab + 2a + 5b + 10", false),
    (r"\text{east}", r"\text{East}", true),
    (r"\text{west}", r"\text{east}", false),
    (r"\text{ellipse}", "ellipse", true),
    (r"\text{circle}", "ellipse", false),
    (r"\frac{20000}{\pi}", r"20000/\pi", true),
    (r"\frac{2000}{\pi}", r"\frac{20000}{\pi}", false),
    (r"137\frac{1}{2}", "137.5", true),
    (r"137\frac{1}{3}", "137.5", false),
    ("6r^2-4r-24", "2(3r^2-2r-12)", true),
    ("6r^2-4r-25", "2(3r^2-2r-12)", false),
    (r"(0,9) \cup (9,36)", r"(9,36) \cup (0,9)", true),
    (r"(0,9) \cup [9,36)", r"(0,9) \cup (9,36)", false),
    (
        r"\left[ \frac{\pi^2}{8}, \frac{5 \pi^2}{4} \right]",
        r"[\frac{\pi^2}{8}, \frac{5\pi^2}{4}]",
        true,
    ),
    ("8n^2 + 4n + 1", "1 + 4n + 8n^2", true),
    ("8n^2 + 4n", "8n^2 + 4n + 1", false),
    ("3R^2", "3 R^{2}", true),
    ("3R^3", "3R^2", false),
    (r"\frac{\sqrt{21}}{5}", r"\sqrt{\frac{21}{25}}", true),
    (r"\frac{\sqrt{21}}{5}", r"\sqrt{\frac{21}{24}}", false),
    // Integers, exactly.
    ("1000001", "1000000", false),
    ("123456789012345678901", "123456789012345678902", false),
    ("123456789012345678901", "123456789012345678901", true),
    ("18.0", "18", true),
    ("-0", "0", true),
    ("007", "7", true),
    // Infinity.
    (r"\infty", r"\infty", true),
    (r"\infty", r"-\infty", false),
    ("1e308", r"\infty", false),
    // Garbage and empty answers.
    ("", "5", false),
    ("   ", "5", false),
    (r"\frac{", "5", false),
    ("5 or 6", "5", false),
    ("x", "5", false),
    ("5x", "5", false),
    ("(5", "5", false),
    // Hedges are lists (or unreadable), never a unit after the right value.
    (r"5 \text{ or 6}", "5", false),
    (r"5 \text{ or maybe } 6", "5", false),
    (r"5 \text{ cm } 6", "5", false),
    (r"\text{(C) or (D)}", "C", false),
    (r"\text{C, D}", "C", false),
    ("5, 5", "5", false),
];

/// Rows that must hold with prediction and reference swapped as well.
fn symmetric(pred: &str, gold: &str) -> bool {
    let decimal = |s: &str| s.contains('.') && !s.contains('\\');
    // A decimal reference accepts exact predictions that round to it, not the reverse.
    !(decimal(gold) || decimal(pred) || pred.trim().is_empty())
}

fn boxed(pred: &str) -> String {
    format!("So the final answer is \\boxed{{{pred}}}.")
}

#[test]
fn math_table_is_large_and_graded_as_listed() {
    let mut failures = Vec::new();
    let mut graded = 0;
    for &(pred, gold, want) in MATH_CASES {
        let got = Math500Reward::new().score(&boxed(pred), gold).unwrap() == 1.0;
        graded += 1;
        if got != want {
            failures.push(format!("{pred:?} vs {gold:?}: want {want}, got {got}"));
        }
        if symmetric(pred, gold) {
            graded += 1;
            let back = math_equiv(gold, pred);
            if back != want {
                failures.push(format!("(swapped) {gold:?} vs {pred:?}: want {want}"));
            }
        }
    }
    assert!(MATH_CASES.len() >= 300, "{} rows", MATH_CASES.len());
    assert!(graded >= 500, "{graded} graded cases");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `(completion, reference, expected)`: where the answer is found in a MATH completion.
const MATH_COMPLETIONS: &[(&str, &str, bool)] = &[
    ("The answer is $2$.", "2", true),
    ("Answer: $2$", "2", true),
    ("Answer: $3$", "2", false),
    ("The final answer is $\\boxed{2}$", "2", true),
    (
        "Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.",
        "0.5",
        true,
    ),
    ("so \\boxed{3} ... wait, actually \\boxed{4}", "4", true),
    ("so \\boxed{3} ... wait, actually \\boxed{4}", "3", false),
    ("the answer is 7", "7", true),
    ("the answer is 7.5.", "7.5", true),
    ("The answer is \\(\\sqrt{2}\\).", "\\sqrt2", true),
    ("no answer here", "7", false),
    ("\\boxed{}", "7", false),
    ("<answer>\\frac{1}{2}</answer>", "0.5", true),
    ("<answer>\\frac{1}{3}</answer>", "0.5", false),
    ("**Answer:** $12$", "12", true),
    ("$\\boxed{x = 5}$", "5", true),
    ("The answer is $2$ or $3$.", "3", false),
];

#[test]
fn math_completions_find_the_final_answer() {
    for &(c, gold, want) in MATH_COMPLETIONS {
        let got = Math500Reward::new().score(c, gold).unwrap() == 1.0;
        assert_eq!(got, want, "{c:?} vs {gold:?}");
    }
}

/// `(completion, reference, strict, flexible)`.
const GSM8K_CASES: &[(&str, &str, bool, bool)] = &[
    ("#### 100 dollars", "100", true, true),
    ("#### **540**", "540", true, true),
    ("The total is \\boxed{7}.", "7", true, true),
    ("So the answer is 2304.", "2304", false, true),
    ("#### $1,000.", "1000", true, true),
    ("<answer>18 dollars</answer>", "18", true, true),
    ("<answer>17 or 18</answer>", "18", false, true),
    ("<answer>18 or 17</answer>", "18", false, false),
    ("#### 17", "18", false, false),
    ("#### 18.0", "18", true, true),
    ("#### 18.5", "18", false, false),
    ("The answer is **42**.", "42", false, true),
    ("Answer: 12", "12", false, true),
    ("#### -5", "-5", true, true),
    ("#### 5", "-5", false, false),
    ("#### \\frac{7}{2}", "3.5", true, true),
    ("#### 7/2", "3.5", true, true),
    ("#### 1,234,567", "1234567", true, true),
    ("#### 1234567", "1234568", false, false),
    ("#### 10%", "10", true, true),
    ("#### 3 + 4 = 7", "7", true, true),
    ("#### 3 + 4 = 7", "3", false, false),
    ("<answer>\\boxed{\\$18}</answer>", "18", true, true),
    ("#### eighteen", "18", false, false),
    ("I think 18.", "18", false, true),
    ("#### 1000001", "1000000", false, false),
    (
        "She pays $\\$12.50$ in total.\n#### 12.5",
        "12.5",
        true,
        true,
    ),
    ("\\boxed{540} dollars", "540", true, true),
    ("Answer: \\boxed{54}, not 45", "54", true, true),
    ("The answer is 60 minutes.", "60", false, true),
    ("The answer is 61 minutes.", "60", false, false),
    ("#### 2,304", "#### 2,304", true, true),
    ("", "5", false, false),
];

#[test]
fn gsm8k_table() {
    for &(c, gold, strict, flexible) in GSM8K_CASES {
        let s = Gsm8kReward::strict().score(c, gold).unwrap() == 1.0;
        let f = Gsm8kReward::flexible().score(c, gold).unwrap() == 1.0;
        assert_eq!((s, f), (strict, flexible), "{c:?} vs {gold:?}");
    }
}

#[test]
fn explain_says_what_was_read_and_why() {
    let e = explain("math", "so \\boxed{\\sqrt{452}}", "2\\sqrt{113}").unwrap();
    assert_eq!(e.score, 1.0);
    assert_eq!(e.extracted.as_deref(), Some("\\sqrt{452}"));
    let text = e.to_string();
    assert!(
        text.contains("Boxed") && text.contains("equal values"),
        "{text}"
    );
    let e = explain("gsm8k", "#### 17", "18").unwrap();
    assert_eq!(e.score, 0.0);
    assert_eq!(e.reason, "different numbers");
    let e = explain("gsm8k_flexible", "so the answer is 18.", "18").unwrap();
    assert_eq!((e.score, e.source.as_str()), (1.0, "Phrase"));
    let e = explain("math", "nothing", "3").unwrap();
    assert_eq!(e.extracted, None);
    assert!(explain("nope", "", "").is_err());
    let e = explain("gsm8k", "#### 1", "not a number").unwrap();
    assert!(e.reason.contains("not a number"), "{}", e.reason);
}
