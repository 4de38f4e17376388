//! Values of answer trees: exact rationals (`i128`, every operation checked) when the answer
//! is a rational number, and complex `f64` otherwise (so `\sqrt{-4}`, `3 + 4i` and roots of
//! negative numbers evaluate instead of failing).
//!
//! Recursion follows the tree, whose depth the parser bounds; exponents and factorials are
//! bounded so that no answer takes more than microseconds to evaluate.

use super::expr::{Constant, Expr, Func};

/// An exact rational number in lowest terms with a positive denominator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ratio {
    num: i128,
    den: i128,
}

fn gcd(mut a: i128, mut b: i128) -> i128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.abs()
}

/// The largest exponent evaluated exactly or by repeated squaring.
const MAX_EXPONENT: i128 = 4096;

impl Ratio {
    pub(crate) fn new(num: i128, den: i128) -> Option<Self> {
        // `i128::MIN` has no absolute value: refusing it keeps `gcd` and `%` panic-free.
        if den == 0 || num == i128::MIN || den == i128::MIN {
            return None;
        }
        let g = gcd(num, den).max(1);
        let (mut num, mut den) = (num / g, den / g);
        if den < 0 {
            num = num.checked_neg()?;
            den = den.checked_neg()?;
        }
        Some(Self { num, den })
    }

    fn int(n: i128) -> Self {
        Self { num: n, den: 1 }
    }

    /// A decimal literal (`"12"`, `"0.25"`), when it fits.
    pub(crate) fn from_decimal(text: &str) -> Option<Self> {
        let (int, frac) = text.split_once('.').unwrap_or((text, ""));
        if int.len() + frac.len() > 36
            || !(int.chars().chain(frac.chars())).all(|c| c.is_ascii_digit())
        {
            return None;
        }
        let digits = format!("{int}{frac}");
        let num: i128 = if digits.is_empty() {
            0
        } else {
            digits.parse().ok()?
        };
        Self::new(num, 10i128.checked_pow(frac.len() as u32)?)
    }

    fn add(self, o: Self) -> Option<Self> {
        let num = self
            .num
            .checked_mul(o.den)?
            .checked_add(o.num.checked_mul(self.den)?)?;
        Self::new(num, self.den.checked_mul(o.den)?)
    }

    fn mul(self, o: Self) -> Option<Self> {
        Self::new(self.num.checked_mul(o.num)?, self.den.checked_mul(o.den)?)
    }

    pub(crate) fn div(self, o: Self) -> Option<Self> {
        self.mul(o.recip()?)
    }

    fn recip(self) -> Option<Self> {
        Self::new(self.den, self.num)
    }

    pub(crate) fn neg(self) -> Option<Self> {
        Some(Self {
            num: self.num.checked_neg()?,
            den: self.den,
        })
    }

    fn pow(self, e: i128) -> Option<Self> {
        if e.abs() > MAX_EXPONENT {
            return None;
        }
        let mut base = if e < 0 { self.recip()? } else { self };
        let mut e = e.unsigned_abs();
        let mut out = Self::int(1);
        while e > 0 {
            if e & 1 == 1 {
                out = out.mul(base)?;
            }
            e >>= 1;
            if e > 0 {
                base = base.mul(base)?;
            }
        }
        Some(out)
    }

    fn integer(self) -> Option<i128> {
        (self.den == 1).then_some(self.num)
    }

    fn sqrt(self) -> Option<Self> {
        let root = |n: i128| -> Option<i128> {
            if n < 0 {
                return None;
            }
            let r = (n as f64).sqrt().round() as i128;
            (r.checked_mul(r)? == n).then_some(r)
        };
        Self::new(root(self.num)?, root(self.den)?)
    }

    /// Whether the decimal expansion ends (the denominator has no prime factor but 2 and 5).
    pub(crate) fn terminates(self) -> bool {
        let mut d = self.den;
        while d % 2 == 0 {
            d /= 2;
        }
        while d % 5 == 0 {
            d /= 5;
        }
        d == 1
    }

    pub(crate) fn to_f64(self) -> f64 {
        self.num as f64 / self.den as f64
    }
}

