//! `src/ffi` is layered: every module uses only modules of lower layers, so no two modules
//! import each other, directly or through a cycle. The order is the numbered list under
//! "# Layers" in `src/ffi/mod.rs`; this test reads that list and checks every reference to a
//! sibling module (`super::x`, `crate::ffi::x`, `$crate::ffi::x`) outside unit-test modules
//! against it, so the documentation and the code cannot drift apart.

use std::collections::BTreeMap;
use std::path::Path;

/// Module name -> rank, from the doc list: one numbered item per layer, and within an item,
/// ", then " separating sub-layers (`[`buffer`], then [`attrs`]`: attrs above buffer).
fn ranks(mod_rs: &str) -> BTreeMap<String, usize> {
    let mut items: Vec<String> = Vec::new();
    let mut in_layers = false;
    for line in mod_rs.lines() {
        let Some(doc) = line.strip_prefix("//!") else {
            continue;
        };
        let doc = doc.trim();
        if doc == "# Layers" {
            in_layers = true;
            continue;
        }
        if !in_layers {
            continue;
        }
        let numbered = doc
            .split_once(". ")
            .filter(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        match numbered {
            Some((_, rest)) => items.push(rest.to_string()),
            None if doc.is_empty() && !items.is_empty() => break,
            None => {
                if let Some(last) = items.last_mut() {
                    last.push(' ');
                    last.push_str(doc);
                }
            }
        }
    }
    let mut ranks = BTreeMap::new();
    let mut rank = 0;
    for item in items {
        for chunk in item.split(", then ") {
            rank += 1;
            for name in chunk.split('`').skip(1).step_by(2) {
                if name.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                    ranks.insert(name.to_string(), rank);
                }
            }
        }
    }
    ranks
}

/// The sibling modules `source`'s code refers to: comments (a doc link to a higher layer is
/// no import) and `#[cfg(test)] mod tests { ... }` blocks left out.
fn references(source: &str, modules: &BTreeMap<String, usize>) -> Vec<String> {
    let source = match source.find("#[cfg(test)]\nmod tests {") {
        Some(i) => &source[..i],
        None => source,
    };
    let code: String = source
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = Vec::new();
    for prefix in ["super::", "crate::ffi::", "$crate::ffi::"] {
        for (i, _) in code.match_indices(prefix) {
            // `$crate::ffi::x` also contains `crate::ffi::x`; both name the same module.
            let rest = &code[i + prefix.len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            // `super::{a, b}` lists several.
            let names: Vec<String> = if rest.starts_with('{') {
                rest[1..rest.find('}').unwrap_or(1)]
                    .split(',')
                    .map(|n| n.trim().split("::").next().unwrap_or("").to_string())
                    .collect()
            } else {
                vec![name]
            };
            found.extend(names.into_iter().filter(|n| modules.contains_key(n)));
        }
    }
    found.sort();
    found.dedup();
    found
}

#[test]
fn every_ffi_module_uses_only_lower_layers() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/xla-ffi-bundles/src/ffi");
    let ranks = ranks(&std::fs::read_to_string(dir.join("mod.rs")).unwrap());
    assert!(
        ranks.len() >= 15,
        "the layer list in src/ffi/mod.rs is too short: {ranks:?}"
    );
    let mut violations = Vec::new();
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.extension().is_none_or(|e| e != "rs") || ["mod", "tests", "fake"].contains(&&*name)
        {
            continue;
        }
        let Some(&rank) = ranks.get(&name) else {
            violations.push(format!(
                "src/ffi/{name}.rs is not in the layer list of mod.rs"
            ));
            continue;
        };
        let source = std::fs::read_to_string(&path).unwrap();
        for used in references(&source, &ranks) {
            checked += 1;
            if used != name && ranks[&used] >= rank {
                violations.push(format!(
                    "{name} (layer {rank}) uses {used} (layer {}), which is not below it",
                    ranks[&used]
                ));
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} references found: is the parser broken?"
    );
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

#[test]
fn the_check_sees_a_cycle() {
    // The parser must see the uses it is meant to check, or the property above proves nothing.
    let ranks = ranks(
        "//! # Layers\n//!\n//! 1. [`sys`].\n//! 2. [`a`], then [`b`] and\n//!    [`c`].\n//!\n",
    );
    assert_eq!(ranks["sys"], 1);
    assert_eq!(ranks["a"], 2);
    assert_eq!((ranks["b"], ranks["c"]), (3, 3));
    let source = "use super::{b, sys::X};\n/// see [`super::a`]\nuse crate::ffi::c::Y;\n#[cfg(test)]\nmod tests {\n use super::a;\n}";
    assert_eq!(references(source, &ranks), ["b", "c", "sys"]);
}
