//! Whether a predicted answer equals a reference answer.
//!
//! Structure first (tuples in order, sets and lists in any order, intervals with their
//! brackets, matrices by shape, equations by sides, choice letters, text), then values:
//! exact rationals compare exactly; other constants compare in floating point with a tight
//! relative tolerance, so a rounded decimal (`0.333`, `1.414`) never equals an exact answer
//! (`\frac13`, `\sqrt2`) unless the reference itself is a decimal, in which case an exact
//! prediction that rounds to it is accepted; expressions with variables compare at seeded
//! random points. Non-finite values never compare equal.

use super::eval::{based_value, complex, exact, C};
use super::expr::{Expr, Rel};

/// The outcome of a comparison, with the rule that decided it (for `--explain`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Equivalence {
    pub equal: bool,
    pub reason: &'static str,
}

/// Compares a predicted answer with the reference (`gold`). Not symmetric in one respect:
/// a decimal reference accepts exact predictions that round to it.
pub fn equivalent(pred: &Expr, gold: &Expr) -> Equivalence {
    let mut reason = "different";
    let equal = equiv(pred, gold, &mut reason);
    Equivalence { equal, reason }
}

fn set(r: &mut &'static str, why: &'static str, v: bool) -> bool {
    *r = why;
    v
}

fn equiv(p: &Expr, g: &Expr, r: &mut &'static str) -> bool {
    if p == g {
        return set(r, "identical after parsing", true);
    }
    match (p, g) {
        // `x = 5` against `5` (either way round): the value of a named unknown.
        (
            Expr::Relation {
                op: Rel::Eq,
                lhs,
                rhs,
            },
            other,
        ) if !matches!(other, Expr::Relation { .. }) && is_name(lhs) => equiv(rhs, other, r),
        (
            other,
            Expr::Relation {
                op: Rel::Eq,
                lhs,
                rhs,
            },
        ) if !matches!(other, Expr::Relation { .. }) && is_name(lhs) => equiv(other, rhs, r),
        (
            Expr::Relation {
                op: po,
                lhs: pl,
                rhs: pr,
            },
            Expr::Relation {
                op: go,
                lhs: gl,
                rhs: gr,
            },
        ) => relations(*po, pl, pr, *go, gl, gr, r),
        // A percentage is the number as written or that number over 100.
        (Expr::Percent(x), other) | (other, Expr::Percent(x)) => {
            let hundredth = Expr::Div(x.clone(), Box::new(Expr::Num("100".into())));
            if matches!(other, Expr::Percent(_)) {
                return equiv(x, strip_percent(other), r);
            }
            equiv(x, other, r) || equiv(&hundredth, other, r)
        }
        // `-2 \le x \le 7` against `[-2, 7]`, `x > 3` against `(3, \infty)`.
        (Expr::Relation { .. }, Expr::Seq { .. } | Expr::Union(_))
        | (Expr::Seq { .. } | Expr::Union(_), Expr::Relation { .. }) => {
            match (as_interval(p), as_interval(g)) {
                (Some(a), Some(b)) => equiv(&a, &b, r),
                _ => set(r, "a relation against an interval", false),
            }
        }
        (Expr::Choice(a), Expr::Choice(b)) => set(r, "choice letters", a == b),
        (Expr::Choice(a), Expr::Var(v)) | (Expr::Var(v), Expr::Choice(a)) => {
            set(r, "choice letters", v.len() == 1 && v.starts_with(*a))
        }
        (Expr::Choice(a), Expr::Text(t)) | (Expr::Text(t), Expr::Choice(a)) => set(
            r,
            "choice letters",
            t.len() == 1 && t.starts_with(a.to_ascii_lowercase()),
        ),
        (Expr::Text(a), Expr::Text(b)) => set(r, "text", a == b),
        (Expr::PlusMinus(..), _) | (_, Expr::PlusMinus(..)) => match (expand_pm(p), expand_pm(g)) {
            (Some(a), Some(b)) => unordered(&a, &b, r),
            _ => set(r, "± with a non-value", false),
        },
        (Expr::Set(a), Expr::Set(b)) => unordered(&expand_items(a), &expand_items(b), r),
        (Expr::Union(a), Expr::Union(b)) => unordered(a, b, r),
        (
            Expr::Seq {
                open: po,
                close: pc,
                items: a,
            },
            Expr::Seq {
                open: go,
                close: gc,
                items: b,
            },
        ) => {
            if (po, pc) != (go, gc) {
                return set(r, "different brackets", false);
            }
            ordered(a, b, r)
        }
        (Expr::Matrix(a), Expr::Matrix(b)) => {
            if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.len() != y.len()) {
                return set(r, "different matrix shapes", false);
            }
            let (a, b): (Vec<Expr>, Vec<Expr>) = (a.concat(), b.concat());
            ordered(&a, &b, r)
        }
        // A column or row vector written as a matrix or as a tuple.
        (
            Expr::Matrix(m),
            Expr::Seq {
                open: '(', items, ..
            },
        )
        | (
            Expr::Seq {
                open: '(', items, ..
            },
            Expr::Matrix(m),
        ) if m.len() == 1 || m.iter().all(|row| row.len() == 1) => ordered(&m.concat(), items, r),
        (Expr::Based { digits: a, base: x }, Expr::Based { digits: b, base: y }) => set(
            r,
            "numbers in a base",
            x == y
                && a.eq_ignore_ascii_case(b)
                && based_value(a, *x).is_some()
                && based_value(b, *y).is_some(),
        ),
        (Expr::Based { digits, base: 10 }, other) | (other, Expr::Based { digits, base: 10 }) => {
            equiv(&Expr::Num(digits.clone()), other, r)
        }
        _ => {
            if let (Some(a), Some(b)) = (infinity_sign(p), infinity_sign(g)) {
                return set(r, "infinities", a == b);
            }
            if infinity_sign(p).is_some() || infinity_sign(g).is_some() {
                return set(r, "infinity against a value", false);
            }
            if p.is_scalar() && g.is_scalar() {
                numeric(p, g, r)
            } else {
                set(r, "different kinds of answer", false)
            }
        }
    }
}