/// The exact value of a rational answer (`\frac{3}{4}`, `0.75`, `2^{-2}`, `\sqrt{16}`,
/// `5!`), or `None` when it is not rational or overflows.
pub(crate) fn exact(e: &Expr) -> Option<Ratio> {
    match e {
        Expr::Num(s) => Ratio::from_decimal(s),
        Expr::Add(xs) => xs
            .iter()
            .try_fold(Ratio::int(0), |acc, x| acc.add(exact(x)?)),
        Expr::Mul(xs) => xs
            .iter()
            .try_fold(Ratio::int(1), |acc, x| acc.mul(exact(x)?)),
        Expr::Neg(x) => exact(x)?.neg(),
        Expr::Percent(x) => exact(x),
        Expr::Div(a, b) => exact(a)?.mul(exact(b)?.recip()?),
        Expr::Pow(b, p) => {
            let p = exact(p)?;
            let b = exact(b)?;
            match p.integer() {
                Some(n) => b.pow(n),
                None if p == Ratio::new(1, 2)? => b.sqrt(),
                None => None,
            }
        }
        Expr::Call(Func::Sqrt, xs) => exact(xs.first()?)?.sqrt(),
        Expr::Call(Func::Abs, xs) => {
            let v = exact(xs.first()?)?;
            if v.num < 0 {
                v.neg()
            } else {
                Some(v)
            }
        }
        Expr::Call(Func::Factorial, xs) => {
            let n = exact(xs.first()?)?.integer()?;
            if !(0..=33).contains(&n) {
                return None;
            }
            (1..=n).try_fold(Ratio::int(1), |acc, k| acc.mul(Ratio::int(k)))
        }
        Expr::Call(Func::Binom, xs) => {
            let n = exact(xs.first()?)?.integer()?;
            let k = exact(xs.get(1)?)?.integer()?;
            if k < 0 || n < 0 || k > n {
                return (k >= 0 && n >= 0).then_some(Ratio::int(0));
            }
            let k = k.min(n - k);
            if k > 1000 {
                return None;
            }
            let mut acc = Ratio::int(1);
            for j in 0..k {
                acc = acc.mul(Ratio::new(n - j, j + 1)?)?;
            }
            Some(acc)
        }
        _ => None,
    }
}

/// A complex number, for numeric evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct C {
    pub re: f64,
    pub im: f64,
}

impl C {
    pub(crate) const NAN: C = C {
        re: f64::NAN,
        im: f64::NAN,
    };

    pub(crate) fn real(re: f64) -> Self {
        Self { re, im: 0.0 }
    }

    pub(crate) fn is_finite(self) -> bool {
        self.re.is_finite() && self.im.is_finite()
    }

    pub(crate) fn abs(self) -> f64 {
        self.re.hypot(self.im)
    }

    fn add(self, o: C) -> C {
        C {
            re: self.re + o.re,
            im: self.im + o.im,
        }
    }

    pub(crate) fn sub(self, o: C) -> C {
        C {
            re: self.re - o.re,
            im: self.im - o.im,
        }
    }

    fn mul(self, o: C) -> C {
        C {
            re: self.re * o.re - self.im * o.im,
            im: self.re * o.im + self.im * o.re,
        }
    }

    pub(crate) fn div(self, o: C) -> C {
        let d = o.re * o.re + o.im * o.im;
        if d == 0.0 {
            return C::NAN;
        }
        C {
            re: (self.re * o.re + self.im * o.im) / d,
            im: (self.im * o.re - self.re * o.im) / d,
        }
    }

    fn exp(self) -> C {
        let m = self.re.exp();
        C {
            re: m * self.im.cos(),
            im: m * self.im.sin(),
        }
    }

    fn ln(self) -> C {
        if self.re == 0.0 && self.im == 0.0 {
            return C::NAN;
        }
        C {
            re: self.abs().ln(),
            im: self.im.atan2(self.re),
        }
    }

    fn powi(self, n: i64) -> C {
        let mut base = if n < 0 { C::real(1.0).div(self) } else { self };
        let mut e = n.unsigned_abs();
        let mut out = C::real(1.0);
        while e > 0 {
            if e & 1 == 1 {
                out = out.mul(base);
            }
            base = base.mul(base);
            e >>= 1;
        }
        out
    }

    fn pow(self, p: C) -> C {
        if p.im == 0.0 && p.re.fract() == 0.0 && p.re.abs() <= 1e9 {
            return self.powi(p.re as i64);
        }
        if self.im == 0.0 && p.im == 0.0 && self.re >= 0.0 {
            return C::real(self.re.powf(p.re));
        }
        p.mul(self.ln()).exp()
    }

    fn sqrt(self) -> C {
        if self.im == 0.0 {
            return if self.re >= 0.0 {
                C::real(self.re.sqrt())
            } else {
                C {
                    re: 0.0,
                    im: (-self.re).sqrt(),
                }
            };
        }
        self.pow(C::real(0.5))
    }

