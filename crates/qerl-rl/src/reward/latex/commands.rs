//! The parts of the [`Parser`] that read named things: numbers (with bases and mixed
//! fractions), words, commands (`\\frac`, `\\sqrt`, functions, constants), function
//! applications and environments (matrices).

use super::expr::{Constant, Expr, Func};
use super::lexer::Tok;
use super::parser::{unexpected, Parser};
use super::words::{constant_word, function, is_constant_word, is_variable_command, text_key};
use super::ParseError;

impl Parser {
    /// A number, with a base subscript (`2516_8`, `101_{2}`) or a mixed fraction (`2\frac12`).
    pub(super) fn number(&mut self, digits: String) -> Result<Expr, ParseError> {
        if self.eat('_') {
            let base = match self.argument()? {
                Expr::Num(b) => b.parse::<u32>().ok(),
                Expr::Text(t) => base_word(&t),
                _ => None,
            };
            let base = base
                .filter(|b| (2..=36).contains(b))
                .ok_or(ParseError::Unexpected("base subscript".into()))?;
            return Ok(Expr::Based {
                digits: digits.trim_start_matches('0').to_string(),
                base,
            });
        }
        // A whole number directly followed by a fraction of whole numbers is a mixed number.
        if !digits.contains('.') && self.is_cmd("frac") {
            let save = self.pos;
            self.pos += 1;
            let num = self.argument()?;
            let den = self.argument()?;
            if let (Expr::Num(a), Expr::Num(b)) = (&num, &den) {
                if !a.contains('.') && !b.contains('.') {
                    let frac = Expr::Div(Box::new(num), Box::new(den));
                    return Ok(Expr::Add(vec![Expr::Num(digits), frac]));
                }
            }
            self.pos = save;
        }
        Ok(Expr::Num(digits))
    }

    /// A bare word: a function, a constant, a variable (with subscript) or a product of
    /// one-letter variables (`xy`).
    pub(super) fn word(&mut self, w: &str) -> Result<Expr, ParseError> {
        if let Some(f) = function(w) {
            return self.call(f);
        }
        if let Some(c) = constant_word(w) {
            return Ok(c);
        }
        let letters: Vec<Expr> = w.chars().map(letter).collect();
        let mut letters = letters;
        if self.eat('_') {
            let sub = self.argument()?;
            if let Some(Expr::Var(v)) = letters.pop() {
                letters.push(Expr::Var(format!("{v}_{sub}")));
            } else {
                return Err(ParseError::Unexpected("subscript".into()));
            }
        }
        Ok(if letters.len() == 1 {
            letters.pop().unwrap_or(Expr::Num("1".into()))
        } else {
            Expr::Mul(letters)
        })
    }

    pub(super) fn command(&mut self, c: &str) -> Result<Expr, ParseError> {
        if let Some(f) = function(c) {
            if f == Func::Sqrt {
                if self.peek() == Some(&Tok::Sym('[')) {
                    let index = self.group('[', ']')?;
                    let x = self.argument()?;
                    return Ok(Expr::Call(Func::Root, vec![index, x]));
                }
                return Ok(Expr::Call(Func::Sqrt, vec![self.argument()?]));
            }
            return self.call(f);
        }
        if is_variable_command(c) {
            return Ok(Expr::Var(c.to_string()));
        }
        match c {
            "frac" => {
                let num = self.argument()?;
                let den = self.argument()?;
                Ok(Expr::Div(Box::new(num), Box::new(den)))
            }
            "binom" => {
                let n = self.argument()?;
                let k = self.argument()?;
                Ok(Expr::Call(Func::Binom, vec![n, k]))
            }
            "pi" => Ok(Expr::Const(Constant::Pi)),
            "infty" => Ok(Expr::Infinity),
            "emptyset" | "varnothing" => Ok(Expr::Set(Vec::new())),
            "lfloor" | "lceil" => {
                let inner = self.sum()?;
                let (close, f) = if c == "lfloor" {
                    ("rfloor", Func::Floor)
                } else {
                    ("rceil", Func::Ceil)
                };
                if !self.is_cmd(close) {
                    return Err(unexpected(self.peek()));
                }
                self.pos += 1;
                Ok(Expr::Call(f, vec![inner]))
            }
            _ => Err(ParseError::UnknownCommand(c.to_string())),
        }
    }

