//! Reading Rust sources just far enough to know what each module imports: comments, strings and
//! `#[cfg(test)]` items are dropped, and every path that starts at `crate`, `super` or `self`
//! (use trees with braces included) is resolved to the module it reaches.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// One module's code, as tokens that matter to imports.
#[derive(Debug, Clone)]
pub struct Module {
    /// The code without comments, string contents and test-only items.
    pub code: Vec<String>,
}

impl Module {
    /// Reads a module's source.
    pub fn parse(source: &str) -> Module {
        Module { code: without_tests(tokens(source)) }
    }
}

/// Every module of the crate under `src`, by its path (`engine::actions`); `lib.rs` and
/// `main.rs` are the crate root, not modules.
pub fn modules(src: &Path) -> BTreeMap<String, Module> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut segs: Vec<String> =
                rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            // a directory's `mod.rs` is the directory's module
            if segs.last().is_some_and(|s| s == "mod") {
                segs.pop();
            }
            if segs.len() == 1 && (segs[0] == "lib" || segs[0] == "main") {
                continue;
            }
            let name = segs.join("::");
            let source = std::fs::read_to_string(&path).unwrap();
            out.insert(name.clone(), Module::parse(&source));
        }
    }
    out
}

/// Splits source into identifiers and the punctuation paths are made of, leaving out comments,
/// string and character literals (their contents are not code) and lifetimes.
fn tokens(s: &str) -> Vec<String> {
    let c: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == 'r' && (next == Some('#') || next == Some('"')) && raw_string_at(&c, i).is_some() {
            i = raw_string_at(&c, i).unwrap_or(i + 1);
            out.push("\"\"".into());
        } else if ch == '"' || (ch == 'b' && next == Some('"')) {
            i += if ch == 'b' { 2 } else { 1 };
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push("\"\"".into());
        } else if ch == '\'' {
            // a character literal ('x', '\n', '\u{..}') or a lifetime ('a)
            if next == Some('\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(c[start..i].iter().collect());
        } else if ch == ':' && next == Some(':') {
            out.push("::".into());
            i += 2;
        } else if ch.is_whitespace() {
            i += 1;
        } else {
            out.push(ch.to_string());
            i += 1;
        }
    }
    out
}

/// Where a raw string starting at `i` (`r"…"`, `r#"…"#`) ends, if one does.
fn raw_string_at(c: &[char], i: usize) -> Option<usize> {
    let mut j = i + 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && (0..hashes).all(|k| c.get(j + 1 + k) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(c.len())
}

/// Drops every item under `#[cfg(test)]`: up to its `;`, or its braces' end.
fn without_tests(t: Vec<String>) -> Vec<String> {
    let is = |k: usize, s: &str| t.get(k).is_some_and(|x| x == s);
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let cfg_test = is(i, "#")
            && is(i + 1, "[")
            && is(i + 2, "cfg")
            && is(i + 3, "(")
            && is(i + 4, "test")
            && is(i + 5, ")")
            && is(i + 6, "]");
        if !cfg_test {
            out.push(t[i].clone());
            i += 1;
            continue;
        }
        i += 7;
        while i < t.len() && t[i] != ";" && t[i] != "{" {
            i += 1;
        }
        if is(i, "{") {
            let mut depth = 0;
            while i < t.len() {
                match t[i].as_str() {
                    "{" => depth += 1,
                    "}" => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        i += 1;
    }
    out
}

/// The paths a module names that start at `crate`, `super` or `self`, use trees expanded.
fn paths(t: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for i in 0..t.len() {
        let head = matches!(t[i].as_str(), "crate" | "super" | "self");
        let after_path = i > 0 && t[i - 1] == "::";
        if head && !after_path && t.get(i + 1).is_some_and(|x| x == "::") {
            out.extend(tree(t, i, Vec::new()).0);
        }
    }
    out
}

/// A use tree (or a plain path) from `i`: the paths it names, and where it ends.
fn tree(t: &[String], mut i: usize, mut segs: Vec<String>) -> (Vec<Vec<String>>, usize) {
    let mut out = Vec::new();
    loop {
        match t.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                while i < t.len() && t[i] != "}" {
                    let (sub, end) = tree(t, i, segs.clone());
                    out.extend(sub);
                    i = end;
                    // skip a rename (`as X`) up to the next item
                    while i < t.len() && t[i] != "," && t[i] != "}" {
                        i += 1;
                    }
                    if t.get(i).is_some_and(|x| x == ",") {
                        i += 1;
                    }
                }
                return (out, i + 1);
            }
            Some(id) if id.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_') => {
                // `self` inside braces names the path so far
                if id != "self" || segs.is_empty() {
                    segs.push(id.to_string());
                }
                i += 1;
                if t.get(i).is_some_and(|x| x == "::") {
                    i += 1;
                    continue;
                }
                out.push(segs);
                return (out, i);
            }
            _ => {
                out.push(segs);
                return (out, i);
            }
        }
    }
}