    fn sin(self) -> C {
        C {
            re: self.re.sin() * self.im.cosh(),
            im: self.re.cos() * self.im.sinh(),
        }
    }

    fn cos(self) -> C {
        C {
            re: self.re.cos() * self.im.cosh(),
            im: -self.re.sin() * self.im.sinh(),
        }
    }
}

/// The value of `e` with variables bound by `env` (unbound variables and non-numbers give
/// NaN, which never compares equal).
pub(crate) fn complex(e: &Expr, env: &[(String, C)]) -> C {
    let arg = |xs: &[Expr], i: usize| xs.get(i).map_or(C::NAN, |x| complex(x, env));
    match e {
        Expr::Num(s) => s.parse::<f64>().map_or(C::NAN, C::real),
        Expr::Const(Constant::Pi) => C::real(std::f64::consts::PI),
        Expr::Const(Constant::E) => C::real(std::f64::consts::E),
        Expr::Const(Constant::I) => C { re: 0.0, im: 1.0 },
        Expr::Var(v) => env
            .iter()
            .find(|(name, _)| name == v)
            .map_or(C::NAN, |(_, x)| *x),
        Expr::Add(xs) => xs
            .iter()
            .fold(C::real(0.0), |acc, x| acc.add(complex(x, env))),
        Expr::Mul(xs) => xs
            .iter()
            .fold(C::real(1.0), |acc, x| acc.mul(complex(x, env))),
        Expr::Neg(x) => C::real(0.0).sub(complex(x, env)),
        Expr::Percent(x) => complex(x, env),
        Expr::Div(a, b) => complex(a, env).div(complex(b, env)),
        Expr::Pow(a, b) => complex(a, env).pow(complex(b, env)),
        Expr::Call(f, xs) => call(*f, xs, env, &arg),
        _ => C::NAN,
    }
}

fn real_only(x: C, f: impl Fn(f64) -> f64) -> C {
    if x.im == 0.0 {
        C::real(f(x.re))
    } else {
        C::NAN
    }
}

fn call(f: Func, xs: &[Expr], env: &[(String, C)], arg: &dyn Fn(&[Expr], usize) -> C) -> C {
    let x = arg(xs, 0);
    match f {
        Func::Sqrt => x.sqrt(),
        Func::Root => {
            let v = arg(xs, 1);
            // An odd root of a negative real is the real root (`\sqrt[3]{-8} = -2`).
            if x.im == 0.0 && x.re.fract() == 0.0 && x.re.rem_euclid(2.0) == 1.0 && v.im == 0.0 {
                C::real(v.re.signum() * v.re.abs().powf(1.0 / x.re))
            } else {
                v.pow(C::real(1.0).div(x))
            }
        }
        Func::Sin => x.sin(),
        Func::Cos => x.cos(),
        Func::Tan => x.sin().div(x.cos()),
        Func::Cot => x.cos().div(x.sin()),
        Func::Sec => C::real(1.0).div(x.cos()),
        Func::Csc => C::real(1.0).div(x.sin()),
        Func::Asin => real_only(x, f64::asin),
        Func::Acos => real_only(x, f64::acos),
        Func::Atan => real_only(x, f64::atan),
        Func::Sinh => real_only(x, f64::sinh),
        Func::Cosh => real_only(x, f64::cosh),
        Func::Tanh => real_only(x, f64::tanh),
        Func::Ln => x.ln(),
        Func::Log if xs.len() == 2 => arg(xs, 1).ln().div(x.ln()),
        Func::Log => x.ln().div(C::real(std::f64::consts::LN_10)),
        Func::Exp => x.exp(),
        Func::Abs => C::real(x.abs()),
        Func::Floor => real_only(x, f64::floor),
        Func::Ceil => real_only(x, f64::ceil),
        Func::Factorial | Func::Binom => {
            let _ = env;
            exact(&Expr::Call(f, xs.to_vec())).map_or(C::NAN, |r| C::real(r.to_f64()))
        }
    }
}

/// The value of a number written in base `base`, when its digits are valid and it fits.
pub(crate) fn based_value(digits: &str, base: u32) -> Option<u128> {
    digits.chars().try_fold(0u128, |acc, c| {
        let d = c.to_digit(36).filter(|&d| d < base)?;
        acc.checked_mul(base as u128)?.checked_add(d as u128)
    })
}
