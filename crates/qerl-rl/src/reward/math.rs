//! MATH-style answers: extraction (`\boxed{…}`, `<answer>`, "the answer is …") and grading
//! with the [`super::latex`] parser.
//!
//! An answer is parsed into an expression and compared structurally and numerically
//! ([`super::latex::equivalent`]). An answer that cannot be parsed is wrong unless it is the
//! reference as written; an empty or missing answer is always wrong.

use super::extract::extract_answer_tag;
use super::latex::{equivalent, parse_answer, Expr, ParseError, MAX_ANSWER_LEN};

/// Content of the **last** `\boxed{…}` (or `\fbox{…}`) in `text`, with nested braces, trimmed.
/// Also reads the brace-less form `\boxed 5`. `None` when there is none, or when the last one
/// is never closed. Linear in the length of `text`.
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
/// count. `None` when `open` is not a `{` or the brace is never closed.
pub(crate) fn matching_brace(s: &str, open: usize) -> Option<usize> {
    let bytes = s.as_bytes();
    if bytes.get(open) != Some(&b'{') {
        return None;
    }
    let mut depth = 0usize;
    let mut i = open;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 1, // skip the escaped character
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
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

/// Where a MATH answer was found in a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerSource {
    /// The last `\boxed{…}`.
    Boxed,
    /// The last `<answer>…</answer>` (a box inside it is unwrapped).
    AnswerTag,
    /// After the last "the answer is" / "Answer:" phrase.
    Phrase,
}

/// The final answer of a MATH completion and where it was found: the last `\boxed{…}`, else
/// the last `<answer>` tag, else what follows the last "answer is" / "answer:" phrase (math
/// in `$…$`, `\(…\)`, `\[…\]`, or the rest of the sentence).
pub fn extract_math_answer(completion: &str) -> Option<(&str, AnswerSource)> {
    if let Some(b) = last_boxed(completion) {
        return Some((b, AnswerSource::Boxed));
    }
    if let Some(tag) = extract_answer_tag(completion) {
        return Some((last_boxed(tag).unwrap_or(tag), AnswerSource::AnswerTag));
    }
    answer_after_phrase(completion).map(|a| (a, AnswerSource::Phrase))
}

/// Phrases that announce a final answer, lower case.
const ANSWER_PHRASES: &[&str] = &["answer is", "answer:", "answer is:"];

/// What follows the last answer phrase: the first math span, else the rest of the sentence.
pub fn answer_after_phrase(text: &str) -> Option<&str> {
    let lower = text.to_ascii_lowercase(); // ASCII lower-casing keeps byte offsets
    let at = ANSWER_PHRASES
        .iter()
        .filter_map(|p| lower.rfind(p).map(|i| i + p.len()))
        .max()?;
    let rest = text[at..].trim_start_matches(|c: char| c.is_whitespace() || c == '*' || c == ':');
    for (open, close) in [("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")] {
        // An unclosed `$` is a currency sign (`The answer is $18.`): read on as a sentence.
        if let Some(end) = rest.strip_prefix(open).and_then(|inner| inner.find(close)) {
            let v = rest[open.len()..open.len() + end].trim();
            return (!v.is_empty()).then_some(v);
        }
    }
    let line = rest.lines().next().unwrap_or("");
    // The sentence ends at a full stop followed by a space (not the point of `2.5`).
    let end = line
        .char_indices()
        .find(|&(i, c)| c == '.' && line[i + 1..].chars().next().is_none_or(char::is_whitespace))
        .map_or(line.len(), |(i, _)| i);
    let v = line[..end].trim().trim_end_matches('*').trim();
    (!v.is_empty()).then_some(v)
}

/// The value of an answer that is a plain number: a decimal or `\frac{a}{b}` (nested
/// allowed), with optional signs. `None` for anything symbolic (`\sqrt{2}`, `\pi`, `x+1`),
/// for division by zero and for numbers too large for `f64`. Never recursive on its input.
pub fn parse_math_number(s: &str) -> Option<f64> {
    fn plain(e: &Expr) -> bool {
        let mut ok = true;
        e.visit(&mut |n| ok &= matches!(n, Expr::Num(_) | Expr::Neg(_) | Expr::Div(..)));
        ok
    }
    let e = parse_answer(s).ok()?;
    if !plain(&e) {
        return None;
    }
    super::latex::value(&e).filter(|v| v.is_finite())
}

/// A MATH answer graded against a reference, with what was parsed and why it matched or not.
#[derive(Debug, Clone, PartialEq)]
pub struct MathGrade {
    /// The prediction as parsed (or why it could not be).
    pub pred: Result<Expr, ParseError>,
    /// The reference as parsed (or why it could not be).
    pub reference: Result<Expr, ParseError>,
    pub equal: bool,
    /// The rule that decided.
    pub reason: &'static str,
}

/// Grades a predicted final answer against a reference answer (both already extracted).
pub fn grade_math(pred: &str, reference: &str) -> MathGrade {
    let (p, r) = (pred.trim(), reference.trim());
    let parsed = (parse_answer(p), parse_answer(r));
    let (equal, reason) = if p.is_empty() {
        (false, "empty answer")
    } else {
        match &parsed {
            (Ok(a), Ok(b)) => {
                let v = equivalent(a, b);
                (v.equal, v.reason)
            }
            _ if p.len() > MAX_ANSWER_LEN => (false, "answer too long"),
            // Unparsable input is wrong, unless it is the reference character for character
            // (spaces aside): normalising text by rules (as the Hendrycks grader does) would
            // let hedges such as `5 \text{ or 6}` through.
            _ => {
                let squeeze = |s: &str| s.split_whitespace().collect::<String>();
                (squeeze(p) == squeeze(r), "unparsable: compared as written")
            }
        }
    };
    MathGrade {
        pred: parsed.0,
        reference: parsed.1,
        equal,
        reason,
    }
}

/// Whether a predicted answer and a reference answer are the same (see [`grade_math`]).
/// An empty prediction is never right; neither side panics or hangs on any input.
pub fn math_equiv(pred: &str, reference: &str) -> bool {
    grade_math(pred, reference).equal
}
