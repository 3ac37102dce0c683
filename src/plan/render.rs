//! Showing a plan to people: a readable text listing, a Graphviz digraph and a Mermaid flowchart
//! of the steps (not the expanded tasks: a picture of 1,000 drain tasks shows nothing).

use std::fmt::{self, Write as _};
use std::str::FromStr;

use super::{Plan, Step};

/// How [`Plan::render`] formats a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RenderFormat {
    /// An ordered list of steps with action, for_each, after and params.
    Text,
    /// A Graphviz `digraph` of the steps, input for `dot -Tsvg`.
    Dot,
    /// A Mermaid `flowchart TD` of the steps.
    Mermaid,
}

impl RenderFormat {
    /// Every format.
    pub const ALL: [RenderFormat; 3] = [RenderFormat::Text, RenderFormat::Dot, RenderFormat::Mermaid];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            RenderFormat::Text => "text",
            RenderFormat::Dot => "dot",
            RenderFormat::Mermaid => "mermaid",
        }
    }
}

impl fmt::Display for RenderFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A format name that is not one of `text`, `dot`, `mermaid`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown plan format {0:?}; use text, dot or mermaid")]
pub struct UnknownRenderFormat(pub String);

impl FromStr for RenderFormat {
    type Err = UnknownRenderFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RenderFormat::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownRenderFormat(s.to_owned()))
    }
}

impl Plan {
    /// The plan in the given format. The output ends with a newline.
    pub fn render(&self, format: RenderFormat) -> String {
        match format {
            RenderFormat::Text => self.render_text(),
            RenderFormat::Dot => self.render_dot(),
            RenderFormat::Mermaid => self.render_mermaid(),
        }
    }

    // `write!` into a String cannot fail; its Result is discarded on purpose below.

    fn render_text(&self) -> String {
        let mut out = String::new();
        let n = self.steps.len();
        let _ = writeln!(out, "plan {:?} ({}), {n} step{}", self.name, self.source, if n == 1 { "" } else { "s" });
        if let Some(description) = &self.description {
            for line in description.trim().lines() {
                let _ = writeln!(out, "  {}", line.trim_end());
            }
        }
        for (number, step) in self.ordered_steps().enumerate() {
            let _ = writeln!(out, "\n{}. {}", number + 1, step.id);
            let _ = writeln!(out, "     action:    {}", step.action);
            if let Some(kind) = step.for_each {
                let _ = writeln!(out, "     for each:  {kind}");
            }
            if !step.after.is_empty() {
                let _ = writeln!(out, "     after:     {}", step.after.join(", "));
            }
            let params = params_text(step, true);
            if !params.is_empty() {
                let _ = writeln!(out, "     params:    {params}");
            }
            if let Some(description) = &step.description {
                for line in description.trim().lines() {
                    let _ = writeln!(out, "     {}", line.trim_end());
                }
            }
        }
        out
    }

    fn render_dot(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "digraph {} {{", dot_quote(&self.name));
        let _ = writeln!(out, "  graph [rankdir=TB, labelloc=t, label={}];", dot_quote(&format!("plan {}", self.name)));
        let _ = writeln!(out, "  node [shape=box, style=rounded, fontname=\"Helvetica\"];");
        for step in self.ordered_steps() {
            let mut label = format!("{}\naction: {}", step.id, step.action);
            if let Some(kind) = step.for_each {
                let _ = write!(label, "\nfor each {kind}");
            }
            let params = params_text(step, false);
            if !params.is_empty() {
                let _ = write!(label, "\n{params}");
            }
            let mut attrs = format!("label={}", dot_quote(&label));
            if let Some(description) = &step.description {
                let _ = write!(attrs, ", tooltip={}", dot_quote(description.trim()));
            }
            let _ = writeln!(out, "  {} [{attrs}];", dot_quote(&step.id));
        }
        for step in self.ordered_steps() {
            for dep in &step.after {
                let _ = writeln!(out, "  {} -> {};", dot_quote(dep), dot_quote(&step.id));
            }
        }
        out.push_str("}\n");
        out
    }

    fn render_mermaid(&self) -> String {
        // Mermaid ids are positional (`s1`, `s2`…): step ids like `end` or ones with dashes can
        // clash with Mermaid keywords and arrow syntax, labels cannot.
        let index: std::collections::HashMap<&str, usize> =
            self.ordered_steps().enumerate().map(|(i, s)| (s.id.as_str(), i + 1)).collect();
        let mut out = String::from("flowchart TD\n");
        for (i, step) in self.ordered_steps().enumerate() {
            let mut label = format!("{}<br/>action: {}", mermaid_escape(&step.id), step.action);
            if let Some(kind) = step.for_each {
                let _ = write!(label, "<br/>for each {kind}");
            }
            let params = params_text(step, false);
            if !params.is_empty() {
                let _ = write!(label, "<br/>{}", mermaid_escape(&params));
            }
            let _ = writeln!(out, "    s{}[\"{label}\"]", i + 1);
        }
        for step in self.ordered_steps() {
            for dep in &step.after {
                if let (Some(from), Some(to)) = (index.get(dep.as_str()), index.get(step.id.as_str())) {
                    let _ = writeln!(out, "    s{from} --> s{to}");
                }
            }
        }
        out
    }
}

/// The params the step's action accepts with their effective values, e.g.
/// `deadline = 10m, on_deadline = fail (default)`.
fn params_text(step: &Step, mark_defaults: bool) -> String {
    step.action
        .spec()
        .params
        .iter()
        .map(|&key| {
            let value = step.params.display_value(key);
            if mark_defaults && !step.explicit_params.contains(&key) {
                format!("{key} = {value} (default)")
            } else {
                format!("{key} = {value}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A DOT double-quoted string. `\n` stays a line break in labels; quotes and backslashes typed
/// by the user are escaped so they cannot end the string.
fn dot_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => {}
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Text safe inside a Mermaid `["…"]` label (Mermaid uses `#name;` entities).
fn mermaid_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("#quot;"),
            '<' => out.push_str("#lt;"),
            '>' => out.push_str("#gt;"),
            '#' => out.push_str("#35;"),
            '\n' => out.push_str("<br/>"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_from_their_names() {
        for f in RenderFormat::ALL {
            assert_eq!(f.name().parse::<RenderFormat>(), Ok(f));
        }
        assert_eq!("DOT".parse::<RenderFormat>(), Ok(RenderFormat::Dot));
        assert!("svg".parse::<RenderFormat>().is_err());
    }

    #[test]
    fn user_text_cannot_break_out_of_quotes() {
        assert_eq!(dot_quote("a \"b\" \\ c\nd"), r#""a \"b\" \\ c\nd""#);
        assert_eq!(mermaid_escape("x \"y\" <z>"), "x #quot;y#quot; #lt;z#gt;");
    }
}