/// What names the unknown on the left of an `=`: a lone variable (`x`, `a_1`, `\theta`) or
/// function notation (`f(x)`, `p(t)`).
fn is_name(e: &Expr) -> bool {
    match e {
        Expr::Var(_) => true,
        Expr::Mul(xs) => matches!(
            xs.as_slice(),
            [Expr::Var(f), Expr::Var(_)] if matches!(f.as_str(), "f" | "g" | "h" | "p" | "q" | "P" | "Q")
        ),
        _ => false,
    }
}

/// An inequality in one variable as the interval it describes (`a < x \le b` is `(a, b]`,
/// `x \ge 3` is `[3, \infty)`); intervals and unions as themselves.
fn as_interval(e: &Expr) -> Option<Expr> {
    let interval = |lo: Expr, lo_closed: bool, hi: Expr, hi_closed: bool| Expr::Seq {
        open: if lo_closed { '[' } else { '(' },
        close: if hi_closed { ']' } else { ')' },
        items: vec![lo, hi],
    };
    let inf = || Expr::Infinity;
    let neg_inf = || Expr::Neg(Box::new(Expr::Infinity));
    match e {
        Expr::Seq { .. } | Expr::Union(_) => Some(e.clone()),
        Expr::Relation { op, lhs, rhs } => {
            if let Expr::Relation {
                op: inner,
                lhs: a,
                rhs: x,
            } = &**lhs
            {
                // A chain `a op1 x op2 b`.
                if !matches!(**x, Expr::Var(_)) {
                    return None;
                }
                let b = (**rhs).clone();
                return match (inner, op) {
                    (Rel::Lt | Rel::Le, Rel::Lt | Rel::Le) => Some(interval(
                        (**a).clone(),
                        *inner == Rel::Le,
                        b,
                        *op == Rel::Le,
                    )),
                    (Rel::Gt | Rel::Ge, Rel::Gt | Rel::Ge) => Some(interval(
                        b,
                        *op == Rel::Ge,
                        (**a).clone(),
                        *inner == Rel::Ge,
                    )),
                    _ => None,
                };
            }
            // `x op v`, or `v op x` read backwards.
            let (op, v) = match (&**lhs, &**rhs) {
                (Expr::Var(_), v) if !v.has_vars() => (*op, v.clone()),
                (v, Expr::Var(_)) if !v.has_vars() => (op.mirrored(), v.clone()),
                _ => return None,
            };
            match op {
                Rel::Lt => Some(interval(neg_inf(), false, v, false)),
                Rel::Le => Some(interval(neg_inf(), false, v, true)),
                Rel::Gt => Some(interval(v, false, inf(), false)),
                Rel::Ge => Some(interval(v, true, inf(), false)),
                Rel::Eq | Rel::Ne => None,
            }
        }
        _ => None,
    }
}

