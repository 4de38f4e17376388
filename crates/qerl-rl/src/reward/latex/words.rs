//! Words in answers: function names, units, choice letters and textual answers.

use super::expr::{Constant, Expr, Func};

/// A function by its name (`sin`, `arctan`, `ln`, ...), spelled as a command or a bare word.
pub(crate) fn function(name: &str) -> Option<Func> {
    Some(match name {
        "sqrt" => Func::Sqrt,
        "sin" => Func::Sin,
        "cos" => Func::Cos,
        "tan" | "tg" => Func::Tan,
        "cot" | "ctg" => Func::Cot,
        "sec" => Func::Sec,
        "csc" | "cosec" => Func::Csc,
        "arcsin" | "asin" => Func::Asin,
        "arccos" | "acos" => Func::Acos,
        "arctan" | "atan" => Func::Atan,
        "sinh" => Func::Sinh,
        "cosh" => Func::Cosh,
        "tanh" => Func::Tanh,
        "ln" => Func::Ln,
        "log" | "lg" => Func::Log,
        "exp" => Func::Exp,
        _ => return None,
    })
}

/// Greek letters and other commands that name a variable.
pub(crate) fn is_variable_command(name: &str) -> bool {
    matches!(
        name,
        "alpha"
            | "beta"
            | "gamma"
            | "delta"
            | "epsilon"
            | "varepsilon"
            | "zeta"
            | "eta"
            | "theta"
            | "vartheta"
            | "iota"
            | "kappa"
            | "lambda"
            | "mu"
            | "nu"
            | "xi"
            | "rho"
            | "sigma"
            | "tau"
            | "upsilon"
            | "phi"
            | "varphi"
            | "chi"
            | "psi"
            | "omega"
            | "Gamma"
            | "Delta"
            | "Theta"
            | "Lambda"
            | "Xi"
            | "Sigma"
            | "Phi"
            | "Psi"
            | "Omega"
            | "ell"
    )
}

/// Short unit words that may follow a number (`5 cm`, `3 ft`, `30 sec`). Longer words after
/// a number (`units`, `dollars`, `square`, `degrees`) are read as units without a list.
const SHORT_UNITS: &[&str] = &[
    "cm", "mm", "km", "ft", "in", "yd", "mi", "kg", "lb", "lbs", "oz", "ml", "mL", "hr", "hrs",
    "min", "sec", "mph", "deg", "sq", "ms", "cc", "pts", "th", "st", "nd", "rd",
];

/// Whether a bare word after a number is a unit (or other trailing text) to drop.
pub(crate) fn is_unit_word(word: &str) -> bool {
    SHORT_UNITS.contains(&word)
        || (word.len() >= 4 && function(word).is_none() && !is_constant_word(word))
}

/// Bare words that name a constant.
pub(crate) fn is_constant_word(word: &str) -> bool {
    matches!(word, "pi" | "inf" | "infty" | "infinity" | "oo")
}

/// The constant a bare word names.
pub(crate) fn constant_word(word: &str) -> Option<Expr> {
    match word {
        "pi" => Some(Expr::Const(Constant::Pi)),
        "inf" | "infty" | "infinity" | "oo" => Some(Expr::Infinity),
        _ => None,
    }
}

/// Words that join the items of a list of answers (`2 and 3`, `x = 1 \text{ or } x = 2`).
/// A text group with `and` / `or` anywhere in it (`\text{ or maybe }`) joins items too, so
/// that a hedge is read as a list, never as a unit.
pub(crate) fn is_list_conjunction(word: &str) -> bool {
    word.trim() == ","
        || word
            .split(|c: char| !c.is_ascii_alphabetic())
            .any(|w| w.eq_ignore_ascii_case("and") || w.eq_ignore_ascii_case("or"))
}

/// A choice letter written as `C`, `(C)`, `(c)` or `C)`; `None` for anything else.
pub(crate) fn choice_letter(text: &str) -> Option<char> {
    let t: String = text
        .replace("\\left", "")
        .replace("\\right", "")
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let inner = t
        .strip_prefix('(')
        .map(|r| r.strip_suffix(')').unwrap_or(r))
        .or_else(|| t.strip_suffix(')'))
        .map(|r| (r, true))
        .unwrap_or((t.as_str(), false));
    let (body, parenthesised) = inner;
    let mut chars = body.chars();
    let (Some(c), None) = (chars.next(), chars.next()) else {
        return None;
    };
    if c.is_ascii_uppercase() || (parenthesised && c.is_ascii_lowercase()) {
        Some(c.to_ascii_uppercase())
    } else {
        None
    }
}

/// A textual answer reduced to what a reader compares: lower case letters and digits only.
pub(crate) fn text_key(text: &str) -> String {
    text.chars()
        .filter(|c| c.is_alphanumeric())
        .flat_map(char::to_lowercase)
        .collect()
}