/// Module → the modules it imports. A module's imports of its own ancestors do not count: a
/// child is part of its parent, which declares it.
pub fn imports(mods: &BTreeMap<String, Module>) -> BTreeMap<String, BTreeSet<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, m) in mods {
        let base: Vec<&str> = name.split("::").collect();
        for p in paths(&m.code) {
            let mut full: Vec<&str> = match p[0].as_str() {
                "crate" => Vec::new(),
                "self" => base.clone(),
                _ => base[..base.len() - 1].to_vec(),
            };
            let mut rest = &p[1..];
            while rest.first().is_some_and(|s| s == "super") {
                full.pop();
                rest = &rest[1..];
            }
            full.extend(rest.iter().map(String::as_str));
            let target = (1..=full.len()).rev().map(|k| full[..k].join("::")).find(|c| mods.contains_key(c));
            if let Some(target) = target
                && target != *name
                && !name.starts_with(&format!("{target}::"))
            {
                edges.entry(name.clone()).or_default().insert(target);
            }
        }
    }
    edges
}

/// The import circles: each set of modules that reach each other, sorted.
pub fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.keys().chain(edges.values().flatten()).collect();
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from];
        while let Some(n) = todo.pop() {
            for m in edges.get(n).into_iter().flatten() {
                if seen.insert(m) {
                    todo.push(m);
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<&String>> = nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    for n in &nodes {
        if !reached[n].contains(n) || out.iter().any(|c| c.contains(n)) {
            continue;
        }
        let mut circle: Vec<String> =
            nodes.iter().filter(|m| reached[n].contains(*m) && reached[*m].contains(n)).map(|m| (*m).clone()).collect();
        circle.sort();
        out.push(circle);
    }
    out
}

/// The crates a module names at the head of a path (`kube::Client`, `use aws_sdk_ec2::…`),
/// besides the standard library's.
pub fn crates_used(code: &[String]) -> Vec<String> {
    let mut out = BTreeSet::new();
    for i in 0..code.len() {
        let t = &code[i];
        let first = t.chars().next().is_some_and(|c| c.is_ascii_lowercase());
        let after_path = i > 0 && code[i - 1] == "::";
        let is_path = code.get(i + 1).is_some_and(|x| x == "::");
        let local = matches!(t.as_str(), "crate" | "super" | "self" | "std" | "core" | "alloc");
        if first && !after_path && is_path && !local {
            out.insert(t.clone());
        }
    }
    out.into_iter().collect()
}

/// One row of the map's dependency rules.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The modules it governs (with their submodules).
    pub modules: Vec<String>,
    /// The modules they never import (`*`: any outside their own).
    pub never_modules: Vec<String>,
    /// The crates they never use (`aws_*`: a prefix).
    pub never_crates: Vec<String>,
    /// The row as written.
    pub source: String,
}

fn within(name: &str, module: &str) -> bool {
    name == module || name.starts_with(&format!("{module}::"))
}

impl Rule {
    /// Whether module `name` is under this rule.
    pub fn governs(&self, name: &str) -> bool {
        self.modules.iter().any(|m| within(name, m))
    }

    /// Whether `name`, under this rule, may not import `target`.
    pub fn forbids_module(&self, name: &str, target: &str) -> bool {
        self.never_modules.iter().any(|f| match f.as_str() {
            "*" => !self.modules.iter().any(|m| within(name, m) && within(target, m)),
            f => within(target, f),
        })
    }

    /// Whether the crate may not be used under this rule.
    pub fn forbids_crate(&self, krate: &str) -> bool {
        self.never_crates.iter().any(|c| match c.strip_suffix('*') {
            Some(prefix) => krate.starts_with(prefix),
            None => krate == c,
        })
    }
}

/// The rows of the table under `## Dependency rules`: modules, the modules they never import,
/// the crates they never use, each cell a list of names in backticks.
pub fn rules(map: &str) -> Vec<Rule> {
    let mut out = Vec::new();
    let mut inside = false;
    let mut past_header = false;
    for line in map.lines() {
        if line.starts_with("## ") {
            inside = line.trim() == "## Dependency rules";
            past_header = false;
            continue;
        }
        if !inside || !line.starts_with('|') {
            continue;
        }
        if line.starts_with("|---") || line.starts_with("| ---") {
            past_header = true;
            continue;
        }
        if !past_header {
            continue;
        }
        let cells: Vec<Vec<String>> = line
            .trim_matches('|')
            .split('|')
            .map(|cell| cell.split('`').skip(1).step_by(2).map(str::to_string).collect())
            .collect();
        let cell = |k: usize| cells.get(k).cloned().unwrap_or_default();
        out.push(Rule { modules: cell(0), never_modules: cell(1), never_crates: cell(2), source: line.trim().into() });
    }
    out
}