fn strip_percent(e: &Expr) -> &Expr {
    match e {
        Expr::Percent(x) => x,
        other => other,
    }
}

fn infinity_sign(e: &Expr) -> Option<i8> {
    match e {
        Expr::Infinity => Some(1),
        Expr::Neg(x) => infinity_sign(x).map(|s| -s),
        _ => None,
    }
}

fn ordered(a: &[Expr], b: &[Expr], r: &mut &'static str) -> bool {
    if a.len() != b.len() {
        return set(r, "different number of elements", false);
    }
    for (x, y) in a.iter().zip(b) {
        if !equiv(x, y, r) {
            return false;
        }
    }
    set(r, "equal element by element", true)
}

/// Every element of `a` matched to a distinct equal element of `b` (lengths equal).
fn unordered(a: &[Expr], b: &[Expr], r: &mut &'static str) -> bool {
    if a.len() != b.len() {
        return set(r, "different number of elements", false);
    }
    let mut used = vec![false; b.len()];
    for x in a {
        let mut scratch = "";
        let found = b
            .iter()
            .enumerate()
            .position(|(j, y)| !used[j] && equiv(x, y, &mut scratch));
        match found {
            Some(j) => used[j] = true,
            None => return set(r, "an element has no equal in the other set", false),
        }
    }
    set(r, "equal as sets", true)
}

/// The elements of a list with every `a ± b` among them counted as its two values
/// (`\{1\pm\sqrt5, -2\}` has three elements).
fn expand_items(items: &[Expr]) -> Vec<Expr> {
    let mut out = Vec::with_capacity(items.len());
    for x in items {
        match x {
            Expr::PlusMinus(..) => out.extend(expand_pm(x).unwrap_or_default()),
            other => out.push(other.clone()),
        }
    }
    out
}

/// `a ± b` as the two values; a plain value as itself; a set as its elements.
fn expand_pm(e: &Expr) -> Option<Vec<Expr>> {
    match e {
        Expr::PlusMinus(a, b) => Some(vec![
            Expr::Add(vec![(**a).clone(), (**b).clone()]),
            Expr::Add(vec![(**a).clone(), Expr::Neg(b.clone())]),
        ]),
        Expr::Set(xs) => Some(expand_items(xs)),
        other if other.is_scalar() => Some(vec![other.clone()]),
        _ => None,
    }
}

#[allow(clippy::too_many_arguments)]
fn relations(
    po: Rel,
    pl: &Expr,
    pr: &Expr,
    go: Rel,
    gl: &Expr,
    gr: &Expr,
    r: &mut &'static str,
) -> bool {
    let mut scratch = "";
    if po == go && equiv(pl, gl, &mut scratch) && equiv(pr, gr, &mut scratch) {
        return set(r, "same relation, equal sides", true);
    }
    if po.mirrored() == go && equiv(pl, gr, &mut scratch) && equiv(pr, gl, &mut scratch) {
        return set(r, "same relation read backwards", true);
    }
    if po == Rel::Eq && go == Rel::Eq {
        // `y = 2x + 1` and `2x - y + 1 = 0`: lhs - rhs proportional.
        let dp = Expr::Add(vec![pl.clone(), Expr::Neg(Box::new(pr.clone()))]);
        let dg = Expr::Add(vec![gl.clone(), Expr::Neg(Box::new(gr.clone()))]);
        if (dp.has_vars() || dg.has_vars()) && proportional(&dp, &dg) {
            return set(r, "equations with proportional sides", true);
        }
    }
    set(r, "different relations", false)
}

/// Deterministic pseudo-random numbers (SplitMix64): the same answer pair always gets the
/// same verdict.
struct SplitMix(u64);

