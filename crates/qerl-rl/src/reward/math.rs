//! MATH-style answers: `\boxed{…}` extraction, LaTeX normalisation and equivalence.
//!
//! The normalisation follows the spirit of the Hendrycks MATH grader (`is_equiv` on stripped
//! strings), extended with a numeric comparison so that `\frac{1}{2}`, `\dfrac12`, `1/2` and
//! `0.5` are one answer, and an element-wise comparison of tuples and intervals.

use std::sync::LazyLock;

use regex::Regex;

use super::extract::numbers_equal;

/// Content of the **last** `\boxed{…}` (or `\fbox{…}`) in `text`, with nested braces, trimmed.
/// Also reads the brace-less form `\boxed 5`. `None` when there is none, or when the last one
/// is never closed.
pub fn last_boxed(text: &str) -> Option<&str> {
    let (idx, name_len) = [
        text.rfind("\\boxed").map(|i| (i, "\\boxed".len())),
        text.rfind("\\fbox").map(|i| (i, "\\fbox".len())),
    ]
    .into_iter()
    .flatten()
    .max_by_key(|&(i, _)| i)?;
    let rest = &text[idx + name_len..];
    let trimmed = rest.trim_start();
    if trimmed.starts_with('{') {
        let open = text.len() - trimmed.len();
        let close = matching_brace(text, open)?;
        return Some(text[open + 1..close].trim());
    }
    if rest.starts_with(' ') {
        let end = trimmed
            .find(|c: char| c.is_whitespace() || c == '$')
            .unwrap_or(trimmed.len());
        let v = &trimmed[..end];
        return (!v.is_empty()).then_some(v);
    }
    None
}

/// Index of the `}` that closes the `{` at byte `open` of `s`; escaped braces (`\{`, `\}`) do not
/// count.
fn matching_brace(s: &str, open: usize) -> Option<usize> {
    let bytes = s.as_bytes();
    debug_assert_eq!(bytes[open], b'{');
    let mut depth = 0usize;
    let mut i = open;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 1, // skip the escaped character
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Replaces every `\cmd{X}` by `X` (brace-matched); an unclosed one is left as it is.
fn unwrap_command(s: &str, cmd: &str) -> String {
    let pat = format!("\\{cmd}{{");
    let mut out = s.to_string();
    let mut from = 0;
    while let Some(pos) = out[from..].find(&pat).map(|p| p + from) {
        let open = pos + pat.len() - 1;
        let Some(close) = matching_brace(&out, open) else {
            break;
        };
        let inner = out[open + 1..close].to_string();
        out.replace_range(pos..=close, &inner);
        from = pos;
    }
    out
}

/// Removes `\left` / `\right` (but not `\rightarrow`, `\leftarrow`, ...).
fn strip_left_right(s: &str) -> String {
    static LR: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"\\(?:left|right)([^a-zA-Z]|$)").unwrap());
    LR.replace_all(s, "$1").into_owned()
}

