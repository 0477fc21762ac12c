//! The doctor's report: one [`Check`] per thing looked at, rendered as a text checklist or as
//! JSON, and the exit status it implies.
//!
//! This module only holds and renders results; the checks themselves live beside it.

use serde::Serialize;

/// The outcome of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// All good.
    Ok,
    /// Works, but something is likely to bite (or could not be fully verified).
    Warn,
    /// gpushare will not work until this is fixed.
    Fail,
    /// Not applicable here, or not checked (no cluster access, option off).
    Skip,
}

impl Status {
    /// The fixed-width label of the text checklist.
    fn label(self) -> &'static str {
        match self {
            Status::Ok => " ok ",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        }
    }

    /// ANSI colour code of the label.
    fn colour(self) -> &'static str {
        match self {
            Status::Ok => "32",
            Status::Warn => "33",
            Status::Fail => "1;31",
            Status::Skip => "2",
        }
    }
}

/// One check: a stable id, what was seen, and how to fix it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Stable identifier (`driver-version`, `container-runtime`, ...), documented in docs/doctor.md.
    pub id: &'static str,
    /// One-line title.
    pub title: &'static str,
    /// The outcome.
    pub status: Status,
    /// What the check saw (may span several lines).
    pub detail: String,
    /// How to fix it; empty when there is nothing to do.
    pub hint: String,
}

impl Check {
    /// A check with `status`, `detail` and no hint.
    pub fn new(
        id: &'static str,
        title: &'static str,
        status: Status,
        detail: impl Into<String>,
    ) -> Check {
        Check {
            id,
            title,
            status,
            detail: detail.into(),
            hint: String::new(),
        }
    }

    /// The same check with a fix hint.
    pub fn hint(mut self, hint: impl Into<String>) -> Check {
        self.hint = hint.into();
        self
    }
}

/// Counts per status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// Checks that passed.
    pub ok: usize,
    /// Checks with a warning.
    pub warn: usize,
    /// Checks that failed.
    pub fail: usize,
    /// Checks skipped.
    pub skip: usize,
}

/// The whole report of one run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    /// `node`, `control-plane` or `all`.
    pub role: &'static str,
    /// The checks, in the order they ran.
    pub checks: Vec<Check>,
    /// Counts per status.
    pub summary: Summary,
}

impl Report {
    /// A report of `checks` for `role`.
    pub fn new(role: &'static str, checks: Vec<Check>) -> Report {
        let mut summary = Summary::default();
        for c in &checks {
            match c.status {
                Status::Ok => summary.ok += 1,
                Status::Warn => summary.warn += 1,
                Status::Fail => summary.fail += 1,
                Status::Skip => summary.skip += 1,
            }
        }
        Report {
            role,
            checks,
            summary,
        }
    }

    /// Whether the run failed: any `fail`, or with `strict` any `warn` too.
    pub fn failed(&self, strict: bool) -> bool {
        self.summary.fail > 0 || (strict && self.summary.warn > 0)
    }

    /// Ids of the checks with `status`.
    pub(crate) fn ids_with(&self, status: Status) -> Vec<&'static str> {
        self.checks
            .iter()
            .filter(|c| c.status == status)
            .map(|c| c.id)
            .collect()
    }

    /// The JSON document (pretty-printed, newline-terminated).
    pub(crate) fn to_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(self)
            .unwrap_or_else(|e| format!("{{\"error\": {:?}}}", e.to_string()));
        text.push('\n');
        text
    }

    /// The text checklist; ANSI colours when `colour`.
    pub(crate) fn to_text(&self, colour: bool) -> String {
        let paint = |status: Status, text: &str| {
            if colour {
                format!("\x1b[{}m{text}\x1b[0m", status.colour())
            } else {
                text.to_string()
            }
        };
        let id_width = self.checks.iter().map(|c| c.id.len()).max().unwrap_or(0);
        let mut out = format!("gpushare doctor (role: {})\n\n", self.role);
        for c in &self.checks {
            out.push_str(&format!(
                "[{}] {:<id_width$}  {}\n",
                paint(c.status, c.status.label()),
                c.id,
                c.title
            ));
            for line in c.detail.lines() {
                out.push_str(&format!("       {line}\n"));
            }
            if c.status != Status::Ok {
                let mut lines = c.hint.lines();
                if let Some(first) = lines.next() {
                    out.push_str(&format!("       fix: {first}\n"));
                    for line in lines {
                        out.push_str(&format!("            {line}\n"));
                    }
                }
            }
        }
        let s = &self.summary;
        out.push_str(&format!(
            "\n{} ok, {} warn, {} fail, {} skip\n",
            s.ok, s.warn, s.fail, s.skip
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        Report::new(
            "node",
            vec![
                Check::new("driver-version", "NVIDIA driver", Status::Ok, "550.54.15"),
                Check::new("gpu-access", "GPU access", Status::Warn, "one\ntwo")
                    .hint("do this\nthen that"),
                Check::new("mps-daemon", "MPS", Status::Skip, "off"),
            ],
        )
    }

    #[test]
    fn summary_counts_and_strictness() {
        let r = sample();
        assert_eq!(
            r.summary,
            Summary {
                ok: 1,
                warn: 1,
                fail: 0,
                skip: 1
            }
        );
        assert!(!r.failed(false));
        assert!(r.failed(true));
        assert_eq!(r.ids_with(Status::Warn), vec!["gpu-access"]);
    }

    #[test]
    fn text_is_plain_without_colour_and_shows_hints_for_problems() {
        let text = sample().to_text(false);
        assert!(!text.contains('\x1b'));
        assert!(text.contains("[warn] gpu-access      GPU access\n       one\n       two\n"));
        assert!(text.contains("       fix: do this\n            then that\n"));
        assert!(text.ends_with("1 ok, 1 warn, 0 fail, 1 skip\n"));
        assert!(sample().to_text(true).contains("\x1b[33mwarn\x1b[0m"));
    }

    #[test]
    fn json_has_the_documented_shape() {
        let v: serde_json::Value = serde_json::from_str(&sample().to_json()).unwrap();
        assert_eq!(v["role"], "node");
        assert_eq!(v["checks"][1]["status"], "warn");
        assert_eq!(v["checks"][1]["hint"], "do this\nthen that");
        assert_eq!(v["summary"]["skip"], 1);
        let keys: Vec<_> = v["checks"][0]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        assert_eq!(keys.len(), 5, "{keys:?}");
    }
}
