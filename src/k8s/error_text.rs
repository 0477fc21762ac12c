//! What a failed API call means, in the operator's words: an answer is named by its status
//! (`not found (HTTP 404)`, `forbidden (HTTP 403)`, with the server's message), an answer that
//! is no Kubernetes status at all (an HTML page: something else listens there) says so, and a
//! failed connection keeps its cause (`Connection refused`, a TLS or DNS failure) instead of
//! kube's bare `client error (Connect)`.
//!
//! It does not decide what to do about the failure ([`super::retry`] and the callers do).

use crate::failure::one_line;

/// The longest server message quoted.
const MAX_MESSAGE: usize = 300;

/// `err` as one line that says what happened.
pub fn describe(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(status) => {
            let code = status.code;
            let what = match code {
                400 => "bad request",
                401 => "unauthorized (the credentials were not accepted)",
                403 => "forbidden",
                404 => "not found",
                409 => "conflict",
                410 => "gone (the resource version is too old)",
                422 => "invalid",
                429 => "too many requests",
                500..=599 => "server error",
                _ => "refused",
            };
            let message = status.message.trim();
            if message.is_empty() {
                format!("{what} (HTTP {code})")
            } else if message.starts_with('<') {
                format!(
                    "{what} (HTTP {code}); the answer is an HTML page, not a Kubernetes status: \
                     is this the API server's address?"
                )
            } else {
                format!("{what} (HTTP {code}): {}", cut(message))
            }
        }
        // kube's own text is `ServiceError: client error (Connect)`; the cause is below it.
        kube::Error::HyperError(e) => one_line(e),
        kube::Error::Service(e) => one_line(e.as_ref()),
        other => one_line(other),
    }
}

/// `text` on one line, at most [`MAX_MESSAGE`] bytes (cut on a character boundary).
fn cut(text: &str) -> String {
    let text = text.replace('\n', " ");
    if text.len() <= MAX_MESSAGE {
        return text;
    }
    let mut end = MAX_MESSAGE;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, message: &str) -> kube::Error {
        let mut status = kube::core::Status::failure(message, "NotFound");
        status.code = code;
        kube::Error::Api(Box::new(status))
    }

    #[test]
    fn an_answer_is_named_by_its_status() {
        assert_eq!(
            describe(&api(404, "nodes \"n9\" not found")),
            "not found (HTTP 404): nodes \"n9\" not found"
        );
        assert_eq!(describe(&api(403, "")), "forbidden (HTTP 403)");
        let html = describe(&api(404, "<!DOCTYPE HTML>\n<html>File not found</html>"));
        assert!(html.starts_with("not found (HTTP 404)"), "{html}");
        assert!(html.contains("not a Kubernetes status"), "{html}");
        assert!(!html.contains("DOCTYPE"), "{html}");
        assert!(describe(&api(500, &"x".repeat(1000))).len() < 400);
    }

    #[test]
    fn a_failed_connection_keeps_its_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let e = kube::Error::Service(Box::new(io));
        assert_eq!(describe(&e), "Connection refused");
    }
}
