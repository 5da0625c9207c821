//! A spanned TOML tree: every value and key remembers where it came from, so that any later
//! check can point at the exact place in the spec.

use std::ops::Range;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

/// Where a value came from: a byte range of the spec file, or a `--set` override.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    File(Range<usize>),
    Override(String),
}

impl Origin {
    pub fn span(&self) -> Option<Range<usize>> {
        match self {
            Origin::File(r) => Some(r.clone()),
            Origin::Override(_) => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Node {
    pub origin: Origin,
    pub value: Val,
}

#[derive(Debug, Clone)]
pub struct Key {
    pub name: String,
    pub origin: Origin,
}

#[derive(Debug, Clone)]
pub enum Val {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Datetime(String),
    /// An integer that does not fit in 64 bits: refused by `parse`, never seen past it.
    BigInt(String),
    Array(Vec<Node>),
    Table(Vec<(Key, Node)>),
}

impl Val {
    pub fn type_name(&self) -> &'static str {
        match self {
            Val::Str(_) => "a string",
            Val::Int(_) => "an integer",
            Val::Float(_) => "a float",
            Val::Bool(_) => "a boolean",
            Val::Datetime(_) => "a datetime",
            Val::BigInt(_) => "an integer",
            Val::Array(_) => "an array",
            Val::Table(_) => "a table",
        }
    }

    /// The plain JSON form (used for parameters and cache keys).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Val::Str(s) | Val::Datetime(s) | Val::BigInt(s) => J::String(s.clone()),
            Val::Int(i) => J::from(*i),
            Val::Float(f) => serde_json::Number::from_f64(*f).map(J::Number).unwrap_or(J::Null),
            Val::Bool(b) => J::Bool(*b),
            Val::Array(a) => J::Array(a.iter().map(|n| n.value.to_json()).collect()),
            Val::Table(t) => J::Object(t.iter().map(|(k, n)| (k.name.clone(), n.value.to_json())).collect()),
        }
    }
}

impl Node {
    pub fn span(&self) -> Option<Range<usize>> {
        self.origin.span()
    }

    pub fn as_table(&self) -> Option<&Vec<(Key, Node)>> {
        match &self.value {
            Val::Table(t) => Some(t),
            _ => None,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Node> {
        self.as_table()?.iter().find(|(k, _)| k.name == key).map(|(_, n)| n)
    }

    pub fn get_key(&self, key: &str) -> Option<&Key> {
        self.as_table()?.iter().find(|(k, _)| k.name == key).map(|(k, _)| k)
    }

    /// Sets `path` (dotted) inside this table, creating tables on the way.
    pub fn set_path(&mut self, path: &[&str], value: Node) -> Result<(), String> {
        let Val::Table(t) = &mut self.value else {
            return Err("is not a table".into());
        };
        let (first, rest) = path.split_first().ok_or("empty key")?;
        let pos = t.iter().position(|(k, _)| k.name == *first);
        if rest.is_empty() {
            match pos {
                Some(i) => t[i].1 = value,
                None => t.push((Key { name: first.to_string(), origin: value.origin.clone() }, value)),
            }
            return Ok(());
        }
        let i = match pos {
            Some(i) => i,
            None => {
                let origin = value.origin.clone();
                t.push((
                    Key { name: first.to_string(), origin: origin.clone() },
                    Node { origin, value: Val::Table(Vec::new()) },
                ));
                t.len() - 1
            }
        };
        t[i].1.set_path(rest, value).map_err(|e| format!("`{first}` {e}"))
    }
}

/// Why a spec's TOML was not read, and where.
#[derive(Debug)]
pub struct ParseError {
    pub span: Option<Range<usize>>,
    pub message: String,
}

/// Parses TOML text into a spanned tree.
pub fn parse(text: &str) -> Result<Node, ParseError> {
    let table =
        DeTable::parse(text).map_err(|e| ParseError { span: e.span(), message: e.message().trim().to_string() })?;
    let span = table.span();
    let value = table_val(table.into_inner());
    let node = Node { origin: Origin::File(span), value };
    match out_of_range(&node) {
        Some((span, digits)) => Err(ParseError { span, message: too_large(&digits) }),
        None => Ok(node),
    }
}

/// Parses the value of a `--set key=value` override: TOML when it parses, else a plain string.
pub fn parse_override(text: &str, origin: &str) -> Result<Node, String> {
    let origin = Origin::Override(origin.to_string());
    let value = match toml::de::DeValue::parse(text) {
        Ok(v) => strip(v.into_inner()),
        Err(_) => Val::Str(text.to_string()),
    };
    let node = Node { origin: origin.clone(), value };
    if let Some((_, digits)) = out_of_range(&node) {
        return Err(too_large(&digits));
    }
    fn reorigin(mut n: Node, o: &Origin) -> Node {
        n.origin = o.clone();
        n.value = match n.value {
            Val::Array(a) => Val::Array(a.into_iter().map(|x| reorigin(x, o)).collect()),
            Val::Table(t) => Val::Table(
                t.into_iter()
                    .map(|(mut k, v)| {
                        k.origin = o.clone();
                        (k, reorigin(v, o))
                    })
                    .collect(),
            ),
            v => v,
        };
        n
    }
    Ok(reorigin(node, &origin))
}

fn too_large(digits: &str) -> String {
    format!("the integer {} does not fit in 64 bits", super::error::excerpt(digits))
}

/// The first integer too large for 64 bits (kept as its digits by `convert`), and where.
fn out_of_range(node: &Node) -> Option<(Option<Range<usize>>, String)> {
    match &node.value {
        Val::BigInt(digits) => Some((node.span(), digits.clone())),
        Val::Array(a) => a.iter().find_map(out_of_range),
        Val::Table(t) => t.iter().find_map(|(_, n)| out_of_range(n)),
        _ => None,
    }
}

fn strip(v: DeValue<'_>) -> Val {
    convert(Spanned::new(0..0, v)).value
}

fn table_val(t: DeTable<'_>) -> Val {
    Val::Table(
        t.into_iter()
            .map(|(k, v)| {
                let key = Key { name: k.get_ref().to_string(), origin: Origin::File(k.span()) };
                (key, convert(v))
            })
            .collect(),
    )
}

fn convert(v: Spanned<DeValue<'_>>) -> Node {
    let origin = Origin::File(v.span());
    let value = match v.into_inner() {
        DeValue::String(s) => Val::Str(s.into_owned()),
        DeValue::Integer(i) => {
            let digits = i.as_str().replace('_', "");
            match i64::from_str_radix(&digits, i.radix()) {
                Ok(n) => Val::Int(n),
                Err(_) => Val::BigInt(digits),
            }
        }
        DeValue::Float(f) => {
            let s = f.as_str().replace('_', "");
            let n = match s.as_str() {
                "inf" | "+inf" => f64::INFINITY,
                "-inf" => f64::NEG_INFINITY,
                "nan" | "+nan" | "-nan" => f64::NAN,
                other => other.parse().unwrap_or(f64::NAN),
            };
            Val::Float(n)
        }
        DeValue::Boolean(b) => Val::Bool(b),
        DeValue::Datetime(d) => Val::Datetime(d.to_string()),
        DeValue::Array(a) => Val::Array(a.into_iter().map(convert).collect()),
        DeValue::Table(t) => table_val(t),
    };
    Node { origin, value }
}
