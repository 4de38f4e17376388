//! LaTeX answer text → tokens, in one linear pass.
//!
//! The lexer already drops what never changes an answer's value (spacing commands, `$`,
//! `\left`/`\right`, `\displaystyle`, `^\circ`, sizing commands), joins thousands separators
//! (`1,000`, `1{,}000`, `1\,000`) into one number and reads `\text{…}`-like groups as one text
//! token, so the parser only sees mathematics.

use super::ParseError;

/// One lexical unit of an answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Tok {
    /// A decimal literal without separators: `"1000"`, `"0.5"`, `".5"` (read as `0.5`).
    Num(String),
    /// A run of ASCII letters (`x`, `xy`, `cm`, `sin`); the parser splits or interprets it.
    Word(String),
    /// A control word without its backslash (`frac`, `pi`, `sqrt`, `le`).
    Cmd(String),
    /// The content of `\text{…}`, `\mbox{…}`, `\mathrm{…}`, `\operatorname{…}` (raw).
    Text(String),
    /// `\begin{name}` (with the argument of `array`-like environments skipped).
    Begin(String),
    /// `\end{name}`.
    End(String),
    /// `\{`: an opening set brace.
    SetOpen,
    /// `\}`: a closing set brace.
    SetClose,
    /// `\\`: a matrix row separator.
    RowSep,
    /// Any other significant character: `+ - * / ^ _ ( ) [ ] { } , ; = < > | ! & ' %`.
    Sym(char),
}

/// Commands that never change the value of an answer.
const IGNORED_COMMANDS: &[&str] = &[
    "left",
    "right",
    "bigl",
    "bigr",
    "Bigl",
    "Bigr",
    "biggl",
    "biggr",
    "Biggl",
    "Biggr",
    "big",
    "Big",
    "bigg",
    "Bigg",
    "displaystyle",
    "textstyle",
    "scriptstyle",
    "limits",
    "nolimits",
    "quad",
    "qquad",
    "hfill",
    "hspace",
    "vspace",
    "nonumber",
    "notag",
    "circ",
    "degree",
    "degrees",
    "dollar",
    "mathstrut",
    "strut",
    "boxed",
    "fbox",
    "phantom",
];

/// Commands whose brace argument is text (read raw as a [`Tok::Text`]).
const TEXT_COMMANDS: &[&str] = &[
    "text",
    "mbox",
    "mathrm",
    "textrm",
    "textnormal",
    "operatorname",
    "textup",
    "textsf",
    "mathsf",
    "textit",
    "mathit",
    "emph",
];

/// Commands that are only styling around their argument: the command is dropped and the
/// argument lexed as mathematics (`\textbf{18}` → `18`).
const STYLE_COMMANDS: &[&str] = &[
    "textbf",
    "mathbf",
    "boldsymbol",
    "bm",
    "mathbb",
    "mathcal",
    "mathnormal",
    "underline",
    "overline",
    "color",
];

/// Splits `src` into tokens. Fails on characters that have no meaning in an answer.
pub(crate) fn lex(src: &str) -> Result<Vec<Tok>, ParseError> {
    let chars: Vec<char> = src.chars().collect();
    let mut toks = Vec::with_capacity(chars.len() / 2 + 1);
    let mut i = 0;
    // Open round or square brackets (tuples, intervals) around the current position.
    let mut depth = 0usize;
    while i < chars.len() {
        let c = chars[i];
        match c {
            c if c.is_whitespace() || c == '~' || c == '$' => i += 1,
            '0'..='9' => i = lex_number(&chars, i, depth > 0, &mut toks),
            '.' if chars.get(i + 1).is_some_and(char::is_ascii_digit) => {
                i = lex_number(&chars, i, depth > 0, &mut toks)
            }
            'a'..='z' | 'A'..='Z' => {
                let start = i;
                while i < chars.len() && chars[i].is_ascii_alphabetic() {
                    i += 1;
                }
                toks.push(Tok::Word(chars[start..i].iter().collect()));
            }
            '\\' => i = lex_backslash(&chars, i, &mut toks)?,
            '{' if chars.get(i + 1) == Some(&',') && chars.get(i + 2) == Some(&'}') => {
                // `{,}` outside a number: a plain comma.
                toks.push(Tok::Sym(','));
                i += 3;
            }
            '(' | '[' => {
                depth += 1;
                toks.push(Tok::Sym(c));
                i += 1;
            }
            ')' | ']' => {
                depth = depth.saturating_sub(1);
                toks.push(Tok::Sym(c));
                i += 1;
            }
            '+' | '-' | '*' | '/' | '^' | '_' | '{' | '}' | ',' | ';' | '=' | '<' | '>' | '|'
            | '!' | '&' | '\'' | '%' | ':' => {
                toks.push(Tok::Sym(c));
                i += 1;
            }
            '.' => i += 1, // a full stop after the answer
            _ => {
                if let Some(t) = unicode_token(c) {
                    if let Some(t) = t {
                        toks.push(t);
                    }
                    i += 1;
                } else {
                    return Err(ParseError::Unexpected(c.to_string()));
                }
            }
        }
    }
    Ok(toks)
}

