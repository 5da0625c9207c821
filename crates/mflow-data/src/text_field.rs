//! One string field of a JSONL line, pulled out of its object without building the others.

use std::fmt;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};

/// The field `key` of the JSON object `json`, which must be all of `json`.
pub(crate) fn parse(json: &str, key: &str) -> serde_json::Result<Found> {
    let mut de = serde_json::Deserializer::from_str(json);
    let found = TextField { key }.deserialize(&mut de)?;
    de.end()?;
    Ok(found)
}

/// Whether serde_json refused a string for a lone UTF-16 surrogate escape (`"\ud800"`), which
/// has no UTF-8 form. Its error says so only in its message: one for a surrogate not followed
/// by an escape, one for a surrogate without its other half.
pub(crate) fn lone_surrogate(e: &serde_json::Error) -> bool {
    let text = e.to_string();
    e.is_syntax()
        && ["unexpected end of hex escape", "lone leading surrogate in hex escape"].iter().any(|m| text.starts_with(m))
}

/// serde_json's message with its "line 1" (the JSON text is one line) replaced by the column.
pub(crate) fn message(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let what = text.rsplit_once(" at line ").map_or(text.as_str(), |(w, _)| w);
    format!("{what} (column {})", e.column())
}

pub(crate) enum Found {
    Text(String),
    NotString(&'static str),
    Missing(Vec<String>),
}

/// Pulls one string field out of a JSON object, skipping the other fields without building them.
struct TextField<'k> {
    key: &'k str,
}

impl<'de> DeserializeSeed<'de> for TextField<'_> {
    type Value = Found;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TextField<'_> {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let mut found: Option<Found> = None;
        let mut fields = Vec::new();
        while let Some(k) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if found.is_none() && k == self.key {
                let v: serde_json::Value = map.next_value()?;
                found = Some(match v {
                    serde_json::Value::String(s) => Found::Text(s),
                    serde_json::Value::Null => Found::NotString("null"),
                    serde_json::Value::Bool(_) => Found::NotString("a boolean"),
                    serde_json::Value::Number(_) => Found::NotString("a number"),
                    serde_json::Value::Array(_) => Found::NotString("an array"),
                    serde_json::Value::Object(_) => Found::NotString("an object"),
                });
            } else {
                if fields.len() < 10 {
                    fields.push(k.into_owned());
                }
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found.unwrap_or(Found::Missing(fields)))
    }
}
