//! A LaTeX answer parser and an equivalence test, in the spirit of math-verify but without
//! a computer algebra system: answers become [`Expr`] trees that are compared structurally
//! (tuples, intervals, sets, matrices, equations, choice letters, text) and numerically
//! (exact rationals where possible, complex floating point otherwise, random points for
//! expressions with variables).
//!
//! Every step is bounded: answers longer than [`MAX_ANSWER_LEN`] bytes are not parsed, the
//! parser's nesting is bounded by [`MAX_DEPTH`], and each pass over the input or the
//! tree is linear, so no answer can crash or stall the trainer.

mod commands;
mod equiv;
mod eval;
mod expr;
mod lexer;
mod parser;
mod words;

pub use equiv::{equivalent, Equivalence};
pub use expr::{Constant, Expr, Func, Rel};

/// The deepest nesting (brackets, fractions, roots, exponents, chains such as `a^b^c`) an
/// answer may have; deeper answers are unparsable, so no input can exhaust the stack.
pub const MAX_DEPTH: usize = parser::MAX_DEPTH;

/// The longest answer (in bytes, after extraction) that is parsed. MATH-500's longest
/// reference answers are matrices of ~200 bytes; anything far longer is not a final answer.
pub const MAX_ANSWER_LEN: usize = 2000;

/// Why an answer could not be parsed. Such an answer is graded wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParseError {
    #[error("empty answer")]
    Empty,
    #[error("answer of {0} bytes is longer than the {MAX_ANSWER_LEN} bytes parsed")]
    TooLong(usize),
    #[error("answer nested deeper than {} levels", parser::MAX_DEPTH)]
    TooDeep,
    #[error("unexpected {0}")]
    Unexpected(String),
    #[error("unbalanced {0}")]
    Unbalanced(&'static str),
    #[error("unknown command \\{0}")]
    UnknownCommand(String),
}

/// Parses one final answer (the content of a `\boxed{}`, a `####` line, ...) into an
/// [`Expr`]. Never panics; time and stack use are linear in the (bounded) input.
pub fn parse_answer(src: &str) -> Result<Expr, ParseError> {
    if src.len() > MAX_ANSWER_LEN {
        return Err(ParseError::TooLong(src.len()));
    }
    let toks = lexer::lex(src)?;
    if toks.is_empty() {
        return Err(ParseError::Empty);
    }
    if let Some(text) = words_only(&toks) {
        return Ok(text);
    }
    parser::Parser::new(toks).answer()
}

/// An answer made only of words (`\text{Evelyn}`, `odd`, `\text{(C)}`, `no solution`) as a
/// [`Expr::Choice`] or [`Expr::Text`]; `None` when there is any mathematics in it.
fn words_only(toks: &[lexer::Tok]) -> Option<Expr> {
    use lexer::Tok;
    let mut parts = Vec::new();
    let mut prose = false;
    for t in toks {
        match t {
            Tok::Text(s) => {
                prose = true;
                parts.push(s.as_str());
            }
            Tok::Word(w) => {
                if words::function(w).is_some() || words::is_constant_word(w) {
                    return None;
                }
                prose |= w.len() >= 3;
                parts.push(w.as_str());
            }
            Tok::Sym('{' | '}') => {}
            _ => return None,
        }
    }
    if !prose {
        return None;
    }
    let joined = parts.join(" ");
    if let Some(c) = words::choice_letter(&joined) {
        return Some(Expr::Choice(c));
    }
    let key = words::text_key(&joined);
    if key.chars().all(|c| c.is_ascii_digit()) {
        // `\text{5}`: a number, for the parser.
        return None;
    }
    Some(Expr::Text(key))
}

/// The real value of a constant answer: exact for rationals, floating point otherwise;
/// `None` for answers with variables, non-real or non-finite values, and non-numbers.
pub fn value(e: &Expr) -> Option<f64> {
    if !e.is_scalar() || e.has_vars() {
        return None;
    }
    if let Some(r) = eval::exact(e) {
        return Some(r.to_f64()).filter(|v| v.is_finite());
    }
    let c = eval::complex(e, &[]);
    (c.is_finite() && c.im == 0.0).then_some(c.re)
}

/// An exact rational, for the GSM8K comparison of decimal numbers.
pub(crate) use eval::Ratio;
