//! Answer extraction for numeric answers (GSM8K style) and the `<answer>` tag.

use std::sync::LazyLock;

use regex::Regex;

/// Trimmed content of the **last** `<answer>…</answer>` pair, if the text has one.
///
/// The last pair wins because models often restate the format instruction (with an empty or
/// placeholder answer) before answering. An opening tag without a closing tag is no answer.
pub fn extract_answer_tag(text: &str) -> Option<&str> {
    let start = text.rfind("<answer>")? + "<answer>".len();
    let rest = &text[start..];
    let end = rest.find("</answer>")?;
    Some(rest[..end].trim())
}

/// The rest of the line after the **last** `####` marker (GSM8K's answer marker), trimmed;
/// `None` when there is no marker or nothing follows it.
pub fn extract_hash_answer(text: &str) -> Option<&str> {
    let start = text.rfind("####")? + "####".len();
    let line = text[start..].lines().next().unwrap_or("").trim();
    (!line.is_empty()).then_some(line)
}

/// Removes what surrounds a number in free text: thousands separators, `$` and `%` (also their
/// LaTeX escapes `\$`, `\%`), all whitespace and trailing periods. `"$1,000. "` → `"1000"`.
pub fn normalize_number_text(s: &str) -> String {
    let s = s.replace("\\$", "").replace("\\%", "");
    let mut t: String = s
        .chars()
        .filter(|c| !matches!(c, ',' | '$' | '%') && !c.is_whitespace())
        .collect();
    while t.ends_with('.') {
        t.pop();
    }
    t
}

static PLAIN_NUMBER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)$").unwrap());

/// A number written as decimal text, or a simple fraction `a/b`, after
/// [`normalize_number_text`]. `None` for anything else (words, expressions, `inf`, `NaN`).
pub fn parse_number(s: &str) -> Option<f64> {
    let t = normalize_number_text(s);
    if PLAIN_NUMBER.is_match(&t) {
        // 309 digits overflow to infinity: not a number anyone can grade.
        return t.parse().ok().filter(|v: &f64| v.is_finite());
    }
    let (num, den) = t.split_once('/')?;
    if !PLAIN_NUMBER.is_match(num) || !PLAIN_NUMBER.is_match(den) {
        return None;
    }
    let (num, den): (f64, f64) = (num.parse().ok()?, den.parse().ok()?);
    Some(num / den).filter(|v| v.is_finite())
}

/// Whether two numbers are the same answer: equal up to a relative 1e-6 (so `18 == 18.0` and
/// `0.1 + 0.2 == 0.3`, but `1000 != 1001`). Infinities and NaN equal nothing (a number too
/// large for `f64` must not match every other such number, nor pass `inf <= inf`).
pub fn numbers_equal(a: f64, b: f64) -> bool {
    a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
}

static ANY_NUMBER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+").unwrap());

/// The last number in free text (GSM8K "flexible" extraction), normalised: `"so 1,000."` →
/// `"1000"`. A number directly followed by `/digits` is read as a fraction (`"7/2"`).
pub fn last_number(text: &str) -> Option<String> {
    let m = ANY_NUMBER.find_iter(text).last()?;
    let mut s = normalize_number_text(m.as_str());
    // "7/2": the regex stops at '/', so look back for "a/" before the match.
    let before = &text[..m.start()];
    if let Some(prefix) = before.strip_suffix('/') {
        if let Some(num) = ANY_NUMBER.find_iter(prefix).last() {
            if num.end() == prefix.len() {
                s = format!("{}/{}", normalize_number_text(num.as_str()), s);
            }
        }
    }
    (!s.is_empty() && s != "-").then_some(s)
}

/// The final answer of a GSM8K reference: the text after `####` in a full solution, or the whole
/// text when it has no marker (an already-extracted answer), normalised with
/// [`normalize_number_text`]. `None` when that is empty.
pub fn gsm8k_reference_answer(solution: &str) -> Option<String> {
    let raw = extract_hash_answer(solution).unwrap_or(solution);
    let t = normalize_number_text(raw);
    (!t.is_empty()).then_some(t)
}
