//! How a failure reads and how the binary ends with it: the exit-status taxonomy (0 success,
//! 1 a failed check or run, 64 a bad command-line value, 78 missing or invalid
//! configuration), the typed wrapper that gives an error one of the non-1 statuses
//! ([`Classified`]), the status of any error ([`status`]), and an error with its causes on one
//! line ([`one_line`]).
//!
//! What it does not do: print (the dispatcher and `inspect` do), or decide what a role's
//! errors mean (each role wraps its own configuration and usage errors).

use std::error::Error as StdError;

/// A check or a run failed.
pub const FAILURE: u8 = 1;
/// A command-line value is bad (sysexits' `EX_USAGE`).
pub const USAGE: u8 = 64;
/// Configuration is missing or invalid (sysexits' `EX_CONFIG`).
pub const CONFIG: u8 = crate::config::EXIT_CONFIG;

type Boxed = Box<dyn StdError + Send + Sync + 'static>;

/// An error whose exit status is not 1. It reads as the error it wraps.
#[derive(Debug, thiserror::Error)]
pub enum Classified {
    /// A command-line value is bad: exit 64.
    #[error(transparent)]
    Usage(Boxed),
    /// Configuration is missing or invalid: exit 78.
    #[error(transparent)]
    Config(Boxed),
}

/// `e` as a bad command-line value (exit 64).
pub fn usage(e: impl Into<Boxed>) -> anyhow::Error {
    anyhow::Error::new(Classified::Usage(e.into()))
}

/// `e` as missing or invalid configuration (exit 78).
pub fn config(e: impl Into<Boxed>) -> anyhow::Error {
    anyhow::Error::new(Classified::Config(e.into()))
}

/// The exit status of `e`: the first [`Classified`] in its chain, or TLS material that
/// cannot be used ([`crate::tls::TlsError`], from configured files: 78); else 1.
pub fn status(e: &anyhow::Error) -> u8 {
    for cause in e.chain() {
        match cause.downcast_ref::<Classified>() {
            Some(Classified::Usage(_)) => return USAGE,
            Some(Classified::Config(_)) => return CONFIG,
            None => {}
        }
        if cause.downcast_ref::<crate::tls::TlsError>().is_some() {
            return CONFIG;
        }
    }
    FAILURE
}

/// An error and its causes on one line, each cause once: a cause whose text is already in
/// the line (an error that prints its source too) is not repeated.
pub fn one_line(e: &(dyn StdError + 'static)) -> String {
    let mut text = String::new();
    let mut cause: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(c) = cause {
        let part = c.to_string();
        let part = part.trim();
        if !part.is_empty() && !text.contains(part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(part);
        }
        cause = c.source();
    }
    text.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_joins_causes_without_repeats() {
        let e = anyhow::anyhow!("refused")
            .context("tcp connect")
            .context("cannot reach x");
        assert_eq!(one_line(e.as_ref()), "cannot reach x: tcp connect: refused");
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let e = anyhow::Error::new(io).context("reading /x: No such file");
        assert_eq!(one_line(e.as_ref()), "reading /x: No such file");
    }

    #[test]
    fn statuses_follow_the_taxonomy() {
        let plain = anyhow::anyhow!("a check failed");
        assert_eq!(status(&plain), FAILURE);
        let bad_flag = usage(anyhow::anyhow!("--x: not a number")).context("starting");
        assert_eq!(status(&bad_flag), USAGE);
        assert_eq!(one_line(bad_flag.as_ref()), "starting: --x: not a number");
        let missing = config(anyhow::anyhow!("the node name is required"));
        assert_eq!(status(&missing), CONFIG);
        assert_eq!(missing.to_string(), "the node name is required");
    }
}