/// The token of a Unicode mathematical character (`Some(None)`: a character to skip).
fn unicode_token(c: char) -> Option<Option<Tok>> {
    let cmd = |s: &str| Some(Some(Tok::Cmd(s.to_string())));
    match c {
        'π' => cmd("pi"),
        '∞' => cmd("infty"),
        '√' => cmd("sqrt"),
        '≤' => cmd("le"),
        '≥' => cmd("ge"),
        '≠' => cmd("ne"),
        '±' => cmd("pm"),
        '∪' => cmd("cup"),
        '∩' => cmd("cap"),
        '×' => Some(Some(Tok::Sym('*'))),
        '·' | '⋅' => Some(Some(Tok::Sym('*'))),
        '÷' => Some(Some(Tok::Sym('/'))),
        '−' | '–' => Some(Some(Tok::Sym('-'))),
        '°' | '\u{a0}' | '\u{2009}' | '\u{200b}' => Some(None),
        _ => None,
    }
}

/// Reads a number starting at `start`, with thousands separators (`,`, `{,}`, `\,`, `\ `)
/// joined when every group after the first has exactly three digits. Returns the next index.
fn lex_number(chars: &[char], start: usize, in_brackets: bool, toks: &mut Vec<Tok>) -> usize {
    let digits_at = |i: usize| {
        let mut j = i;
        while j < chars.len() && chars[j].is_ascii_digit() {
            j += 1;
        }
        j - i
    };
    let mut text = String::new();
    let mut i = start;
    let first = digits_at(i);
    text.extend(&chars[i..i + first]);
    i += first;
    if first > 0 && first <= 3 {
        loop {
            // The separator spellings: `{,}`  `,\!` (MATH's own)  `\,`  `\ `  a thin space, and a
            // plain `,` outside brackets only (`(12,102)` is a pair, `12,102` a number).
            let sep_len = match chars.get(i) {
                Some(',') if chars.get(i + 1) == Some(&'\\') && chars.get(i + 2) == Some(&'!') => {
                    let mut j = i + 3;
                    while chars.get(j).is_some_and(|c| c.is_whitespace()) {
                        j += 1;
                    }
                    j - i
                }
                Some(',') if !in_brackets => 1,
                Some('{') if chars.get(i + 1) == Some(&',') && chars.get(i + 2) == Some(&'}') => {
                    let mut j = i + 3;
                    while chars.get(j).is_some_and(|c| c.is_whitespace()) {
                        j += 1;
                    }
                    j - i
                }
                Some('\\') if matches!(chars.get(i + 1), Some(',' | ' ' | '!')) => 2,
                Some('\u{2009}') => 1,
                _ => 0,
            };
            if sep_len == 0 || digits_at(i + sep_len) != 3 {
                break;
            }
            // `1,234.5` yes; `1,2345` no (checked above); a following `,` group is checked next.
            text.extend(&chars[i + sep_len..i + sep_len + 3]);
            i += sep_len + 3;
        }
    }
    if chars.get(i) == Some(&'.') && chars.get(i + 1).is_some_and(char::is_ascii_digit) {
        text.push('.');
        i += 1;
        let n = digits_at(i);
        text.extend(&chars[i..i + n]);
        i += n;
    }
    if text.starts_with('.') {
        text.insert(0, '0');
    }
    toks.push(Tok::Num(text));
    i
}

