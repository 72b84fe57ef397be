//! A JSON value's digest, taken as the value is read and never built: what tells two images (or
//! other media parts of a chat message) apart, for megabytes of base64 without a copy of them.
//!
//! ```text
//! digest = xxh3-64 over the value's tokens in document order: a tag byte per kind
//!          (null, bool, number, string, array start/end, object start/end, key), then
//!          its bytes (strings and keys with their length, numbers as 8 bytes)
//! ```
//!
//! Equal JSON texts give equal digests; so do texts that differ only in whitespace or in how a
//! string is escaped. Object keys are taken in the order written (engines do not reorder them).

use serde::Deserializer;
use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use std::fmt;
use xxhash_rust::xxh3::Xxh3;

/// Feeds the next value of a deserializer into `hasher`.
pub struct DigestSeed<'a>(pub &'a mut Xxh3);

impl fmt::Debug for DigestSeed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DigestSeed")
    }
}

impl DigestSeed<'_> {
    fn tag(&mut self, tag: u8) {
        self.0.update(&[tag]);
    }

    fn bytes(&mut self, tag: u8, b: &[u8]) {
        self.tag(tag);
        self.0.update(&(b.len() as u64).to_le_bytes());
        self.0.update(b);
    }
}

impl<'de> DeserializeSeed<'de> for DigestSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(mut self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(&mut self)
    }
}

impl<'de> Visitor<'de> for &mut DigestSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.tag(0);
        Ok(())
    }

    fn visit_none<E>(self) -> Result<(), E> {
        self.tag(0);
        Ok(())
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.tag(if v { 2 } else { 1 });
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.bytes(3, &v.to_le_bytes());
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.bytes(4, &v.to_le_bytes());
        Ok(())
    }

    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        self.bytes(5, &v.to_le_bytes());
        Ok(())
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.bytes(6, v.as_bytes());
        Ok(())
    }

    fn visit_bytes<E>(self, v: &[u8]) -> Result<(), E> {
        self.bytes(6, v);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.tag(7);
        while seq.next_element_seed(DigestSeed(self.0))?.is_some() {}
        self.tag(8);
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.tag(9);
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            self.bytes(11, key.as_bytes());
            map.next_value_seed(DigestSeed(self.0))?;
        }
        self.tag(10);
        Ok(())
    }
}

/// The digest of one JSON text (for tests and callers holding a whole value).
pub fn digest_json(text: &str) -> serde_json::Result<u64> {
    let mut hasher = Xxh3::new();
    let mut de = serde_json::Deserializer::from_str(text);
    DigestSeed(&mut hasher).deserialize(&mut de)?;
    de.end()?;
    Ok(hasher.digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_agree_and_any_difference_shows() {
        let a = digest_json(r#"{"url": "data:image/png;base64,AAAA", "detail": "auto"}"#).unwrap();
        let same = digest_json(r#"{"url":"data:image/png;base64,AAAA","detail":"auto"}"#).unwrap();
        let escaped =
            digest_json(r#"{"url":"data:image\/png;base64,AAAA","detail":"auto"}"#).unwrap();
        assert_eq!(a, same);
        assert_eq!(a, escaped);
        for other in [
            r#"{"url":"data:image/png;base64,AAAB","detail":"auto"}"#,
            r#"{"url":"data:image/png;base64,AAAA","detail":"low"}"#,
            r#"{"url":"data:image/png;base64,AAAA"}"#,
            r#"{"detail":"auto","url":"data:image/png;base64,AAAA"}"#,
            r#"["data:image/png;base64,AAAA","auto"]"#,
        ] {
            assert_ne!(a, digest_json(other).unwrap(), "{other}");
        }
        // Kinds are told apart, not only contents: "1" and 1, [] and {}, null and false.
        for (x, y) in [
            ("\"1\"", "1"),
            ("[]", "{}"),
            ("null", "false"),
            ("1", "1.0"),
        ] {
            assert_ne!(digest_json(x).unwrap(), digest_json(y).unwrap(), "{x} {y}");
        }
    }

    #[test]
    fn nested_values_and_bad_json() {
        let v = r#"{"a":[1,{"b":[null,true,-2,3.5,"x"]}],"c":{}}"#;
        assert_eq!(digest_json(v).unwrap(), digest_json(v).unwrap());
        assert_ne!(
            digest_json(v).unwrap(),
            digest_json(r#"{"a":[1,{"b":[null,true,-2,3.5,"y"]}],"c":{}}"#).unwrap()
        );
        assert!(digest_json(r#"{"a":"#).is_err());
        assert!(digest_json(r#"{"a":1} x"#).is_err());
    }
}
