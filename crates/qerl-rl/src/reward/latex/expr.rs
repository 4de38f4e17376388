//! The answer tree the parser builds and the comparison reads.

use std::fmt;

/// A mathematical constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Constant {
    Pi,
    /// Euler's number (`e`, `\mathrm{e}`, `\exp(1)`).
    E,
    /// The imaginary unit (`i`).
    I,
}

/// A function of one argument (two for `Log` with a base, `Binom`, `Root`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Func {
    Sqrt,
    /// `\sqrt[n]{x}`: arguments `[n, x]`.
    Root,
    Sin,
    Cos,
    Tan,
    Cot,
    Sec,
    Csc,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    Ln,
    /// `\log x` (base 10) or `\log_b x`: arguments `[x]` or `[b, x]`.
    Log,
    Exp,
    Abs,
    Factorial,
    /// `\binom{n}{k}`: arguments `[n, k]`.
    Binom,
    Floor,
    Ceil,
}

/// A comparison between two sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rel {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Rel {
    /// The relation read right to left (`a < b` is `b > a`).
    pub fn mirrored(self) -> Rel {
        match self {
            Rel::Lt => Rel::Gt,
            Rel::Gt => Rel::Lt,
            Rel::Le => Rel::Ge,
            Rel::Ge => Rel::Le,
            other => other,
        }
    }

    fn symbol(self) -> &'static str {
        match self {
            Rel::Eq => "=",
            Rel::Ne => "\\ne",
            Rel::Lt => "<",
            Rel::Le => "\\le",
            Rel::Gt => ">",
            Rel::Ge => "\\ge",
        }
    }
}

/// A parsed answer. Sums and products are flat lists; subtraction is `Add` of a `Neg`,
/// division is a `Div` node (kept so that exact fractions stay exact).
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// A decimal literal as written without separators (`"1000"`, `"0.5"`).
    Num(String),
    /// A number written in another base: `2516_8` is digits `"2516"`, base 8.
    Based {
        digits: String,
        base: u32,
    },
    Const(Constant),
    /// Positive or negative infinity (`\infty`, `-\infty` is `Neg(Infinity)`).
    Infinity,
    /// A variable: one letter, possibly with a subscript (`x`, `a_1`, `\alpha`).
    Var(String),
    Add(Vec<Expr>),
    Mul(Vec<Expr>),
    Neg(Box<Expr>),
    Div(Box<Expr>, Box<Expr>),
    Pow(Box<Expr>, Box<Expr>),
    Call(Func, Vec<Expr>),
    /// `x\%`: read as `x` (`10\%` answers "what percent") or as `x / 100` (`25\%` = 0.25).
    Percent(Box<Expr>),
    /// `a \pm b`: the two answers `a + b` and `a - b`.
    PlusMinus(Box<Expr>, Box<Expr>),
    /// A bracketed sequence: tuples `(1, 2)`, intervals `[0, 1)`, vectors `\langle 1,2 \rangle`.
    Seq {
        open: char,
        close: char,
        items: Vec<Expr>,
    },
    /// An unordered collection: `\{1, 2\}` or a bare list `1, 2`.
    Set(Vec<Expr>),
    /// `A \cup B`.
    Union(Vec<Expr>),
    /// Rows of a matrix in any environment.
    Matrix(Vec<Vec<Expr>>),
    /// `lhs op rhs` (`x = 5`, `y = 2x + 1`, `x \le 3`).
    Relation {
        op: Rel,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    /// A multiple-choice letter (`C`, `(C)`, `\text{(C)}`), upper case.
    Choice(char),
    /// A textual answer, lower-cased with spacing and punctuation removed.
    Text(String),
}

impl Expr {
    /// Whether the tree names any free variable.
    pub fn has_vars(&self) -> bool {
        let mut out = false;
        self.visit(&mut |e| out |= matches!(e, Expr::Var(_)));
        out
    }

    /// The free variables of the tree, sorted and without duplicates.
    pub fn vars(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.visit(&mut |e| {
            if let Expr::Var(v) = e {
                out.push(v.clone());
            }
        });
        out.sort();
        out.dedup();
        out
    }

