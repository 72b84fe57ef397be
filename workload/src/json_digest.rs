//! A JSON value's digest, taken as the value is deserialized and never built into a value of its
//! own: what tells two images (or other media parts of a chat message) apart, for megabytes of
//! base64.
//!
//! ```text
//! digest(v) = xxh3-64 over v's tokens: a tag byte per kind (null, bool, number, string, array
//!             start/end, object), then its bytes (strings with their length, numbers as 8 bytes)
//! object    = tag, entry count, Σ xxh3(key with its length, value's tokens)  (wrapping sum)
//! ```
//!
//! Equal JSON values give equal digests: texts that differ only in whitespace, in how a string is
//! escaped, or in the order of an object's keys (a client's serializer may order them either way).
//! Numbers are read as serde_json reads them: integers exactly, others as f64 (`1.0` and `1e0`
//! agree, `1` and `1.0` do not).

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
        let mut object = ObjectDigest::default();
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            object.entry(&key, &mut map)?;
        }
        self.tag(9);
        self.0.update(&object.digest().to_le_bytes());
        Ok(())
    }
}

/// The digest of an object's entries, whatever their order: for a caller that reads the object's
/// keys itself and digests only some of its entries.
#[derive(Debug, Default, Clone, Copy)]
pub struct ObjectDigest {
    entries: u64,
    sum: u64,
}

impl ObjectDigest {
    /// Digests the entry `key` whose value `map` reads next.
    pub fn entry<'de, A: MapAccess<'de>>(
        &mut self,
        key: &str,
        map: &mut A,
    ) -> Result<(), A::Error> {
        let mut hasher = Xxh3::new();
        let mut seed = DigestSeed(&mut hasher);
        seed.bytes(11, key.as_bytes());
        map.next_value_seed(seed)?;
        self.entries += 1;
        self.sum = self.sum.wrapping_add(hasher.digest());
        Ok(())
    }

    /// Whether no entry was digested.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// The digest of the entries so far.
    pub fn digest(&self) -> u64 {
        let mut hasher = Xxh3::new();
        hasher.update(&self.entries.to_le_bytes());
        hasher.update(&self.sum.to_le_bytes());
        hasher.digest()
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
        let reordered =
            digest_json(r#"{"detail":"auto","url":"data:image/png;base64,AAAA"}"#).unwrap();
        assert_eq!(a, same);
        assert_eq!(a, escaped);
        assert_eq!(a, reordered);
        for other in [
            r#"{"url":"data:image/png;base64,AAAB","detail":"auto"}"#,
            r#"{"url":"data:image/png;base64,AAAA","detail":"low"}"#,
            r#"{"url":"data:image/png;base64,AAAA"}"#,
            r#"{"url":"data:image/png;base64,AAAA","detail":"auto","x":null}"#,
            r#"{"detail":"data:image/png;base64,AAAA","url":"auto"}"#,
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
