//! The configuration reference (docs/configuration.md) and the JSON Schema of `headroom serve`'s
//! config, generated from the config types: their doc comments, types and defaults. A test keeps
//! the committed reference equal to what the types say.

use serde_json::Value;

use crate::serve::ServeConfig;

/// The JSON Schema of the `headroom serve` config (draft 2020-12), for editors and validators.
pub fn schema() -> Value {
    schemars::schema_for!(ServeConfig).to_value()
}

/// The configuration reference in Markdown: one table per section, in the order of the config.
pub fn markdown() -> String {
    let schema = schema();
    let defs = &schema["$defs"];
    let mut out = String::from(
        "# Configuration reference\n\n\
         Generated from the config types by `headroom config reference` (do not edit by hand; a test\n\
         checks it is current). `headroom serve --config FILE --check` validates a file; every setting\n\
         with a default may be left out. A commented example of every section:\n\
         [config/examples/headroom.toml](../config/examples/headroom.toml). The JSON Schema of the same\n\
         types (`headroom config schema`) lets an editor check a file as it is written.\n",
    );
    let mut top = Vec::new();
    let mut sections = Vec::new();
    for (name, prop) in properties(&schema) {
        match section_of(prop, defs) {
            Some((kind, def)) => sections.push((name, kind, def, prop)),
            None => top.push((name.clone(), prop.clone())),
        }
    }
    out.push_str("\n## Top level\n\n");
    out.push_str(&table(&top, defs, required(&schema)));
    for (name, kind, def, prop) in sections {
        let heading = match kind {
            Kind::Table => format!("[{name}]"),
            Kind::Array => format!("[[{name}]]"),
            Kind::Map => format!("[{name}.NAME]"),
        };
        out.push_str(&format!("\n## `{heading}`\n\n"));
        if let Some(d) = description(prop).or_else(|| description(def)) {
            out.push_str(&format!("{d}\n\n"));
        }
        write_def(&mut out, &heading, def, defs);
    }
    out
}

/// How a section nests in TOML.
#[derive(Clone, Copy)]
enum Kind {
    /// `[name]`
    Table,
    /// `[[name]]`
    Array,
    /// `[name.KEY]`
    Map,
}

/// The struct a property holds, and how, when it holds one.
fn section_of<'a>(prop: &'a Value, defs: &'a Value) -> Option<(Kind, &'a Value)> {
    if let Some(def) = deref(prop, defs) {
        return Some((Kind::Table, def));
    }
    if let Some(def) = prop.get("items").and_then(|i| deref(i, defs)) {
        return Some((Kind::Array, def));
    }
    if let Some(def) = prop
        .get("additionalProperties")
        .and_then(|i| deref(i, defs))
    {
        return Some((Kind::Map, def));
    }
    None
}

/// The definition a `$ref` (possibly wrapped in `allOf`, or in `anyOf` with null: an optional
/// table) points at.
fn deref<'a>(v: &'a Value, defs: &'a Value) -> Option<&'a Value> {
    let r = v
        .get("$ref")
        .or_else(|| v.get("allOf").and_then(|a| a.get(0)?.get("$ref")))
        .or_else(|| {
            v.get("anyOf")?
                .as_array()?
                .iter()
                .find_map(|x| x.get("$ref"))
        })?
        .as_str()?;
    defs.get(r.strip_prefix("#/$defs/")?)
}

/// A definition's table, then the tables of the structs it nests.
fn write_def(out: &mut String, heading: &str, def: &Value, defs: &Value) {
    let mut plain = Vec::new();
    let mut nested = Vec::new();
    for (name, prop) in properties(def) {
        match section_of(prop, defs) {
            Some((kind, d)) => nested.push((name, kind, d)),
            None => plain.push((name.clone(), prop.clone())),
        }
    }
    out.push_str(&table(&plain, defs, required(def)));
    for (name, kind, d) in nested {
        let inner = heading.trim_start_matches('[').trim_end_matches(']');
        let sub = match kind {
            Kind::Table => format!("[{inner}.{name}]"),
            Kind::Array => format!("[[{inner}.{name}]]"),
            Kind::Map => format!("[{inner}.{name}.NAME]"),
        };
        out.push_str(&format!("\n### `{sub}`\n\n"));
        if let Some(desc) = description(d) {
            out.push_str(&format!("{desc}\n\n"));
        }
        write_def(out, &sub, d, defs);
    }
}

fn properties(def: &Value) -> Vec<(&String, &Value)> {
    def["properties"]
        .as_object()
        .map(|m| m.iter().collect())
        .unwrap_or_default()
}

fn required(def: &Value) -> Vec<&str> {
    def["required"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn description(v: &Value) -> Option<String> {
    v["description"]
        .as_str()
        .map(|d| d.split_whitespace().collect::<Vec<_>>().join(" "))
}

fn table(rows: &[(String, Value)], defs: &Value, required: Vec<&str>) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut t = String::from("| key | type | default | meaning |\n|---|---|---|---|\n");
    for (name, prop) in rows {
        let default = match prop.get("default") {
            Some(Value::Null) => "unset".to_owned(),
            Some(d) => format!("`{}`", toml_value(d)),
            None if required.contains(&name.as_str()) => "required".to_owned(),
            None => "unset".to_owned(),
        };
        t.push_str(&format!(
            "| `{name}` | {} | {default} | {} |\n",
            type_name(prop, defs),
            description(prop).unwrap_or_default().replace('|', "\\|")
        ));
    }
    t
}

fn type_name(prop: &Value, defs: &Value) -> String {
    let one = |t: &str| match t {
        "array" => format!("list of {}", type_name(&prop["items"], defs)),
        "object" => "table".to_owned(),
        other => other.to_owned(),
    };
    match &prop["type"] {
        Value::String(t) => one(t),
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .filter(|t| *t != "null")
            .map(one)
            .collect::<Vec<_>>()
            .join(" or "),
        _ if deref(prop, defs).is_some() => "table".to_owned(),
        _ => "value".to_owned(),
    }
}

/// A default as it would be written in TOML.
fn toml_value(v: &Value) -> String {
    match v {
        Value::String(s) => format!("\"{s}\""),
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(toml_value).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(m) if m.is_empty() => "{}".to_owned(),
        Value::Object(m) => format!(
            "{{ {} }}",
            m.iter()
                .map(|(k, v)| format!("{k} = {}", toml_value(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_reference_is_what_the_types_say() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        let generated = markdown();
        assert!(
            committed == generated,
            "docs/configuration.md is out of date: run `cargo run -- config reference > docs/configuration.md`"
        );
    }

    #[test]
    fn every_section_and_default_is_there() {
        let md = markdown();
        for needle in [
            "## `[routing]`",
            "## `[[backends]]`",
            "## `[classes.NAME]`",
            "### `[classes.NAME.slo]`",
            "## `[[pools]]`",
            "| `policy` | string | `\"prefix_affinity\"` |",
            "| `kv_raise_below` | number | `0.85` |",
            "| `url` | string | required |",
        ] {
            assert!(md.contains(needle), "missing {needle}:\n{md}");
        }
    }
}
