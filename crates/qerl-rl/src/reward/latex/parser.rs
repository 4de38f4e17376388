//! Tokens → [`Expr`]: a recursive-descent parser whose nesting is bounded by [`MAX_DEPTH`]
//! (so no input can exhaust the stack) and which reads every token once (linear time).
//!
//! Grammar, loosest first: list (`,` `;` `and` `or`) → union (`\cup`) → relation (`=` `<`
//! `\le` ...) → sum (`+` `-` `\pm`) → product (`*` `\cdot` `\times` `/` `\div`, implicit) →
//! signs → power (`^`, postfix `!` `%` and trailing units) → primary.

use super::commands::text_value;
use super::expr::{Expr, Func, Rel};
use super::lexer::Tok;
use super::words::{is_list_conjunction, is_unit_word};
use super::ParseError;

/// The deepest nesting of brackets, fractions, roots and exponents an answer may have.
pub(crate) const MAX_DEPTH: usize = 40;

pub(crate) struct Parser {
    pub(super) toks: Vec<Tok>,
    pub(super) pos: usize,
    pub(super) depth: usize,
}

pub(super) fn unexpected(t: Option<&Tok>) -> ParseError {
    match t {
        Some(t) => ParseError::Unexpected(format!("{t:?}")),
        None => ParseError::Unexpected("end of answer".into()),
    }
}

impl Parser {
    pub(crate) fn new(toks: Vec<Tok>) -> Self {
        Self {
            toks,
            pos: 0,
            depth: 0,
        }
    }

