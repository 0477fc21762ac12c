//! Log output of the real binary: plain text wherever it is not a terminal (a file, a pipe,
//! journald, `kubectl logs`), colour on a terminal unless `NO_COLOR` is set.
//!
//! The terminal cases run the binary under `script(1)` (util-linux), which gives it a pseudo
//! terminal; without `script` they say SKIPPED and check nothing.

use std::process::Command;

use crate::support::{bin, run_with_env, stderr};

const ESC: char = '\x1b';

/// The demo at `--log-level info` logs from the extender and the device plugin.
const LOGGING_DEMO: [&str; 4] = ["demo", "--log-level", "info", "--fake-gpus=2x16GiB"];

#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    let out = run_with_env(&LOGGING_DEMO, &[]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("INFO"),
        "the demo logged nothing at info:\n{err}"
    );
    assert!(
        !err.contains(ESC),
        "ANSI escapes in logs written to a pipe:\n{err:?}"
    );
}

/// Runs the logging demo on a pseudo terminal; `None` without `script(1)`.
fn on_a_terminal(no_color: Option<&str>) -> Option<String> {
    let line = format!("{} {}", bin().display(), LOGGING_DEMO.join(" "));
    let mut cmd = Command::new("script");
    cmd.args(["-qec", &line, "/dev/null"])
        .env_remove("NO_COLOR");
    if let Some(v) = no_color {
        cmd.env("NO_COLOR", v);
    }
    match cmd.output() {
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(out.status.success(), "{text}");
            Some(text)
        }
        Err(e) => {
            crate::support::clients::skip(&format!("cannot run script(1): {e}"));
            None
        }
    }
}

#[test]
fn logs_on_a_terminal_are_coloured_unless_no_color_is_set() {
    let Some(coloured) = on_a_terminal(None) else {
        return;
    };
    assert!(coloured.contains("INFO"), "{coloured}");
    assert!(
        coloured.contains(ESC),
        "no colour on a terminal without NO_COLOR:\n{coloured:?}"
    );
    let Some(plain) = on_a_terminal(Some("1")) else {
        return;
    };
    assert!(plain.contains("INFO"), "{plain}");
    assert!(
        !plain.contains(ESC),
        "NO_COLOR=1 and still ANSI escapes:\n{plain:?}"
    );
}
