//! One string field of a JSONL line, pulled out of its object without building the others.

use std::fmt;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};

pub(crate) enum Found {
    Text(String),
    NotString(&'static str),
    Missing(Vec<String>),
}

/// Pulls one string field out of a JSON object, skipping the other fields without building them.
pub(crate) struct TextField<'k> {
    pub(crate) key: &'k str,
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
