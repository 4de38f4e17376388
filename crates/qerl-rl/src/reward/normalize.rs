//! Text normalisation of MATH answers (the Hendrycks grader's rules), kept as a public helper
//! for callers that want canonical text. Grading no longer uses it: its rules (cut at
//! `\text{ `, drop units by pattern) accept hedges such as `5 \text{ or 6}`.

use std::sync::LazyLock;

use regex::Regex;

use super::latex::MAX_ANSWER_LEN;
use super::math::{last_boxed, matching_brace};

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
///
/// Inputs longer than [`MAX_ANSWER_LEN`] bytes are returned trimmed, not normalised (the
/// rules are quadratic in the worst case).
pub fn normalize_math_answer(s: &str) -> String {
    let mut s = s.trim().to_string();
    if s.len() > MAX_ANSWER_LEN {
        return s;
    }
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
