//! Feeds arbitrary bytes to `mflow_untrusted::json::shape`, which measures a JSON document
//! without building it. It must accept exactly what serde_json accepts, never panic, and count
//! what serde_json builds: as many containers and scalars (objects may hold fewer entries than
//! counted, where a key is repeated), and strings of as many bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mflow_untrusted::json::{shape, Shape};
use serde_json::Value;

/// The same counts, walking a built value.
fn count(v: &Value, s: &mut Shape) {
    match v {
        Value::Null | Value::Bool(_) | Value::Number(_) => s.scalars += 1,
        Value::String(t) => {
            s.strings += 1;
            s.string_bytes += t.len() as u64;
        }
        Value::Array(a) => {
            s.arrays += 1;
            s.items += a.len() as u64;
            a.iter().for_each(|e| count(e, s));
        }
        Value::Object(o) => {
            s.objects += 1;
            s.items += o.len() as u64;
            s.keys += o.len() as u64;
            for (k, e) in o {
                s.string_bytes += k.len() as u64;
                count(e, s);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let measured = shape(data);
    let parsed = serde_json::from_slice::<Value>(data);
    assert_eq!(measured.is_ok(), parsed.is_ok(), "{measured:?} / {parsed:?}");
    let (Ok(m), Ok(v)) = (measured, parsed) else { return };
    let mut built = Shape::default();
    count(&v, &mut built);
    assert_eq!((m.arrays, m.objects), (built.arrays, built.objects));
    // A repeated key is counted each time it is read, and kept once.
    assert!(m.scalars >= built.scalars && m.strings >= built.strings && m.keys >= built.keys);
    assert!(m.string_bytes >= built.string_bytes && m.items >= built.items);
    if m.keys == built.keys {
        assert_eq!(m, Shape { value_bytes: m.value_bytes, depth: m.depth, ..built });
    }
    assert!(m.value_bytes() >= built.string_bytes);
});
