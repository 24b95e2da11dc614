//! The config reference (docs/config.md) names every key the parser
//! accepts: each table's keys are read from the parser itself (an unknown
//! key's error lists the ones it expects), and a key the reference does
//! not name fails this test.

use std::path::Path;

use batchcast_broker::config::Config;

/// A config with an unknown key `zzz` in one table, and that table.
const PROBES: &[(&str, &str)] = &[
    ("[broker]", "[broker]\nzzz = 1\n"),
    ("[[stream]]", "[[stream]]\nzzz = 1\n"),
    (
        "[[stream]] fields",
        "[[stream]]\nname = \"a\"\n[stream.synthetic]\nfields = [{ zzz = 1 }]\n",
    ),
    (
        "[stream.synthetic]",
        "[[stream]]\nname = \"a\"\n[stream.synthetic]\nzzz = 1\n",
    ),
    (
        "[stream.image_folder]",
        "[[stream]]\nname = \"a\"\n[stream.image_folder]\nzzz = 1\n",
    ),
    (
        "[stream.webdataset]",
        "[[stream]]\nname = \"a\"\n[stream.webdataset]\nzzz = 1\n",
    ),
    (
        "[stream.transform]",
        "[[stream]]\nname = \"a\"\n[stream.transform]\nzzz = 1\n",
    ),
    (
        "[stream.remote]",
        "[[stream]]\nname = \"a\"\n[stream.remote]\nzzz = 1\n",
    ),
    ("[[source]]", "[[source]]\nzzz = 1\n"),
];

/// Inline tables of `[stream.transform]`.
const TRANSFORM_TABLES: &[&str] = &[
    "random_resized_crop",
    "random_crop",
    "pad",
    "normalize",
    "color_jitter",
    "gaussian_blur",
    "trivial_augment_wide",
    "rand_augment",
    "auto_augment",
    "random_erasing",
];

/// The keys an unknown-key error says the table expects: serde's list
/// (`expected one of `a`, `b``), or for a key of several forms the table
/// form its message spells out (`{ a = ..., b = ... }`).
fn expected_keys(text: &str) -> Option<Vec<String>> {
    let err = match Config::parse(text, Path::new("probe.toml")) {
        Ok(_) => return None,
        Err(e) => e.to_string(),
    };
    if err.contains("unknown field") {
        let list = err.split("expected ").nth(1)?;
        let keys: Vec<String> = list
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect();
        return (!keys.is_empty()).then_some(keys);
    }
    // The last one: the message, after the quoted config line.
    let table = err.rsplit("{ ").next()?.split(" }").next()?;
    let keys: Vec<String> = table
        .split(", ")
        .filter_map(|kv| kv.split(" = ").next())
        .filter(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .map(str::to_string)
        .collect();
    (!keys.is_empty()).then_some(keys)
}

#[test]
fn the_config_reference_names_every_key_the_parser_accepts() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/config.md"))
            .unwrap();
    let named = |key: &str| {
        doc.match_indices(key).any(|(i, _)| {
            let before = doc[..i]
                .chars()
                .next_back()
                .is_none_or(|c| !c.is_alphanumeric() && c != '_');
            let after = doc[i + key.len()..]
                .chars()
                .next()
                .is_none_or(|c| !c.is_alphanumeric() && c != '_');
            before && after
        })
    };
    let mut probes: Vec<(String, String)> = PROBES
        .iter()
        .map(|(t, c)| (t.to_string(), c.to_string()))
        .collect();
    for table in TRANSFORM_TABLES {
        probes.push((
            format!("transform {table}"),
            format!("[[stream]]\nname = \"a\"\n[stream.transform]\n{table} = {{ zzz = 1 }}\n"),
        ));
    }
    let mut missing = Vec::new();
    let mut checked = 0;
    for (table, text) in &probes {
        let keys = expected_keys(text).unwrap_or_else(|| {
            panic!("{table}: no list of expected keys from the parser for\n{text}")
        });
        for k in keys {
            checked += 1;
            if !named(&k) {
                missing.push(format!("{table}: {k}"));
            }
        }
    }
    assert!(checked > 60, "only {checked} keys read from the parser");
    assert!(
        missing.is_empty(),
        "keys the parser accepts that docs/config.md does not name:\n{}",
        missing.join("\n")
    );
}