impl SplitMix {
    fn next_unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Trial points for the variables: scales vary so that both small and large arguments (and
/// both signs) are tried.
fn points(vars: &[String], trials: usize) -> Vec<Vec<(String, C)>> {
    let mut rng = SplitMix(0x005E_ED0F_0E12);
    const SCALES: [f64; 4] = [2.0, 5.0, 0.9, 13.0];
    (0..trials)
        .map(|t| {
            vars.iter()
                .map(|v| {
                    let x = (rng.next_unit() * 2.0 - 1.0) * SCALES[t % SCALES.len()];
                    (v.clone(), C::real(x + 0.0123))
                })
                .collect()
        })
        .collect()
}

fn close(a: C, b: C, rel: f64, abs: f64) -> bool {
    let d = a.sub(b).abs();
    d <= abs || d <= rel * a.abs().max(b.abs())
}

/// `a / b` is the same non-zero constant at every trial point.
fn proportional(a: &Expr, b: &Expr) -> bool {
    let mut vars = a.vars();
    vars.extend(b.vars());
    vars.sort();
    vars.dedup();
    let mut ratio: Option<C> = None;
    let mut agree = 0;
    for env in points(&vars, 12) {
        let (x, y) = (complex(a, &env), complex(b, &env));
        if !x.is_finite() || !y.is_finite() || y.abs() < 1e-9 {
            continue;
        }
        let q = x.div(y);
        match ratio {
            None => ratio = Some(q),
            Some(r0) if close(q, r0, 1e-8, 1e-12) => {}
            Some(_) => return false,
        }
        agree += 1;
    }
    agree >= 3 && ratio.is_some_and(|q| q.abs() > 1e-12)
}

/// Number of decimals of a decimal literal reference (`0.33` → 2), `None` for anything else.
fn decimal_places(e: &Expr) -> Option<usize> {
    match e {
        Expr::Num(s) => s.split_once('.').map(|(_, f)| f.len()),
        Expr::Neg(x) => decimal_places(x),
        _ => None,
    }
}

fn numeric(p: &Expr, g: &Expr, r: &mut &'static str) -> bool {
    let (pv, gv) = (p.vars(), g.vars());
    if pv != gv {
        return set(r, "different variables", false);
    }
    if pv.is_empty() {
        return constants(p, g, r);
    }
    let mut agree = 0;
    for env in points(&pv, 16) {
        let (x, y) = (complex(p, &env), complex(g, &env));
        if !x.is_finite() || !y.is_finite() {
            continue;
        }
        if !close(x, y, 1e-8, 1e-10) {
            return set(r, "different values at a random point", false);
        }
        agree += 1;
        if agree >= 6 {
            break;
        }
    }
    set(r, "equal at random points", agree >= 2)
}

fn constants(p: &Expr, g: &Expr, r: &mut &'static str) -> bool {
    let (pe, ge) = (exact(p), exact(g));
    let (x, y) = (complex(p, &[]), complex(g, &[]));
    // The reference is a rounded decimal: an exact prediction that rounds to it counts,
    // unless it is itself a finite decimal (then it would have been written as the reference).
    let finite_decimal = pe.is_some_and(|a| a.terminates());
    if let (Some(places), None, false) = (decimal_places(g), decimal_places(p), finite_decimal) {
        if !x.is_finite() || !y.is_finite() {
            return set(r, "not a finite number", false);
        }
        let half_ulp = 0.5 * 10f64.powi(-(places.min(300) as i32));
        return set(
            r,
            "rounds to the decimal reference",
            x.im.abs() < 1e-12 && y.im == 0.0 && (x.re - y.re).abs() < half_ulp,
        );
    }
    if let (Some(a), Some(b)) = (pe, ge) {
        return set(r, "equal exact values", a == b);
    }
    if !x.is_finite() || !y.is_finite() {
        return set(r, "not a finite number", false);
    }
    if pe.is_some() || ge.is_some() {
        // One side is an exact rational, the other is not: only floating-point noise may
        // separate them (`\sin\frac{\pi}{6}` and `\frac12`), never a rounding.
        return set(r, "equal values", close(x, y, 1e-12, 1e-15));
    }
    set(r, "equal values", close(x, y, 1e-10, 1e-14))
}
