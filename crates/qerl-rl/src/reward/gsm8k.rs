//! GSM8K answers: one number, however it is dressed.
//!
//! A candidate answer (what follows `####`, an `<answer>` tag, a `\boxed{}`) counts when it
//! holds exactly **one** number once markup is removed: bold (`**540**`), `$` and `\$`,
//! thousands separators, `\text{}` units (`100 dollars`), a trailing period or words. Two
//! numbers (`17 or 18`, `between 5 and 6`) are no answer, so hedging never pays. Numbers
//! compare exactly as decimals or fractions; a number too large for `f64` equals nothing.

use std::sync::LazyLock;

use regex::Regex;

use super::extract::{extract_answer_tag, extract_hash_answer, last_number};
use super::latex::Ratio;
use super::math::{answer_after_phrase, last_boxed};

/// A number as written in a GSM8K answer: a decimal or a fraction `a/b`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GsmNumber {
    exact: Option<Ratio>,
    approx: f64,
}

impl GsmNumber {
    /// Reads `"1,000"`, `"-3.5"`, `".5"`, `"7/2"` (spaces and commas ignored).
    pub fn parse(text: &str) -> Option<Self> {
        let t: String = text
            .chars()
            .filter(|c| *c != ',' && !c.is_whitespace())
            .collect();
        let (neg, body) = match t.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, t.strip_prefix('+').unwrap_or(&t)),
        };
        let (num, den) = body.split_once('/').unwrap_or((body, "1"));
        let decimal = |s: &str| {
            let s = if s.starts_with('.') {
                format!("0{s}")
            } else {
                s.to_string()
            };
            let ok = !s.is_empty()
                && s.chars().all(|c| c.is_ascii_digit() || c == '.')
                && s.matches('.').count() <= 1
                && !s.ends_with('.');
            ok.then_some(s)
        };
        let (num, den) = (decimal(num)?, decimal(den)?);
        let (n, d): (f64, f64) = (num.parse().ok()?, den.parse().ok()?);
        if d == 0.0 {
            return None;
        }
        let sign = if neg { -1.0 } else { 1.0 };
        let exact = Ratio::from_decimal(&num)
            .zip(Ratio::from_decimal(&den))
            .and_then(|(a, b)| a.div(b))
            .and_then(|r| if neg { r.neg() } else { Some(r) });
        Some(Self {
            exact,
            approx: sign * n / d,
        })
    }

    /// The value as `f64` (possibly infinite for absurdly long numbers).
    pub fn value(&self) -> f64 {
        self.approx
    }

    /// Whether two numbers are the same answer: exactly equal when both are exact, else equal
    /// to a relative 1e-9; never when either is not finite.
    pub fn same(&self, other: &Self) -> bool {
        if let (Some(a), Some(b)) = (self.exact, other.exact) {
            return a == b;
        }
        let (a, b) = (self.approx, other.approx);
        a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }
}

static NUMBER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:\s*/\s*[0-9]+(?:\.[0-9]+)?)?|-?\.[0-9]+",
    )
    .expect("valid pattern")
});

/// Removes the markup around a number: bold and italics, `$`, `\$`, `\(` `\)`, `\text{…}`,
/// `\boxed{…}`, spacing commands and `{,}`; `\frac{a}{b}` becomes `a/b`.
fn strip_markup(candidate: &str) -> String {
    let mut s = candidate.to_string();
    for (from, to) in [
        ("{,}", ","),
        ("\\,", ""),
        ("\\!", ""),
        ("\\$", " "),
        ("\\%", " "),
        ("\\(", " "),
        ("\\)", " "),
        ("\\[", " "),
        ("\\]", " "),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
    ] {
        s = s.replace(from, to);
    }
    // `\frac{a}{b}` with plain numbers → `a/b`.
    static FRAC: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"\\frac\{\s*(-?[0-9.,]+)\s*\}\{\s*([0-9.,]+)\s*\}").expect("valid pattern")
    });
    s = FRAC.replace_all(&s, "$1/$2").into_owned();
    s.chars()
        .map(|c| match c {
            '*' | '_' | '$' | '{' | '}' | '%' | '\\' => ' ',
            other => other,
        })
        .collect()
}

/// The only number of an answer candidate (after the last `=` if there is one), with its
/// spelling; `None` when it holds no number or more than one.
pub fn single_number(candidate: &str) -> Option<(String, GsmNumber)> {
    let clean = strip_markup(candidate);
    let tail = match clean.rfind('=') {
        Some(i) if NUMBER.is_match(&clean[i + 1..]) => &clean[i + 1..],
        _ => clean.as_str(),
    };
    let mut found = NUMBER.find_iter(tail);
    let m = found.next()?;
    if found.next().is_some() {
        return None;
    }
    // A number glued to letters (`x2`, `3x`) is not a plain number.
    let glued = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphabetic());
    if glued(tail[..m.start()].chars().last()) {
        return None;
    }
    let text: String = m
        .as_str()
        .chars()
        .filter(|c| *c != ',' && !c.is_whitespace())
        .collect();
    let n = GsmNumber::parse(&text)?;
    Some((text, n))
}

/// The first number of a text (for "the answer is 18 dollars, ...").
fn first_number(text: &str) -> Option<(String, GsmNumber)> {
    let clean = strip_markup(text);
    let m = NUMBER.find(&clean)?;
    let t: String = m
        .as_str()
        .chars()
        .filter(|c| *c != ',' && !c.is_whitespace())
        .collect();
    let n = GsmNumber::parse(&t)?;
    Some((t, n))
}

/// The strict candidate: the last `<answer>` tag (a `####` or `\boxed{}` inside it is
/// honoured), else the rest of the line after the last `####`, else the last `\boxed{}`.
pub fn strict_candidate(completion: &str) -> Option<&str> {
    if let Some(mut cand) = extract_answer_tag(completion) {
        if let Some(after) = extract_hash_answer(cand) {
            cand = after;
        }
        return Some(last_boxed(cand).unwrap_or(cand));
    }
    if let Some(line) = extract_hash_answer(completion) {
        return Some(last_boxed(line).unwrap_or(line));
    }
    last_boxed(completion)
}

/// Where the flexible verdict found its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlexibleSource {
    Boxed,
    Phrase,
    Marker,
    LastNumber,
}

/// The flexible answer: the last `\boxed{}` holding one number, else the first number after
/// the last "the answer is" / "Answer:", else the strict candidate, else the last number of
/// the text.
pub fn flexible_number(completion: &str) -> Option<(String, GsmNumber, FlexibleSource)> {
    if let Some(n) = last_boxed(completion).and_then(single_number) {
        return Some((n.0, n.1, FlexibleSource::Boxed));
    }
    if let Some(n) = answer_after_phrase(completion).and_then(first_number) {
        return Some((n.0, n.1, FlexibleSource::Phrase));
    }
    if let Some(n) = strict_candidate(completion).and_then(single_number) {
        return Some((n.0, n.1, FlexibleSource::Marker));
    }
    let text = last_number(completion)?;
    let n = GsmNumber::parse(&text)?;
    Some((text, n, FlexibleSource::LastNumber))
}