    /// Whether the tree is a single value (no tuple, set, matrix, relation or text inside).
    pub fn is_scalar(&self) -> bool {
        let mut ok = true;
        self.visit(&mut |e| {
            ok &= !matches!(
                e,
                Expr::Seq { .. }
                    | Expr::Set(_)
                    | Expr::Union(_)
                    | Expr::Matrix(_)
                    | Expr::Relation { .. }
                    | Expr::Choice(_)
                    | Expr::Text(_)
                    | Expr::PlusMinus(..)
                    | Expr::Based { .. }
            )
        });
        ok
    }

    /// Calls `f` on every node, parents first. The tree's depth is bounded by the parser.
    pub fn visit(&self, f: &mut dyn FnMut(&Expr)) {
        f(self);
        match self {
            Expr::Add(xs) | Expr::Mul(xs) | Expr::Call(_, xs) | Expr::Set(xs) | Expr::Union(xs) => {
                xs.iter().for_each(|x| x.visit(f))
            }
            Expr::Seq { items, .. } => items.iter().for_each(|x| x.visit(f)),
            Expr::Matrix(rows) => rows.iter().flatten().for_each(|x| x.visit(f)),
            Expr::Neg(x) | Expr::Percent(x) => x.visit(f),
            Expr::Div(a, b) | Expr::Pow(a, b) | Expr::PlusMinus(a, b) => {
                a.visit(f);
                b.visit(f);
            }
            Expr::Relation { lhs, rhs, .. } => {
                lhs.visit(f);
                rhs.visit(f);
            }
            Expr::Num(_)
            | Expr::Based { .. }
            | Expr::Const(_)
            | Expr::Infinity
            | Expr::Var(_)
            | Expr::Choice(_)
            | Expr::Text(_) => {}
        }
    }
}

fn join(f: &mut fmt::Formatter<'_>, xs: &[Expr], sep: &str) -> fmt::Result {
    for (i, x) in xs.iter().enumerate() {
        if i > 0 {
            f.write_str(sep)?;
        }
        write!(f, "{x}")?;
    }
    Ok(())
}

/// A fully parenthesised rendering, used by `--explain` and in test messages.
impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Num(s) => f.write_str(s),
            Expr::Based { digits, base } => write!(f, "{digits}_{base}"),
            Expr::Const(Constant::Pi) => f.write_str("pi"),
            Expr::Const(Constant::E) => f.write_str("e"),
            Expr::Const(Constant::I) => f.write_str("i"),
            Expr::Infinity => f.write_str("oo"),
            Expr::Var(v) => f.write_str(v),
            Expr::Add(xs) => {
                f.write_str("(")?;
                join(f, xs, " + ")?;
                f.write_str(")")
            }
            Expr::Mul(xs) => {
                f.write_str("(")?;
                join(f, xs, " * ")?;
                f.write_str(")")
            }
            Expr::Neg(x) => write!(f, "-{x}"),
            Expr::Percent(x) => write!(f, "{x}%"),
            Expr::Div(a, b) => write!(f, "({a} / {b})"),
            Expr::Pow(a, b) => write!(f, "{a}^{b}"),
            Expr::Call(func, xs) => {
                write!(f, "{func:?}(")?;
                join(f, xs, ", ")?;
                f.write_str(")")
            }
            Expr::PlusMinus(a, b) => write!(f, "({a} ± {b})"),
            Expr::Seq { open, close, items } => {
                write!(f, "{open}")?;
                join(f, items, ", ")?;
                write!(f, "{close}")
            }
            Expr::Set(xs) => {
                f.write_str("{")?;
                join(f, xs, ", ")?;
                f.write_str("}")
            }
            Expr::Union(xs) => join(f, xs, " ∪ "),
            Expr::Matrix(rows) => {
                f.write_str("[")?;
                for (i, r) in rows.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    join(f, r, ", ")?;
                }
                f.write_str("]")
            }
            Expr::Relation { op, lhs, rhs } => write!(f, "{lhs} {} {rhs}", op.symbol()),
            Expr::Choice(c) => write!(f, "choice {c}"),
            Expr::Text(t) => write!(f, "text {t:?}"),
        }
    }
}