/// Reads a brace group `{…}` starting at `open` (which must be `{`); returns its raw content
/// and the index after the closing brace, or `None` when it is never closed.
fn brace_group(chars: &[char], open: usize) -> Option<(String, usize)> {
    let mut depth = 0usize;
    let mut i = open;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 1,
            '{' => depth += 1,
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some((chars[open + 1..i].iter().collect(), i + 1));
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

fn skip_spaces(chars: &[char], mut i: usize) -> usize {
    while i < chars.len() && chars[i].is_whitespace() {
        i += 1;
    }
    i
}

/// Lexes a backslash sequence at `start`; returns the next index.
fn lex_backslash(chars: &[char], start: usize, toks: &mut Vec<Tok>) -> Result<usize, ParseError> {
    let Some(&next) = chars.get(start + 1) else {
        return Ok(start + 1);
    };
    if !next.is_ascii_alphabetic() {
        match next {
            '{' => toks.push(Tok::SetOpen),
            '}' => toks.push(Tok::SetClose),
            '\\' => toks.push(Tok::RowSep),
            '%' => toks.push(Tok::Sym('%')),
            '|' => toks.push(Tok::Sym('|')),
            // `\,` `\;` `\:` `\!` `\ ` `\$` `\&`-less spacing and escapes: nothing.
            _ => {}
        }
        return Ok(start + 2);
    }
    let mut i = start + 1;
    while i < chars.len() && chars[i].is_ascii_alphabetic() {
        i += 1;
    }
    let name: String = chars[start + 1..i].iter().collect();
    if name == "left" || name == "right" {
        // `\left.` and `\right.` are invisible delimiters.
        let j = skip_spaces(chars, i);
        if chars.get(j) == Some(&'.') {
            return Ok(j + 1);
        }
        return Ok(i);
    }
    if IGNORED_COMMANDS.contains(&name.as_str()) {
        if matches!(name.as_str(), "hspace" | "vspace" | "phantom" | "color") {
            let j = skip_spaces(chars, i);
            if chars.get(j) == Some(&'{') {
                if let Some((_, end)) = brace_group(chars, j) {
                    return Ok(end);
                }
            }
        }
        return Ok(i);
    }
    if TEXT_COMMANDS.contains(&name.as_str()) {
        let j = skip_spaces(chars, i);
        if chars.get(j) == Some(&'{') {
            let (content, end) =
                brace_group(chars, j).ok_or(ParseError::Unbalanced("text group"))?;
            toks.push(Tok::Text(content));
            return Ok(end);
        }
        return Ok(i);
    }
    if STYLE_COMMANDS.contains(&name.as_str()) {
        if name == "color" {
            let j = skip_spaces(chars, i);
            if let Some((_, end)) = (chars.get(j) == Some(&'{'))
                .then(|| brace_group(chars, j))
                .flatten()
            {
                return Ok(end);
            }
        }
        return Ok(i);
    }
    if name == "begin" || name == "end" {
        let j = skip_spaces(chars, i);
        if chars.get(j) != Some(&'{') {
            return Err(ParseError::Unexpected(format!("\\{name}")));
        }
        let (env, mut end) =
            brace_group(chars, j).ok_or(ParseError::Unbalanced("environment name"))?;
        let env = env.trim().trim_end_matches('*').to_string();
        if name == "begin" {
            // `\begin{array}{cc}`: skip the column specification.
            if env == "array" {
                let k = skip_spaces(chars, end);
                if chars.get(k) == Some(&'{') {
                    if let Some((_, e)) = brace_group(chars, k) {
                        end = e;
                    }
                }
            }
            toks.push(Tok::Begin(env));
        } else {
            toks.push(Tok::End(env));
        }
        return Ok(end);
    }
    let canonical = match name.as_str() {
        "dfrac" | "tfrac" | "cfrac" => "frac",
        "dbinom" | "tbinom" => "binom",
        "leq" | "leqslant" => "le",
        "geq" | "geqslant" => "ge",
        "neq" => "ne",
        "lt" => "<",
        "gt" => ">",
        "varpi" => "pi",
        "infin" => "infty",
        "lbrace" => "{set",
        "rbrace" => "}set",
        "langle" => "(",
        "rangle" => ")",
        "lvert" | "rvert" | "vert" | "mid" => "|",
        "cdot" | "times" | "ast" => "*",
        "div" => "/",
        "colon" => ":",
        "lbrack" => "[",
        "rbrack" => "]",
        other => other,
    };
    let tok = match canonical {
        "{set" => Tok::SetOpen,
        "}set" => Tok::SetClose,
        "<" | ">" | "(" | ")" | "|" | "*" | "/" | ":" | "[" | "]" => {
            Tok::Sym(canonical.chars().next().unwrap_or('*'))
        }
        _ => Tok::Cmd(canonical.to_string()),
    };
    toks.push(tok);
    Ok(i)
}