    pub(super) fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }

    pub(super) fn peek_at(&self, k: usize) -> Option<&Tok> {
        self.toks.get(self.pos + k)
    }

    pub(super) fn bump(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += usize::from(t.is_some());
        t
    }

    pub(super) fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Sym(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    pub(super) fn expect(&mut self, c: char) -> Result<(), ParseError> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(unexpected(self.peek()))
        }
    }

    pub(super) fn is_cmd(&self, name: &str) -> bool {
        matches!(self.peek(), Some(Tok::Cmd(n)) if n == name)
    }

    /// The whole answer: a list, with nothing left over.
    pub(crate) fn answer(&mut self) -> Result<Expr, ParseError> {
        let items = self.list_items()?;
        if self.pos < self.toks.len() {
            return Err(unexpected(self.peek()));
        }
        Ok(if items.len() == 1 {
            items.into_iter().next().unwrap_or(Expr::Set(Vec::new()))
        } else {
            Expr::Set(items)
        })
    }

    /// Whether the next token separates list items (and consumes it).
    fn eat_separator(&mut self) -> bool {
        let sep = match self.peek() {
            Some(Tok::Sym(',' | ';')) => true,
            Some(Tok::Word(w)) | Some(Tok::Text(w)) => is_list_conjunction(w),
            _ => false,
        };
        self.pos += usize::from(sep);
        sep
    }

    pub(super) fn list_items(&mut self) -> Result<Vec<Expr>, ParseError> {
        // `x \in [2, 5)`: the set is the answer.
        if matches!(
            (self.peek(), self.peek_at(1)),
            (Some(Tok::Word(w)), Some(Tok::Cmd(c))) if w.len() == 1 && c == "in"
        ) {
            self.pos += 2;
        }
        let mut items = vec![self.union()?];
        while self.eat_separator() {
            items.push(self.union()?);
        }
        Ok(items)
    }

    pub(super) fn union(&mut self) -> Result<Expr, ParseError> {
        let first = self.relation()?;
        if !self.is_cmd("cup") {
            return Ok(first);
        }
        let mut parts = vec![first];
        while self.is_cmd("cup") {
            self.pos += 1;
            parts.push(self.relation()?);
        }
        Ok(Expr::Union(parts))
    }

    fn relation_op(&mut self) -> Option<Rel> {
        let op = match self.peek()? {
            Tok::Sym('=') => Rel::Eq,
            Tok::Sym('<') if self.peek_at(1) == Some(&Tok::Sym('=')) => {
                self.pos += 1;
                Rel::Le
            }
            Tok::Sym('>') if self.peek_at(1) == Some(&Tok::Sym('=')) => {
                self.pos += 1;
                Rel::Ge
            }
            Tok::Sym('<') => Rel::Lt,
            Tok::Sym('>') => Rel::Gt,
            Tok::Cmd(c) if c == "le" => Rel::Le,
            Tok::Cmd(c) if c == "ge" => Rel::Ge,
            Tok::Cmd(c) if c == "ne" => Rel::Ne,
            _ => return None,
        };
        self.pos += 1;
        Some(op)
    }

    fn relation(&mut self) -> Result<Expr, ParseError> {
        let mut lhs = self.sum()?;
        let mut wraps = 0;
        while let Some(op) = self.relation_op() {
            self.wrap(&mut wraps)?;
            let rhs = self.sum()?;
            lhs = Expr::Relation {
                op,
                lhs: Box::new(lhs),
                rhs: Box::new(rhs),
            };
        }
        self.depth -= wraps;
        Ok(lhs)
    }

    pub(super) fn sum(&mut self) -> Result<Expr, ParseError> {
        let mut terms = Vec::new();
        if self.is_cmd("pm") {
            self.pos += 1;
            let rest = self.sum_nested()?;
            return Ok(Expr::PlusMinus(
                Box::new(Expr::Num("0".into())),
                Box::new(rest),
            ));
        }
        terms.push(self.signed_product()?);
        loop {
            // `signed_product` reads the sign itself.
            if matches!(self.peek(), Some(Tok::Sym('+' | '-'))) {
                terms.push(self.signed_product()?);
            } else if self.is_cmd("pm") || self.is_cmd("mp") {
                self.pos += 1;
                let rest = self.sum_nested()?;
                return Ok(Expr::PlusMinus(Box::new(flat_add(terms)), Box::new(rest)));
            } else {
                return Ok(flat_add(terms));
            }
        }
    }

    /// A sum inside `\pm`, counted against the depth bound.
    fn sum_nested(&mut self) -> Result<Expr, ParseError> {
        self.enter()?;
        let r = self.sum();
        self.depth -= 1;
        r
    }

    /// Leading signs (counted in a loop, never recursively), then a product.
    fn signed_product(&mut self) -> Result<Expr, ParseError> {
        let mut negative = false;
        loop {
            if self.eat('-') {
                negative = !negative;
            } else if !self.eat('+') {
                break;
            }
        }
        let p = self.product()?;
        Ok(if negative { Expr::Neg(Box::new(p)) } else { p })
    }

    /// A factor after `*` or `/`: it may carry its own signs (`2 \cdot -3`).
    fn signed_factor(&mut self) -> Result<Expr, ParseError> {
        let mut negative = false;
        while self.eat('-') {
            negative = !negative;
        }
        let p = self.power()?;
        Ok(if negative { Expr::Neg(Box::new(p)) } else { p })
    }

    fn product(&mut self) -> Result<Expr, ParseError> {
        let mut factors = vec![self.power()?];
        let mut wraps = 0;
        loop {
            if self.eat('*') {
                factors.push(self.signed_factor()?);
            } else if self.eat('/') {
                self.wrap(&mut wraps)?;
                let den = self.signed_factor()?;
                let num = factors.pop().unwrap_or(Expr::Num("1".into()));
                factors.push(Expr::Div(Box::new(num), Box::new(den)));
            } else if self.skip_unit() {
                // A unit (`square units`: one or more words) ends the value: `5 \text{ cm } 6`
                // is not 30.
                while self.skip_unit() {}
                break;
            } else if self.starts_implicit_factor() {
                factors.push(self.power()?);
            } else {
                break;
            }
        }
        self.depth -= wraps;
        Ok(if factors.len() == 1 {
            factors.pop().unwrap_or(Expr::Num("1".into()))
        } else {
            Expr::Mul(factors)
        })
    }

    /// Drops a unit after a value (`\text{ cm}^2`, `square units`, `dollars`); true if one was.
    fn skip_unit(&mut self) -> bool {
        let is_unit = match self.peek() {
            // A text with a number in it is not a unit (`5 \text{ or 6}` must not read as 5).
            Some(Tok::Text(t)) => !is_list_conjunction(t) && !t.chars().any(|c| c.is_ascii_digit()),
            Some(Tok::Word(w)) => is_unit_word(w) && !is_list_conjunction(w),
            _ => false,
        };
        if !is_unit {
            return false;
        }
        self.pos += 1;
        // `cm^2`, `\text{cm}^{3}`
        if self.peek() == Some(&Tok::Sym('^')) {
            match (self.peek_at(1), self.peek_at(2), self.peek_at(3)) {
                (Some(Tok::Num(_)), _, _) => self.pos += 2,
                (Some(Tok::Sym('{')), Some(Tok::Num(_)), Some(Tok::Sym('}'))) => self.pos += 4,
                _ => {}
            }
        }
        true
    }

    fn starts_implicit_factor(&self) -> bool {
        match self.peek() {
            Some(Tok::Num(_)) | Some(Tok::Sym('(' | '{')) | Some(Tok::Begin(_)) => true,
            Some(Tok::Word(w)) => !is_list_conjunction(w),
            Some(Tok::Cmd(c)) => !matches!(
                c.as_str(),
                "le" | "ge"
                    | "ne"
                    | "pm"
                    | "mp"
                    | "cup"
                    | "cap"
                    | "to"
                    | "approx"
                    | "rfloor"
                    | "rceil"
                    | "in"
                    | "implies"
                    | "quad"
            ),
            _ => false,
        }
    }

    /// One more level of a left-nested chain (`a = b = c`, `a^b^c`, `a/b/c`, `n!!`): chains
    /// deepen the tree as brackets do, so they count against the same bound.
    fn wrap(&mut self, wraps: &mut usize) -> Result<(), ParseError> {
        *wraps += 1;
        self.enter()
    }

    pub(super) fn enter(&mut self) -> Result<(), ParseError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            Err(ParseError::TooDeep)
        } else {
            Ok(())
        }
    }

    /// A primary with its exponent and postfix operators.
    pub(super) fn power(&mut self) -> Result<Expr, ParseError> {
        let mut base = self.primary()?;
        let mut wraps = 0;
        loop {
            if self.eat('^') {
                self.wrap(&mut wraps)?;
                if let Some(exp) = self.exponent()? {
                    base = Expr::Pow(Box::new(base), Box::new(exp));
                }
            } else if self.eat('!') {
                self.wrap(&mut wraps)?;
                base = Expr::Call(Func::Factorial, vec![base]);
            } else if self.eat('%') {
                self.wrap(&mut wraps)?;
                base = Expr::Percent(Box::new(base));
            } else if self.eat('\'') {
                // Primes: ignored.
            } else {
                self.depth -= wraps;
                return Ok(base);
            }
        }
    }

    /// The exponent after `^`: a group, a number, or one letter or command.
    /// `None` for an exponent that was only `^\circ` (dropped by the lexer).
    fn exponent(&mut self) -> Result<Option<Expr>, ParseError> {
        match self.peek() {
            // `{90^\circ}`: the exponent was only `\circ`, dropped by the lexer.
            None | Some(Tok::Sym('}' | ')' | ']' | ',')) => Ok(None),
            Some(Tok::Sym('{')) if self.peek_at(1) == Some(&Tok::Sym('}')) => {
                self.pos += 2;
                Ok(None)
            }
            Some(Tok::Sym('-')) => {
                self.pos += 1;
                Ok(Some(Expr::Neg(Box::new(self.argument()?))))
            }
            // `2^10` is written for 2^{10} far more often than for 2^1 \cdot 0.
            Some(Tok::Num(n)) => {
                let n = n.clone();
                self.pos += 1;
                Ok(Some(Expr::Num(n)))
            }
            Some(_) => self.argument().map(Some),
        }
    }

    /// One argument of `\frac`, `\sqrt`, `^`: a brace group, or a single digit / letter /
    /// command (`\frac12`, `\sqrt3`, `\frac\pi2`).
    pub(super) fn argument(&mut self) -> Result<Expr, ParseError> {
        match self.peek().cloned() {
            Some(Tok::Sym('{')) => self.group('{', '}'),
            Some(Tok::Num(s)) if s.len() > 1 => {
                let first: String = s.chars().take(1).collect();
                let rest: String = s.chars().skip(1).collect();
                if rest.starts_with('.') {
                    self.pos += 1;
                    return Ok(Expr::Num(s));
                }
                self.toks[self.pos] = Tok::Num(rest);
                Ok(Expr::Num(first))
            }
            Some(Tok::Word(w)) if w.len() > 1 => {
                let first: String = w.chars().take(1).collect();
                self.toks[self.pos] = Tok::Word(w.chars().skip(1).collect());
                self.enter()?;
                let r = self.word(&first);
                self.depth -= 1;
                r
            }
            Some(Tok::Sym(c)) if c != '(' && c != '|' => Err(unexpected(self.peek())),
            _ => self.primary(),
        }
    }

    /// `open … close` holding one expression (or a list, as a set, for braces).
    pub(super) fn group(&mut self, open: char, close: char) -> Result<Expr, ParseError> {
        self.enter()?;
        self.expect(open)?;
        let items = self.list_items()?;
        self.expect(close)?;
        self.depth -= 1;
        Ok(if items.len() == 1 {
            items.into_iter().next().unwrap_or(Expr::Set(Vec::new()))
        } else {
            Expr::Set(items)
        })
    }

    pub(super) fn primary(&mut self) -> Result<Expr, ParseError> {
        self.enter()?;
        let r = self.primary_inner();
        self.depth -= 1;
        r
    }

    fn primary_inner(&mut self) -> Result<Expr, ParseError> {
        let Some(tok) = self.bump() else {
            return Err(unexpected(None));
        };
        match tok {
            Tok::Num(s) => self.number(s),
            Tok::Word(w) => self.word(&w),
            Tok::Text(t) => text_value(&t),
            Tok::Cmd(c) => self.command(&c),
            Tok::Sym(open @ ('(' | '[')) => {
                let items = self.list_items()?;
                let close = match self.bump() {
                    Some(Tok::Sym(c @ (')' | ']'))) => c,
                    other => return Err(unexpected(other.as_ref())),
                };
                if items.len() == 1 && (open == '(') == (close == ')') {
                    return Ok(items.into_iter().next().unwrap_or(Expr::Set(Vec::new())));
                }
                Ok(Expr::Seq { open, close, items })
            }
            Tok::Sym('{') => {
                self.pos -= 1;
                self.depth -= 1; // `group` counts this level itself
                let r = self.group('{', '}');
                self.depth += 1;
                r
            }
            Tok::SetOpen => {
                if self.peek() == Some(&Tok::SetClose) {
                    self.pos += 1;
                    return Ok(Expr::Set(Vec::new()));
                }
                let items = self.list_items()?;
                match self.bump() {
                    Some(Tok::SetClose) => Ok(Expr::Set(items)),
                    other => Err(unexpected(other.as_ref())),
                }
            }
            Tok::Sym('|') => {
                let inner = self.sum()?;
                self.expect('|')?;
                Ok(Expr::Call(Func::Abs, vec![inner]))
            }
            Tok::Begin(env) => self.environment(&env),
            other => Err(unexpected(Some(&other))),
        }
    }
}

/// Flattens nested sums into one.
fn flat_add(terms: Vec<Expr>) -> Expr {
    if terms.len() == 1 {
        return terms.into_iter().next().unwrap_or(Expr::Num("0".into()));
    }
    let mut out = Vec::with_capacity(terms.len());
    for t in terms {
        match t {
            Expr::Add(inner) => out.extend(inner),
            other => out.push(other),
        }
    }
    Expr::Add(out)
}