    /// A function application: `\sin x`, `\sin(x)`, `\sin^2 x`, `\log_2 8`, `\ln\left(x\right)`.
    pub(super) fn call(&mut self, f: Func) -> Result<Expr, ParseError> {
        let mut power = None;
        let mut base = None;
        for _ in 0..2 {
            if self.eat('^') {
                power = Some(self.argument()?);
            } else if f == Func::Log && self.eat('_') {
                base = Some(self.argument()?);
            }
        }
        let arg = if self.peek() == Some(&Tok::Sym('(')) {
            self.group('(', ')')?
        } else {
            self.power()?
        };
        let call = match base {
            Some(b) => Expr::Call(Func::Log, vec![b, arg]),
            None => Expr::Call(f, vec![arg]),
        };
        Ok(match power {
            Some(p) => Expr::Pow(Box::new(call), Box::new(p)),
            None => call,
        })
    }

    /// `\begin{env} … \end{env}`: a matrix in any matrix environment (rows of `&`-separated
    /// cells), or the lines of `aligned`/`gathered`/`cases` as a list.
    pub(super) fn environment(&mut self, env: &str) -> Result<Expr, ParseError> {
        let matrix = matches!(
            env,
            "matrix"
                | "pmatrix"
                | "bmatrix"
                | "Bmatrix"
                | "vmatrix"
                | "Vmatrix"
                | "smallmatrix"
                | "array"
        );
        let mut rows: Vec<Vec<Expr>> = vec![Vec::new()];
        loop {
            match self.peek() {
                Some(Tok::End(e)) if e == env => {
                    self.pos += 1;
                    break;
                }
                Some(Tok::RowSep) => {
                    self.pos += 1;
                    rows.push(Vec::new());
                }
                Some(Tok::Sym('&')) => {
                    self.pos += 1;
                }
                None => return Err(ParseError::Unbalanced("environment")),
                Some(_) => {
                    let cell = self.union()?;
                    if let Some(row) = rows.last_mut() {
                        row.push(cell);
                    }
                }
            }
        }
        rows.retain(|r| !r.is_empty());
        if matrix {
            let width = rows.first().map_or(0, Vec::len);
            if width == 0 || rows.iter().any(|r| r.len() != width) {
                return Err(ParseError::Unexpected("ragged matrix".into()));
            }
            Ok(Expr::Matrix(rows))
        } else {
            Ok(Expr::Set(rows.into_iter().flatten().collect()))
        }
    }
}

/// A one-letter variable, or the constants `e` and `i`.
fn letter(c: char) -> Expr {
    match c {
        'e' => Expr::Const(Constant::E),
        'i' => Expr::Const(Constant::I),
        other => Expr::Var(other.to_string()),
    }
}

/// The value of a `\text{…}` group standing alone: a number, a choice letter, a constant or
/// words.
pub(super) fn text_value(t: &str) -> Result<Expr, ParseError> {
    let trimmed = t.trim();
    if !trimmed.is_empty() && trimmed.chars().all(|c| c.is_ascii_digit()) {
        return Ok(Expr::Num(trimmed.to_string()));
    }
    if let Some(c) = super::words::choice_letter(trimmed) {
        return Ok(Expr::Choice(c));
    }
    match trimmed {
        "e" => return Ok(Expr::Const(Constant::E)),
        "i" => return Ok(Expr::Const(Constant::I)),
        w if is_constant_word(w) => return constant_word(w).ok_or(ParseError::Empty),
        _ => {}
    }
    let key = text_key(trimmed);
    if key.is_empty() {
        return Err(ParseError::Empty);
    }
    Ok(Expr::Text(key))
}

/// Bases written as words in a subscript (`10_{\text{ten}}`).
fn base_word(t: &str) -> Option<u32> {
    Some(match t {
        "two" => 2,
        "three" => 3,
        "four" => 4,
        "five" => 5,
        "six" => 6,
        "seven" => 7,
        "eight" => 8,
        "nine" => 9,
        "ten" => 10,
        "eleven" => 11,
        "twelve" => 12,
        "sixteen" => 16,
        _ => t.parse().ok()?,
    })
}
