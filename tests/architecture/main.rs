//! The dependency rules of `ARCHITECTURE.md`, held against `src/`: the table under "Dependency
//! rules" is read from the map itself, every module's imports from its source (tests and comments
//! left out), so neither the map nor the code can drift from the other unnoticed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

mod source;

use source::{Module, Rule, crates_used, cycles, imports, modules, rules};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn product() -> BTreeMap<String, Module> {
    let mods = modules(&root().join("src"));
    // the crate has about fifty modules: far fewer means the walk or the parse went wrong
    assert!(mods.len() >= 40, "only {} modules read from src/: {:?}", mods.len(), mods.keys());
    mods
}

fn the_rules() -> Vec<Rule> {
    let map = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let rules = rules(&map);
    assert_eq!(rules.len(), 7, "ARCHITECTURE.md's dependency rules table has 7 rows: {rules:#?}");
    rules
}

#[test]
fn no_module_of_src_imports_one_that_imports_it_back() {
    let mods = product();
    let edges = imports(&mods);
    let found = cycles(&edges);
    assert!(found.is_empty(), "import circles in src/ (each listed as the modules on it): {found:#?}");
}

#[test]
fn every_module_keeps_the_dependency_rules_of_the_map() {
    let mods = product();
    let edges = imports(&mods);
    let mut broken = Vec::new();
    let mut governed = BTreeSet::new();
    for rule in the_rules() {
        for (name, module) in &mods {
            if !rule.governs(name) {
                continue;
            }
            governed.insert(name.clone());
            for target in edges.get(name).into_iter().flatten() {
                if rule.forbids_module(name, target) {
                    broken.push(format!("{name} imports {target} ({})", rule.source));
                }
            }
            for krate in crates_used(&module.code) {
                if rule.forbids_crate(&krate) {
                    broken.push(format!("{name} uses the crate {krate} ({})", rule.source));
                }
            }
        }
    }
    // every row names modules that exist: a renamed module would otherwise drop out of its rule
    assert!(governed.len() >= 25, "the rules govern only {} modules: {governed:?}", governed.len());
    assert!(broken.is_empty(), "dependency rules of ARCHITECTURE.md broken:\n{}", broken.join("\n"));
}

#[test]
fn every_module_the_rules_name_exists() {
    let mods = product();
    let tops: BTreeSet<&str> = mods.keys().map(|m| m.split("::").next().unwrap_or(m)).collect();
    for rule in the_rules() {
        for m in rule.modules.iter().chain(&rule.never_modules).filter(|m| *m != "*") {
            let top = m.split("::").next().unwrap_or(m);
            assert!(tops.contains(top) || mods.contains_key(m), "ARCHITECTURE.md names module `{m}`, which src/ lacks");
        }
    }
}

/// The checker itself finds what it is there to find, on sources written for it.
#[test]
fn the_checker_finds_a_circle_an_import_through_braces_and_a_forbidden_crate() {
    let mut mods = BTreeMap::new();
    for (name, code) in [
        ("a", "use crate::{b::Thing, c};\nfn f() { let s = \"crate::d // not code\"; }"),
        ("b", "use super::a::X; // crate::d in a comment\n#[cfg(test)]\nmod tests { use crate::d; }"),
        ("b::inner", "use super::super::c::Y;"),
        ("c", "fn g() -> kube::Client { crate::b::inner::h() }"),
        ("d", "use aws_sdk_ec2::Client;"),
    ] {
        mods.insert(name.to_string(), Module::parse(code));
    }
    let edges = imports(&mods);
    let of = |m: &str| edges.get(m).cloned().unwrap_or_default().into_iter().collect::<Vec<_>>();
    assert_eq!(of("a"), ["b", "c"]);
    assert_eq!(of("b"), ["a"], "the test module and the comment are not imports");
    assert_eq!(of("b::inner"), ["c"]);
    assert_eq!(of("c"), ["b::inner"]);
    let found = cycles(&edges);
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(found[0], ["a", "b"]);
    assert_eq!(found[1], ["b::inner", "c"]);
    assert_eq!(crates_used(&mods["c"].code), ["kube"]);
    assert_eq!(crates_used(&mods["d"].code), ["aws_sdk_ec2"]);
    let rule = rules(
        "## Dependency rules\n\n| modules | never import | never use |\n|---|---|---|\n| `c` | `b` | `kube`, `aws_*` |\n\n## Next\n",
    );
    assert_eq!(rule.len(), 1);
    assert!(rule[0].forbids_module("c", "b::inner"));
    assert!(!rule[0].forbids_module("c", "a"));
    assert!(rule[0].forbids_crate("aws_sdk_ec2") && rule[0].forbids_crate("kube") && !rule[0].forbids_crate("serde"));
}