/// `\frac12` → `\frac{1}{2}`, `\frac1{x}` → `\frac{1}{x}`: single-character arguments braced.
fn fix_fracs(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    let mut rest = s;
    while let Some(pos) = rest.find("\\frac") {
        out.push_str(&rest[..pos + "\\frac".len()]);
        rest = &rest[pos + "\\frac".len()..];
        for _ in 0..2 {
            if rest.starts_with('{') {
                match matching_brace(rest, 0) {
                    Some(close) => {
                        out.push_str(&rest[..=close]);
                        rest = &rest[close + 1..];
                    }
                    None => break,
                }
            } else if let Some(c) = rest.chars().next() {
                if c == '\\' {
                    break; // `\frac\pi2` and the like: leave as written
                }
                out.push('{');
                out.push(c);
                out.push('}');
                rest = &rest[c.len_utf8()..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `\sqrt3` → `\sqrt{3}`.
fn fix_sqrt(s: &str) -> String {
    static SQRT: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\\sqrt([0-9a-zA-Z])").unwrap());
    SQRT.replace_all(s, "\\sqrt{$1}").into_owned()
}

static UNITS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^(.*[0-9}])\s*(?:square|cubic)?\s*(?:units?|cm|mm|km|m|meters?|metres?|centimeters?|kilometers?|inch(?:es)?|in|feet|foot|ft|yards?|miles?|mph|seconds?|sec|minutes?|min|hours?|hrs?|days?|weeks?|months?|years?|degrees?|deg|dollars?|cents?|pounds?|lbs?|ounces?|oz|grams?|g|kg|kilograms?|liters?|litres?|L|ml|gallons?|people|students?|ways|sq)(?:\^\{?[23]\}?)?$",
    )
    .unwrap()
});

static THOUSANDS: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?$").unwrap());
static INT_FRACTION: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(-?[0-9]+)/([0-9]+)$").unwrap());

/// Canonical text of a MATH answer, so that equal answers written differently compare equal:
///
/// * the content of a `\boxed{…}` if there is one;
/// * spacing commands (`\!`, `\,`, `\;`, `\quad`, `\displaystyle`) and all whitespace removed;
/// * `\dfrac`/`\tfrac` → `\frac`, `\frac12` → `\frac{1}{2}`, `\sqrt3` → `\sqrt{3}`, `a/b` →
///   `\frac{a}{b}` for integers;
/// * `\left`/`\right`, `^\circ`/`^{\circ}`/`°`, `$`, `%` removed;
/// * `\text{…}`, `\textbf{…}`, `\mbox{…}`, `\mathrm{…}` unwrapped, and units after a number
///   dropped (`5\text{ cm}`, `12 inches`, `3\text{ cm}^2`);
/// * `x = 5` → `5` (a short left-hand side), `.5` → `0.5`, trailing periods dropped,
///   thousands separators removed (`1,000` and `1{,}000` → `1000`).
pub fn normalize_math_answer(s: &str) -> String {
    let mut s = s.trim().to_string();
    if let Some(inner) = last_boxed(&s) {
        s = inner.to_string();
    }
    for (from, to) in [
        ("\n", " "),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\qquad", ""),
        ("\\quad", ""),
        ("\\displaystyle", ""),
        ("\\\\", "\\"),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("°", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\%", ""),
        ("%", ""),
        ("{,}", ","),
    ] {
        s = s.replace(from, to);
    }
    s = strip_left_right(&s);
    // "5 \text{ cm}": a `\text{ ` with a leading space is a unit (Hendrycks' grader rule).
    if let Some(pos) = s.find("\\text{ ") {
        if pos > 0 {
            s.truncate(pos);
        }
    }
    for cmd in [
        "text",
        "textbf",
        "textit",
        "mbox",
        "mathrm",
        "mathbf",
        "textnormal",
    ] {
        s = unwrap_command(&s, cmd);
    }
    // "x = 5", "k=5": keep the right-hand side of a single equation with a short left side.
    if s.matches('=').count() == 1 {
        let (lhs, rhs) = s.split_once('=').unwrap();
        if lhs.trim().chars().count() <= 2 {
            s = rhs.to_string();
        }
    }
    s = s.replace(" .", " 0.").replace("{.", "{0.");
    s = fix_sqrt(s.trim());
    s.retain(|c| !c.is_whitespace());
    s = fix_fracs(&s);
    if s.starts_with('.') {
        s.insert(0, '0');
    }
    if let Some(c) = UNITS.captures(&s) {
        s = c[1].to_string();
    }
    while s.ends_with('.') {
        s.pop();
    }
    if THOUSANDS.is_match(&s) {
        s.retain(|c| c != ',');
    }
    if let Some(c) = INT_FRACTION.captures(&s) {
        s = format!("\\frac{{{}}}{{{}}}", &c[1], &c[2]);
    }
    s
}

static DECIMAL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)$").unwrap());

/// The value of a normalised answer that is a plain number: a decimal, `\frac{a}{b}` (nested
/// allowed), with an optional sign. `None` for anything symbolic (`\sqrt{2}`, `\pi`, `x+1`).
pub fn parse_math_number(s: &str) -> Option<f64> {
    let s = s.strip_prefix('+').unwrap_or(s);
    if let Some(rest) = s.strip_prefix('-') {
        return parse_math_number(rest).map(|v| -v);
    }
    if DECIMAL.is_match(s) {
        return s.parse().ok();
    }
    if let Some(rest) = s.strip_prefix("\\frac{") {
        let rest_start = s.len() - rest.len() - 1;
        let close1 = matching_brace(s, rest_start)?;
        let after = &s[close1 + 1..];
        if !after.starts_with('{') {
            return None;
        }
        let open2 = close1 + 1;
        let close2 = matching_brace(s, open2)?;
        if close2 != s.len() - 1 {
            return None;
        }
        let num = parse_math_number(&s[rest_start + 1..close1])?;
        let den = parse_math_number(&s[open2 + 1..close2])?;
        return (den != 0.0).then(|| num / den);
    }
    None
}

/// Splits at commas that are not inside brackets or braces.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn equiv_normalized(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    if let (Some(x), Some(y)) = (parse_math_number(a), parse_math_number(b)) {
        return numbers_equal(x, y);
    }
    // Tuples and intervals: same brackets, same arity, equal elements.
    let brackets = |s: &str| match (s.chars().next(), s.chars().last()) {
        (Some(o @ ('(' | '[')), Some(c @ (')' | ']'))) if s.len() >= 2 => Some((o, c)),
        _ => None,
    };
    let (a_in, b_in) = match (brackets(a), brackets(b)) {
        (Some(x), Some(y)) if x == y => (&a[1..a.len() - 1], &b[1..b.len() - 1]),
        (None, None) => (a, b),
        _ => return false,
    };
    let (pa, pb) = (split_top_level(a_in), split_top_level(b_in));
    if pa.len() < 2 || pa.len() != pb.len() {
        return false;
    }
    pa.iter().zip(&pb).all(|(x, y)| equiv_normalized(x, y))
}

/// Whether a predicted answer and a reference answer are the same after
/// [`normalize_math_answer`]: equal text, equal numbers, or equal tuples element by element.
/// An empty prediction is never right.
pub fn math_equiv(pred: &str, reference: &str) -> bool {
    let (a, b) = (
        normalize_math_answer(pred),
        normalize_math_answer(reference),
    );
    !a.is_empty() && equiv_normalized(&a, &b)
}
